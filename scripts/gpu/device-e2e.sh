#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh put MLX's CUDA
# build into /root/site (see scripts/gpu/build-cuda.sh, ONLY=wheel is enough):
# installs the veloxquant wheel from .device/build with this checkout's Python
# files over it, then the end-to-end benchmark and, with PROFILE set, the GPU
# time of each kernel in decode steps (Nsight Compute). mlx_lm comes from
# .device/pylib (a copy of the .venv's package: the machine has its dependencies
# but not mlx_lm). Output goes to $OUT.
#
#   BENCH    arguments of `veloxquant bench` (default: the H200 record's)
#   PROFILE  entries SHAPE:CONTEXT:CACHE[:CHUNK[:BATCH]] for scripts/gpu/profile_decode.py
#            under ncu (with CHUNK other than 0: one prefill chunk of CHUNK tokens;
#            BATCH sequences, default 1)
#   NCU      entries SHAPE:CONTEXT:CACHE:KERNEL: Nsight Compute's sections and
#            stall reasons for the first launch of KERNEL (a regex) in those
#            decode steps
#   SKIP_BENCH  set to run the profiles alone
#   NCU_CACHE   Nsight Compute's --cache-control for PROFILE: none (default: kernels
#               find the caches as the step left them) or all (flushed first)
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export PYTHONPATH="/root/site:$PWD/.device/pylib" PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /root/site --upgrade .device/build/veloxquant-*-cp312-*.whl ||
  { echo "no veloxquant wheel in .device/build" >&2; exit 1; }
cp python/veloxquant/*.py /root/site/veloxquant/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; } | tee "$OUT/machine.txt"
status=0
ncu_bin="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
for spec in ${PROFILE:-}; do
  IFS=: read -r shape context cache chunk batch <<<"$spec"
  [ "${chunk:-0}" = 0 ] && chunk=""
  file="$OUT/profile_${shape}_${context}_${cache}${chunk:+_chunk$chunk}${batch:+_batch$batch}.csv"
  "$ncu_bin" --profile-from-start off --clock-control none --cache-control "${NCU_CACHE:-none}" --metrics gpu__time_duration.sum --csv \
    python3 scripts/gpu/profile_decode.py --shape "$shape" --context "$context" --cache "$cache" --steps 2 \
    --chunk "${chunk:-0}" --batch "${batch:-1}" >"$file" 2>&1 || status=1
  python3 scripts/gpu/kernel_times.py "$file" | tee -a "$OUT/profile_summary.txt"
done
for spec in ${NCU:-}; do
  IFS=: read -r shape context cache kernel <<<"$spec"
  file="$OUT/ncu_${shape}_${context}_${kernel}.txt"
  "$ncu_bin" --profile-from-start off --clock-control none -k "regex:$kernel" -c 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 scripts/gpu/profile_decode.py --shape "$shape" --context "$context" --cache "$cache" --steps 1 >"$file" 2>&1 || status=1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Issue Slots Busy|Memory Throughput|stalled_(long|short|wait|math|barrier|lg|mio|no_inst|not_sel|selected|branch|dispatch|drain|imc|membar|sleep|tex)" "$file" | head -40
done
[ -n "${SKIP_BENCH:-}" ] && exit $status
# shellcheck disable=SC2086
python3 -m veloxquant bench ${BENCH:---shape llama-1b,llama-8b --contexts 4096,32768 --batch 1 --caches fp16,veloxquant --decode-tokens 128 --timeout 200} \
  --out-jsonl "$OUT/e2e-h200.jsonl" --out-md "$OUT/e2e-h200.md" --plot "$OUT/e2e-h200.png" 2>&1 | tail -40 || status=1
exit $status
