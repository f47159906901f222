// Shared by the TurboQuant CUDA kernels (placed before the kernel, in the
// global namespace, after MLX's device utilities, which bring the half and
// bfloat16 types).

// ‖v‖ of n floats as crate::quant computes it: float64 squares summed in
// order, the root rounded to float32.
__device__ inline float tq_norm(const float* v, int n) {
  double s2 = 0.0;
  for (int j = 0; j < n; ++j) {
    const double f = static_cast<double>(v[j]);
    s2 = __dadd_rn(s2, __dmul_rn(f, f));
  }
  return __double2float_rn(__dsqrt_rn(s2));
}

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's layout).
__device__ inline unsigned tq_code_at(const uint8_t* row, unsigned j, unsigned bits) {
  const unsigned o = j * bits;
  unsigned w = row[o >> 3];
  if ((o & 7u) + bits > 8u) {
    w |= unsigned(row[(o >> 3) + 1]) << 8;
  }
  return (w >> (o & 7u)) & ((1u << bits) - 1u);
}

// The NB bytes at p, little-endian. Callers pass offsets that are multiples
// of NB, so the 1-, 2-, 4- and 8-byte cases are single aligned loads.
template <int NB>
__device__ __forceinline__ unsigned long long tq_load_bytes(const uint8_t* p) {
  if constexpr (NB == 1) {
    return p[0];
  } else if constexpr (NB == 2) {
    return *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (NB == 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else if constexpr (NB == 8) {
    return *reinterpret_cast<const unsigned long long*>(p);
  } else {
    unsigned long long v = 0;
#pragma unroll
    for (int y = 0; y < NB; ++y) v |= static_cast<unsigned long long>(p[y]) << (8 * y);
    return v;
  }
}

// Eight consecutive elements at p (16-byte aligned for 16-bit types) as float.
__device__ __forceinline__ void tq_load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void tq_load8(const __half* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void tq_load8(const __nv_bfloat16* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}
