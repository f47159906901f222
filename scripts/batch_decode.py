"""Decode speed of a batch of per-sequence compressed caches, side by side:
the batch's attention as one operation a layer (``LayerCache.attention_each``,
what ``VeloxQuantBatchCache`` uses) against one call per sequence, and
mlx_lm's float16 batch cache, in one process.

Each sequence's prompt (random token ids, lengths --min-tokens + i * --step)
is prefilled alone, the caches are merged as mlx_lm's BatchGenerator merges
them, and --steps greedy decode steps are timed after three warm-up steps;
rows alternate (A B A B) so that the host's drift shows.

    .venv/bin/python scripts/batch_decode.py --sequences 32 --min-tokens 40 --step 5 \\
        --out docs/results/batch-decode-cpu.md

``--shape`` takes one of ``veloxquant bench``'s shapes with random weights
(``llama-8b`` on the GPU machine) instead of a model; prompts are then
prefilled in chunks of 2048 tokens.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an mlx_lm model path (default: SmolLM2-135M)")
    p.add_argument("--shape", default=None, help="a veloxquant bench shape with random weights (llama-8b, ...) instead of --model")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=40)
    p.add_argument("--step", type=int, default=5, help="tokens added to each next prompt")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args()
    if args.sequences < 1 or args.min_tokens < 2 or args.step < 0 or args.steps < 1:
        p.error("--sequences, --steps: at least 1; --min-tokens: at least 2; --step: at least 0")

    import veloxquant  # noqa: F401  (before mlx: veloxquant.blas chooses the BLAS)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    from veloxquant import blas

    from veloxquant.tools import bench, models
    from veloxquant.batch_cache import VeloxQuantBatchCache
    from veloxquant.cache import KVConfig, make_prompt_cache

    if args.shape and args.model:
        p.error("--shape and --model: give one")
    if args.shape:
        model = bench.build_model({"shape": args.shape})
    else:
        model, _ = models.load(args.model)
        blas.maybe_float32_compute(model)
    name = args.shape or args.model or "SmolLM2-135M"
    lengths = [args.min_tokens + args.step * i for i in range(args.sequences)]
    mx.random.seed(0)
    prompts = [mx.random.randint(0, 1000, (1, n)) for n in lengths]
    chunk = 2048 if args.shape else 256

    def run(row: str):
        """Aggregate tokens/s, then the seconds a step spends building its
        graph on the host and evaluating it (launches and the device's work)."""
        per_seq, first = [], []
        for prompt in prompts:
            cache = mlx_prompt_cache(model) if row == "fp16" else make_prompt_cache(model, KVConfig())
            first.append(bench.prefill(model, cache, prompt, chunk))
            per_seq.append(cache)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*per_seq)]
        attend_each = VeloxQuantBatchCache.attend_each
        if row == "per-sequence":
            # The batch cache's own loop: one attention call per sequence.
            VeloxQuantBatchCache.attend_each = lambda self, q, attend, scale=None: attend_each(self, q, attend)
        try:
            y = mx.concatenate(first)
            build = 0.0
            for i in range(3 + args.steps):
                if i == 3:
                    t0, build = time.perf_counter(), 0.0
                tb = time.perf_counter()
                y = mx.argmax(model(y[:, None], cache=batch)[:, -1], axis=-1)
                build += time.perf_counter() - tb
                mx.eval(y)
            elapsed = time.perf_counter() - t0
            return args.sequences * args.steps / elapsed, build / args.steps, (elapsed - build) / args.steps
        finally:
            VeloxQuantBatchCache.attend_each = attend_each

    lines = [
        f"# Batched decode over per-sequence caches ({name}, {args.sequences} sequences "
        f"of {lengths[0]}-{lengths[-1]} tokens)",
        "",
        f"`python scripts/batch_decode.py{' --shape ' + args.shape if args.shape else ''} --sequences {args.sequences} --min-tokens {args.min_tokens} "
        f"--step {args.step} --steps {args.steps}`; {mx.default_device()}. Aggregate decode tokens/s over "
        f"{args.steps} steps, and a step's time split into building its graph (host) and evaluating it "
        "(launches and the device's work); rows in the order run.",
        "",
        "| cache | attention | tok/s aggregate | build ms/step | eval ms/step |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for row in ("fp16", "batched", "per-sequence", "batched", "per-sequence"):
        cache = "float16 (mlx_lm BatchKVCache)" if row == "fp16" else "veloxquant (default recipe)"
        how = {"fp16": "SDPA over the batch", "batched": "one operation a layer",
               "per-sequence": "one call per sequence"}[row]
        tok_s, build, evaluate = run(row)
        line = f"| {cache} | {how} | {tok_s:.1f} | {build * 1e3:.2f} | {evaluate * 1e3:.2f} |"
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
