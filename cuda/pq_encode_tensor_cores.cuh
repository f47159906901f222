// pq_encode's codes, packing and tensor-core search, placed after
// quant_common.cuh and mma_common.cuh.

// The planes of a C_BITS-bit code (crate::cpu::code_planes): widths 1, 2,
// 3, 4 and 8 are one plane; 5..7 keep 4 bits in the low plane, 9..12 keep 8.
template <int C_BITS>
struct PqPlanes {
  static constexpr int LO = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
  static constexpr int HI = C_BITS - LO;
};

// Stores the codes code(0..count) of sub-vectors 8g.. of `row` (count <= 8)
// into both planes, bit_pack's layout: LO bytes of the low plane, HI of the
// high one (8 codes fill whole bytes of each).
template <int C_BITS, typename Code>
__device__ __forceinline__ void pq_store_group(Code code, uint32_t count, uint32_t row, uint32_t g, uint32_t nbytes,
                                               uint32_t nbytes_hi, uint8_t* packed, uint8_t* packed_hi) {
  constexpr int LO = PqPlanes<C_BITS>::LO;
  constexpr int HI = PqPlanes<C_BITS>::HI;
  uint64_t word = 0;
  uint64_t word_hi = 0;
  for (uint32_t j = 0; j < count; ++j) {
    const uint32_t c = code(j);
    word |= uint64_t(c & ((1u << LO) - 1u)) << (j * LO);
    word_hi |= uint64_t(c >> LO) << (j * (HI > 0 ? HI : 1));
  }
  vq_store_group<LO>(word, g, row, nbytes, packed);
  if constexpr (HI > 0) {
    vq_store_group<HI>(word_hi, g, row, nbytes_hi, packed_hi);
  }
}

// ---------------------------------------------------------------- tensor cores
//
// For float16 and bfloat16 x. ‖v − c‖² = ‖v‖² − 2 v·c + ‖c‖² for 16
// sub-vectors v (the rows of an m16n8k16 A tile) against 8 entries c (B's
// columns) at a time: A's row holds v PQ_TC_PARTS times, then four ones and
// zeros; B's column −2c in PQ_TC_PARTS parts of x's type (vq_split_pair: about
// 24 bits of each float32 coordinate) and ‖c‖² in four, and the accumulator
// starts at ‖v‖². Float16 operands are first scaled by one power of two (the
// same for the whole codebook, exact) that brings the largest |2 c_j| or ‖c‖²
// into [2^14, 2^15). A distance's float32 bits, its low bits replaced by its
// n-tile, are the key each lane's running minimum keeps (__vimin3_s32); a
// tie of keys goes to the lower index, as the exact search's strict `<`.
// Distances differing by less than the key's resolution (2^-16 of the
// distance at K = 1024) are ties here, and the tensor cores' rounding is not
// crate::cpu's: codes may differ from the exact search at near-ties. Rows
// whose ‖v‖² leaves the range these products hold (or any codebook whose ‖c‖²
// does) are searched exactly instead.

constexpr int PQ_TC_THREADS = 256;
constexpr int PQ_TC_PARTS = 3;
constexpr int PQ_TC_NORM_PARTS = 4;
// Sub-vectors whose codes a block stages in shared memory before packing
// them, whole rows at a time (the host keeps D / S at most this).
constexpr int PQ_TC_CHUNK = 512;
// M-tiles of 16 sub-vectors a warp searches together, each B fragment
// loaded once for them (independent products in flight).
constexpr int PQ_TC_MTILES = 2;
// Resident blocks per SM (the host's PQ_TC_BLOCKS_PER_SM).
#define PQ_TC_BLOCKS_PER_SM 4
// Larger ‖v‖² or ‖c‖² (scaled) go to the exact search: products and sums
// then stay far inside float32's range.
constexpr float PQ_TC_LIMIT = 1.2676506e30f;  // 2^100

template <int S>
__host__ __device__ constexpr int pq_tc_ksteps() {
  return (S * PQ_TC_PARTS + PQ_TC_NORM_PARTS + 15) / 16;
}

