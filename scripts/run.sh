#!/usr/bin/env bash
# The main job: set-up, then the same prompt through the default model
# (SmolLM2-135M-Instruct, converted offline on first use) with the float16
# cache and with the compressed cache, side by side: text, KV bytes held by
# MLX, peak memory, tokens/s. Arguments go to `veloxquant compare`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd /
exec "$root/.venv/bin/python" -m veloxquant compare "$@"
