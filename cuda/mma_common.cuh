// Tensor-core helpers (mma.sync m16n8k16, float16 operands, float32
// accumulators), placed after quant_common.cuh. Fragment layouts, with lane =
// 4 g + q: A (16 x 16, row-major) registers hold (row g | g + 8, columns
// 2q, 2q + 1 | 2q + 8, 2q + 9); B (16 x 8) holds rows 2q, 2q + 1 | 2q + 8,
// 2q + 9 of column g; C holds rows g | g + 8, columns 2q, 2q + 1.
//
// A float32 matrix enters as two float16 parts, its float16 rounding and the
// float16 rounding of the remainder: against float16 (or ±1) operands every
// product is exact and the matrix keeps about 22 bits instead of 11. Each
// column of B is first scaled by a power of two (exact) that puts its
// largest entry in [2^14, 2^15), inside float16's range with room to spare.

// 16-bit element helpers by tag (the tag's value is never read).
__device__ __forceinline__ __half vq_round(const __half*, float a) { return __float2half_rn(a); }
__device__ __forceinline__ __nv_bfloat16 vq_round(const __nv_bfloat16*, float a) { return __float2bfloat16_rn(a); }
__device__ __forceinline__ uint32_t vq_bits16(__half a) { return __half_as_ushort(a); }
__device__ __forceinline__ uint32_t vq_bits16(__nv_bfloat16 a) { return __bfloat16_as_ushort(a); }
// Whether products with the type's operands need vq_split_b's column scale:
// float16's range is narrow, bfloat16's that of float32.
__device__ constexpr bool vq_narrow_range(const __half*) { return true; }
__device__ constexpr bool vq_narrow_range(const __nv_bfloat16*) { return false; }

// Two float32 entries as PARTS fragment registers of the tag's type: part 0
// their rounding, each next part the rounding of what the earlier parts
// leave (exact in float32: a float minus its own rounding to fewer bits).
template <int PARTS, typename E>
__device__ __forceinline__ void vq_split_pair(const E* tag, float a, float b, uint32_t (&part)[PARTS]) {
#pragma unroll
  for (int p = 0; p < PARTS; ++p) {
    const E ea = vq_round(tag, a);
    const E eb = vq_round(tag, b);
    part[p] = vq_bits16(ea) | (vq_bits16(eb) << 16);
    a -= static_cast<float>(ea);
    b -= static_cast<float>(eb);
  }
}

// The high and low float16 parts of two float32 entries.
__device__ __forceinline__ void vq_split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  uint32_t part[2];
  vq_split_pair<2>(static_cast<const __half*>(nullptr), a, b, part);
  hi = part[0];
  lo = part[1];
}

// 2^e as a float, from its bits (exact whatever the math flags); e in [-126, 127].
__device__ __forceinline__ float vq_pow2(int e) {
  return __int_as_float((127 + e) << 23);
}

// This lane's B fragments for one n-tile and KS k-steps of a K x 8 block
// whose column g (this lane's) reads at(k), k < 16 KS, in PARTS parts of the
// tag's type (vq_split_pair): column g scaled by 2^shift first (0 for a
// type of float32's range). Returns shift; a product's column c (C layout)
// is unscaled by vq_pow2(-shift of lane 4c).
template <int KS, int PARTS, typename E, typename At>
__device__ __forceinline__ int vq_split_b(const E* tag, At at, uint32_t (&part)[PARTS][KS][2]) {
  const int q = threadIdx.x % 4;
  float amax = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = ks * 16 + h * 8 + 2 * q;
      amax = fmaxf(amax, fmaxf(fabsf(at(k)), fabsf(at(k + 1))));
    }
  }
  // The group's four lanes hold the whole column.
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const int shift =
      vq_narrow_range(tag) && amax > 0.0f && isfinite(amax) ? max(-126, min(126, 14 - ilogbf(amax))) : 0;
  const float scale = vq_pow2(shift);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = ks * 16 + h * 8 + 2 * q;
      uint32_t p[PARTS];
      vq_split_pair<PARTS>(tag, at(k) * scale, at(k + 1) * scale, p);
#pragma unroll
      for (int i = 0; i < PARTS; ++i) {
        part[i][ks][h] = p[i];
      }
    }
  }
  return shift;
}

// vq_split_b in two float16 parts, high and low.
template <int KS, typename At>
__device__ __forceinline__ int vq_split_b(At at, uint32_t (&hi)[KS][2], uint32_t (&lo)[KS][2]) {
  uint32_t part[2][KS][2];
  const int shift = vq_split_b<KS, 2>(static_cast<const __half*>(nullptr), at, part);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      hi[ks][h] = part[0][ks][h];
      lo[ks][h] = part[1][ks][h];
    }
  }
  return shift;
}

