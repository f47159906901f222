#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh put MLX's CUDA
# build into /root/site (see scripts/gpu/build-cuda.sh): the quantizer benchmark,
# Nsight Compute profiles, the GPU kernel tests, the Python GPU checks and the
# other benchmarks. Output goes to $OUT.
#
#   CHECKS      any of quant ncu tests python vq attention plot (default: all
#               but ncu), run in that order: the benchmark first, alone on
#               the GPU, the tests last
#   QUANT_ARGS  extra quant_kernels_bench arguments, e.g. "--only tq_prod"
#   NCU         profiles, each ROW:KERNEL ("+" for a space in ROW): the first
#               launch of KERNEL (a regex) in the benchmark's row ROW, at
#               N = 262144, with the stall reasons per issued instruction;
#               NCU_ARGS adds ncu options
#   TESTS       test binaries, each BIN or BIN:FILTER (default: every GPU
#               test binary), started together as separate processes (NVRTC
#               compiling is most of their time), each to its own file
#   TEST_TIMEOUT  seconds per test process (default 540)
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export PYTHONPATH=/root/site
export LD_LIBRARY_PATH=/root/site/mlx/lib
python3 -m pip install -q --no-index --no-deps --target /root/site --upgrade .device/build/veloxquant-*-cp312-*.whl 2>/dev/null ||
  echo "no veloxquant wheel in .device/build: the Python checks will fail" >&2
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; } | tee "$OUT/machine.txt"
CHECKS="${CHECKS:-quant tests python vq attention plot}"
want() { [[ " $CHECKS " == *" $1 "* ]]; }
status=0
if want quant; then
  # shellcheck disable=SC2086
  .device/build/quant_kernels_bench --device gpu --dtype f16 ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quant_kernels_cuda.txt" || status=1
fi
if want ncu; then
  ncu_bin="$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  for spec in ${NCU:-}; do
    row="${spec%%:*}"
    row="${row//+/ }"
    kernel="${spec#*:}"
    file="$OUT/ncu_$(echo "$row" | tr -c 'A-Za-z0-9_\n' _).txt"
    # shellcheck disable=SC2086
    "$ncu_bin" -k "regex:$kernel" -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" ${NCU_ARGS:-} \
      .device/build/quant_kernels_bench --device gpu --dtype f16 --n 262144 --only "$row" >"$file" 2>&1 || status=1
    grep -E "Duration|Registers Per|Issue Slots|stalled" "$file"
  done
fi
if want tests; then
  pids=()
  files=()
  for spec in ${TESTS:-kernels_gpu kernel_cache_gpu quant_kernels_gpu tq_gpu kv_attention_gpu tq_codec_gpu}; do
    bin="${spec%%:*}"
    filter=""
    [ "$bin" != "$spec" ] && filter="${spec#*:}"
    file="$OUT/test_${bin}${filter:+_$filter}.txt"
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-540}" ".device/build/$bin" --ignored --test-threads=1 $filter >"$file" 2>&1 &
    pids+=($!)
    files+=("$file")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { status=1; echo "FAILED (or timed out): ${files[$i]}"; }
    grep -E "^test |test result|panicked" "${files[$i]}"
  done
fi
if want python; then
  python3 python/tests/check_gpu.py 2>&1 | tee "$OUT/check_gpu.txt" || status=1
fi
if want vq; then
  .device/build/vq_quantize_bench --device gpu --dtype f16 1048576:256:4 262144:256:8 2>&1 | tee "$OUT/vq_quantize_cuda.txt" || status=1
fi
if want attention; then
  python3 -m veloxquant.tools.bench_attention --device gpu --out "$OUT/attention_cuda.md" 2>&1 | tail -3 || status=1
fi
if want plot; then
  python3 -m veloxquant.tools.plot_kernels --device gpu --max-n 1048576 --out "$OUT/kernels_cuda.png" 2>&1 | tee "$OUT/kernels_cuda.txt" || status=1
fi
exit $status
