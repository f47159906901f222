"""veloxquant.quant on numpy arrays and mx.array: round trips, the measured
table, byte counts, artifacts and errors."""

import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant import quant

D = 128


def unit(n, dim=D, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


CALIB = unit(4000, seed=3)

# name -> (builder, relative MSE bound on unit vectors at d=128)
METHODS = {
    "turboquant-mse": (lambda: quant.TurboQuantMSE(D, 3, seed=7), 0.04),
    "turboquant-mse-dense": (lambda: quant.TurboQuantMSE(D, 2, rotation="dense", seed=7), 0.13),
    "turboquant-prod": (lambda: quant.TurboQuantProd(D, 3, seed=7), 0.08),
    "turboquant-rvq": (lambda: quant.TurboQuantRVQ(D, 2, 1, seed=7), 0.05),
    "outlier": (lambda: quant.OutlierSplit(D, 2, outlier_bits=3, n_outliers=32, seed=7).fit(CALIB), 0.11),
    "qjl": (lambda: quant.QJL(D, 256, seed=7), 0.9),
    "pq": (lambda: quant.ProductQuantizer(D, bits=4, sub_dim=2, seed=7).fit(CALIB), 0.12),
    "kivi-keys": (lambda: quant.KIVIKeys(D, 4, group=32), 0.01),
    "kivi-values": (lambda: quant.KIVIValues(D, 4, group=32), 0.01),
}

_built = {}


def build(name):
    # Calibrated ones take a moment; every test gets the same object.
    if name not in _built:
        _built[name] = METHODS[name][0]()
    return _built[name]


def mse(x, y):
    return float(((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2).sum(1).mean())


def test_exported():
    assert veloxquant.quant is quant
    assert set(quant.METHODS) == {
        "turboquant-mse", "turboquant-prod", "turboquant-rvq", "outlier-split",
        "qjl", "pq", "kivi-keys", "kivi-values",
    }


@pytest.mark.parametrize("name", METHODS)
def test_numpy_round_trip(name):
    q = build(name)
    x = unit(300, seed=1)
    enc = q.encode(x)
    assert isinstance(enc, quant.Encoded)
    assert (enc.method, enc.rows, enc.dim) == (q.method, 300, D)
    y = q.decode(enc)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (300, D)
    assert mse(x, y) < METHODS[name][1]
    # Deterministic: the same input gives the same bytes.
    assert q.encode(x) == enc
    # A strided view is read in row order.
    wide = np.zeros((300, 2 * D), np.float32)
    wide[:, ::2] = x
    assert q.encode(wide[:, ::2]) == enc


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mlx_round_trip(name, dtype):
    q = build(name)
    xm = mx.array(unit(200, seed=2)).astype(dtype)
    as_np = np.array(xm.astype(mx.float32))
    enc = q.encode(xm)
    # The mx path reads the same values as numpy float32 of them.
    assert enc == q.encode(as_np)
    y = q.decode(enc)
    assert isinstance(y, mx.array) and y.dtype == mx.float32 and y.shape == (200, D)
    np.testing.assert_array_equal(np.array(y), q.decode(q.encode(as_np)))
    assert isinstance(q.decode(enc, output="numpy"), np.ndarray)
    assert isinstance(q.decode(q.encode(as_np), output="mlx"), mx.array)
    assert mse(as_np, np.array(y)) < METHODS[name][1]


def test_numpy_float16_and_float64_are_read_as_float32():
    q = build("turboquant-mse")
    x = unit(50, seed=4)
    h = x.astype(np.float16)
    assert q.encode(h) == q.encode(h.astype(np.float32))
    assert q.encode(x.astype(np.float64)) == q.encode(x)


# docs/quantizer_table.md: d = 128, random unit vectors.
TABLE = [
    (lambda: quant.TurboQuantMSE(D, 1, seed=7), 0.36116),
    (lambda: quant.TurboQuantMSE(D, 2, seed=7), 0.11577),
    (lambda: quant.TurboQuantMSE(D, 3, seed=7), 0.03392),
    (lambda: quant.TurboQuantMSE(D, 4, seed=7), 0.00928),
    (lambda: quant.TurboQuantProd(D, 2, seed=7), 0.20502),
    (lambda: quant.TurboQuantProd(D, 4, seed=7, orthogonal=False), 0.05264),
    (lambda: quant.TurboQuantRVQ(D, 2, 1, seed=7), 0.04067),
    (lambda: build("outlier"), 0.09457),
    (lambda: quant.QJL(D, 128, seed=7), 1.54438),
    (lambda: build("pq"), 0.10675),
    (lambda: quant.KIVIKeys(D, 2, group=32), 0.15297),
    (lambda: quant.KIVIValues(D, 4, group=32), 0.00611),
]


@pytest.mark.parametrize("i", range(len(TABLE)))
def test_mse_matches_the_rust_table(i):
    make, want = TABLE[i]
    q = make()
    x = unit(4000, seed=11)
    got = mse(x, q.decode(q.encode(x)))
    assert abs(got - want) < 0.04 * want, (q, got, want)


def test_mse_is_a_function_of_bits():
    x = unit(2000, seed=5)
    errs = [mse(x, q.decode(q.encode(x))) for q in (quant.TurboQuantMSE(D, b) for b in (1, 2, 3, 4, 8))]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-4


@pytest.mark.parametrize("name", METHODS)
def test_bits_per_element_counts_stored_bytes(name):
    q = build(name)
    enc = q.encode(unit(100, seed=6))
    stored = sum(len(b) for b in enc.buffers.values())
    assert stored == enc.stored_bytes > 0
    for name_, b in enc.buffers.items():
        np.testing.assert_array_equal(enc.buffer(name_), np.frombuffer(b, np.uint8))
    want = 8 * stored / (100 * D) + 8 * q.shared_bytes / (100 * D)
    assert q.bits_per_element(enc) == pytest.approx(want, rel=1e-12)
    want = 8 * stored / (100 * D) + 8 * q.shared_bytes / (4096 * D)
    assert q.bits_per_element(enc, tokens=4096) == pytest.approx(want, rel=1e-12)
    # Without an encoding: a cache of `tokens` rows.
    big = q.encode(np.zeros((4096, D), np.float32))
    assert q.bits_per_element() == pytest.approx(q.bits_per_element(big, tokens=4096), rel=1e-12)


def test_bits_per_element_known_values():
    # 4 code bits + one f16 norm per 128 elements.
    q = quant.TurboQuantMSE(D, 4)
    assert 8 * q.encode(unit(10)).stored_bytes / (10 * D) == 4.125
    # 32 @ 3 + 96 @ 2 code bits + two f16 norms: 2.5 bits/element stored.
    o = build("outlier")
    assert 8 * o.encode(unit(10)).stored_bytes / (10 * D) == 2.5
    # PQ: 4 bits per 2 elements, nothing else per row.
    assert 8 * build("pq").encode(unit(10)).stored_bytes / (10 * D) == 2.0
    assert q.shared_bytes == 4 * 16 + D // 8


@pytest.mark.parametrize("name", METHODS)
def test_save_load_bit_identical(name, tmp_path):
    q = build(name)
    path = tmp_path / f"{name}.safetensors"
    q.save(path)
    data = path.read_bytes()
    assert data == q.to_bytes()
    r = quant.load(path)
    assert type(r) is type(q) and r.method == q.method and r.dim == D
    assert r.to_bytes() == data
    assert r.config == q.config and r.shared_bytes == q.shared_bytes
    x = unit(64, seed=8)
    enc = q.encode(x)
    assert r.encode(x) == enc
    np.testing.assert_array_equal(r.decode(enc), q.decode(enc))
    assert quant.from_bytes(data).to_bytes() == data


def test_corrupt_artifact_is_a_clear_error(tmp_path):
    data = bytearray(build("pq").to_bytes())
    path = tmp_path / "pq.safetensors"
    # A flipped byte in the tensor data: caught by the checksum.
    bad = bytearray(data)
    bad[-5] ^= 0x40
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=r"artifact: .*checksum"):
        quant.load(path)
    # Truncated.
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"artifact:"):
        quant.load(path)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"artifact:"):
        quant.load(path)
    with pytest.raises(ValueError, match=r"artifact:"):
        quant.from_bytes(b"")
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        quant.load(tmp_path / "missing.safetensors")


