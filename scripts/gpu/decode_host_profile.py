"""Host time of each Python-visible call in decode steps (cProfile), for the
GPU machine where a batch-1 step is bound by the host: a random-weight model
of --shape, a --context prompt prefilled, then --steps decode steps each
evaluated, profiled after ten warm-up steps. Prints the calls by own time;
`LayerCache.attention` and `LayerCache.append` are the compressed cache's
graph building per layer (divide by layers x steps).

    python3 scripts/gpu/decode_host_profile.py --shape llama-1b --context 8192 --steps 64

With ``--chunk N``, the steps are prefill chunks of N tokens instead (each
built, then evaluated with the caches' state, as ``bench.prefill`` does),
after one chunk of warm-up.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--cache", choices=("veloxquant", "fp16"), default="veloxquant")
    p.add_argument("--top", type=int, default=22, help="calls printed")
    p.add_argument("--chunk", type=int, default=0, help="profile prefill chunks of this many tokens")
    args = p.parse_args()

    import veloxquant  # noqa: F401  (before mlx: veloxquant.blas chooses the BLAS)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    from veloxquant.tools import bench
    from veloxquant.cache import KVConfig, make_prompt_cache

    model = bench.build_model({"shape": args.shape})
    cache = make_prompt_cache(model, KVConfig()) if args.cache == "veloxquant" else mlx_prompt_cache(model)
    y = bench.prefill(model, cache, mx.random.randint(0, 1000, (1, args.context)), 2048)

    def run(n: int) -> None:
        nonlocal y
        for _ in range(n):
            if args.chunk:
                chunk = mx.random.randint(0, 1000, (1, args.chunk))
                model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
                continue
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)

    run(1 if args.chunk else 10)
    profile = cProfile.Profile()
    profile.enable()
    run(args.steps)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
