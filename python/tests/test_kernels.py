"""veloxquant.kernels on mlx.core.array: values, laziness, errors, leaks."""

import gc
import resource

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant import kernels as K


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, written plainly: code i at stream bits [i*b, i*b+b)."""
    rows, n = codes.shape
    nbytes = (n * bits + 7) // 8
    out = np.zeros((rows, nbytes), np.uint8)
    for r in range(rows):
        stream = 0
        for i, c in enumerate(codes[r]):
            stream |= (int(c) & ((1 << bits) - 1)) << (i * bits)
        out[r] = np.frombuffer(stream.to_bytes(nbytes, "little"), np.uint8)
    return out


def np_vq(x: np.ndarray, cb: np.ndarray) -> np.ndarray:
    d = ((x[:, None, :].astype(np.float32) - cb[None].astype(np.float32)) ** 2).sum(-1)
    return d.argmin(-1).astype(np.uint32)


@pytest.mark.parametrize("bits", K.SUPPORTED_BITS)
@pytest.mark.parametrize("policy", ["auto", "require", "off"])
def test_bit_pack_matches_numpy_and_round_trips(bits, policy):
    rng = np.random.default_rng(bits)
    for rows, n in [(1, 1), (3, 7), (2, 16), (5, 29)]:
        codes = rng.integers(0, 256, (rows, n), dtype=np.uint8)
        packed = K.bit_pack(mx.array(codes), bits, policy=policy, device="cpu")
        assert packed.dtype == mx.uint8
        np.testing.assert_array_equal(np.array(packed), np_pack(codes, bits))
        back = K.bit_unpack(packed, bits, n, policy=policy, device="cpu")
        np.testing.assert_array_equal(np.array(back), codes & ((1 << bits) - 1))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("d", K.VQ_DIMS)
def test_vq_quantize_equals_numpy(dtype, d):
    rng = np.random.default_rng(d)
    # Distinct, well-separated distances: a numpy reference cannot disagree on ties.
    cb = mx.array(rng.normal(size=(64, d)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.normal(size=(2, 500, d)).astype(np.float32)).astype(dtype)
    y = K.vq_quantize(x, cb)
    assert isinstance(y, mx.array) and y.dtype == mx.uint32 and y.shape == (2, 500)
    xf = np.array(x.astype(mx.float32)).reshape(-1, d)
    cf = np.array(cb.astype(mx.float32))
    want = np_vq(xf, cf)
    got = np.array(y).reshape(-1)
    dist = lambda idx: ((xf - cf[idx]) ** 2).sum(-1)  # noqa: E731
    # Indices equal except at float32 near-ties, where the distances agree.
    differ = got != want
    assert differ.mean() < 0.002
    np.testing.assert_allclose(dist(got)[differ], dist(want)[differ], rtol=1e-5)


def test_results_are_lazy_and_compose_under_compile():
    x = mx.random.normal((4096, 4))
    cb = mx.random.normal((256, 4))
    mx.eval(x, cb)
    before = mx.get_active_memory()
    y = K.vq_quantize(x, cb)
    z = (y + 1) * 2
    # Building the ops allocated nothing for their results (only the two
    # scalar constants): nothing was evaluated.
    assert mx.get_active_memory() - before < 1024
    mx.eval(z)
    assert mx.get_active_memory() - before >= 4096 * 4
    np.testing.assert_array_equal(np.array(z), (np_vq(np.array(x), np.array(cb)) + 1) * 2)

    # Forcing evaluation inside mx.compile's trace raises; the kernels do not.
    f = mx.compile(lambda a, b: K.bit_unpack(K.bit_pack(K.vq_quantize(a, b).astype(mx.uint8), 8), 8, 4096))
    np.testing.assert_array_equal(np.array(f(x, cb)), np.array(y).astype(np.uint8))


def test_wrong_arguments_raise_errors_naming_them():
    f32 = mx.zeros((4, 4))
    u8 = mx.zeros((4, 4), dtype=mx.uint8)
    with pytest.raises(TypeError, match=r"^codes: dtype float32"):
        K.bit_pack(f32, 2)
    with pytest.raises(TypeError, match=r"^codes: expected an mlx.core.array"):
        K.bit_pack(np.zeros((4, 4), np.uint8), 2)
    with pytest.raises(ValueError, match=r"^bits: 5"):
        K.bit_pack(u8, 5)
    with pytest.raises(ValueError, match=r"^packed: last dimension"):
        K.bit_unpack(u8, 3, 100)
    with pytest.raises(TypeError, match=r"^x: dtype uint8"):
        K.vq_quantize(u8, u8)
    with pytest.raises(TypeError, match=r"^codebook: dtype float16"):
        K.vq_quantize(f32, f32.astype(mx.float16))
    with pytest.raises(ValueError, match=r"^x: vector size"):
        K.vq_quantize(mx.zeros((4, 3)), mx.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"^codebook: 4097 centroids"):
        K.vq_quantize(mx.zeros((4, 2)), mx.zeros((4097, 2)))
    with pytest.raises(ValueError, match=r"^policy:"):
        K.bit_pack(u8, 2, policy="fast")
    with pytest.raises(ValueError, match=r"^device:"):
        K.bit_pack(u8, 2, device="tpu")
    with pytest.raises(TypeError, match=r"^device:"):
        K.bit_pack(u8, 2, device=3)


def test_device_objects_and_gpu_absence():
    u8 = mx.zeros((2, 8), dtype=mx.uint8)
    assert K.bit_pack(u8, 1, device=mx.cpu).shape == (2, 1)
    assert K.bit_pack(u8, 1, device=mx.default_stream(mx.cpu)).shape == (2, 1)
    if veloxquant._native.gpu_backend() is None:
        with pytest.raises(RuntimeError, match="no GPU"):
            K.bit_pack(u8, 1, device="gpu")


def test_another_mlx_version_is_refused(monkeypatch):
    monkeypatch.setattr(veloxquant._metadata, "version", lambda name: "0.31.0")
    with pytest.raises(ImportError, match=r"needs mlx==0\.32\.4, but mlx 0\.31\.0 is installed"):
        veloxquant._check_mlx()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_100k_calls_leak_nothing():
    x = mx.random.normal((64, 4))
    cb = mx.random.normal((16, 4))
    codes = mx.zeros((4, 10), dtype=mx.uint8)
    mx.eval(x, cb, codes)

    def burst(count):
        for _ in range(count):
            y = K.vq_quantize(x, cb)
            p = K.bit_pack(codes, 3)
            mx.eval(y, p)
        gc.collect()

    burst(5_000)  # warm up caches and allocator pools
    rss0, active0 = _rss_mib(), mx.get_active_memory()
    burst(100_000)
    rss1, active1 = _rss_mib(), mx.get_active_memory()
    assert active1 == active0, f"MLX active memory grew {active1 - active0} bytes"
    assert rss1 - rss0 < 8, f"RSS grew {rss1 - rss0:.1f} MiB over 100k calls"