def test_fit_refuses_a_loaded_calibration(tmp_path):
    r = quant.from_bytes(build("pq").to_bytes())
    with pytest.raises(ValueError, match="construct a new one"):
        r.fit(CALIB)


@pytest.mark.parametrize("name", METHODS)
def test_zero_rows_decode_to_zeros(name):
    q = build(name)
    if name != "pq":
        z = np.zeros((5, D), np.float32)
        np.testing.assert_array_equal(q.decode(q.encode(z)), z)
    if name.startswith(("turboquant", "qjl", "outlier")):
        # Norm-based methods: a zero row among others is still exactly zero.
        x = unit(4, seed=9)
        x[2] = 0
        y = q.decode(q.encode(x))
        np.testing.assert_array_equal(y[2], np.zeros(D, np.float32))
        assert np.abs(y[[0, 1, 3]]).sum() > 0


def test_pq_zero_row_goes_to_the_nearest_centroid():
    # PQ has no norm: a zero row becomes the codebook entries nearest zero,
    # the same for every zero row.
    q = build("pq")
    y = q.decode(q.encode(np.zeros((3, D), np.float32)))
    np.testing.assert_array_equal(y[0], y[2])


@pytest.mark.parametrize("make", [lambda: quant.TurboQuantProd(D, 3, seed=1), lambda: quant.QJL(D, 256, seed=1)])
def test_estimate_inner_products(make):
    q = make()
    x = unit(3000, seed=12)
    qs = unit(4, seed=13)
    enc = q.encode(x)
    est = q.estimate_inner_products(qs, enc)
    assert isinstance(est, np.ndarray) and est.shape == (4, 3000) and est.dtype == np.float32
    np.testing.assert_allclose(est, qs @ q.decode(enc).T, atol=1e-5)
    # Unbiased: the mean error over many keys is within a few standard errors of 0.
    err = est - qs @ x.T
    assert np.all(np.abs(err.mean(1)) < 4 * err.std(1) / math.sqrt(err.shape[1]))
    est_mx = q.estimate_inner_products(mx.array(qs), enc)
    assert isinstance(est_mx, mx.array) and est_mx.shape == (4, 3000)
    np.testing.assert_array_equal(np.array(est_mx), est)


