// tq_encode and tq_rvq_encode on the tensor cores, for float16 and bfloat16
// inputs rotated by a dense Π or Hadamard signs (D = 64 or 128). Placed
// after quant_common.cuh and mma_common.cuh.
//
// y = Π x / ‖x‖: x enters the mma.sync products as it is (exact as an
// operand of its own type) against Π's rows as B columns, and the product is
// scaled afterwards. A dense Π enters in PARTS parts of x's type
// (mma_common.cuh's split: every product exact, Π kept to about 11 PARTS
// bits in float16, 8 PARTS in bfloat16); Hadamard signs enter as the exact
// ±1 entries of H diag(s), the 1/√D applied after. The nearest centroid is
// the interval between the midpoints of neighbouring centroids that y falls
// in (TqTcNearest); RVQ's second stage codes the residual y - c1[code] the
// same way against its own codebook. Sums run in the tensor cores' order and
// the norm's by fma, so a code may differ from the exact path's where y (or
// the residual) lies near a midpoint: the parity rule's near-ties for
// float16 and bfloat16 inputs.
//
// A block of 2D threads (D/16 warps) holds Π's fragments in registers and
// walks tiles of 64 vectors, grid-stride. Each warp owns NT n-tiles (8
// output coordinates each) of MTW m-tiles (16 vectors each): 4 n-tiles
// where Π enters in one part, so that each A fragment read from shared
// memory feeds 4 products, else 2 (the registers of two parts). The tile
// sits in shared memory as rows padded so that ldmatrix hits 32 banks, the
// next tile is fetched into registers while this one is encoded, and the
// codes gather in a shared tile that leaves as one contiguous block.
//
// TurboQuant-Prod (PROD) codes y against its codebook the same way, then
// sketches the residual r = y - c[code]: r goes to a shared tile in float16
// and the signs of S r come from a second product, against S's rows as B
// fragments held in shared memory (the registers hold Π's), one float16
// part (a sign needs no more: each rounding, of S and of r, moves S r by
// about 1e-5 ‖S_j‖ ‖r‖). ‖r‖ sums by fma across the warps' columns.

// The nearest of 2^B sorted centroids, by the midpoints between neighbours
// (the midpoint c lies between centroids c and c + 1; above it is nearer
// c + 1): for B <= 4 by vq_pair_code, y rounded to float16, two values at a
// time against thresholds held in registers; else a binary search of the
// float32 midpoints in shared memory. TABLE (B <= 4): the code of each of
// float16's 65536 bit patterns, built once by the block from the same
// search into 64 KB of shared memory, so that a value costs one byte load
// where the search costs about 20 integer instructions (Nsight: the search
// held the integer pipe busy and was most of the tensor-core tq_encode's
// instructions).
template <int B, bool TABLE = false>
struct TqTcNearest {
  static constexpr int K = 1 << B;
  static constexpr bool PAIRED = B <= 4;
  static_assert(!TABLE || PAIRED, "a code table holds the codes of float16 values");
  uint32_t thr[PAIRED ? K - 1 : 1];
  const float* mids;
  const uint8_t* table;

  // Every thread calls it; where !PAIRED, a barrier must follow before pair().
  __device__ __forceinline__ void init(const float* centroids, float* shared_mids) {
    auto mid = [&](int c) { return 0.5f * (centroids[c] + centroids[c + 1]); };
    mids = shared_mids;
    if constexpr (PAIRED) {
#pragma unroll
      for (int c = 0; c < K - 1; ++c) {
        thr[c] = vq_bits_above(static_cast<const __half*>(nullptr), mid(c)) * 0x10001u;
      }
    } else {
      for (int c = threadIdx.x; c < K - 1; c += blockDim.x) {
        shared_mids[c] = mid(c);
      }
    }
  }

  // TABLE: fills the 65536 bytes at shared_table; every thread calls it
  // after init(), and a barrier must follow before pair().
  __device__ __forceinline__ void build(uint8_t* shared_table) {
    if constexpr (TABLE) {
      vq_build_pair_code_table<B>(shared_table, [&](uint32_t v) {
        return vq_pair_code<B>(static_cast<const __half*>(nullptr), v, thr);
      });
      table = shared_table;
    }
  }

