"""Throughput of the fused kernels against their reference graphs as N grows,
one PNG per back-end.

    python -m veloxquant.tools.plot_kernels [--device cpu|gpu] [--max-n 65536] [--out kernels_cpu.png]

Vectors of d = 128 in float16 (float32 on the CPU); each point is the median
of 5 evaluated calls. Throughput counts input vectors per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from .. import kernels as K


def _time(fn, reps: int = 5) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cases(dtype):
    d = 128
    cb16 = mx.sort(mx.random.normal((16,), key=mx.random.key(1))) / d**0.5
    pq_cb = mx.random.normal((256, 4), key=mx.random.key(2))  # PQ codebooks are float32 for every input dtype
    vq_cb = mx.random.normal((256, 4), key=mx.random.key(3)).astype(dtype)
    return {
        "scalar_quantize b=4": lambda x, p: K.scalar_quantize(x, cb16, 4, policy=p),
        "kivi_quantize keys b=2": lambda x, p: K.kivi_quantize(x, 2, 32, "keys", policy=p),
        "pq_encode s=4 K=256": lambda x, p: K.pq_encode(x, pq_cb, 8, policy=p),
        "vq_quantize d=4 K=256": lambda x, p: K.vq_quantize(x.reshape(-1, 4), vq_cb, policy=p),
        "bit_pack b=3": lambda x, p: K.bit_pack((x > 0).astype(mx.uint8), 3, policy=p),
    }, d


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m veloxquant.tools.plot_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--max-n", type=int, default=65536)
    p.add_argument("--out", default=None, help="PNG path (default: kernels_<device>.png)")
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    dtype = mx.float16 if a.device == "gpu" else mx.float32
    cases, d = _cases(dtype)
    ns = []
    n = 1024
    while n <= a.max_n:
        ns.append(n)
        n *= 4
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.6), sharey=False)
    print(f"kernel throughput on {mx.default_device()}, d = {d}, {dtype}")
    print("| kernel | N | fused vectors/s | reference vectors/s | speed-up |")
    print("|---|---|---|---|---|")
    for ax, (name, fn) in zip(axes, cases.items()):
        fused, ref = [], []
        for n in ns:
            x = mx.random.normal((n, d), key=mx.random.key(n)).astype(dtype)
            mx.eval(x)
            tf = _time(lambda: fn(x, "require"))
            tr = _time(lambda: fn(x, "off"))
            fused.append(n / tf)
            ref.append(n / tr)
            print(f"| {name} | {n} | {n / tf:.3g} | {n / tr:.3g} | {tr / tf:.1f}x |", flush=True)
        ax.loglog(ns, fused, "o-", label="fused kernel")
        ax.loglog(ns, ref, "s--", label="reference graph")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("N (vectors)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("vectors / s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"veloxquant kernels on {a.device}, d = {d}")
    fig.tight_layout()
    out = a.out or f"kernels_{a.device}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
