"""GPU checks of veloxquant.kernels through Python (run on a machine whose MLX
has a GPU back-end; not collected by pytest in CI, which has none):

    python python/tests/check_gpu.py

Every check compares the GPU result with the CPU primitive, and shows that the
results are lazy arrays that compose with mx ops and mx.compile on the GPU.
"""

import sys

import mlx.core as mx

import veloxquant
from veloxquant import kernels as K


def check_vq_parity():
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for d in K.VQ_DIMS:
            x = mx.random.normal((200_000, d), key=mx.random.key(d)).astype(dtype)
            cb = mx.random.normal((256, d), key=mx.random.key(100 + d)).astype(dtype)
            g = K.vq_quantize(x, cb, policy="require", device="gpu")
            c = K.vq_quantize(x, cb, policy="require", device="cpu")
            same = mx.array_equal(g, c).item()
            assert same, f"vq_quantize {dtype} d={d}: GPU and CPU indices differ"


def check_bit_pack_parity():
    for bits in K.SUPPORTED_BITS:
        codes = mx.random.randint(0, 256, (1000, 1001), key=mx.random.key(bits)).astype(mx.uint8)
        g = K.bit_pack(codes, bits, policy="require", device="gpu")
        c = K.bit_pack(codes, bits, policy="require", device="cpu")
        assert mx.array_equal(g, c).item(), f"bit_pack bits={bits}"
        u = K.bit_unpack(g, bits, 1001, policy="require", device="gpu")
        assert mx.array_equal(u, codes & ((1 << bits) - 1)).item(), f"bit_unpack bits={bits}"


def check_lazy_and_compile():
    x = mx.random.normal((4096, 4))
    cb = mx.random.normal((64, 4))
    f = mx.compile(lambda a, b: K.bit_unpack(K.bit_pack(K.vq_quantize(a, b).astype(mx.uint8), 8), 8, 4096) + 1)
    want = K.vq_quantize(x, cb, device="cpu").astype(mx.uint8) + 1
    assert mx.array_equal(f(x, cb), want).item()


def check_non_finite_and_huge_tokens_decode_as_on_the_cpu():
    # TurboQuant-MSE marks a token from the norm its encoder stored: a NaN,
    # an infinity or a norm of 65504 or more decodes to NaN, on the GPU as on
    # the CPU; a prefill chunk's one-call path leaves the cache as append does.
    from veloxquant._native import LayerCache

    k = mx.random.normal((1, 2, 300, 128), key=mx.random.key(5))
    k[0, 0, 10, 3] = float("nan")
    k[0, 1, 20, 0] = float("inf")
    k[0, 0, 30] = 1e6  # a norm past 65504 in the cache's frame (k / 32 at head_dim 128)
    k[0, 1, 40] = 1e4  # one within it
    out = {}
    for device in ("cpu", "gpu"):
        c = LayerCache(128, 2, window=16, sinks=4, device=device)
        c.framed_append(k[:, :, :150], k[:, :, :150])
        c.framed_append(k[:, :, 150:], k[:, :, 150:])
        out[device] = [mx.isnan(x).any(axis=-1) for x in c.dequantize()]
    for side, (g, c) in enumerate(zip(out["gpu"], out["cpu"])):
        assert mx.array_equal(g, c).item(), f"side {side}: NaN tokens differ between GPU and CPU"
        rows = {(h, t) for h in range(2) for t in range(300) if c[0, h, t].item()}
        assert {(0, 10), (1, 20), (0, 30)} <= rows and (1, 40) not in rows, f"side {side}: NaN rows {sorted(rows)}"


