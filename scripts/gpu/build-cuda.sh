#!/usr/bin/env bash
# Builds, on this machine, what the NVIDIA GPU machine runs: the GPU test and
# benchmark binaries and a CPython 3.12 wheel, all against MLX's CUDA wheel
# (mlx-cuda-13, the same version). Output: .device/build/ (git-ignored), to be
# carried to the GPU machine as docs/results/README.md says.
#   ONLY=wheel  builds the wheel alone (the Python benchmarks need nothing else)
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
MLX_VERSION=0.32.4
if ! ls .device/dl/mlx_cuda_13-"$MLX_VERSION"-*.whl >/dev/null 2>&1 || [ ! -d .device/b ]; then
  bash ../shared/tools/device-mlx-cuda
fi
if [ ! -f .device/mlx-cuda/mlx/lib/libmlx.so ]; then
  rm -rf .device/mlx-cuda && mkdir -p .device/mlx-cuda
  for w in .device/dl/*.whl; do python3 -m zipfile -e "$w" .device/mlx-cuda; done
fi
export MLX_DIR="$root/.device/mlx-cuda/mlx"
export CARGO_TARGET_DIR="$root/target/cuda"
py312="$(pyenv root)/versions/3.12.1/bin/python3.12"
if [ ! -x .device/venv312/bin/python ]; then
  "$py312" -m venv .device/venv312
  .device/venv312/bin/pip install -q nanobind==3.1.0 maturin==1.16.0
fi
export VELOXQUANT_PYTHON="$root/.device/venv312/bin/python"
rm -rf .device/build && mkdir -p .device/build
copy_exe() {  # copy the executables cargo reports for one target
  jq -r 'select(.executable != null) | .executable' | while read -r exe; do
    cp "$exe" ".device/build/$1"
    strip ".device/build/$1"
  done
}
if [ "${ONLY:-}" != wheel ]; then
cargo test --release --no-run --test kernels_gpu --message-format=json 2>/dev/null | copy_exe kernels_gpu
cargo test --release --no-run --test kernel_cache_gpu --message-format=json 2>/dev/null | copy_exe kernel_cache_gpu
cargo test --release --no-run --test quant_kernels_gpu --message-format=json 2>/dev/null | copy_exe quant_kernels_gpu
cargo test --release --no-run --test tq_gpu --message-format=json 2>/dev/null | copy_exe tq_gpu
cargo test --release --no-run --test kv_attention_gpu --message-format=json 2>/dev/null | copy_exe kv_attention_gpu
cargo test --release --no-run --test tq_codec_gpu --message-format=json 2>/dev/null | copy_exe tq_codec_gpu
cargo bench --no-run --bench quant_kernels --message-format=json 2>/dev/null | copy_exe quant_kernels_bench
cargo bench --no-run --bench vq_quantize --message-format=json 2>/dev/null | copy_exe vq_quantize_bench
fi
# Stripped like the binaries: the wheel is then ~1/4 the size, so that
# several (device-wheel-ab.sh) fit one carry beside MLX's second half.
PYO3_PYTHON="$VELOXQUANT_PYTHON" .device/venv312/bin/maturin build --release --strip -i "$VELOXQUANT_PYTHON" -o .device/build >/dev/null
ls -la .device/build
