// Loading codes and elements: packed bytes, eight elements as float, words of
// codes, and asynchronous copies into shared memory. What tq_decode needs of
// the quantizers' helpers (quant_common.cuh follows it in every other kernel).

// The NB bytes at p, little-endian. Callers pass offsets that are multiples
// of NB, so the 1-, 2-, 4- and 8-byte cases are single aligned loads.
template <int NB>
__device__ __forceinline__ unsigned long long vq_load_bytes(const uint8_t* p) {
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

// Eight consecutive elements at p (16-byte aligned for 16-bit types, 32 for
// float) as float.
__device__ __forceinline__ void vq_load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void vq_load8(const __half* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void vq_load8(const __nv_bfloat16* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}

// The narrowest unsigned word that holds 8 B-bit codes.
template <bool NARROW>
struct VqWordOf {
  using type = unsigned long long;
};
template <>
struct VqWordOf<true> {
  using type = uint32_t;
};
template <int B>
using vq_word_t = typename VqWordOf<8 * B <= 32>::type;

// Code j of a word of 8 packed B-bit codes (vq_load_bytes' value): 32-bit
// shifts where the word fits in 32 bits.
template <int B>
__device__ __forceinline__ uint32_t vq_code(unsigned long long word, int j) {
  constexpr uint32_t mask = (1u << B) - 1u;
  if constexpr (B <= 4) {
    return (uint32_t(word) >> (j * B)) & mask;
  } else {
    return uint32_t(word >> (j * B)) & mask;
  }
}

// dst[0, bytes) = src[offset, offset + bytes) of a global array of `total`
// bytes, bytes past its end as zero, by the block's threads in 16-byte
// chunks (bytes a multiple of 16, dst 16-byte aligned). With `async` (src
// and offset 16-byte aligned) each chunk is a cp.async: the data lands in
// shared memory with no register held while it is in flight, complete for
// the thread after vq_copy_wait() and for the block after a barrier that
// follows it. Otherwise the chunks are read bytewise and stored at once.
__device__ __forceinline__ void vq_copy_to_shared(uint8_t* dst, const uint8_t* src, uint64_t offset, uint64_t total,
                                                  int bytes, bool async) {
  for (int c = 16 * threadIdx.x; c < bytes; c += 16 * blockDim.x) {
    const uint64_t at = offset + c;
    const int have = at >= total ? 0 : int(min(total - at, uint64_t(16)));
    if (async) {
      const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst + c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(have > 0 ? src + at : src),
                   "r"(have)
                   : "memory");
    } else {
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int y = 0; y < 16; ++y) {
        if (y < have) {
          w[y / 4] |= uint32_t(src[at + y]) << (8 * (y % 4));
        }
      }
      *reinterpret_cast<uint4*>(dst + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Waits for this thread's cp.async copies.
__device__ __forceinline__ void vq_copy_wait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