def test_estimate_inner_products_only_where_unbiased():
    q = build("turboquant-mse")
    with pytest.raises(ValueError, match="method: turboquant-mse has no unbiased"):
        q.estimate_inner_products(unit(2), q.encode(unit(3)))


def test_encoded_rebuilt_from_buffers():
    q = build("turboquant-rvq")
    enc = q.encode(unit(7))
    again = quant.Encoded(enc.method, enc.rows, enc.dim, enc.buffers)
    assert again == enc
    np.testing.assert_array_equal(q.decode(again), q.decode(enc))
    short = dict(enc.buffers)
    short["norms"] = short["norms"][:-1]
    with pytest.raises(ValueError, match="encoded: buffer norms has 13 bytes, expected 14"):
        q.decode(quant.Encoded(enc.method, enc.rows, enc.dim, short))
    with pytest.raises(ValueError, match="encoded: made by turboquant-rvq"):
        build("turboquant-mse").decode(enc)
    with pytest.raises(ValueError, match="encoded: "):
        build("turboquant-mse").bits_per_element(enc)
    with pytest.raises(TypeError, match="buffers: \"codes\" must be bytes, got int"):
        quant.Encoded(enc.method, enc.rows, enc.dim, {"codes": 3})


# --------------------------------------------------------------- bad input


