"""Host time of one layer's decode-step cache work: the append and the
attention as a model calls them (``update_and_fetch``, then mlx_lm's
``scaled_dot_product_attention`` through veloxquant's dispatch), float16
against the compressed cache, and the compressed cache's parts alone.

    python3 scripts/gpu/decode_layer_host.py --heads 32,8 --head-dim 64 --context 1024 --layers 16

``--layers`` independent layer caches are stepped as one model step (one
evaluation each step), at a short context so that the GPU's part is small.
Per layer, in µs: ``build`` is graph building, ``launch`` MLX's
``async_eval`` of the step (the host's share of running it: allocations and
kernel launches), ``step`` the whole step waited for. ``build + launch`` is
what a decode step costs the host, which bounds a batch-1 decode on a fast
GPU. ``vq append`` and ``vq attention`` time the native layer's calls alone
(the append's ``launch`` and ``step`` include evaluating the layer's state
views). Variants are interleaved round by round so that the host's drift
hits them alike; the median round is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,8", help="query heads,KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="steps a round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--recipe", default="k4v3")
    args = p.parse_args()

    import veloxquant  # noqa: F401  (before mlx: veloxquant.blas chooses the BLAS)
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from veloxquant import attention as vq_attention
    from veloxquant.tools import bench
    from veloxquant.cache import VeloxQuantCache

    vq_attention.install()
    hq, hkv = (int(x) for x in args.heads.split(","))
    d, n = args.head_dim, args.layers
    scale = d**-0.5

    def normal(shape, seed):
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.float16)

    prompt_k, prompt_v = normal((1, hkv, args.context, d), 0), normal((1, hkv, args.context, d), 1)
    q, k1, v1 = normal((1, hq, 1, d), 2), normal((1, hkv, 1, d), 3), normal((1, hkv, 1, d), 4)
    mx.eval(prompt_k, prompt_v, q, k1, v1)
    config = bench.recipe_config(args.recipe, "")

    def held(cs):
        return [list(c.layer.state_parts()[0].values()) for c in cs]

    def vq_caches():
        cs = [VeloxQuantCache(config) for _ in range(n)]
        for c in cs:
            c.update_and_fetch(prompt_k, prompt_v)
            c.attention(q, scale, None)
        mx.eval(held(cs))
        return cs

    def fp16_caches():
        cs = [KVCache() for _ in range(n)]
        for c in cs:
            c.update_and_fetch(prompt_k, prompt_v)
        mx.eval([c.keys for c in cs])
        return cs

    sdpa = base.scaled_dot_product_attention

    def model_step(cs):
        outs = []
        for c in cs:
            k, v = c.update_and_fetch(k1, v1)
            outs.append(sdpa(q, k, v, c, scale=scale, mask=None))
        return outs

    def append_only(cs):
        for c in cs:
            c.layer.append(k1, v1)
        return None

    def attention_only(cs):
        return [c.layer.attention(q, scale, None) for c in cs]

    variants = {
        "fp16": (fp16_caches, model_step),
        "veloxquant": (vq_caches, model_step),
        "vq append": (vq_caches, append_only),
        "vq attention": (vq_caches, attention_only),
    }
    state = {name: make() for name, (make, _) in variants.items()}
    build = {name: [] for name in variants}
    launch = {name: [] for name in variants}
    step = {name: [] for name in variants}
    for r in range(args.rounds + 1):
        for name, (make, run) in variants.items():
            if r % 4 == 0:
                # Keep the caches' windows from flushing into the timing: fresh caches now and then.
                state[name] = make()
            cs = state[name]
            tb = tl = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                h0 = time.perf_counter()
                outs = run(cs)
                h1 = time.perf_counter()
                outs = outs if outs is not None else held(cs)
                h2 = time.perf_counter()
                mx.async_eval(outs)
                h3 = time.perf_counter()
                mx.eval(outs)
                tb += h1 - h0
                tl += h3 - h2
            wall = time.perf_counter() - t0
            if r:
                build[name].append(1e6 * tb / (args.steps * n))
                launch[name].append(1e6 * tl / (args.steps * n))
                step[name].append(1e6 * wall / (args.steps * n))
    print(f"heads {hq}/{hkv}, head_dim {d}, context {args.context}, {n} layers, {args.steps} steps x {args.rounds} rounds, {mx.default_device()}")
    print(f"{'variant':<14}{'build us/layer':>16}{'launch us/layer':>17}{'step us/layer':>15}")
    for name in variants:
        b, la, st = (statistics.median(x[name]) for x in (build, launch, step))
        print(f"{name:<14}{b:>16.1f}{la:>17.1f}{st:>15.1f}")


if __name__ == "__main__":
    main()
