"""Time and transient memory of one layer's prefill buffer (`framed_with`):
a compressed layer holding --context tokens of random keys and values
(TurboQuant-MSE K4/V3) is handed a chunk, and the two buffers MLX's SDPA
attends over are built and evaluated, --rounds times.

    python3 scripts/gpu/framed_cost.py --context 32768 --kv-heads 8 --head-dim 128 [--device gpu]

Prints the median time and the peak memory above what the cache held before,
beside the two buffers' own bytes (the least any way of building them needs).
Run it at two commits to compare a change (docs/results/README.md).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from veloxquant import _native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = p.parse_args()
    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    b, h, d = args.batch, args.kv_heads, args.head_dim
    layer = _native.LayerCache(d, h, key_bits=4, value_bits=3, device=args.device)
    k, v = (mx.random.normal((b, h, args.context, d)).astype(mx.float16) for _ in range(2))
    layer.append(k, v)
    mx.eval(layer.state_parts()[0])
    del k, v
    ck, cv = (mx.random.normal((b, h, args.chunk, d)).astype(mx.float16) for _ in range(2))
    mx.eval(ck, cv)
    times, peak, out = [], 0, 0
    for _ in range(args.rounds):
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        fk, fv = layer.framed_with(ck, cv)
        mx.eval(fk, fv)
        mx.synchronize()
        times.append(time.perf_counter() - t)
        peak, out = max(peak, mx.get_peak_memory() - base), fk.nbytes + fv.nbytes
        del fk, fv
    times.sort()
    print(
        f"framed_with, {args.context} tokens held + {args.chunk}, batch {b}, {h} KV heads, head_dim {d}, {args.device}: "
        f"median {times[len(times) // 2] * 1e3:.2f} ms (min {times[0] * 1e3:.2f}); peak {peak / 2**20:.1f} MiB above the cache, "
        f"the buffers {out / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
