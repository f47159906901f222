#!/usr/bin/env bash
# `veloxquant eval` on the NVIDIA GPU machine: SmolLM2-135M at 2K context
# (default windows, and a 32-token window) and at 8K (the model's limit).
# Needs MLX's CUDA build and the veloxquant wheel in /root/site (installed by
# scripts/gpu/device-checks.sh), mlx_lm's package under .device/pylib (the GPU
# machine has its dependencies but not mlx_lm itself) and the SmolLM2 GGUF
# at $VELOXQUANT_GGUF. Output: $OUT/eval-h200-*/. RUNS picks a subset of
# 2k, 2k-window32 and 8k (default: all).
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
export PYTHONPATH="/root/site:$PWD/.device/pylib"
export LD_LIBRARY_PATH=/root/site/mlx/lib
export VELOXQUANT_HOME="${VELOXQUANT_HOME:-/root/vqhome}"
: "${VELOXQUANT_GGUF:?point it at SmolLM2-135M-Instruct.Q4_1.gguf}"
export VELOXQUANT_GGUF
SWEEP=(--methods turboquant-mse,kivi,pq --bits 4,3,2 --needle-depths 0.1,0.5,0.9)
RUNS="${RUNS:-2k 2k-window32 8k}"
want() { [[ " $RUNS " == *" $1 "* ]]; }
status=0
want 2k && { python3 -m veloxquant eval "${SWEEP[@]}" --tokens 2048 --prefix 1024 --chunk 64 --kv-window 128 --kv-sinks 4 \
  --needle-lengths 1024,2048 --out "$OUT/eval-h200-2k" || status=1; }
want 2k-window32 && { python3 -m veloxquant eval --methods turboquant-mse --bits 4,4/3,3,2 --needle-depths 0.1,0.5,0.9 --tokens 2048 \
  --prefix 1024 --chunk 64 --kv-window 32 --kv-sinks 4 --mlx-bits "" --needle-lengths 1024,2048 \
  --out "$OUT/eval-h200-2k-window32" || status=1; }
want 8k && { python3 -m veloxquant eval --methods turboquant-mse,kivi --bits 4,3,2 --needle-depths 0.1,0.5,0.9 --tokens 8192 --prefix 4096 --chunk 256 --kv-window 128 --kv-sinks 4 \
  --needle-lengths 4096,8192 --out "$OUT/eval-h200-8k" || status=1; }
exit $status