  // The codes of y0 and y1 as low | high << B; a NaN gets code 0.
  __device__ __forceinline__ uint32_t pair(float y0, float y1) const {
    if constexpr (TABLE) {
      const __half2 h = __floats2half2_rn(y0, y1);
      const uint32_t v = *reinterpret_cast<const uint32_t*>(&h);
      return uint32_t(table[v & 0xFFFFu]) | (uint32_t(table[v >> 16]) << B);
    } else if constexpr (PAIRED) {
      const __half2 h = __floats2half2_rn(y0, y1);
      return vq_pair_code<B>(static_cast<const __half*>(nullptr), *reinterpret_cast<const uint32_t*>(&h), thr);
    } else {
      uint32_t out = 0;
      const float y[2] = {y0, y1};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        uint32_t c = 0;
#pragma unroll
        for (int step = K / 2; step >= 1; step /= 2) {
          c += y[e] > mids[c + step - 1] ? step : 0;
        }
        out |= c << (e * B);
      }
      return out;
    }
  }
};

// The codes of an n-tile's 8 columns are B bytes of the row at dst; lane q
// holds those of columns 2q and 2q + 1 in `pair` (low | high << B), bits
// 2 q B onward of the 8.
template <int B>
__device__ __forceinline__ void tq_tc_store_codes(uint8_t* dst, uint32_t pair) {
  const uint32_t q = threadIdx.x % 4;
  if constexpr (B == 8) {
    *reinterpret_cast<uint16_t*>(dst + 2 * q) = uint16_t(pair);
  } else if constexpr (B == 4) {
    dst[q] = uint8_t(pair);  // the lane's two codes are byte q
  } else {
    uint32_t w = pair << (2 * B * q);
    w |= __shfl_xor_sync(0xffffffffu, w, 1);
    w |= __shfl_xor_sync(0xffffffffu, w, 2);
    if (q < B) {
      dst[q] = uint8_t(w >> (8 * q));
    }
  }
}

// acc[nt] += the 16 rows of the float16 or bfloat16 tile at `rows` (pitch
// PITCH elements, K = 16 KS columns) times this warp's B fragments of NT
// n-tiles in NP parts, b(nt, p, ks) giving k-step ks's register pair; tag
// picks the operand type (vq_mma).
template <int KS, int NT, int NP, int PITCH, typename T, typename GetB>
__device__ __forceinline__ void tq_tc_product(float (&acc)[NT][4], const __half* rows, const T* tag, GetB b) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t a[4];
    vq_load_a(a, rows + ks * 16, PITCH);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const uint2 f = b(nt, p, ks);
        vq_mma(tag, acc[nt], a, f.x, f.y);
      }
    }
  }
}

// B2_BITS = 0: tq_encode (centroids2 and codes2 unused). Else tq_rvq_encode:
// codes of B_BITS against centroids, then of B2_BITS for the residual
// against centroids2. PROD (B2_BITS = 0): tq_prod_encode's codes of B_BITS
// (its MSE stage, at least 1 bit), then the residual's norm into
// residual_norms and the signs of S r (sketch: float32 [D, D], row-major)
// into codes2; it takes 2 D² + 128 (D + 8) bytes of dynamic shared memory
// (S's fragments, a uint2 per lane, n-tile and k-step, then the float16
// residual tile of 64 rows). TABLE: the first stage's codes by a table
// (TqTcNearest) in 64 KB of dynamic shared memory; not with PROD.
template <typename T, int D, int B_BITS, int B2_BITS, int PARTS, bool HADAMARD, bool PROD = false,
          bool TABLE = false>
