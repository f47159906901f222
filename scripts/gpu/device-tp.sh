#!/usr/bin/env bash
# Tensor-parallel generation on the GPU machine's kind with two GPUs (the
# distributed issue's run): `veloxquant bench` under MLX's launcher with the
# NCCL back-end, one process a GPU (mlx.launch gives rank r
# CUDA_VISIBLE_DEVICES=r), llama-8b at 32K and 128K, batch 1 and 8, the
# float16 cache against the default compressed recipe side by side. Run after
# .device/b/install.sh put MLX's CUDA build into /root/site and with the
# wheel of scripts/gpu/build-cuda.sh (ONLY=wheel) in .device/build; output in
# $OUT (e2e-tp2.jsonl, .md, .png).
#
#   RANKS     processes, one a GPU (default 2; 1 is a dry run of the launch on
#             the one-GPU kind)
#   BACKEND   mlx.launch's back-end (default nccl; ring runs the same plumbing
#             on CPUs: `BACKEND=ring BENCH="--shape tiny --contexts 8192
#             --batch 1 --device cpu" OUT=out/tp bash scripts/gpu/device-tp.sh`
#             on this machine, with INSTALL=0)
#   BENCH     the benchmark's shape, contexts and batches (default the issue's)
#   INSTALL   0 to use the veloxquant already importable (default 1: install
#             .device/build's wheel into /root/site first)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the GPU machine asks.
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
RANKS="${RANKS:-2}"
BACKEND="${BACKEND:-nccl}"
mkdir -p "$OUT"
if [ "${INSTALL:-1}" != 0 ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/site --upgrade .device/build/veloxquant-*-cp312-*.whl ||
    { echo "no veloxquant wheel in .device/build" >&2; exit 1; }
  cp python/veloxquant/*.py /root/site/veloxquant/
  export LD_LIBRARY_PATH=/root/site/mlx/lib PYTHONPATH="/root/site:$PWD/.device/pylib"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
py="$(command -v python3)"
# The launcher passes --env to every rank; the ranks' bench workers inherit it.
env_args=()
for v in PYTHONPATH LD_LIBRARY_PATH NCCL_NVLS_ENABLE PYTHONUNBUFFERED; do
  [ -n "${!v:-}" ] && env_args+=(--env "$v=${!v}")
done
# shellcheck disable=SC2086
"$py" -c 'from mlx._distributed_utils.launch import main; main()' --backend "$BACKEND" -n "$RANKS" \
  "${env_args[@]}" -- \
  "$py" -m veloxquant bench ${BENCH:---shape llama-8b --contexts 32768,131072 --batch 1,8} \
  --caches fp16,veloxquant --decode-tokens 32 --timeout 300 --parallel tensor \
  --out-jsonl "$OUT/e2e-tp$RANKS.jsonl" --out-md "$OUT/e2e-tp$RANKS.md" --plot "$OUT/e2e-tp$RANKS.png"