def check_prefill_chunks_leave_the_stores_the_cpu_leaves():
    # Chunks that outgrow the stores write them in one launch a side
    # (store_write); the stores decode as the CPU's do, every slot in place.
    from veloxquant._native import LayerCache

    for d, dtype in ((128, mx.float16), (64, mx.bfloat16)):
        x = mx.random.normal((2, 4, 1200, d), key=mx.random.key(d)).astype(dtype)
        y = mx.random.normal((2, 4, 1200, d), key=mx.random.key(d + 1)).astype(dtype)
        out = {}
        for device in ("cpu", "gpu"):
            c = LayerCache(d, 4, window=64, sinks=4, device=device)
            for lo, hi in ((0, 300), (300, 700), (700, 1199), (1199, 1200)):
                c.framed_append(x[:, :, lo:hi], y[:, :, lo:hi])
            out[device] = [a.astype(mx.float32) for a in c.dequantize()]
        for side, (g, c) in enumerate(zip(out["gpu"], out["cpu"])):
            err = (mx.linalg.norm(g - c) / mx.linalg.norm(c)).item()
            assert g.shape == c.shape and err < 2e-2, f"d={d} side {side}: GPU against CPU relative error {err:.3g}"


def check_several_queries_attend_over_the_stored_tokens():
    # Several queries a head (speculative verification, short chunks) run the
    # attention kernel of every codec: TurboQuant sides staged in shared
    # memory, KIVI sides read in place. Against float32 attention over the
    # tokens the cache decodes from the very codes the kernel read.
    from veloxquant._native import LayerCache

    recipes = [("turboquant-mse", 4, "turboquant-mse", 3), ("turboquant-mse", 2, "turboquant-mse", 4),
               ("kivi", 4, "turboquant-mse", 3), ("turboquant-mse", 8, "kivi", 2)]
    worst = 0.0
    for i, ((km, kb, vm, vb), d, dtype, group, queries) in enumerate(
            (r, d, t, g, n) for r in recipes for d in (64, 128) for t in (mx.float16, mx.bfloat16)
            for g, n in ((4, 4), (8, 2), (1, 8))):
        mx.random.seed(i)
        c = LayerCache(d, 2, key_method=km, key_bits=kb, value_method=vm, value_bits=vb, window=64, sinks=4,
                       policy="require", device="gpu")
        k = (mx.random.normal((2, 2, 900, d)) * mx.linspace(0.2, 3.0, d) + 0.7).astype(dtype)
        v = mx.random.normal((2, 2, 900, d)).astype(dtype)
        c.append(k[:, :, :896], v[:, :, :896])
        c.append(k[:, :, 896:], v[:, :, 896:])
        q = (mx.random.normal((2, 2 * group, queries, d)) * 2.0).astype(dtype)
        out = c.attention(q, d**-0.5, "causal").astype(mx.float32)
        ks, vs = (mx.repeat(x.astype(mx.float32), group, axis=1) for x in c.dequantize())
        # Query l sits at position 900 - queries + l and sees tokens up to it.
        hidden = mx.arange(900)[None, :] > (900 - queries + mx.arange(queries))[:, None]
        scores = (q.astype(mx.float32) * d**-0.5) @ ks.swapaxes(-1, -2) + mx.where(hidden, -mx.inf, 0.0)
        want = mx.softmax(scores, axis=-1) @ vs
        err = (mx.linalg.norm(out - want) / mx.linalg.norm(want)).item()
        worst = max(worst, err)
        tol = 2e-2 if dtype == mx.bfloat16 else 5e-3
        assert mx.all(mx.isfinite(out)).item() and err < tol, (
            f"{km}/{kb} {vm}/{vb} d={d} {dtype} group={group} queries={queries}: relative error {err:.3g}")
    print(f"  several queries: largest relative error {worst:.2e}")


def main():
    print(f"mlx {mx.__version__}, default device {mx.default_device()}, GPU back-end {veloxquant._native.gpu_backend()}")
    if veloxquant._native.gpu_backend() is None:
        print("no GPU back-end in this MLX")
        return 2
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("check_"):
            try:
                fn()
                print(f"PASS {name}")
            except AssertionError as e:
                failed += 1
                print(f"FAIL {name}: {e}")
    print(f"{len([n for n in globals() if n.startswith('check_')]) - failed} passed, {failed} failed")
    print(f"GPU kernel objects created: {veloxquant._native.cached_kernel_count()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