__device__ void tq_encode_tensor_cores(const T* x, const float* rotation, const float* centroids,
                                       const float* centroids2, uint8_t* codes, uint8_t* codes2, __half* norms,
                                       uint32_t n, const float* sketch = nullptr,
                                       __half* residual_norms = nullptr) {
  static_assert((D == 64 || D == 128) && PARTS >= 1 && PARTS <= 3, "tensor-core shape");
  constexpr int ROWS = 64;                // vectors per tile
  constexpr int KS = D / 16;              // k-steps of an mma
  constexpr int THREADS = 2 * D;          // D / 16 warps
  constexpr bool RVQ = B2_BITS > 0;
  static_assert(!(PROD && RVQ) && B_BITS >= 1, "one second stage");
  static_assert(!(PROD && TABLE), "the code table and PROD's tiles share the dynamic shared memory");
  constexpr int RB = D * B_BITS / 8;      // code bytes per vector
  constexpr int RB2 = PROD ? D / 8 : D * B2_BITS / 8;  // second codes, or signs
  constexpr int PITCH = D + 8;            // elements per staged row: row r starts at bank 4r (mod 32)
  constexpr int TPV = THREADS / ROWS;     // threads per vector for the norms, 32 elements each
  constexpr int NP = HADAMARD ? 1 : PARTS;
  constexpr int NT = NP == 1 ? 4 : 2;             // n-tiles per warp
  constexpr int COL_WARPS = D / (8 * NT);         // warps across the coordinates
  constexpr int MTW = (ROWS / 16) * COL_WARPS / (THREADS / 32);  // m-tiles per warp
  static_assert(TPV * 32 == D, "tile shape");
  __shared__ __align__(16) T xs[ROWS * PITCH];
  __shared__ __align__(16) uint8_t sc[ROWS * RB];
  __shared__ __align__(16) uint8_t sc2[RVQ || PROD ? ROWS * RB2 : 16];
  __shared__ float s_inv[ROWS];
  __shared__ float mids[TqTcNearest<B_BITS>::PAIRED ? 1 : (1 << B_BITS)];
  __shared__ float mids2[TqTcNearest<RVQ ? B2_BITS : 1>::PAIRED ? 1 : (1 << B2_BITS)];
  __shared__ float cent[RVQ || PROD ? 1 << B_BITS : 1];
  __shared__ float rn2[PROD ? ROWS * COL_WARPS : 1];  // ‖r‖² of each row's columns, by column warp
  const uint32_t tid = threadIdx.x;
  const uint32_t warp = tid / 32;
  const uint32_t g = (tid % 32) / 4;  // fragment row group
  const uint32_t q = tid % 4;         // lane in the group
  const uint32_t col0 = 8 * NT * (warp % COL_WARPS);  // the warp's first coordinate
  const uint32_t mt0 = MTW * (warp / COL_WARPS);      // and m-tile
  const T* tag = nullptr;

  // The dynamic shared memory: PROD's fragments and residual tile, or the
  // code table.
  extern __shared__ __align__(16) uint2 tq_encode_dynamic[];
  TqTcNearest<B_BITS, TABLE> nearest;
  nearest.init(centroids, mids);
  nearest.build(reinterpret_cast<uint8_t*>(tq_encode_dynamic));
  TqTcNearest<RVQ ? B2_BITS : 1> nearest2;
  if constexpr (RVQ) {
    nearest2.init(centroids2, mids2);
  }
  if constexpr (RVQ || PROD) {
    for (int c = tid; c < (1 << B_BITS); c += THREADS) {
      cent[c] = centroids[c];
    }
  }
  // PROD: S's fragments, sfrag[(n-tile · KS + ks) · 32 + lane], column g of
  // n-tile t being S's row 8 t + g (scaled by a power of two: signs need no
  // unscale); the residual tile rs, rows PITCH apart. The first barrier of
  // the tile loop orders these writes before the reads.
  uint2* sfrag = tq_encode_dynamic;
  __half* rs = reinterpret_cast<__half*>(tq_encode_dynamic + (PROD ? D * D / 4 : 0));
  if constexpr (PROD) {
    if (warp < COL_WARPS) {
#pragma unroll 1
      for (int nt = 0; nt < NT; ++nt) {
        const int t = col0 / 8 + nt;
        const float* row = sketch + (8 * t + g) * D;
        uint32_t part[1][KS][2];
        vq_split_b<KS, 1>(static_cast<const __half*>(nullptr), [&](int j) { return row[j]; }, part);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          sfrag[(t * KS + ks) * 32 + tid % 32] = make_uint2(part[0][ks][0], part[0][ks][1]);
        }
      }
    }
  }

  // B fragments: column g of n-tile nt is Π's row (output coordinate)
  // col0 + 8 nt + g; a register pair holds its entries ks*16 + 2q (+1) and
  // ks*16 + 8 + 2q (+1). unscale: of the product's columns 2q, 2q + 1 (with
  // Hadamard signs 1, the 1/√D going with 1/‖x‖).
  uint32_t b[NT][NP][KS][2];
  float unscale[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int i = col0 + 8 * nt + g;
    if constexpr (HADAMARD) {
      // H[i][j] s_j = (-1)^popc(i & j) s_j: ±1, the sign bit set for -1.
      const uint32_t one = vq_bits16(vq_round(tag, 1.0f));
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = ks * 16 + h * 8 + 2 * q;
          uint32_t pair = 0;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t neg = (__popc(i & (j + e)) & 1) ^ (rotation[j + e] < 0.0f ? 1u : 0u);
            pair |= (one | (neg << 15)) << (16 * e);
          }
          b[nt][0][ks][h] = pair;
        }
      }
      unscale[nt][0] = unscale[nt][1] = 1.0f;
    } else {
      const float* row = rotation + i * D;
      const int shift = vq_split_b<KS, NP>(tag, [&](int j) { return row[j]; }, b[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        unscale[nt][e] = vq_pow2(-__shfl_sync(0xffffffffu, shift, 4 * (2 * q + e)));
      }
    }
  }
  const float post = HADAMARD ? 1.0f / sqrtf(float(D)) : 1.0f;
  const uint32_t tiles = (n + ROWS - 1) / ROWS;
  const bool wide = vq_aligned(x, 16);
  VqRowTile<D, ROWS, THREADS> rows_in;

  if (blockIdx.x < tiles) {
    rows_in.fetch(x, blockIdx.x, n, wide, tid);
    rows_in.template stage<PITCH>(xs, tid);
  }
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    __syncthreads();  // xs holds this tile; sc is free; the midpoints are set
    if (tile + gridDim.x < tiles) {
      rows_in.fetch(x, tile + gridDim.x, n, wide, tid);
    }
    // Norms: TPV threads per vector, 32 elements each, by fma.
    {
      const uint32_t r = tid / TPV;
      float s2 = 0.0f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float f[8];
        vq_load8(&xs[r * PITCH + (tid % TPV) * 32 + c * 8], f);
#pragma unroll
        for (int y = 0; y < 8; ++y) s2 = __fmaf_rn(f[y], f[y], s2);
      }