// c += a (b_hi + b_lo): one product of a split B.
__device__ __forceinline__ void vq_mma_split(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&hi)[2],
                                             const uint32_t (&lo)[2]) {
  vq_mma(c, a, hi[0], hi[1]);
  vq_mma(c, a, lo[0], lo[1]);
}

// A fragment register of ±1 (bit set: +1) from bits 8k and 8k + 1 of t (k
// = 0 or 1; t's other bits are ignored): (b0 + 2 b1) 2^8k times
// 0x40008000 / 2^8k puts b0 at bit 15 and b1 at bit 31, the sign bits that
// turn -1.0 (0xBC00) into +1.0.
__device__ __forceinline__ uint32_t vq_sign_pair(uint32_t t, int k) {
  const uint32_t m = (t & (3u << (8 * k))) * (0x40008000u >> (8 * k));
  return (m & 0x80008000u) ^ 0xBC00BC00u;
}

// A fragment of the 16 x 16 float16 block at `tile` in shared memory, rows
// `stride` elements apart (each row's 16 bytes aligned): lanes 0-15 address
// rows 0-15 at column 0, lanes 16-31 the same rows at column 8, the four
// 8 x 8 matrices ldmatrix returns being a[0] to a[3] of the layout above.
__device__ __forceinline__ void vq_load_a(uint32_t (&a)[4], const __half* tile, int stride) {
  const int l = threadIdx.x % 32;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(tile + (l % 16) * stride + (l / 16) * 8));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// 16 bytes of shared memory, read where the code puts the read: a volatile
// load is neither merged with an equal one nor hoisted out of a loop, so
// fragments reread per use do not stay alive in registers.
__device__ __forceinline__ uint4 vq_shared_load4(const uint4* p) {
  uint4 v;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// A tile of ROWS rows of D 16-bit elements (D a multiple of 8) moved by
// THREADS threads in 16-byte chunks, PER a thread: fetched from global
// memory into registers (so that the next tile loads while this one is
// used), then staged into shared memory as rows PITCH elements apart.
template <int D, int ROWS, int THREADS>
struct VqRowTile {
  static constexpr int CHUNKS = ROWS * D / 8;
  static constexpr int PER = (CHUNKS + THREADS - 1) / THREADS;
  uint4 next[PER];

  // Rows tile * ROWS.. of x [n, D] (rows past n read as zeros), by thread
  // tid; `wide`: x 16-byte aligned, else element loads.
  template <typename T>
  __device__ __forceinline__ void fetch(const T* x, uint32_t tile, uint32_t n, bool wide, uint32_t tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const uint32_t c = tid + i * THREADS;
      const uint32_t r = tile * ROWS + c / (D / 8);
      next[i] = make_uint4(0, 0, 0, 0);
      if ((CHUNKS % THREADS == 0 || c < CHUNKS) && r < n) {
        const T* src = x + uint64_t(r) * D + (c % (D / 8)) * 8;
        if (wide) {
          next[i] = *reinterpret_cast<const uint4*>(src);
        } else {
          T* e = reinterpret_cast<T*>(&next[i]);
#pragma unroll
          for (int y = 0; y < 8; ++y) e[y] = src[y];
        }
      }
    }
  }

  template <int PITCH, typename T>
  __device__ __forceinline__ void stage(T* xs, uint32_t tid) const {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const uint32_t c = tid + i * THREADS;
      if (CHUNKS % THREADS == 0 || c < CHUNKS) {
        *reinterpret_cast<uint4*>(&xs[(c / (D / 8)) * PITCH + (c % (D / 8)) * 8]) = next[i];
      }
    }
  }
};

// The first `rows` rows (of RB bytes) of a shared tile to out, where they
// are contiguous, by threads tid, tid + stride, ...: 16 bytes a step where
// the tile is whole and out aligned, else bytewise.
template <int ROWS, int RB>
__device__ __forceinline__ void vq_copy_tile_rows(const uint8_t* tile, uint8_t* out, uint32_t rows, uint32_t tid,
                                                  uint32_t stride) {
  if (rows == ROWS && (ROWS * RB) % 16 == 0 && vq_aligned(out, 16)) {
    for (uint32_t c = tid; c < ROWS * RB / 16; c += stride) {
      reinterpret_cast<uint4*>(out)[c] = reinterpret_cast<const uint4*>(tile)[c];
    }
  } else {
    for (uint32_t c = tid; c < rows * RB; c += stride) {
      out[c] = tile[c];
    }
  }
}
