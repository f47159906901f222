"""Where one decode attention call's time goes on the GPU: graph building,
evaluation, and (under Nsight Compute) the kernels' GPU time, for the
compressed cache's call and MLX's float16 SDPA at the same shape.

    python3 scripts/gpu/decode_call_cost.py --contexts 4096 131072
    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv \\
        python3 scripts/gpu/decode_call_cost.py --contexts 4096 --calls 4 --rounds 1

For each context: a LayerCache (B=1, Hq=32, Hkv=8, D=128, K4/V3) filled as
`veloxquant.tools.bench_attention` fills it, then `--rounds` rounds of
`--calls` calls built into one graph and evaluated. Per call, in µs:
`build` is graph building, `eval` the evaluation (launches, GPU, wait).
The compressed cache's calls depend on each other (each decode hands the
next its zeroed counters), SDPA's do not; `sdpa chained` feeds each SDPA
call's output into the next query, so that its calls run one after another
as a model's layers do. Only the rounds after the first are bracketed by
cudaProfilerStart/Stop, so ncu sees warm calls only.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import mlx.core as mx

from veloxquant._native import LayerCache


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _time(build, rounds):
    b, e = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = build()
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        b.append(t1 - t0)
        e.append(t2 - t1)
    return statistics.median(b), statistics.median(e)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072])
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    hq, hkv, d = 32, 8, 128
    scale = d**-0.5
    cudart = _cudart()
    print(f"{'context':>8} {'op':<14} {'build us':>9} {'eval us':>9} {'total us':>9}  (per call, {a.calls} calls a graph)")
    for t in a.contexts:
        k1, k2, k3 = mx.random.split(mx.random.key(t), 3)
        k = mx.random.normal((1, hkv, t, d), key=k1).astype(mx.float16)
        v = mx.random.normal((1, hkv, t, d), key=k2).astype(mx.float16)
        qs = [mx.random.normal((1, hq, 1, d), key=mx.random.key(t + i)).astype(mx.float16) for i in range(a.calls)]
        mx.eval(k, v, *qs)
        cache = LayerCache(d, hkv, key_bits=4, value_bits=3, device="gpu")
        for s in range(0, t, 8192):
            cache.append(k[:, :, s : s + 8192], v[:, :, s : s + 8192])
            mx.eval(cache.attention(qs[0][:, :hkv], scale))

        def chained():
            out, x = [], qs[0]
            for _ in range(a.calls):
                x = mx.fast.scaled_dot_product_attention(x, k, v, scale=scale)
                out.append(x)
            return out

        ops = {
            "veloxquant": lambda: [cache.attention(q, scale) for q in qs],
            "sdpa": lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale) for q in qs],
            "sdpa chained": chained,
        }
        for name, build in ops.items():
            _time(build, 1)  # warm-up (and the kernels' first compile)
            if cudart is not None:
                cudart.cudaProfilerStart()
            bt, et = _time(build, a.rounds)
            if cudart is not None:
                cudart.cudaProfilerStop()
            n = a.calls
            print(f"{t:>8} {name:<14} {bt / n * 1e6:>9.1f} {et / n * 1e6:>9.1f} {(bt + et) / n * 1e6:>9.1f}", flush=True)
        del cache, k, v


if __name__ == "__main__":
    main()