#pragma unroll
      for (int o = 1; o < TPV; o *= 2) s2 += __shfl_xor_sync(0xffffffffu, s2, o);
      const float s = __fsqrt_rn(s2);
      const uint32_t v = tile * ROWS + r;
      if (!(s > 0.0f)) {
        // As the exact path's u = x/‖x‖ = 0 for a zero (or underflowing) or
        // NaN norm: y = 0. (An infinite norm leaves products times 1/∞ = 0:
        // NaN, code 0, where x holds an infinity, as there.)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          *reinterpret_cast<uint4*>(&xs[r * PITCH + (tid % TPV) * 32 + c * 8]) = make_uint4(0, 0, 0, 0);
        }
      }
      if (tid % TPV == 0) {
        s_inv[r] = s > 0.0f ? post / s : 0.0f;
        if (v < n) {
          norms[v] = __float2half_rn(fminf(s, 65504.0f));
        }
      }
    }
    __syncthreads();  // s_inv holds the tile's norms
#pragma unroll 1
    for (int mt = mt0; mt < mt0 + MTW; ++mt) {
      float acc[NT][4] = {};
      tq_tc_product<KS, NT, NP, PITCH>(acc, reinterpret_cast<const __half*>(xs) + mt * 16 * PITCH, tag,
                                       [&](int nt, int p, int ks) { return make_uint2(b[nt][p][ks][0], b[nt][p][ks][1]); });
      float rr[2] = {0.0f, 0.0f};  // PROD: this lane's share of ‖r‖² of rows g, g + 8
      // y of rows g + 8 hr and columns nt's 2q, 2q + 1 (inv: the row's
      // 1/‖x‖, read once per row: the code stores between may alias it),
      // and their codes.
      float y[2][NT][2];
      uint32_t pairs[2][NT];
      auto code = [&](int hr, int nt, float inv) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          y[hr][nt][e] = HADAMARD ? acc[nt][2 * hr + e] * inv : acc[nt][2 * hr + e] * unscale[nt][e] * inv;
        }
        pairs[hr][nt] = nearest.pair(y[hr][nt][0], y[hr][nt][1]);
      };
      // tq_encode codes the whole m-tile before it stores, so that the
      // searches (or table loads) overlap; the second stages, which keep
      // more registers live, code each pair just before its use.
      constexpr bool CODES_FIRST = !RVQ && !PROD;
      if constexpr (CODES_FIRST) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float inv = s_inv[mt * 16 + g + 8 * hr];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            code(hr, nt, inv);
          }
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const uint32_t r = mt * 16 + g + 8 * hr;
        const float inv = CODES_FIRST ? 0.0f : s_inv[r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if constexpr (!CODES_FIRST) {
            code(hr, nt, inv);
          }
          const uint32_t pair = pairs[hr][nt];
          tq_tc_store_codes<B_BITS>(sc + r * RB + (col0 / 8 + nt) * B_BITS, pair);
          constexpr uint32_t MASK = (1u << B_BITS) - 1u;
          if constexpr (RVQ) {
            const uint32_t pair2 =
                nearest2.pair(y[hr][nt][0] - cent[pair & MASK], y[hr][nt][1] - cent[pair >> B_BITS]);
            tq_tc_store_codes<B2_BITS>(sc2 + r * RB2 + (col0 / 8 + nt) * B2_BITS, pair2);
          }
          if constexpr (PROD) {
            const float r0 = y[hr][nt][0] - cent[pair & MASK];
            const float r1 = y[hr][nt][1] - cent[pair >> B_BITS];
            *reinterpret_cast<__half2*>(&rs[r * PITCH + col0 + 8 * nt + 2 * q]) = __floats2half2_rn(r0, r1);
            rr[hr] = __fmaf_rn(r0, r0, __fmaf_rn(r1, r1, rr[hr]));
          }
        }
        if constexpr (PROD) {
          // The row's sum over this warp's columns: the quad's four lanes.
          rr[hr] += __shfl_xor_sync(0xffffffffu, rr[hr], 1);
          rr[hr] += __shfl_xor_sync(0xffffffffu, rr[hr], 2);
          if (q == 0) {
            rn2[r * COL_WARPS + warp % COL_WARPS] = rr[hr];
          }
        }
      }
    }
    __syncthreads();  // sc complete; xs read by every warp
    if constexpr (PROD) {
      // ‖r‖ of each row, then the signs of S r for this warp's m-tiles and
      // n-tiles into sc2; the barrier after orders them before the copy.
      if (tid < ROWS && tile * ROWS + tid < n) {
        float s2 = 0.0f;
#pragma unroll
        for (int w = 0; w < COL_WARPS; ++w) {
          s2 += rn2[tid * COL_WARPS + w];
        }
        residual_norms[tile * ROWS + tid] = __float2half_rn(fminf(__fsqrt_rn(s2), 65504.0f));
      }
#pragma unroll 1
      for (int mt = mt0; mt < mt0 + MTW; ++mt) {
        float acc[NT][4] = {};
        tq_tc_product<KS, NT, 1, PITCH>(acc, rs + mt * 16 * PITCH, static_cast<const __half*>(nullptr),
                                        [&](int nt, int, int ks) { return sfrag[((col0 / 8 + nt) * KS + ks) * 32 + tid % 32]; });
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const uint32_t r = mt * 16 + g + 8 * hr;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            // As the exact path's p >= 0 (a NaN gives 0).
            const uint32_t pair = (acc[nt][2 * hr] >= 0.0f ? 1u : 0u) | (acc[nt][2 * hr + 1] >= 0.0f ? 2u : 0u);
            tq_tc_store_codes<1>(sc2 + r * RB2 + col0 / 8 + nt, pair);
          }
        }
      }
      __syncthreads();  // sc2 complete; rs and rn2 read
    }
    // The tile's code rows are contiguous in the output.
    const uint32_t rows = min(uint32_t(ROWS), n - tile * ROWS);
    vq_copy_tile_rows<ROWS, RB>(sc, codes + uint64_t(tile) * ROWS * RB, rows, threadIdx.x, blockDim.x);
    if constexpr (RVQ || PROD) {
      vq_copy_tile_rows<ROWS, RB2>(sc2, codes2 + uint64_t(tile) * ROWS * RB2, rows, threadIdx.x, blockDim.x);
    }
    if (tile + gridDim.x < tiles) {
      rows_in.template stage<PITCH>(xs, tid);
    }
  }
}