// ‖c‖² of entry c, float32, in order.
template <int S>
__device__ __forceinline__ float pq_entry_norm(const float* codebook, uint32_t c) {
  float n2 = 0.0f;
#pragma unroll
  for (int j = 0; j < S; ++j) {
    n2 = __fadd_rn(n2, __fmul_rn(codebook[c * S + j], codebook[c * S + j]));
  }
  return n2;
}

// Register `reg` (0 or 1) of k-step ks of lane's B fragment for entry c:
// rows k, k + 1 of column c (module comment's layout), entries scaled.
template <int S, typename E>
__device__ __forceinline__ uint32_t pq_b_register(const E* tag, const float* codebook, uint32_t c, int ks, int reg,
                                                  int q, float scale) {
  const int k = ks * 16 + reg * 8 + 2 * q;
  if (k < S * PQ_TC_PARTS) {
    // S is even, so k and k + 1 are coordinates j, j + 1 of one part.
    const int j = k % S;
    uint32_t part[PQ_TC_PARTS];
    vq_split_pair<PQ_TC_PARTS>(tag, -2.0f * codebook[c * S + j] * scale, -2.0f * codebook[c * S + j + 1] * scale,
                               part);
    uint32_t r = 0;
#pragma unroll
    for (int p = 0; p < PQ_TC_PARTS; ++p) {
      r = p == k / S ? part[p] : r;
    }
    return r;
  }
  if (k < S * PQ_TC_PARTS + PQ_TC_NORM_PARTS) {
    uint32_t part[PQ_TC_NORM_PARTS];
    vq_split_pair<PQ_TC_NORM_PARTS>(tag, pq_entry_norm<S>(codebook, c) * scale, 0.0f, part);
    const int p = k - S * PQ_TC_PARTS;
    uint32_t r = 0;
#pragma unroll
    for (int i = 0; i < PQ_TC_NORM_PARTS; ++i) {
      r |= i == p ? (part[i] & 0xffffu) : 0u;
      r |= i == p + 1 ? (part[i] & 0xffffu) << 16 : 0u;
    }
    return r;
  }
  return 0u;
}

// Two 16-bit elements of x at p (4-byte aligned where `wide`) as one word.
template <typename T>
__device__ __forceinline__ uint32_t pq_load_pair(const T* p, bool wide) {
  if (wide) {
    return *reinterpret_cast<const uint32_t*>(p);
  }
  return vq_bits16(p[0]) | (vq_bits16(p[1]) << 16);
}

__device__ __forceinline__ uint32_t pq_one_pair(const __half*) { return 0x3c003c00u; }
__device__ __forceinline__ uint32_t pq_one_pair(const __nv_bfloat16*) { return 0x3f803f80u; }

// Bits that hold 0..n - 1 (at least 1).
__host__ __device__ constexpr int pq_index_bits(int n) {
  return n <= 2 ? 1 : 1 + pq_index_bits((n + 1) / 2);
}

// (bits(a) & b & c) | (b ^ c) as one LOP3 (the compiler would split it in
// two, masking a first).
__device__ __forceinline__ int pq_key(float a, int b, int c) {
  int r;
  asm("lop3.b32 %0, %1, %2, %3, 0xe6;" : "=r"(r) : "r"(__float_as_int(a)), "r"(b), "r"(c));
  return r;
}

// The lower of two (key, index) candidates; equal keys go to the lower index.
__device__ __forceinline__ long long pq_candidate(int key, uint32_t index) {
  return static_cast<long long>(key) * 4294967296LL + index;
}