def test_wrong_dtype_is_a_type_error():
    q = build("turboquant-mse")
    with pytest.raises(TypeError, match=r"^x: dtype int32"):
        q.encode(np.zeros((2, D), np.int32))
    with pytest.raises(TypeError, match=r"^x: dtype complex64"):
        q.encode(np.zeros((2, D), np.complex64))
    with pytest.raises(TypeError, match=r"^x: dtype int32"):
        q.encode(mx.zeros((2, D), mx.int32))
    with pytest.raises(TypeError, match=r"^x: expected a numpy.ndarray or mlx.core.array, got list"):
        q.encode([[0.0] * D])
    with pytest.raises(TypeError, match=r"^samples: dtype uint8"):
        build("pq").fit(np.zeros((2, D), np.uint8))
    with pytest.raises(TypeError, match=r"^queries: dtype int64"):
        build("qjl").estimate_inner_products(np.zeros((2, D), np.int64), build("qjl").encode(unit(2)))


def test_wrong_shape_is_a_value_error():
    q = build("turboquant-mse")
    with pytest.raises(ValueError, match=r"^x: shape \[2, 64\] is not \[n, 128\]"):
        q.encode(np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"^x: shape \[128\]"):
        q.encode(np.zeros(D, np.float32))
    with pytest.raises(ValueError, match=r"^x: shape \[1, 2, 128\]"):
        q.encode(mx.zeros((1, 2, D)))
    with pytest.raises(ValueError, match=r"^samples: shape"):
        quant.ProductQuantizer(D).fit(np.zeros((10, 3), np.float32))


def test_non_finite_is_a_value_error():
    q = build("turboquant-mse")
    x = unit(3)
    x[1, 5] = np.nan
    with pytest.raises(ValueError, match=r"^x: element 133 is not finite \(NaN\)"):
        q.encode(x)
    x[1, 5] = np.inf
    with pytest.raises(ValueError, match=r"^x: element 133 is not finite"):
        q.encode(mx.array(x))
    with pytest.raises(ValueError, match=r"^samples: element 133"):
        quant.OutlierSplit(D, 2).fit(x)
    # float64 beyond float32's range becomes inf: refused, not stored.
    with np.errstate(over="ignore"), pytest.raises(ValueError, match=r"^x: element 0 is not finite"):
        q.encode(np.full((1, D), 1e300))


