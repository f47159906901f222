"""Where a decode step's time goes: host (graph build and launch) or GPU.

    python3 scripts/gpu/decode_ablation.py --shape llama-1b --context 32768 [--steps 64]

For one prefilled random-weight model, times greedy decode steps of fp16 and
the compressed cache, and variants of the compressed cache with a part of
its work removed (the output is then wrong; only the time matters):
``no-append`` (decode tokens are not appended), ``no-attention`` (the
attention returns the queries). Per variant: tokens/s with the next step's
graph built while the current one runs (as mlx_lm), host milliseconds per
step spent building the graph and in ``async_eval`` (the launches), and
milliseconds per step run one at a time (host and GPU in series).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from veloxquant.tools import bench
from veloxquant.cache import VeloxQuantCache


def _steps(model, cache, y, n):
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        h0 = time.perf_counter()
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(nxt)
        host += time.perf_counter() - h0
        y.tolist()
        y = nxt
    mx.eval(y)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(n // 4):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    serial = (time.perf_counter() - t1) / (n // 4)
    return y, n / wall, 1e3 * host / n, 1e3 * serial


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--model", help="a model path, or 'default' (instead of --shape)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--variants", default="fp16,vq,no-append,no-attention,fp16")
    args = p.parse_args()
    model = bench.build_model({"shape": args.shape, "model": args.model})
    from veloxquant import blas

    blas.maybe_float32_compute(model)  # as bench does on a CPU with a fast BLAS
    tokens = mx.random.randint(0, model.args.vocab_size, (1, args.context), key=mx.random.key(0))
    append, attention = VeloxQuantCache.update_and_fetch, VeloxQuantCache.attention

    def no_append(self, keys, values):
        if keys.shape[2] > 8:
            return append(self, keys, values)
        self._attended = False
        return keys, values

    def no_attention(self, queries, scale, mask=None):
        if queries.shape[2] > 8:
            return attention(self, queries, scale, mask)
        self._attended = True
        return queries

    print(f"{args.model or args.shape} context {args.context}: {args.steps} steps")
    print(f"{'variant':<14}{'tok/s':>9}{'host ms/step':>14}{'serial ms/step':>16}")
    for v in args.variants.split(","):
        VeloxQuantCache.update_and_fetch = no_append if v == "no-append" else append
        VeloxQuantCache.attention = no_attention if v == "no-attention" else attention
        cache = bench.make_cache(model, bench.parse_cache("fp16" if v == "fp16" else "veloxquant", "k4v3"))
        y = bench.prefill(model, cache, tokens, 2048)
        y, _, _, _ = _steps(model, cache, y, 8)
        _, tok_s, host, serial = _steps(model, cache, y, args.steps)
        print(f"{v:<14}{tok_s:>9.1f}{host:>14.3f}{serial:>16.3f}", flush=True)
        del cache
        mx.clear_cache()


if __name__ == "__main__":
    main()
