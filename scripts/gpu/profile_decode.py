"""GPU time of each kernel in decode steps (or one prefill chunk) of a
random-weight Llama model, for Nsight Compute on the NVIDIA machine.

    ncu --profile-from-start off --clock-control none \\
        --metrics gpu__time_duration.sum --csv \\
        python3 scripts/gpu/profile_decode.py --shape llama-1b --context 32768 --cache veloxquant

Prefills `--context` tokens, decodes a few warm-up tokens, then brackets
`--steps` decode steps (with `--chunk N`: one more prefill chunk of N
tokens) with cudaProfilerStart/Stop so that ncu records only those
kernels. Without ncu it prints the wall time per step. `--context 0
--chunk N` profiles a prompt's first chunk (no warm-up: the kernels'
compilation falls in the wall time, not in ncu's GPU times).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time

import mlx.core as mx

from veloxquant.tools import bench


def _cuda_profiler():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--cache", default="veloxquant")
    p.add_argument("--recipe", default="k4v3", help="the veloxquant recipe (veloxquant bench's syntax)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--chunk", type=int, default=0, help="profile one prefill chunk of this many tokens instead")
    args = p.parse_args()
    model = bench.build_model({"shape": args.shape})
    cache = bench.make_cache(model, bench.parse_cache(args.cache, args.recipe))
    tokens = mx.random.randint(0, model.args.vocab_size, (args.batch, args.context), key=mx.random.key(0))
    y = bench.prefill(model, cache, tokens, 2048) if args.context else None
    for _ in range(args.warmup if args.context else 0):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.synchronize()
    cudart = _cuda_profiler()
    if cudart is not None:
        cudart.cudaProfilerStart()
    t = time.perf_counter()
    if args.chunk:
        chunk = mx.random.randint(0, model.args.vocab_size, (args.batch, args.chunk), key=mx.random.key(1))
        mx.eval(chunk)
        t = time.perf_counter()
        hidden = model.model(chunk, cache=cache)
        built = time.perf_counter() - t
        mx.eval(hidden, [c.state for c in cache])
        steps, what = 1, f"prefill chunk of {args.chunk} (the graph built in {built * 1e3:.3f} ms)"
    else:
        for _ in range(args.steps):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
        steps, what = args.steps, "decode step"
    mx.synchronize()
    dt = (time.perf_counter() - t) / steps
    if cudart is not None:
        cudart.cudaProfilerStop()
    print(f"{args.shape} {args.cache} context {args.context} batch {args.batch}: {dt * 1e3:.3f} ms per {what}")


if __name__ == "__main__":
    main()