template <typename T, int S, int C_BITS, typename Sizes>
__device__ __forceinline__ void pq_encode_tensor_cores(const T* x, const float* codebook, const Sizes& sizes,
                                                       uint8_t* packed, uint8_t* packed_hi) {
  constexpr int KS = pq_tc_ksteps<S>();
  constexpr int MT = PQ_TC_MTILES;
  // n-tiles of 8 entries, an even count (they go in pairs); entries past K
  // repeat entry 0, whose lower index wins their ties.
  constexpr int NT_MAX = ((1 << C_BITS) + 15) / 16 * 2;
  static_assert(NT_MAX * KS <= 128, "the tensor-core search keeps at most 128 n-tile k-steps (32 KB)");
  constexpr int TBITS = pq_index_bits(NT_MAX);
  constexpr int TMASK = (1 << TBITS) - 1;
  __shared__ uint2 bfrag[NT_MAX * KS * 32];
  __shared__ uint16_t codes[PQ_TC_CHUNK];
  __shared__ int s_amax;
  __shared__ int s_bad;
  const T* tag = nullptr;
  const uint32_t n = vq_size(sizes, 0);
  const uint32_t d = vq_size(sizes, 1);
  const uint32_t kk = vq_size(sizes, 2);
  const uint32_t nbytes = vq_size(sizes, 3);
  const uint32_t nbytes_hi = vq_size(sizes, 4);
  const uint32_t tid = threadIdx.x;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int q = lane % 4;
  // n-tiles are searched in groups of U (unrolled), the last one padded.
  constexpr int U = NT_MAX < 8 ? NT_MAX : 8;
  const uint32_t nt = (kk + 8 * U - 1) / (8 * U) * U;

  // The codebook's scale: the largest |2 c_j| and ‖c‖²; a ‖c‖² past the
  // limit (or not finite) sends every row to the exact search.
  if (tid == 0) {
    s_amax = 0;
    s_bad = 0;
  }
  __syncthreads();
  float amax = 0.0f;
  bool bad = false;
  for (uint32_t c = tid; c < kk; c += PQ_TC_THREADS) {
    const float n2 = pq_entry_norm<S>(codebook, c);
    bad |= !(n2 <= PQ_TC_LIMIT);
    amax = fmaxf(amax, n2);
#pragma unroll
    for (int j = 0; j < S; ++j) {
      amax = fmaxf(amax, 2.0f * fabsf(codebook[c * S + j]));
    }
  }
  if (bad) {
    s_bad = 1;
  }
  if (amax > 0.0f) {
    atomicMax(&s_amax, __float_as_int(amax));
  }
  __syncthreads();
  amax = __int_as_float(s_amax);
  const bool exact_only = s_bad != 0;
  const float scale =
      vq_pow2(vq_narrow_range(tag) && amax > 0.0f && !exact_only ? max(-126, min(126, 14 - ilogbf(amax))) : 0);
  for (uint32_t i = tid; i < nt * KS * 32; i += PQ_TC_THREADS) {
    const uint32_t l = i % 32;
    const uint32_t c = (i / (KS * 32)) * 8 + l / 4;
    const int ks = (i / 32) % KS;
    const uint32_t entry = c < kk ? c : 0;
    bfrag[i] = make_uint2(pq_b_register<S>(tag, codebook, entry, ks, 0, l % 4, scale),
                          pq_b_register<S>(tag, codebook, entry, ks, 1, l % 4, scale));
  }
  __syncthreads();

  const uint32_t per = d / S;
  const uint32_t rows_per_chunk = max(1u, PQ_TC_CHUNK / per);
  const uint32_t groups = (per + 7) / 8;
  const bool wide = vq_aligned(x, 4);
  const uint32_t one = pq_one_pair(tag);
  const uint32_t warp = tid / 32;
  for (uint32_t r0 = blockIdx.x * rows_per_chunk; r0 < n; r0 += gridDim.x * rows_per_chunk) {
    const uint32_t rows = min(rows_per_chunk, n - r0);
    const uint32_t subs = rows * per;
    const T* xc = x + uint64_t(r0) * d;
    for (uint32_t m0 = warp * 16 * MT; m0 < subs; m0 += PQ_TC_THREADS / 2 * MT) {
      // This lane's pair of coordinates (2q mod S) of sub-vectors
      // m0 + 16i + g + 8h (m-tile i, row half h); past the chunk, zeros.
      uint32_t word[MT][2];
      float norm[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t m = m0 + 16 * i + g + 8 * h;
          word[i][h] = m < subs ? pq_load_pair(xc + uint64_t(m) * S + (2 * q) % S, wide) : 0u;
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float lo = vq_word_elem(tag, word[i][h], 0);
          const float hi = vq_word_elem(tag, word[i][h], 1);
          norm[i][h] = lo * lo + hi * hi;
          if (S >= 4) norm[i][h] += __shfl_xor_sync(0xffffffffu, norm[i][h], 1);
          if (S >= 8) norm[i][h] += __shfl_xor_sync(0xffffffffu, norm[i][h], 2);
          norm[i][h] *= scale;
        }
      }
      uint32_t a[MT][KS][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int k = ks * 16 + (r / 2) * 8 + 2 * q;
            const uint32_t v = word[i][r % 2];
            a[i][ks][r] = k < S * PQ_TC_PARTS ? v : (k < S * PQ_TC_PARTS + PQ_TC_NORM_PARTS ? one : 0u);
          }
        }
      }
      // best[i][h][e]: m-tile i, row g + 8h, columns 2q + e of the n-tiles.
      int best[MT][2][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        best[i][0][0] = best[i][0][1] = best[i][1][0] = best[i][1][1] = INT_MAX;
      }
      const uint2* bq = bfrag + lane;
      for (uint32_t t0 = 0; t0 < nt; t0 += U) {
        // A key's bits above TBITS are the distance's, below them the
        // n-tile t0 + u (t0 a multiple of U, u < U): with b = ~TMASK | u
        // (an immediate) and c = ~TMASK | t0, (bits & b & c) | (b ^ c) is
        // one LOP3 and no per-tile index arithmetic.
        const int c = int(t0) | ~TMASK;
#pragma unroll
        for (int u = 0; u < U; u += 2) {
          uint2 b[2][KS];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
              b[h][ks] = bq[((t0 + u + h) * KS + ks) * 32];
            }
          }
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            int key[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float acc[4] = {norm[i][0], norm[i][0], norm[i][1], norm[i][1]};
#pragma unroll
              for (int ks = 0; ks < KS; ++ks) {
                vq_mma(tag, acc, a[i][ks], b[h][ks].x, b[h][ks].y);
              }
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                key[h][r] = pq_key(acc[r], ~TMASK | (u + h), c);
              }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              best[i][r / 2][r % 2] = __vimin3_s32(best[i][r / 2][r % 2], key[0][r], key[1][r]);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          long long c = min(pq_candidate(best[i][h][0], uint32_t(best[i][h][0] & TMASK) * 8 + 2 * q),
                            pq_candidate(best[i][h][1], uint32_t(best[i][h][1] & TMASK) * 8 + 2 * q + 1));
          c = min(c, __shfl_xor_sync(0xffffffffu, c, 1));
          c = min(c, __shfl_xor_sync(0xffffffffu, c, 2));
          const uint32_t m = m0 + 16 * i + g + 8 * h;
          if (q == 0 && m < subs) {
            uint32_t code = uint32_t(c) < kk ? uint32_t(c) : 0u;
            if (exact_only || !(norm[i][h] <= PQ_TC_LIMIT)) {
              code = vq_nearest_exact<S>(xc + uint64_t(m) * S, kk,
                                         [&](uint32_t e, int j) { return codebook[e * S + j]; });
            }
            codes[m] = uint16_t(code);
          }
        }
      }
    }
    __syncthreads();
    for (uint32_t i = tid; i < rows * groups; i += PQ_TC_THREADS) {
      const uint32_t row = i / groups;
      const uint32_t grp = i % groups;
      const uint16_t* rc = codes + row * per + grp * 8;
      pq_store_group<C_BITS>([&](uint32_t j) { return uint32_t(rc[j]); }, min(8u, per - grp * 8), r0 + row, grp,
                             nbytes, nbytes_hi, packed, packed_hi);
    }
    __syncthreads();
  }
}

// Four resident blocks of 256 threads per SM (at most 64 registers a
// thread), as the host sizes the grid, for the kernel MLX declares after
// this header: MLX writes `__global__ void NAME(` itself, so the bound
// rides on the keyword. The exact path's blocks are 256 threads too.
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(256, PQ_TC_BLOCKS_PER_SM)
