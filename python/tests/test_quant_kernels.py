"""veloxquant.kernels' quantizer kernels on mlx.core.array: values against
plain numpy, the three policies, dtypes, laziness and argument errors."""

import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant import kernels as K
from veloxquant import quant

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def np_unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    rows = packed.shape[0]
    out = np.zeros((rows, n), np.uint8)
    for r in range(rows):
        stream = int.from_bytes(packed[r].tobytes(), "little")
        for i in range(n):
            out[r, i] = (stream >> (i * bits)) & ((1 << bits) - 1)
    return out


def as_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("policy", ["auto", "require", "off"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_scalar_quantize_is_nearest_centroid(policy, dtype, bits):
    rng = np.random.default_rng(bits)
    cb = np.sort(rng.normal(size=1 << bits)).astype(np.float32)
    x = mx.array(rng.normal(size=(9, 13)).astype(np.float32)).astype(dtype)
    packed = K.scalar_quantize(x, mx.array(cb), bits, policy=policy, device="cpu")
    assert packed.dtype == mx.uint8 and packed.shape == (9, (13 * bits + 7) // 8)
    codes = np_unpack(np.array(packed), bits, 13)
    want = np.abs(as_np(x)[..., None] - cb).argmin(-1)
    np.testing.assert_array_equal(codes, want)
    y = K.scalar_dequantize(packed, mx.array(cb), bits, 13, dtype, policy=policy, device="cpu")
    assert y.dtype == dtype
    np.testing.assert_array_equal(as_np(y), np.array(mx.array(cb[want]).astype(dtype).astype(mx.float32)))


@pytest.mark.parametrize("policy", ["require", "off"])
@pytest.mark.parametrize("mode", ["keys", "values"])
def test_kivi_round_trip_within_half_a_step(policy, mode):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(70, 64)).astype(np.float32)
    c, s, z = K.kivi_quantize(mx.array(x), 4, 32, mode, policy=policy, device="cpu")
    assert s.dtype == mx.float16 and z.dtype == mx.float16
    assert s.shape == ((3, 64) if mode == "keys" else (70, 2))
    y = np.array(K.kivi_dequantize(c, s, z, 4, 32, mode, 64, policy=policy, device="cpu"))
    sf = np.array(s.astype(mx.float32))
    step = np.repeat(sf, 32, axis=0)[:70] if mode == "keys" else np.repeat(sf, 32, axis=1)
    assert np.all(np.abs(y - x) <= 0.5 * step + 1e-2 * step + 2e-3)


def test_kivi_policies_agree():
    x = mx.random.normal((50, 128), key=mx.random.key(1))
    a = K.kivi_quantize(x, 2, 16, "keys", policy="require", device="cpu")
    b = K.kivi_quantize(x, 2, 16, "keys", policy="off", device="cpu")
    for u, v in zip(a[1:], b[1:]):
        np.testing.assert_array_equal(np.array(u), np.array(v))


@pytest.mark.parametrize("policy", ["require", "off"])
def test_qjl_score_estimates_inner_products(policy):
    rng = np.random.default_rng(5)
    d, m, n = 64, 2048, 40
    sketch = mx.array(rng.normal(size=(m, d)).astype(np.float32))
    k = rng.normal(size=(n, d)).astype(np.float32)
    q = rng.normal(size=(1, d)).astype(np.float32)
    signs, norms = K.qjl_encode(mx.array(k), sketch, policy=policy, device="cpu")
    assert signs.shape == (n, m // 8) and norms.dtype == mx.float16
    np.testing.assert_allclose(np.array(norms.astype(mx.float32)), np.linalg.norm(k, axis=1), rtol=1e-3)
    est = np.array(K.qjl_score(mx.array(q), sketch, signs, norms, policy=policy, device="cpu"))[0]
    truth = k @ q[0]
    # Error ~ |k||q| sqrt(pi/2 / m): about 0.028 |k||q| at m = 2048.
    scale = np.linalg.norm(k, axis=1) * np.linalg.norm(q)
    assert np.all(np.abs(est - truth) < 5 * math.sqrt(math.pi / 2 / m) * scale)


@pytest.mark.parametrize("policy", ["require", "off"])
@pytest.mark.parametrize("s", K.PQ_SUB_DIMS)
def test_pq_encode_decode_gathers_nearest(policy, s):
    rng = np.random.default_rng(s)
    cb = rng.normal(size=(16, s)).astype(np.float32)
    x = rng.normal(size=(33, 8 * s)).astype(np.float32)
    packed, high = K.pq_encode(mx.array(x), mx.array(cb), 4, policy=policy, device="cpu")
    assert packed.shape == (33, 4) and high is None
    sub = x.reshape(-1, s)
    want = ((sub[:, None] - cb[None]) ** 2).sum(-1).argmin(-1).reshape(33, 8)
    np.testing.assert_array_equal(np_unpack(np.array(packed), 4, 8), want)
    y = K.pq_decode(packed, mx.array(cb), 4, 8 * s, mx.bfloat16, policy=policy, device="cpu")
    assert y.dtype == mx.bfloat16
    np.testing.assert_allclose(as_np(y), cb[want].reshape(33, 8 * s), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("policy", ["require", "off"])
@pytest.mark.parametrize("bits", [6, 10, 12])
def test_pq_wide_codes_use_two_planes(policy, bits):
    rng = np.random.default_rng(bits)
    k = min(1 << bits, 1500)
    cb = rng.normal(size=(k, 2)).astype(np.float32)
    x = rng.normal(size=(17, 22)).astype(np.float32)
    low, high = K.pq_encode(mx.array(x), mx.array(cb), bits, policy=policy, device="cpu")
    lo = 4 if bits < 8 else 8
    hi = bits - lo
    assert low.shape == (17, (11 * lo + 7) // 8) and high.shape == (17, (11 * hi + 7) // 8)
    want = ((x.reshape(-1, 2)[:, None] - cb[None]) ** 2).sum(-1).argmin(-1).reshape(17, 11)
    codes = np_unpack(np.array(low), lo, 11).astype(np.int64) | (np_unpack(np.array(high), hi, 11).astype(np.int64) << lo)
    np.testing.assert_array_equal(codes, want)
    y = K.pq_decode(low, mx.array(cb), bits, 22, codes_hi=high, policy=policy, device="cpu")
    np.testing.assert_array_equal(np.array(y), cb[want].reshape(17, 22))
    with pytest.raises(ValueError, match=r"^codes_hi:"):
        K.pq_decode(low, mx.array(cb), bits, 22, device="cpu")


def _artifact(q, tmp_path) -> dict:
    path = tmp_path / "q.safetensors"
    q.save(path)
    return mx.load(str(path))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tq_encode_reproduces_the_quantizer(dtype, tmp_path):
    # The cache's encoder sums the norm in float32 where the quantizer uses
    # float64: codes agree but at near-ties, norms to one float16 step.
    d = 64
    q = quant.TurboQuantMSE(d, 4, rotation="dense", seed=3)
    a = _artifact(q, tmp_path)
    rot, cb = a["rotation.matrix"], a["codebook"]
    x = mx.array(np.random.default_rng(6).normal(size=(3, 40, d)).astype(np.float32)).astype(dtype)
    codes, norms = K.tq_encode(x, rot, cb, 4, policy="require", device="cpu")
    assert codes.shape == (3, 40, d // 2) and codes.dtype == mx.uint8
    assert norms.shape == (3, 40) and norms.dtype == mx.float16
    enc = q.encode(as_np(x).reshape(120, d))
    got = np_unpack(np.array(codes).reshape(120, d // 2), 4, d)
    want = np_unpack(np.frombuffer(enc.buffers["codes"], np.uint8).reshape(120, d // 2), 4, d)
    assert (got != want).mean() < 1e-3
    want_norms = np.frombuffer(enc.buffers["norms"], np.float16).astype(np.float32)
    np.testing.assert_allclose(np.array(norms).reshape(120).astype(np.float32), want_norms, rtol=1e-3)
    # Unrotated input: the codes of x/|x| itself.
    codes0, _ = K.tq_encode(x, None, cb, 4, device="cpu")
    u = as_np(x).reshape(120, d)
    u = u / np.linalg.norm(u, axis=1, keepdims=True)
    nearest = np.abs(u[..., None] - np.array(cb)[None, None]).argmin(-1)
    assert (np_unpack(np.array(codes0).reshape(120, d // 2), 4, d) != nearest).mean() < 1e-3
    with pytest.raises(ValueError, match=r"^bits: 5"):
        K.tq_encode(x, rot, cb, 5, device="cpu")
    with pytest.raises(ValueError, match=r"^x: head dimension 12"):
        K.tq_encode(mx.zeros((4, 12)), None, cb, 4, device="cpu")


def test_tq_encode_takes_hadamard_signs():
    # Signs [d] apply R = H diag(s) / sqrt(d) by butterflies: the codes of the
    # same rotation passed dense, but at near-ties.
    d = 128
    rng = np.random.default_rng(8)
    s = np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float32)
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    dense = (h * s[None, :] / np.sqrt(d)).astype(np.float32)
    cb = mx.array(np.sort(rng.normal(size=16) / np.sqrt(d)).astype(np.float32))
    x = mx.array(rng.normal(size=(200, d)).astype(np.float16))
    codes, norms = K.tq_encode(x, mx.array(s), cb, 4, policy="require", device="cpu")
    codes_d, norms_d = K.tq_encode(x, mx.array(dense), cb, 4, policy="require", device="cpu")
    assert np.array_equal(np.array(norms), np.array(norms_d))
    got, want = np_unpack(np.array(codes), 4, d), np_unpack(np.array(codes_d), 4, d)
    assert (got != want).mean() < 1e-3
    with pytest.raises(ValueError, match=r"^rotation: Hadamard signs need a power-of-two"):
        K.tq_encode(mx.zeros((2, 96)), mx.ones((96,)), cb, 4, device="cpu")


@pytest.mark.parametrize("bits", [1, 3, 9])
def test_tq_prod_kernels_reproduce_the_quantizer(bits, tmp_path):
    d = 64
    q = quant.TurboQuantProd(d, bits, rotation="dense", seed=bits)
    a = _artifact(q, tmp_path)
    rot, sketch = a["rotation.matrix"], a["sketch"]
    cb = a["codebook"] if bits > 1 else None
    x = np.random.default_rng(bits).normal(size=(21, d)).astype(np.float32)
    enc = q.encode(x)
    codes, signs, norms, rnorms = K.tq_prod_encode(mx.array(x), rot, cb, sketch, bits, policy="require", device="cpu")
    assert np.array(signs).tobytes() == enc.buffers["signs"]
    assert np.array(norms).tobytes() == enc.buffers["norms"]
    if bits > 1:
        assert np.array(codes).tobytes() == enc.buffers["codes"]
        assert np.array(rnorms).tobytes() == enc.buffers["residual_norms"]
    else:
        assert codes is None and rnorms is None
    for policy in ["require", "off"]:
        y = K.tq_prod_decode(codes, signs, norms, rnorms, rot, cb, sketch, bits, policy=policy, device="cpu")
        np.testing.assert_allclose(np.array(y), q.decode(enc, output="numpy"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tq_rvq_kernels_reproduce_the_quantizer(dtype, tmp_path):
    d = 128
    q = quant.TurboQuantRVQ(d, 2, 3, rotation="dense", seed=4)
    a = _artifact(q, tmp_path)
    rot, c1, c2 = a["rotation.matrix"], a["codebook1"], a["codebook2"]
    x = mx.array(np.random.default_rng(5).normal(size=(2, 9, d)).astype(np.float32)).astype(dtype)
    codes1, codes2, norms = K.tq_rvq_encode(x, rot, c1, c2, 2, 3, policy="require", device="cpu")
    assert codes1.shape == (2, 9, d * 2 // 8) and codes2.shape == (2, 9, d * 3 // 8) and norms.shape == (2, 9)
    enc = q.encode(as_np(x).reshape(18, d))
    assert np.array(codes1).tobytes() == enc.buffers["codes1"]
    assert np.array(codes2).tobytes() == enc.buffers["codes2"]
    y = K.tq_rvq_decode(codes1, codes2, norms, rot, c1, c2, 2, 3, d, dtype, device="cpu")
    assert y.dtype == dtype and y.shape == (2, 9, d)
    np.testing.assert_allclose(as_np(y).reshape(18, d), q.decode(enc, output="numpy"), rtol=2e-2, atol=2e-2)


def test_pending_primitives_counts_launches():
    a, b, c = mx.array([1.0, 2.0]), mx.array([3.0, 4.0]), mx.array([5.0, 6.0])
    y = (a + b) * c
    assert K.pending_primitives([y]) == ["Add", "Multiply"]
    mx.eval(y)
    assert K.pending_primitives([y]) == []
    x = mx.random.normal((4, 64))
    cb = mx.array(np.sort(np.random.default_rng(0).normal(size=4)).astype(np.float32) / 8)
    mx.eval(x)
    out = K.tq_rvq_encode(x, None, cb, cb, 2, 2, policy="require", device="cpu")
    names = K.pending_primitives(out)
    assert names.count("veloxquant_tq_rvq_encode") == 1, names
    with pytest.raises(TypeError, match=r"^arrays\[1\]: expected an mlx.core.array"):
        K.pending_primitives([y, 3])


def test_results_are_lazy_and_compile():
    x = mx.random.normal((4096, 128))
    cb = mx.array(np.sort(np.random.default_rng(0).normal(size=4)).astype(np.float32))
    mx.eval(x, cb)
    before = mx.get_active_memory()
    p = K.scalar_quantize(x, cb, 2)
    assert mx.get_active_memory() - before < 1024
    f = mx.compile(lambda a: K.scalar_dequantize(K.scalar_quantize(a, cb, 2), cb, 2, 128))
    np.testing.assert_array_equal(np.array(f(x)), np.array(K.scalar_dequantize(p, cb, 2, 128)))


def test_wrong_arguments_raise_errors_naming_them():
    f32 = mx.zeros((4, 8))
    cb = mx.zeros((4,))
    with pytest.raises(TypeError, match=r"^x: dtype uint8"):
        K.scalar_quantize(f32.astype(mx.uint8), cb, 2)
    with pytest.raises(TypeError, match=r"^codebook: dtype float16"):
        K.scalar_quantize(f32, cb.astype(mx.float16), 2)
    with pytest.raises(ValueError, match=r"^codebook: shape"):
        K.scalar_quantize(f32, cb, 3)
    with pytest.raises(TypeError, match=r"^dtype: dtype int32"):
        K.scalar_dequantize(mx.zeros((4, 2), dtype=mx.uint8), cb, 2, 8, mx.int32)
    with pytest.raises(ValueError, match=r"^group:"):
        K.kivi_quantize(f32, 2, 3, "values")
    with pytest.raises(ValueError, match=r"^mode:"):
        K.kivi_quantize(f32, 2, 4, "rows")
    with pytest.raises(TypeError, match=r"^sketch: dtype float16"):
        K.qjl_encode(f32, mx.zeros((16, 8), dtype=mx.float16))
    with pytest.raises(ValueError, match=r"^codebook: shape"):
        K.pq_encode(f32, mx.zeros((4, 3)), 2)
    with pytest.raises(ValueError, match=r"^bits: 13"):
        K.pq_encode(f32, mx.zeros((4, 4)), 13)
    x16 = mx.zeros((4, 16))
    with pytest.raises(TypeError, match=r"^rotation: dtype float16"):
        K.tq_prod_encode(x16, mx.zeros((16, 16), dtype=mx.float16), cb, mx.zeros((16, 16)), 3)
    with pytest.raises(ValueError, match=r"^bits: 6"):
        K.tq_prod_encode(x16, None, cb, mx.zeros((16, 16)), 6)
    with pytest.raises(ValueError, match=r"^x: head dimension 12"):
        K.tq_rvq_encode(mx.zeros((4, 12)), None, cb, cb, 2, 2)
