"""GPU check of the fused decode attention over the compressed cache (run on a
machine whose MLX has a GPU back-end; not collected by pytest in CI):

    python python/tests/check_decode_gpu.py

For each head size, dtype, bit pair, batch, query heads per KV head and
window, one cache is filled on the GPU and read by the fused kernels
(policy "require") and by the reference graph of plain MLX ops (policy
"off"); the relative error ‖fused − reference‖ / ‖reference‖ must stay
below 5e-3 (2e-2 in bfloat16, whose operands on the tensor cores keep 8
bits) and every output must be finite. Prints one line per case and the
largest error.
"""

import itertools
import sys

import mlx.core as mx

from veloxquant import LayerCache


def case(d, dtype, kb, vb, batch, group, window, tokens, seed):
    mx.random.seed(seed)
    hkv = 2
    kw = dict(key_bits=kb, value_bits=vb, window=window, sinks=4, device="gpu")
    fused = LayerCache(d, hkv, policy="require", **kw)
    ref = LayerCache(d, hkv, policy="off", **kw)
    # A channel offset and uneven scales, as real keys have.
    k = (mx.random.normal((batch, hkv, tokens, d)) * mx.linspace(0.2, 3.0, d) + 0.7).astype(dtype)
    v = mx.random.normal((batch, hkv, tokens, d)).astype(dtype)
    for c in (fused, ref):
        c.append(k[:, :, : tokens - 3], v[:, :, : tokens - 3])
        for i in range(tokens - 3, tokens):  # decode-sized appends after the prefill
            c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
    q = (mx.random.normal((batch, hkv * group, 1, d)) * 2.0).astype(dtype)
    scale = d**-0.5
    out = fused.attention(q, scale).astype(mx.float32)
    want = ref.attention(q, scale).astype(mx.float32)
    err = (mx.linalg.norm(out - want) / mx.linalg.norm(want)).item()
    finite = mx.all(mx.isfinite(out)).item()
    return err, finite, fused.compressed_tokens


def main() -> int:
    worst, failed = 0.0, 0
    # The tensor-core path (16-bit types, d up to 128) in full; the lane path
    # (float32, d = 256) at the default bits.
    cases = list(itertools.product(
        (64, 128),
        (mx.float16, mx.bfloat16),
        ((4, 3), (8, 4), (3, 1)),
        ((1, 4, 128, 3000), (2, 1, 16, 700), (1, 8, 32, 140)),
    )) + [(256, mx.float16, (4, 3), (1, 4, 128, 3000)), (128, mx.float32, (4, 3), (1, 4, 128, 3000))]
    # Splits long enough for the tensor-core path to read them in several
    # chunks (a last chunk cut short, two row tiles, two sequences).
    cases += list(itertools.product(
        (64, 128),
        (mx.float16, mx.bfloat16),
        ((4, 3), (3, 1)),
        ((1, 4, 128, 70000), (2, 8, 64, 40000)),
    ))
    for i, (d, dtype, (kb, vb), (batch, group, window, tokens)) in enumerate(cases):
        err, finite, comp = case(d, dtype, kb, vb, batch, group, window, tokens, i)
        ok = finite and err < (2e-2 if dtype == mx.bfloat16 else 5e-3)
        worst = max(worst, err)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} d={d} {dtype} k{kb}v{vb} batch={batch} group={group} window={window} "
              f"tokens={tokens} compressed={comp}: rel. err {err:.2e}{'' if finite else ' NON-FINITE'}")
    print(f"{failed} failed; largest rel. err {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
