#!/usr/bin/env bash
# One call of the device tool that checks and measures a decode change, for a
# session with little device time: after .device/b/install.sh put MLX's CUDA
# build into /root/site and the wheel of scripts/gpu/build-cuda.sh (ONLY=wheel)
# lies in .device/build, it installs the wheel with this checkout's Python
# files, runs the fused-decode check, A/Bs tq_decode's blocks per SM at batch 8
# (the attention alone), then the end-to-end benchmark at llama-8b 32K (batch 8
# with the best count, batch 1 with the default), a prefill chunk's wall and
# graph-building time for each cache, and Nsight Compute's GPU time per kernel
# of a prefill chunk and of decode steps (device-e2e.sh's PROFILE). A step that would end
# after DEADLINE seconds (default 400) is skipped, so that the call returns
# what it made before the session's device time runs out. Output in $OUT.
#
#   PER_SM      block counts per SM to A/B (default "2 3 6")
#   CHECK_TIMEOUT  seconds for python/tests/check_decode_gpu.py (default 240)
#   TQ_GPU      path of tq_gpu's test binary: also run its test of decodes in one graph
#   KERNELS_GPU path of kernels_gpu's test binary: also run its framed_dequantize test
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
DEADLINE=${DEADLINE:-400}
mkdir -p "$OUT"
left() { echo $((DEADLINE - SECONDS)); }
export LD_LIBRARY_PATH=/root/site/mlx/lib PYTHONPATH="/root/site:$PWD/.device/pylib" PYTHONUNBUFFERED=1
install_wheel() {
  python3 -m pip install -q --no-index --no-deps --target /root/site --upgrade "$1" && cp python/veloxquant/*.py /root/site/veloxquant/ &&
    mkdir -p /root/site/veloxquant/tools && cp python/veloxquant/tools/*.py /root/site/veloxquant/tools/
}
install_wheel "$(ls .device/build/veloxquant-*-cp312-*.whl | head -1)" || { echo "no veloxquant wheel in .device/build" >&2; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/machine.txt"
# Alone on the machine: it compiles one kernel per case, and NVRTC beside it
# (a GPU test binary) made it miss a 150 s limit.
timeout "${CHECK_TIMEOUT:-240}" python3 python/tests/check_decode_gpu.py >"$OUT/check_decode.txt" 2>&1
rc=$?
echo "check_decode rc=$rc at ${SECONDS}s ($(grep -c '^ok' "$OUT/check_decode.txt") cases ok)"
tail -1 "$OUT/check_decode.txt"
if [ -n "${TQ_GPU:-}" ]; then  # tq_gpu's binary (build-cuda.sh), for the decode tests the check lacks
  timeout 120 "$TQ_GPU" --ignored --test-threads=1 gpu_decodes_of_one_layer >"$OUT/test_tq_gpu_graph.txt" 2>&1
  echo "tq_gpu decodes in one graph rc=$? at ${SECONDS}s"
fi
if [ -n "${KERNELS_GPU:-}" ]; then  # the prefill buffer's kernel against the CPU's
  timeout 120 "$KERNELS_GPU" --ignored --test-threads=1 gpu_framed_dequantize >"$OUT/test_framed_dequantize.txt" 2>&1
  echo "kernels_gpu framed_dequantize rc=$? at ${SECONDS}s"
fi
profile() {  # PROFILE entries of device-e2e.sh (SHAPE:CONTEXT:CACHE[:CHUNK[:BATCH]])
  [ "$(left)" -lt 60 ] && { echo "skipped profile $*"; return; }
  # A llama-8b model built and 32K tokens prefilled under ncu: about 50 s at
  # batch 1 (a 60 s limit cut two of them short), longer at batch 8.
  PROFILE="$*" SKIP_BENCH=1 OUT="$OUT" timeout $(( $(left) < 150 ? $(left) : 150 )) bash scripts/gpu/device-e2e.sh | grep -v "^NVIDIA\|^Python"
}
[ $rc -eq 0 ] || exit 1
best=2
best_us=
for n in ${PER_SM:-2 3 6}; do
  [ "$(left)" -lt 150 ] && break
  VELOXQUANT_DECODE_BLOCKS_PER_SM=$n timeout 90 python3 -m veloxquant.tools.bench_attention --device gpu --contexts 32768 \
    --batch 8 --iters 5 >"$OUT/attention_b8_per_sm$n.md" 2>&1
  # The compressed cache's time per call over 16 calls an evaluation.
  us=$(grep "^| 32768" "$OUT/attention_b8_per_sm$n.md" | awk -F'|' '{gsub(/ /, "", $11); print $11}')
  echo "blocks per SM $n: batch 8 32K attention ${us:-?} us a call (x16) at ${SECONDS}s"
  if [ -n "$us" ] && { [ -z "$best_us" ] || [ "$us" -lt "$best_us" ]; }; then
    best=$n
    best_us=$us
  fi
done
echo "best: $best blocks per SM"
bench() {  # seconds, then bench arguments
  local limit=$1
  shift
  [ "$(left)" -lt "$limit" ] && { echo "skipped bench $*"; return; }
  timeout "$limit" python3 -m veloxquant bench --shape llama-8b --contexts 32768 --caches fp16,veloxquant --decode-tokens 128 \
    --timeout $((limit - 10)) "$@" 2>&1 | grep "^| llama"
}
VELOXQUANT_DECODE_BLOCKS_PER_SM=$best bench 90 --batch 8 --out-jsonl "$OUT/e2e-b8.jsonl" --out-md "$OUT/e2e-b8.md"
bench 70 --batch 1 --out-jsonl "$OUT/e2e-b1.jsonl" --out-md "$OUT/e2e-b1.md"
echo "benchmarks done at ${SECONDS}s"
# A prefill chunk's wall time and the time to build its graph, without ncu:
# the chunk's GPU time (the profile below) is less than the gap the benchmark
# measures between the caches.
for cache in fp16 veloxquant; do
  [ "$(left)" -lt 90 ] && break
  timeout 60 python3 scripts/gpu/profile_decode.py --shape llama-8b --context 32768 --cache $cache --chunk 2048 2>&1 |
    tail -1 | tee -a "$OUT/prefill_chunk.txt"
done
# One layer's prefill buffers (both sides) at 32K, batch 1 and 8: time and transient memory.
for b in 1 8; do
  [ "$(left)" -lt 60 ] && break
  timeout 45 python3 scripts/gpu/framed_cost.py --device gpu --context 32768 --batch $b 2>&1 | tail -1 | tee -a "$OUT/framed_cost.txt"
done
profile llama-8b:32768:veloxquant:2048
VELOXQUANT_DECODE_BLOCKS_PER_SM=$best profile llama-8b:32768:veloxquant:0:8
profile llama-8b:32768:veloxquant
profile llama-8b:32768:fp16:2048
