#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh put MLX's CUDA
# build into /root/site (see scripts/build-cuda.sh): the GPU kernel tests, the
# Python GPU checks and the benchmarks. Output goes to $OUT. CHECKS picks a
# subset: any of tests, python, vq, quant, attention, plot (default: all); TESTS
# picks the test binaries.
set -uo pipefail
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export PYTHONPATH=/root/site
export LD_LIBRARY_PATH=/root/site/mlx/lib
python3 -m pip install -q --no-index --no-deps --target /root/site --upgrade .device/build/veloxquant-*-cp312-*.whl
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; } | tee "$OUT/machine.txt"
CHECKS="${CHECKS:-tests python vq quant attention plot}"
want() { [[ " $CHECKS " == *" $1 "* ]]; }
status=0
if want tests; then
  for t in ${TESTS:-kernels_gpu kernel_cache_gpu quant_kernels_gpu tq_gpu kv_attention_gpu tq_codec_gpu}; do
    echo "== $t" >>"$OUT/kernels_gpu.txt"
    .device/build/$t --ignored --test-threads=1 >>"$OUT/kernels_gpu.txt" 2>&1 || status=1
  done
  cat "$OUT/kernels_gpu.txt"
fi
if want python; then
  python3 python/tests/check_gpu.py 2>&1 | tee "$OUT/check_gpu.txt" || status=1
fi
if want vq; then
  .device/build/vq_quantize_bench --device gpu --dtype f16 1048576:256:4 262144:256:8 2>&1 | tee "$OUT/vq_quantize_cuda.txt" || status=1
fi
if want quant; then
  .device/build/quant_kernels_bench --device gpu --dtype f16 2>&1 | tee "$OUT/quant_kernels_cuda.txt" || status=1
fi
if want attention; then
  python3 -m veloxquant.bench_attention --device gpu --out "$OUT/attention_cuda.md" 2>&1 | tail -3 || status=1
fi
if want plot; then
  python3 -m veloxquant.plot_kernels --device gpu --max-n 1048576 --out "$OUT/kernels_cuda.png" 2>&1 | tee "$OUT/kernels_cuda.txt" || status=1
fi
exit $status
