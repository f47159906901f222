// What veloxquant's kernels need of MLX's "mlx/backend/cuda/device/utils.cuh",
// which MLX's generated kernel source includes: the CUDA number types and
// Shape / Strides for kernels that read their inputs' strides (MLX passes
// them by value, MAX_NDIM entries each). When veloxquant compiles its kernels
// for MLX's kernel cache, this stands in for MLX's header: MLX's pulls in
// libcu++ (cuda/std/array, tuple, limits), which is most of a kernel's
// compile time (a first process on an H100 started the cache in 8.7 s with
// MLX's headers, 2.1 s with these: docs/results/first-use-h100.txt).
#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>

namespace mlx::core::cu {

template <typename T>
struct Dims {
  T dim[MAX_NDIM];
  __host__ __device__ T& operator[](int i) { return dim[i]; }
  __host__ __device__ const T& operator[](int i) const { return dim[i]; }
};
using Shape = Dims<int32_t>;
using Strides = Dims<int64_t>;

}  // namespace mlx::core::cu