def test_f16_overflow_is_a_value_error():
    with pytest.raises(ValueError, match=r"^norm: .* does not fit in float16"):
        build("turboquant-mse").encode(np.full((1, D), 1e4, np.float32))


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: quant.TurboQuantMSE(D, 5), r"^bits: 5 is not supported by turboquant-mse \(1, 2, 3, 4, 8\)"),
        (lambda: quant.TurboQuantMSE(D, -1), r"^bits: -1 is out of range"),
        (lambda: quant.TurboQuantMSE(D, 2**40), r"^bits: \d+ is out of range"),
        (lambda: quant.TurboQuantProd(D, 6), r"^bits: 6 is not supported by turboquant-prod"),
        (lambda: quant.TurboQuantRVQ(D, 2, 7), r"^bits: 7 is not supported by turboquant-rvq"),
        (lambda: quant.ProductQuantizer(D, bits=13), r"^bits: 13 is not supported by pq"),
        (lambda: quant.ProductQuantizer(D, sub_dim=3), r"^sub_dim: 3 is not 2, 4 or 8"),
        (lambda: quant.ProductQuantizer(D, tol=float("nan")), r"^tol: "),
        (lambda: quant.KIVIKeys(D, 0), r"^bits: 0 is not supported by kivi-keys"),
        (lambda: quant.KIVIValues(D, 2, group=48), r"^group: 48 does not divide dim 128"),
        (lambda: quant.OutlierSplit(D, 2, outlier_bits=6), r"^bits: 6 is not supported by turboquant-mse"),
        (lambda: quant.OutlierSplit(D, 2, n_outliers=D), r"^n_outliers: 128 is not in 1..128"),
        (lambda: quant.TurboQuantMSE(100, 2), r"^dim: 100 is not supported"),
        (lambda: quant.TurboQuantMSE(D, 2, rotation="givens"), r"^rotation: unknown kind"),
        (lambda: quant.TurboQuantMSE(-3, 2), r"^dim: -3 is out of range"),
        (lambda: quant.QJL(D, 0), r"^m: sketch size must be positive"),
        (lambda: quant.Quantizer("turboquant", D, 2), r"^method: unknown method \"turboquant\""),
        (lambda: quant.Quantizer("turboquant-mse", D), r"^bits: turboquant-mse needs bits"),
        (lambda: quant.Quantizer("turboquant-mse", D, 2, group=4), r"^group: is not an option of turboquant-mse"),
        (lambda: quant.Quantizer("qjl", D, 1), r"^bits: qjl stores one bit per sketch row"),
    ],
)
def test_bad_configuration_is_a_value_error(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_dense_rotation_takes_any_dim():
    q = quant.TurboQuantMSE(100, 3, rotation="dense")
    x = unit(500, dim=100, seed=14)
    assert mse(x, q.decode(q.encode(x))) < 0.05


def test_calibrated_methods_need_fit():
    q = quant.ProductQuantizer(D, bits=4, sub_dim=4)
    assert not q.fitted
    with pytest.raises(ValueError, match=r"calibration: pq is not calibrated: call fit\(samples\) first"):
        q.encode(unit(2))
    with pytest.raises(ValueError, match=r"^calibration: pq needs at least one calibration row"):
        q.fit(np.zeros((0, D), np.float32))
    assert q.fit(CALIB[:500]) is q and q.fitted
    assert q.decode(q.encode(unit(2))).shape == (2, D)
    # Methods without calibration are fitted from the start; fit only checks.
    m = quant.TurboQuantMSE(D, 2)
    assert m.fitted and m.fit(unit(3)) is m


def test_outlier_split_picks_the_loud_channels():
    x = unit(2000, seed=15)
    loud = list(range(1, D, 4))
    x[:, loud] *= 10
    q = quant.OutlierSplit(D, 2, outlier_bits=4, n_outliers=32).fit(x)
    assert q.config["outlier.dim"] == "32"
    mask_error = mse(x, q.decode(q.encode(x)))
    # Loud channels at 4 bits beat a plain 2-bit quantizer on the same rows.
    plain = quant.TurboQuantMSE(D, 2)
    assert mask_error < 0.5 * mse(x, plain.decode(plain.encode(x)))


def test_sphere_codebook_approaches_gaussian_levels_and_checks_its_arguments():
    from veloxquant import _native

    levels = np.array(_native.sphere_codebook(64, 3))
    # 2^bits ascending levels, symmetric about 0 (the coordinate's density is).
    assert levels.shape == (8,) and np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-6)
    # In many dimensions a coordinate is nearly Gaussian with variance 1/dim:
    # the levels approach Gaussian Lloyd-Max levels over sqrt(dim).
    np.testing.assert_allclose(np.array(_native.sphere_codebook(4096, 1)) * 64, [-0.7979, 0.7979], atol=1e-3)
    np.testing.assert_allclose(np.array(_native.sphere_codebook(4096, 2)) * 64, [-1.5104, -0.4528, 0.4528, 1.5104],
                               atol=2e-3)
    for args, message in [((1, 2), "dim: 1"), ((64, 0), "bits: 0"), ((64, 9), "bits: 9"), ((-3, 2), "dim: -3")]:
        with pytest.raises(ValueError, match=message):
            _native.sphere_codebook(*args)
    with pytest.raises(TypeError, match="bits: expected an int"):
        _native.sphere_codebook(64, 2.5)


def test_turboquant_levels_are_the_caches_tables():
    from veloxquant import _native

    # Keys, and values of other widths, on the Lloyd-Max levels; 3-bit values
    # on the uniform grid (step 0.586 / sqrt(d)).
    for bits in (2, 3, 4):
        assert _native.turboquant_levels(128, bits, True) == _native.sphere_codebook(128, bits)
    assert _native.turboquant_levels(128, 4, False) == _native.sphere_codebook(128, 4)
    grid = np.array(_native.turboquant_levels(128, 3, False))
    np.testing.assert_allclose(grid * np.sqrt(128), (np.arange(8) - 3.5) * 0.586, atol=1e-5)
    with pytest.raises(ValueError, match="dim"):
        _native.turboquant_levels(1, 3, False)
