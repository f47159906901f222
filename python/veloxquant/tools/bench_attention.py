"""Decode attention over a compressed cache against MLX's float16 attention
and mlx_lm's 4-bit QuantizedKVCache attention, side by side in one run.

    python -m veloxquant.tools.bench_attention [--device gpu] [--contexts 4096 32768 131072]
        [--batch 1] [--queries 1] [--key-bits 4] [--value-bits 3] [--out results.md]

Shape: `--batch` sequences (default 1), 32 query heads, 8 KV heads, head_dim 128, float16 queries, one
decode query a head, or `--queries` (speculative verification: the last
positions, causal). Times are medians over `--iters` calls, each evaluated and
synchronised. "bits/elem" counts every byte the layer holds (codes, norms,
float16 windows, capacity) for keys and values; "HBM %" is the bytes the
fused kernel reads (the used codes, norms and windows) per second against the
H200's 4.8 TB/s peak. "floor µs" is one trivial op evaluated and
synchronised the same way: the per-call cost every column includes. The
"×16" columns evaluate 16 calls (distinct queries) in one graph, as a
model's layers are, and report the time per call: the per-call overhead is
amortised there and what is left is mostly GPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from .._native import LayerCache

PEAK_BYTES_PER_S = 4.8e12


def _median_time(fn, iters: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def quantized_sdpa(q, qk, qv, scale, group_size=64, bits=4):
    """mlx_lm.models.base.quantized_scaled_dot_product_attention, for a
    QuantizedKVCache (two quantized_matmul calls)."""
    b, hq, l, d = q.shape
    hkv = qk[0].shape[1]
    q = (q * scale).reshape(b, hkv, hq // hkv, l, d)
    qk = tuple(mx.expand_dims(x, -3) for x in qk)
    qv = tuple(mx.expand_dims(x, -3) for x in qv)
    scores = mx.quantized_matmul(q, *qk, transpose=True, group_size=group_size, bits=bits)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *qv, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(b, hq, l, d)


def _median_time_batched(fn, queries, iters: int) -> float:
    """Median over `iters` of one evaluation of `fn(q)` for every query, per call."""
    return _median_time(lambda: [fn(q) for q in queries], iters) / len(queries)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m veloxquant.tools.bench_attention", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--batch", type=int, default=1, help="sequences, each with its own keys and query")
    p.add_argument("--queries", type=int, default=1, help="queries a head, at the last positions (causal)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--key-bits", type=int, default=4)
    p.add_argument("--value-bits", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="also write the table to this file")
    a = p.parse_args(argv)
    dev = mx.gpu if a.device == "gpu" else mx.cpu
    mx.set_default_device(dev)
    d, hkv, hq, nb = a.head_dim, a.kv_heads, a.heads, a.batch
    if nb < 1:
        p.error(f"--batch must be at least 1, got {nb}")
    nq = a.queries
    if not 1 <= nq <= min(a.contexts):
        p.error(f"--queries must be from 1 to the shortest context, got {nq}")
    # Several queries sit at the last positions: MLX's causal mask aligns them so.
    mask = "causal" if nq > 1 else None
    scale = d**-0.5
    lines = [
        f"decode attention, {mx.default_device()}, B={nb} Hq={hq} Hkv={hkv} L={nq} D={d} float16, "
        f"veloxquant turboquant-mse K{a.key_bits}/V{a.value_bits}, median of {a.iters}",
        "",
        "| context | floor µs | fp16 SDPA µs | mlx_lm 4-bit µs | veloxquant µs | vs SDPA | vs mlx_lm 4-bit "
        "| SDPA ×16 µs/call | mlx_lm 4-bit ×16 | veloxquant ×16 | vs SDPA ×16 | vs mlx_lm ×16 "
        "| bits/elem | MiB fp16 | MiB veloxquant | HBM % (×16) | rel. err vs decode+SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for t in a.contexts:
        key = mx.random.key(t)
        k1, k2, k3 = mx.random.split(key, 3)
        k = mx.random.normal((nb, hkv, t, d), key=k1).astype(mx.float16)
        v = mx.random.normal((nb, hkv, t, d), key=k2).astype(mx.float16)
        q = mx.random.normal((nb, hq, nq, d), key=k3).astype(mx.float16)
        batch = [mx.random.normal((nb, hq, nq, d), key=mx.random.key(t + i)).astype(mx.float16) for i in range(16)]
        mx.eval(k, v, q, *batch)
        t_floor = _median_time(lambda: q + 1, a.iters)
        t_sdpa = _median_time(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask), a.iters)
        b_sdpa = _median_time_batched(
            lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=scale, mask=mask), batch, a.iters)
        qk = mx.quantize(k, group_size=64, bits=4)
        qv = mx.quantize(v, group_size=64, bits=4)
        mx.eval(qk, qv)
        try:
            if nq > 1:
                raise ValueError("the 4-bit column times one decode query only")
            t_q4 = _median_time(lambda: quantized_sdpa(q, qk, qv, scale), a.iters)
            b_q4 = _median_time_batched(lambda x: quantized_sdpa(x, qk, qv, scale), batch, a.iters)
        except (RuntimeError, ValueError) as e:  # a shape MLX's back-end has no kernel for
            print(f"mlx_lm 4-bit at {t}: {e}", flush=True)
            t_q4 = b_q4 = float("nan")
        del qk, qv
        cache = LayerCache(d, hkv, key_bits=a.key_bits, value_bits=a.value_bits, device=a.device)
        step = 8192
        for s in range(0, t, step):
            cache.append(k[:, :, s : s + step], v[:, :, s : s + step])
            mx.eval(cache.attention(q[:, :hkv, :1], scale))  # materialise the stores chunk by chunk
        t_vq = _median_time(lambda: cache.attention(q, scale, mask), a.iters)
        b_vq = _median_time_batched(lambda x: cache.attention(x, scale, mask), batch, a.iters)
        kd, vd = cache.dequantize()
        ref = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask=mask)
        out = cache.attention(q, scale, mask)
        err = (mx.linalg.norm((out - ref).astype(mx.float32)) / mx.linalg.norm(ref.astype(mx.float32))).item()
        del kd, vd, ref
        fp16_bytes = k.nbytes + v.nbytes
        elems = 2 * nb * hkv * t * d
        bits = 8 * cache.nbytes / elems
        # Bytes the kernel reads: used codes and norms, the windows' used rows.
        comp = cache.compressed_tokens
        read = nb * (hkv * comp * (d * (a.key_bits + a.value_bits) // 8 + 4) + 2 * hkv * (t - comp) * d * 2)
        row = (
            f"| {t} | {t_floor * 1e6:.0f} | {t_sdpa * 1e6:.0f} | {t_q4 * 1e6:.0f} | {t_vq * 1e6:.0f} | {t_sdpa / t_vq:.2f}x | "
            f"{t_q4 / t_vq:.2f}x | {b_sdpa * 1e6:.0f} | {b_q4 * 1e6:.0f} | {b_vq * 1e6:.0f} | {b_sdpa / b_vq:.2f}x | "
            f"{b_q4 / b_vq:.2f}x | {bits:.2f} | {fp16_bytes / 2**20:.1f} | {cache.nbytes / 2**20:.1f} | "
            f"{100 * read / b_vq / PEAK_BYTES_PER_S:.1f} | {err:.1e} |"
        )
        lines.append(row)
        print(row, flush=True)
        del cache, k, v
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
