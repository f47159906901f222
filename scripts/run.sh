#!/usr/bin/env bash
# The main job: set-up, then a long prompt (the opening of Alice's Adventures
# in Wonderland, shipped with veloxquant, and a question) through the default
# model (SmolLM2-135M-Instruct, converted offline on first use) with mlx_lm's
# float16 cache, mlx_lm's 4-bit cache and veloxquant's, side by side: text, KV
# bytes held by MLX, perplexity, peak memory, tokens/s, a summary, and
# out/compare.png (KV memory against tokens, tokens/s) with out/compare.json.
# Arguments go to `veloxquant compare` (--help lists them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
mkdir -p "$root/out"
cd /
exec "$root/.venv/bin/python" -m veloxquant compare --plot "$root/out/compare.png" --json "$root/out/compare.json" "$@"
