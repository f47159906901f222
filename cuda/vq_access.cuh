// The smallest helpers of the quantizer and cache kernels: a kernel's sizes,
// pointer alignment, eight elements stored at once. A kernel that needs no
// more lists this header alone: MLX rebuilds and hashes a kernel's whole
// source at every launch, so each KB of header costs host time a call.

// Size i of a kernel's sizes. The host hands them over as the shape [0, v0,
// v1, ...] of an empty array named params (kernels::sizes), which MLX passes
// by value among the launch's arguments as params_shape: an array of values
// would live in managed memory, migrated to the GPU at its first read in
// every call.
template <typename Shape>
__device__ __forceinline__ uint32_t vq_size(const Shape& shape, int i) {
  return static_cast<uint32_t>(shape[i + 1]);
}

// Eight floats to eight consecutive elements at p (aligned as for vq_load8),
// each rounded to nearest as static_cast<T>(float) rounds it.
__device__ __forceinline__ void vq_store8(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ void vq_store8(__half* p, const float* v) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ void vq_store8(__nv_bfloat16* p, const float* v) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Whether p may take wide accesses (vq_store8, quant_common.cuh's). MLX hands over row-contiguous
// views without copying them, and a view can start anywhere.
__device__ __forceinline__ bool vq_aligned(const void* p, unsigned bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
