"""MLX's CPU matmul and the default model three ways (``veloxquant.blas``):
the ``mlx[cpu]`` wheel's reference BLAS with the model in float16 (what a
plain install runs), OpenBLAS with the model still in float16, and OpenBLAS
with float32 compute (weights in float32, activations and cache float16).

Each runs in its own process (the BLAS is chosen when libmlx loads): float32
matmul GFLOP/s, then SmolLM2-135M-Instruct over the first --tokens tokens of
the shipped text (Alice's Adventures in Wonderland) in chunks of --chunk
through mlx_lm's float16 cache: prefill tokens/s and perplexity, which must
agree up to float rounding.

    .venv/bin/python scripts/blas_check.py --out docs/results/cpu_blas.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(tokens: int, chunk: int, repeats: int) -> dict:
    import veloxquant  # noqa: F401  (before mlx: veloxquant.blas chooses the BLAS)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant import blas

    from veloxquant.tools import models
    from veloxquant.tools.texts import alice

    st = blas.status()
    gflops = blas.matmul_gflops()
    model, tokenizer = models.load()
    compute = blas.maybe_float32_compute(model)
    ids = tokenizer.encode(alice())[: tokens + 1]
    x = mx.array(ids)[None]
    best, nll = float("inf"), None
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        total = mx.array(0.0)
        t0 = time.perf_counter()
        for pos in range(0, tokens, chunk):
            logits = model(x[:, pos : pos + chunk], cache=cache).astype(mx.float32)
            targets = x[:, pos + 1 : pos + chunk + 1]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            total = total - mx.take_along_axis(lp, targets[..., None], axis=-1).sum()
            mx.eval(total, [c.state for c in cache])
        best = min(best, time.perf_counter() - t0)
        nll = total.item() / tokens
    return {
        "blas": st.name,
        "library": st.library,
        "fast": st.fast,
        "compute": "float32" if compute else "float16",
        "matmul_gflops": gflops,
        "prefill_tok_s": tokens / best,
        "perplexity": float(__import__("math").exp(nll)),
        "tokens": tokens,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="prefill runs per configuration; the fastest is kept")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.tokens, args.chunk, args.repeats)))
        return 0
    rows = []
    configs = (
        ("reference BLAS, float16 compute", {"VELOXQUANT_BLAS": "reference"}),
        ("OpenBLAS, float16 compute", {"VELOXQUANT_CPU_FLOAT32": "0"}),
        ("OpenBLAS, float32 compute", {}),
    )
    for label, env in configs:
        e = {k: v for k, v in os.environ.items() if k not in ("VELOXQUANT_BLAS", "VELOXQUANT_CPU_FLOAT32")}
        e.update(env)
        cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--chunk", str(args.chunk),
               "--repeats", str(args.repeats)]
        r = subprocess.run(cmd, env=e, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            return r.returncode
        rows.append(dict(json.loads(r.stdout.strip().splitlines()[-1]), label=label))
        print(f"{label}: {rows[-1]}", file=sys.stderr, flush=True)
    ref, half, fast = rows
    out = [
        f"SmolLM2-135M-Instruct (float16 weights), mlx_lm's float16 cache, the first {args.tokens} tokens of the "
        f"shipped text in chunks of {args.chunk} (fastest of {args.repeats}); matmul: float32 768 x 768 on "
        "MLX's CPU device.",
        "",
        "| configuration | BLAS serving MLX | model compute | matmul GFLOP/s | prefill tok/s | perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['label']} | {r['blas']} (`{r['library']}`) | {r['compute']} | {r['matmul_gflops']:.1f} | "
            f"{r['prefill_tok_s']:.1f} | {r['perplexity']:.4f} |"
        )
    out += [
        "",
        f"OpenBLAS: matmul {fast['matmul_gflops'] / ref['matmul_gflops']:.0f}x faster; the float16 model alone "
        f"{half['prefill_tok_s'] / ref['prefill_tok_s']:.2f}x (MLX's float16 matmul does not use BLAS), with "
        f"float32 compute {fast['prefill_tok_s'] / ref['prefill_tok_s']:.1f}x. Perplexity {ref['perplexity']:.4f}, "
        f"{half['perplexity']:.4f}, {fast['perplexity']:.4f} (float32 compute: relative difference "
        f"{abs(fast['perplexity'] / ref['perplexity'] - 1):.1e}).",
    ]
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
