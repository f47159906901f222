"""veloxquant._native.LayerCache from Python: attention, memory, state, errors."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant._native import LayerCache


def rel_err(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def filled(method="turboquant-mse", dtype=mx.float16, tokens=300, **kw):
    cache = LayerCache(64, 2, key_method=method, value_method=method, window=32, sinks=4, **kw)
    k = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(2)).astype(dtype)
    cache.append(k, v)
    return cache, k, v


def test_fused_attention_matches_decode_then_sdpa():
    cache, _, _ = filled(dtype=mx.float32)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(3))
    out = cache.attention(q, 0.125)
    k, v = cache.dequantize()
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert out.shape == (1, 6, 1, 64) and out.dtype == mx.float32
    assert rel_err(out, ref) < 1e-5
    # Causal prefill-style queries.
    q = mx.random.normal((1, 6, 7, 64), key=mx.random.key(4))
    out = cache.attention(q, 0.125, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("tokens", [40, 200])
@pytest.mark.parametrize("method", ["turboquant-mse", "kivi"])
def test_a_prefill_chunk_attends_over_the_framed_buffer_in_float32_as_in_float16(method, tokens):
    """The CPU's float32 route for a prefill chunk: the same attention as the
    float16 one and as decode-then-SDPA in float32, returned in the cache's
    dtype. A chunk of 40 queries over 340 tokens enters the buffer's frame;
    one of 200 (more query rows than buffer rows) takes the buffer out of it."""
    cache, _, _ = filled(method=method, device="cpu")
    chunk = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(6)).astype(mx.float16)
    q = mx.random.normal((1, 6, tokens, 64), key=mx.random.key(7)).astype(mx.float16)
    fk, fv = cache.framed_with(chunk, chunk)
    half = cache.attend_framed(q, fk, fv, 0.125, "causal")
    single = cache.attend_framed(q, fk, fv, 0.125, "causal", float32=True)
    assert single.dtype == mx.float16 and single.shape == (1, 6, tokens, 64)
    k, v = cache.dequantize()
    k = mx.concatenate([k, chunk], axis=2).astype(mx.float32)
    v = mx.concatenate([v, chunk], axis=2).astype(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=0.125, mask="causal")
    assert rel_err(single, ref) < 1e-3
    assert rel_err(half, ref) < 2e-3
    with pytest.raises(TypeError, match="float32"):
        cache.attend_framed(q, fk, fv, 0.125, "causal", float32="yes")


@pytest.mark.parametrize("method", ["turboquant-mse", "kivi", "fp16"])
def test_framed_append_is_framed_with_then_append(method):
    """A prefill chunk's one call gives framed_with's buffers and leaves the
    cache as append does, for the first chunk (no key offset yet) and later ones."""
    one = LayerCache(64, 2, key_method=method, value_method=method, window=32, sinks=4)
    two = LayerCache(64, 2, key_method=method, value_method=method, window=32, sinks=4)
    for i, t in enumerate((100, 70, 130)):
        k = mx.random.normal((1, 2, t, 64), key=mx.random.key(10 + i)).astype(mx.float16)
        v = mx.random.normal((1, 2, t, 64), key=mx.random.key(20 + i)).astype(mx.float16)
        want = one.framed_with(k, v)
        one.append(k, v)
        got = two.framed_append(k, v)
        for a, b in zip(got + two.dequantize(), want + one.dequantize()):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
        assert two.offset == one.offset and two.nbytes == one.nbytes


def test_fp16_method_is_plain_sdpa():
    cache, k, v = filled(method="fp16")
    q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(5)).astype(mx.float16)
    np.testing.assert_array_equal(
        np.array(cache.attention(q, 0.1)), np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1))
    )


def test_counts_memory_trim_and_state():
    cache, k, _ = filled(tokens=300, key_bits=4, value_bits=2)
    assert cache.offset == 300 and cache.compressed_tokens == 300 - 4 - 32
    # Every held byte: codes (4 + 2 bits x 64 dims) and two float16 norms per
    # slot of a store sized by need (264 compressed tokens, rounded up to 64
    # slots), and the float16 windows (4 sinks + 2 x 32 recent slots) of keys
    # and values, and the keys' float32 channel means and their float16
    # offsets in the rotated frame; and the decode kernel's 16 uint32
    # counters per KV head (scratch, not data).
    heads, slots, window_slots = 2, 320, 4 + 2 * 32
    assert cache.nbytes == (
        heads * slots * (32 + 16 + 2 + 2) + 2 * heads * window_slots * 64 * 2 + heads * 64 * 4 + heads * 64 * 2
        + heads * 16 * 4
    )
    assert cache.data_nbytes < cache.nbytes
    data = cache.to_bytes()
    back = LayerCache.from_bytes(data)
    assert back.to_bytes() == data and back.offset == 300
    assert back.config["value_bits"] == 2
    assert cache.trim(10) == 10 and cache.offset == 290
    with pytest.raises(ValueError, match=r"^state:"):
        LayerCache.from_bytes(data[:100])


def test_a_corrupt_or_truncated_state_is_refused():
    cache, _, _ = filled(tokens=120)
    data = cache.to_bytes()
    rng = np.random.default_rng(0)
    for bit in rng.integers(0, 8 * len(data), 200):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError, match=r"^state:"):
            LayerCache.from_bytes(bytes(bad))
    for n in (0, 8, len(data) // 3, len(data) - 1):
        with pytest.raises(ValueError, match=r"^state:"):
            LayerCache.from_bytes(data[:n])
    bad = bytearray(data)
    bad[-1] ^= 4
    with pytest.raises(ValueError, match=r"^state: win_v: the data's checksum does not match"):
        LayerCache.from_bytes(bytes(bad))


@pytest.mark.parametrize("method", ["turboquant-mse", "kivi", "pq", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_is_never_made_finite(method, bad):
    # A NaN or an infinity in a key appended after the first chunk: once
    # compressed, the token decodes to NaN and attention of the queries that
    # see it is NaN, as float16 attention is for a NaN key.
    k = np.array(mx.random.normal((1, 2, 100, 64), key=mx.random.key(1)).astype(mx.float16))
    v = mx.random.normal((1, 2, 100, 64), key=mx.random.key(2)).astype(mx.float16)
    k[0, 1, 50, 7] = bad
    k = mx.array(k)
    bits = 8 if method == "fp8" else 4
    cache = LayerCache(64, 2, key_method=method, value_method=method, key_bits=bits, value_bits=bits, window=16, sinks=4, device="cpu")
    cache.append(k[:, :, :40], v[:, :, :40])
    for t in range(40, 100):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert cache.compressed_tokens > 50
    kd, _ = cache.dequantize()
    kd = np.array(kd.astype(mx.float32))
    assert np.isnan(kd[0, 1, 50]).any() and np.isfinite(kd[0, 0]).all()
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3)).astype(mx.float16)
    out = np.array(cache.attention(q, 0.125).astype(mx.float32))
    assert np.isfinite(out[0, :2]).all() and np.isnan(out[0, 2:]).all()
    if bad != bad:  # NaN: where MLX's float16 attention has NaN
        ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125).astype(mx.float32))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


@pytest.mark.parametrize(
    "dtype, scale", [(mx.float32, 1e5), (mx.bfloat16, 1e5), (mx.float16, 3e4)]
)
def test_norms_beyond_float16_come_back_right(dtype, scale):
    # Norms far past float16's 65504 (about 3e5 to 1e6 here): the cache holds
    # them (float16 inputs: every one), with the error it has at unit scale.
    def errors(scale):
        k = (mx.random.uniform(-1, 1, (1, 2, 120, 128), key=mx.random.key(1)) * scale).astype(dtype)
        v = (mx.random.uniform(-1, 1, (1, 2, 120, 128), key=mx.random.key(2)) * scale).astype(dtype)
        cache = LayerCache(128, 2, window=8, sinks=4, device="cpu")
        cache.append(k, v)
        kd, vd = cache.dequantize()
        assert np.isfinite(np.array(kd.astype(mx.float32))).all() and np.isfinite(np.array(vd.astype(mx.float32))).all()
        q = (mx.random.uniform(-1, 1, (1, 4, 1, 128), key=mx.random.key(3)) / scale).astype(dtype)
        out = cache.attention(q, 0.1)
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kd.astype(mx.float32), vd.astype(mx.float32), scale=0.1)
        return rel_err(kd, k), rel_err(vd, v), rel_err(out, ref)

    k1, v1, _ = errors(1.0)
    ke, ve, ae = errors(scale)
    assert ke < 1.2 * k1 + 0.02 and ve < 1.2 * v1 + 0.02, (ke, ve, k1, v1)
    assert ae < 2e-2


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^key_bits: 7"):
        LayerCache(64, 2, key_bits=7)
    with pytest.raises(ValueError, match=r"^key_method:"):
        LayerCache(64, 2, key_method="zip")
    with pytest.raises(ValueError, match=r"^head_dim:"):
        LayerCache(100, 2)
    cache = LayerCache(64, 2)
    with pytest.raises(ValueError, match=r"^keys: shape"):
        cache.append(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)))
    with pytest.raises(TypeError, match=r"^keys: dtype int32"):
        cache.append(mx.zeros((1, 2, 4, 64), dtype=mx.int32), mx.zeros((1, 2, 4, 64), dtype=mx.int32))
    with pytest.raises(TypeError, match=r"^keys: expected an mlx.core.array"):
        cache.append(np.zeros((1, 2, 4, 64)), np.zeros((1, 2, 4, 64)))
    cache.append(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
    with pytest.raises(ValueError, match=r"^mask: shape"):
        cache.attention(mx.zeros((1, 2, 1, 64)), 0.1, mask=mx.zeros((1, 5)))
    with pytest.raises(TypeError, match=r"^mask: dtype int32"):
        cache.attention(mx.zeros((1, 2, 1, 64)), 0.1, mask=mx.zeros((1, 4), dtype=mx.int32))
    with pytest.raises(ValueError, match=r'^mask: "sliding" is not supported'):
        cache.attention(mx.zeros((1, 2, 1, 64)), 0.1, mask="sliding")


def _filled_small():
    cache = LayerCache(64, 2, window=8, sinks=2)
    cache.append(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
    return cache


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: LayerCache("64", 2), r"^head_dim: expected an int, got str$"),
        (lambda: LayerCache(64, 2.0), r"^n_kv_heads: expected an int, got float$"),
        (lambda: LayerCache(64, True), r"^n_kv_heads: expected an int, got bool$"),
        (lambda: LayerCache(64, 2, key_bits=4.5), r"^key_bits: expected an int, got float$"),
        (lambda: LayerCache(64, 2, value_bits="4"), r"^value_bits: expected an int, got str$"),
        (lambda: LayerCache(64, 2, key_method=3), r"^key_method: expected a str, got int$"),
        (lambda: LayerCache(64, 2, window=1.0), r"^window: expected an int, got float$"),
        (lambda: LayerCache(64, 2, seed="0"), r"^seed: expected an int, got str$"),
        (lambda: LayerCache(64, 2, policy=1), r"^policy: expected a str, got int$"),
        (lambda: LayerCache(64, 2, device=3), r'^device: expected None, "cpu" or "gpu", got int$'),
        (lambda: _filled_small().attention(mx.zeros((1, 2, 1, 64)), "x"), r"^scale: expected a float, got str$"),
        (lambda: _filled_small().trim(1.5), r"^n: expected an int, got float$"),
        (lambda: LayerCache.from_bytes("state"), r"^data: expected bytes \(from to_bytes\), got str$"),
        (lambda: LayerCache.from_state_parts([], {}), r"^arrays: expected a dict of mlx.core.array by name, got list$"),
        (lambda: LayerCache.from_state_parts({"k_codes": 3}, {}), r'^arrays\["k_codes"\]: expected an mlx.core.array, got int$'),
    ],
)
def test_wrong_types_are_type_errors_naming_the_argument(call, message):
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: LayerCache(-64, 2), r"^head_dim: -64 is out of range; expected a multiple of 8 from 8 to 256$"),
        (lambda: LayerCache(64, -2), r"^n_kv_heads: -2 is out of range; expected an integer >= 1$"),
        (lambda: LayerCache(64, 2, key_bits=-1), r"^key_bits: -1 is not supported; expected one of \[1, 2, 3, 4, 8\] for turboquant-mse$"),
        (lambda: LayerCache(64, 2, value_method="kivi", value_bits=5), r"^value_bits: 5 is not supported by kivi; use one of \[1, 2, 3, 4, 8\]$"),
        (lambda: LayerCache(64, 2, window=-1), r"^window: -1 is out of range; expected a number of tokens >= 0"),
        (lambda: LayerCache(64, 2, sinks=-4), r"^sinks: -4 is out of range; expected a number of tokens >= 0$"),
        (lambda: LayerCache(64, 2, seed=-1), r"^seed: -1 is out of range; expected an integer from 0 to 2\*\*64 - 1$"),
        (lambda: LayerCache(64, 2, key_method="zip"), r'^key_method: "zip" is not one of "fp16", "turboquant-mse", "kivi"'),
        (lambda: LayerCache(64, 2, value_method="zip"), r'^value_method: "zip" is not one of "fp16"'),
        (lambda: LayerCache(64, 2, device="tpu"), r'^device: "tpu" is not one of "cpu", "gpu"$'),
        (lambda: LayerCache(64, 2, key_group=100), r"^key_group: 100 is not a multiple of 8 from 8 to 1024 tokens$"),
        (lambda: LayerCache(64, 2, key_group=2048), r"^key_group: 2048 is not a multiple of 8 from 8 to 1024 tokens$"),
        (lambda: LayerCache(64, 2, key_group=-8), r"^key_group: -8 is out of range; expected a multiple of 8 from 8 to 1024 tokens$"),
        (lambda: _filled_small().trim(-1), r"^n: -1 is out of range; expected a number of tokens >= 0$"),
        (lambda: LayerCache.from_state_parts({}, {"format": "veloxquant-layer-cache", "version": "2"}), r'^state: version "2" is not supported: this veloxquant reads versions 7 and 8'),
        (lambda: LayerCache.from_state_parts({}, {"version": "4"}), r'^state: no format field \(expected "veloxquant-layer-cache"\)'),
    ],
)
def test_wrong_values_are_value_errors_naming_the_argument_and_the_allowed_values(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert type(e.value) is ValueError and "Some(" not in str(e.value)


def test_numpy_integers_and_floats_are_accepted():
    cache = LayerCache(np.int64(64), np.int32(2), key_bits=np.int64(4), window=np.int64(8), sinks=2)
    cache.append(mx.zeros((1, 2, 20, 64)), mx.zeros((1, 2, 20, 64)))
    assert cache.attention(mx.zeros((1, 2, 1, 64)), np.float32(0.125)).shape == (1, 2, 1, 64)
    assert cache.trim(np.int64(3)) == 3


METHOD_PAIRS = [
    ("kivi", 4, "kivi", 2),
    ("pq", 2, "pq", 4),
    ("pq", 1, "kivi", 4),
    ("turboquant-mse", 4, "kivi", 3),
    ("kivi", 2, "turboquant-mse", 4),
    ("kivi", 8, "fp16", 16),
    ("fp16", 16, "kivi", 4),
    ("turboquant-mse", 3, "fp16", 16),
    ("qjl", 1, "kivi", 4),
    ("turboquant-prod", 4, "turboquant-rvq", 3),
    ("turboquant-rvq", 5, "fp16", 16),
    ("fp8", 8, "fp8", 8),
    ("fp8", 8, "turboquant-mse", 3),
]


@pytest.mark.parametrize("key_method, key_bits, value_method, value_bits", METHOD_PAIRS)
def test_every_method_mix_attends_like_decode_then_sdpa(key_method, key_bits, value_method, value_bits):
    cache = LayerCache(
        64, 2, key_method=key_method, key_bits=key_bits, value_method=value_method, value_bits=value_bits,
        window=32, sinks=4, policy="require",
    )
    k = mx.random.normal((2, 2, 300, 64), key=mx.random.key(1))
    v = mx.random.normal((2, 2, 300, 64), key=mx.random.key(2))
    cache.append(k, v)
    assert cache.offset == 300 and cache.compressed_tokens > 0
    kd, vd = cache.dequantize()
    q = mx.random.normal((2, 8, 1, 64), key=mx.random.key(3))
    assert rel_err(cache.attention(q, 0.125), mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125)) < 1e-5
    q = mx.random.normal((2, 8, 5, 64), key=mx.random.key(4))
    ref = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask="causal")
    assert rel_err(cache.attention(q, 0.125, mask="causal"), ref) < 1e-5
    # An array mask (mlx_lm's form: boolean, shared by the heads) as MLX applies it.
    keep = mx.random.uniform(shape=(2, 1, 5, 300), key=mx.random.key(5)) > 0.3
    keep[..., -1] = True
    ref = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask=keep)
    assert rel_err(cache.attention(q, 0.125, mask=keep), ref) < 1e-5
    # The reconstruction is close to what went in (8-bit integer codes
    # closest, then e4m3's 3 mantissa bits; QJL's unbiased 1-bit decode has
    # about sqrt(pi/2 - 1) = 0.76 relative error).
    bound = {"fp8": 0.03, "qjl": 0.85}.get(key_method, 0.02 if key_bits == 8 else 0.6)
    assert rel_err(kd, k) < bound
    data = cache.to_bytes()
    back = LayerCache.from_bytes(data)
    assert back.to_bytes() == data
    assert (back.config["key_method"], back.config["value_method"]) == (key_method, value_method)
    assert cache.trim(7) == 7 and cache.offset == 293


def test_mixed_methods_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^value_bits: 5 is not supported by kivi"):
        LayerCache(64, 2, value_method="kivi", value_bits=5)
    with pytest.raises(ValueError, match=r"^value_method: \"pq-ish\" is not one of"):
        LayerCache(64, 2, value_method="pq-ish")
    with pytest.raises(ValueError, match=r"^key_bits: 3 is not supported by pq"):
        LayerCache(64, 2, key_method="pq", key_bits=3)
    with pytest.raises(ValueError, match=r"^value_method: qjl estimates attention scores and stores keys only"):
        LayerCache(64, 2, key_method="qjl", key_bits=1, value_method="qjl", value_bits=1)
    with pytest.raises(ValueError, match=r"^value_method: turboquant-prod"):
        LayerCache(64, 2, value_method="turboquant-prod", value_bits=3)
    with pytest.raises(ValueError, match=r"^key_bits: 1 is not supported by turboquant-prod"):
        LayerCache(64, 2, key_method="turboquant-prod", key_bits=1)
    with pytest.raises(ValueError, match=r"^value_bits: 8 is not supported by turboquant-rvq"):
        LayerCache(64, 2, value_method="turboquant-rvq", value_bits=8)


@pytest.mark.parametrize("group", [8, 128])
def test_kivi_key_groups_attend_like_decode_then_sdpa_and_cost_their_bits(group):
    """A KIVI key group of `group` tokens: the fused attention reads what
    dequantize gives, flushes compress whole groups, the state keeps the
    group, and the keys' scale and zero bytes shrink as the group grows."""
    def make(g):
        cache = LayerCache(64, 2, key_method="kivi", key_bits=3, value_method="turboquant-mse", value_bits=3,
                           window=32, sinks=4, key_group=g, policy="require")
        k = mx.random.normal((1, 2, 700, 64), key=mx.random.key(1))
        v = mx.random.normal((1, 2, 700, 64), key=mx.random.key(2))
        cache.append(k, v)
        for i in range(3):  # decode appends after the prefill
            cache.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        return cache, k
    cache, k = make(group)
    assert cache.config["key_group"] == group
    assert cache.compressed_tokens % group == 0 and cache.compressed_tokens > 0
    kd, vd = cache.dequantize()
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(3))
    assert rel_err(cache.attention(q, 0.125), mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125)) < 1e-5
    n = cache.compressed_tokens
    assert rel_err(kd[:, :, 4 : 4 + n], k[:, :, 4 : 4 + n]) < 0.3
    back = LayerCache.from_bytes(cache.to_bytes())
    assert back.config["key_group"] == group and back.to_bytes() == cache.to_bytes()
    # The data stored differs from groups of 32 (the default) by the keys'
    # scale and zero (float16) per head, channel and group alone.
    # (Groups of 8 flush at other boundaries: 664 tokens compressed, not 640.)
    if group == 128:
        base, _ = make(32)
        assert base.compressed_tokens == n == 640 and base.offset == cache.offset
        per_group = 2 * 64 * 2 * 2  # heads x channels x (scale, zero) x bytes
        assert base.data_nbytes - cache.data_nbytes == per_group * (n // 32 - n // group)
