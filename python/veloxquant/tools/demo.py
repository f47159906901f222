"""Compress a key tensor through the fused kernels and report sizes and parity.

    python -m veloxquant.tools.demo [--tokens N] [--centroids K] [--sub-dim d]

Keys shaped like one layer's cache (8 heads x N tokens x head_dim 128,
float16) are split into sub-vectors of d elements; each sub-vector is replaced
by the index of its nearest centroid (vq_quantize), and the indices are packed
densely (bit_pack). The codebook is a seeded sample of the sub-vectors. Sizes
count every stored byte (packed codes and the codebook). The fused kernels'
results are compared with the reference graph of plain MLX ops.
"""

from __future__ import annotations

import argparse
import math
import time

import mlx.core as mx
import numpy as np

from .. import _native
from .. import kernels as K


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    mx.eval(out)
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m veloxquant.tools.demo", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--centroids", type=int, default=256, help="codebook size K (bits per code = log2 K)")
    p.add_argument("--sub-dim", type=int, default=4, choices=K.VQ_DIMS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    bits = math.ceil(math.log2(a.centroids))
    if bits not in K.SUPPORTED_BITS:
        p.error(f"--centroids {a.centroids} needs {bits}-bit codes; use 2, 4, 8, 16 or 256 centroids")

    rng = np.random.default_rng(a.seed)
    # Correlated channels with a few outliers, like real keys.
    mix = rng.normal(size=(a.head_dim, a.head_dim)) / math.sqrt(a.head_dim)
    scale = np.where(rng.random(a.head_dim) < 0.05, 6.0, 1.0)
    keys_np = (rng.normal(size=(a.heads, a.tokens, a.head_dim)) @ mix) * scale
    keys = mx.array(keys_np.astype(np.float16))
    sub = keys.reshape(-1, a.sub_dim)
    codebook = sub[mx.array(rng.choice(sub.shape[0], a.centroids, replace=False))]
    mx.eval(keys, codebook)

    device = mx.default_device()
    print(f"veloxquant demo on {device} (GPU back-end: {_native.gpu_backend() or 'none'}), MLX {mx.__version__}")
    print(f"keys {tuple(keys.shape)} {keys.dtype}, sub-vectors of {a.sub_dim}, {a.centroids} centroids -> {bits}-bit codes")

    codes_per_row = a.head_dim // a.sub_dim
    idx, t_fused = _timed(lambda: K.vq_quantize(keys.reshape(a.heads, a.tokens, codes_per_row, a.sub_dim), codebook))
    packed, t_pack = _timed(lambda: K.bit_pack(idx.astype(mx.uint8) if bits <= 8 else idx, bits))
    ref_idx, t_ref = _timed(lambda: K.vq_quantize(keys.reshape(a.heads, a.tokens, codes_per_row, a.sub_dim), codebook, policy="off"))
    ref_packed = K.bit_pack(ref_idx.astype(mx.uint8), bits, policy="off")

    unpacked = K.bit_unpack(packed, bits, codes_per_row)
    recon = codebook[unpacked.astype(mx.uint32)].reshape(keys.shape)
    err = (recon.astype(mx.float32) - keys.astype(mx.float32)).square().mean() / keys.astype(mx.float32).square().mean()

    original = keys.nbytes
    stored = packed.nbytes + codebook.nbytes
    agree = (idx == ref_idx).astype(mx.float32).mean().item()
    print()
    print(f"  original float16 keys       {original:>12,d} bytes")
    print(f"  packed codes                {packed.nbytes:>12,d} bytes  ({bits} bits per {a.sub_dim} elements)")
    print(f"  codebook (float16)          {codebook.nbytes:>12,d} bytes")
    print(f"  stored in all               {stored:>12,d} bytes  -> {original / stored:.2f}x smaller, "
          f"{8 * stored / keys.size:.3f} bits/element")
    print(f"  relative reconstruction MSE {err.item():.4f}")
    print()
    print(f"  vq_quantize fused {t_fused * 1e3:8.2f} ms   reference graph {t_ref * 1e3:8.2f} ms   "
          f"({t_ref / t_fused:.1f}x)")
    print(f"  bit_pack    fused {t_pack * 1e3:8.2f} ms")
    print(f"  parity: indices equal to the reference on {agree:.4%} of sub-vectors; "
          f"packed bytes identical: {bool(mx.array_equal(packed, ref_packed).item()) if agree == 1.0 else 'n/a (near-ties)'}; "
          f"unpack(pack(codes)) == codes: {bool(mx.array_equal(unpacked, idx.astype(mx.uint8)).item())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
