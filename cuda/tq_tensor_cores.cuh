// TurboQuant decoders on the tensor cores, for float16 and bfloat16 outputs
// (D = 64 or 128). Placed after tq_common.cuh and mma_common.cuh.
//
// Prod:
// y = ‖x‖ Πᵀ (c[code] + a Sᵀ z) with z the ±1 signs and a = scale · ‖r‖:
// Sᵀ z is one mma.sync product per tile, ±1 (exact in float16) against the
// split sketch, so every product is exact and only the sums' order differs
// from the exact path (float32 rounding, far below the output's). The rest
// (centroids, the rotation's inverse, the norms) is the exact path's
// arithmetic, operation for operation.
//
// A block of 256 threads holds the split sketch in registers as B fragments
// (warp w owns columns 8 (D/64) w onward) and walks tiles of TQ_TV vectors,
// grid-stride.
//
// RVQ with a dense Π: y = ‖x‖ Πᵀ u, u = c1[a] + c2[b] (the exact path's
// float32), entering as float16 high and low parts against the split Π:
// u_hi Π_hi + u_hi Π_lo + u_lo Π_hi, every product exact, the dropped
// u_lo Π_lo below float32's rounding of the sums.

// The sign words of this lane's rows v0 + g and v0 + g + 8 (D bits each;
// rows past n read as zero words: their products are never stored),
// shifted right by 2q for tq_sign_a.
template <int D>
__device__ __forceinline__ void tq_sign_words(uint32_t (&w)[2][D / 32], const uint8_t* signs, bool wide_signs,
                                              uint64_t v0, uint32_t n) {
  const int g = (threadIdx.x % 32) / 4;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const uint64_t v = v0 + g + 8 * hr;
    const uint8_t* row = signs + v * (D / 8);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      w[hr][i] = v >= n ? 0u : uint32_t(vq_read_bytes<4>(row + 4 * i, wide_signs)) >> (2 * (threadIdx.x % 4));
    }
  }
}

// The A fragment of ±1 for k-step ks of those rows: sketch rows 16 ks.. are
// bytes 2 ks (columns 0-7) and 2 ks + 1 (8-15) of the sign words, of which
// lane q takes bits 2q and 2q + 1: bits 0, 1 and 8, 9 of the words'
// halves once shifted by 2q.
template <int D>
__device__ __forceinline__ void tq_sign_a(uint32_t (&a)[4], const uint32_t (&w)[2][D / 32], int ks) {
  const uint32_t w0 = w[0][ks / 2] >> ((ks % 2) * 16);
  const uint32_t w1 = w[1][ks / 2] >> ((ks % 2) * 16);
  a[0] = vq_sign_pair(w0, 0);
  a[1] = vq_sign_pair(w1, 0);
  a[2] = vq_sign_pair(w0, 1);
  a[3] = vq_sign_pair(w1, 1);
}

// A float32 D x D matrix M, split, as this lane's B fragments (B(k, c) =
// M[k][c]): warp w's n-tiles 8 (NTW w + nt).
template <int D>
struct TqSplitFragments {
  static constexpr int KS = D / 16;  // k-steps (sketch rows) of an mma
  static constexpr int NTW = D / 64;  // n-tiles (8 columns) per warp: 8 warps cover D
  uint32_t hi[NTW][KS][2];
  uint32_t lo[NTW][KS][2];
  float unscale[NTW][2];  // of the product's columns 2q, 2q + 1 in each n-tile

  // This lane's column of B is 8 (NTW warp + nt) + g.
  __device__ __forceinline__ void load(const float* m) {
    const int warp = threadIdx.x / 32;
    const int g = (threadIdx.x % 32) / 4;
    const int q = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int col = 8 * (NTW * warp + nt) + g;
      const int shift = vq_split_b<KS>([&](int k) { return m[k * D + col]; }, hi[nt], lo[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        unscale[nt][e] = vq_pow2(-__shfl_sync(0xffffffffu, shift, 4 * (2 * q + e)));
      }
    }
  }

  // p[nt][2 hr + e] = (Mᵀ z)[8 (NTW warp + nt) + 2q + e] of vector v0 + g +
  // 8 hr, z the ±1 of its sign bits (rows past n: zero words, never stored).
  __device__ __forceinline__ void sign_product(float (&p)[NTW][4], const uint8_t* signs, bool wide_signs, uint64_t v0,
                                               uint32_t n) const {
    uint32_t w[2][D / 32];
    tq_sign_words<D>(w, signs, wide_signs, v0, n);
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p[nt][r] = 0.0f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t a[4];
      tq_sign_a<D>(a, w, ks);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        vq_mma_split(p[nt], a, hi[nt][ks], lo[nt][ks]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p[nt][r] = __fmul_rn(p[nt][r], unscale[nt][r % 2]);
      }
    }
  }
};

// acc[nt] += (rows 16 mt.. of the split U) × (the split B of this warp's
// n-tile nt): u_hi b_hi + u_hi b_lo + u_lo b_hi, every product exact, the
// dropped u_lo b_lo below float32's rounding of the sums. Uh, Ul: float16
// high and low parts, row-major with stride US; b(nt, ks, hi, lo) gives the
// B fragments of k-step ks. The small terms sum apart and join at the end:
// two dependent mma chains per n-tile instead of one three times as long.
template <int D, int US, typename GetB>
__device__ __forceinline__ void tq_split_product(float (&acc)[D / 64][4], const __half* Uh, const __half* Ul,
                                                 int mt, GetB b) {
  float small[D / 64][4] = {};
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t ah[4];
    uint32_t al[4];
    vq_load_a(ah, Uh + mt * 16 * US + 16 * ks, US);
    vq_load_a(al, Ul + mt * 16 * US + 16 * ks, US);
#pragma unroll
    for (int nt = 0; nt < D / 64; ++nt) {
      uint32_t hi[2];
      uint32_t lo[2];
      b(nt, ks, hi, lo);
      vq_mma(acc[nt], ah, hi[0], hi[1]);
      vq_mma(small[nt], ah, lo[0], lo[1]);
      vq_mma(small[nt], al, hi[0], hi[1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < D / 64; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      acc[nt][r] = __fadd_rn(acc[nt][r], small[nt][r]);
    }
  }
}

// Prod decode with a dense Π, both products on the tensor cores. Per tile:
// Sᵀ z with the sketch's split fragments in dynamic shared memory (D²·4
// bytes: 64 KB at D = 128, past the 48 KB of static shared memory; each warp
// reads back only its own); u = c[code] + a Sᵀ z at the accumulators' places
// (the exact path's float32 operations), split into U; then Πᵀ u as RVQ's
// product, Π's fragments in registers. The tile's codes, sign words,
// residual norms and norms reach shared memory by cp.async a tile ahead
// (read from global memory once per block, not once per warp); U and the
// staged tile are double-buffered: one barrier per tile.
template <int D, int MSE_BITS, typename T>
__device__ void tq_prod_decode_tensor_cores_dense(const uint8_t* codes, const uint8_t* signs, const __half* norms,
                                                  const __half* residual_norms, const float* rotation,
                                                  const float* centroids, const float* sketch, T* y, uint32_t n,
                                                  float scale) {
  using Frags = TqSplitFragments<D>;
  constexpr int NTW = Frags::NTW;
  constexpr int KS = Frags::KS;
  constexpr int US = D + 8;
  constexpr int MT = TQ_TV / 16;
  constexpr int CODE_BYTES = D * MSE_BITS / 8;
  constexpr int TILE_CODES = TQ_TV * CODE_BYTES;  // a tile's code bytes (rows are contiguous)
  constexpr int SIGN_ROW = D / 32;  // sign words per vector
  constexpr int TILE_SIGNS = TQ_TV * D / 8;
  static_assert(TILE_CODES % 16 == 0 && TILE_SIGNS % 16 == 0, "tiles of whole 16-byte chunks");
  constexpr int CENTROIDS = 1 << MSE_BITS;
  static_assert(D == 64 || D == 128, "tensor-core decode: D = 64 or 128");
  extern __shared__ __align__(16) uint4 tq_sketch_fragments[];  // [warp][nt][ks][lane]: hi0, hi1, lo0, lo1
  __shared__ __align__(16) __half U[2][2][TQ_TV * US];
  __shared__ __align__(16) uint32_t K[2][TILE_CODES / 4 + 4];  // + 4: a row's last code word has a successor
  __shared__ __align__(16) uint32_t Z[2][TQ_TV * SIGN_ROW];
  __shared__ __align__(16) __half RN[2][TQ_TV];  // ‖r‖
  __shared__ __align__(16) __half NM[2][TQ_TV];  // ‖x‖
  __shared__ float C[CENTROIDS];
  __shared__ float SU[D];  // the sketch's column unscales
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int q = lane % 4;
  tq_stage_table(C, centroids, MSE_BITS > 0 ? CENTROIDS : 0);
  {
    // Warp w splits the sketch's n-tiles NTW w.. (Frags::load's columns).
    Frags sk;
    sk.load(sketch);
    uint4* own = tq_sketch_fragments + warp * (NTW * KS * 32) + lane;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        own[(nt * KS + ks) * 32] = make_uint4(sk.hi[nt][ks][0], sk.hi[nt][ks][1], sk.lo[nt][ks][0], sk.lo[nt][ks][1]);
      }
      if (g == 0) {
        SU[8 * (NTW * warp + nt) + 2 * q] = sk.unscale[nt][0];
        SU[8 * (NTW * warp + nt) + 2 * q + 1] = sk.unscale[nt][1];
      }
    }
  }
  // In the sketch's product warp w takes row block pm = w / 4 of the tile
  // and a quarter of the columns, n-tiles NTP (w % 4)..: each warp builds the
  // sign fragments of one row block, not of both.
  constexpr int NTP = 2 * NTW;
  static_assert(MT * 4 == 8 && 4 * NTP * 8 == D, "8 warps: 2 row blocks x 4 column quarters");
  const int pm = warp / 4;
  const int first_nt = NTP * (warp % 4);
  const uint4* sketch_frags = tq_sketch_fragments + first_nt * (KS * 32) + lane;
  Frags rot;
  rot.load(rotation);
  const bool async_codes = vq_aligned(codes, 16);
  const bool async_signs = vq_aligned(signs, 16);
  const bool async_norms = vq_aligned(norms, 16);
  const bool async_residual_norms = vq_aligned(residual_norms, 16);
  // A tile's codes, sign words, residual norms and norms go to shared memory
  // by cp.async (bytes past n as zero), requested a tile ahead.
  auto request = [&](uint32_t tile, int b) {
    const auto copy = [&](void* dst, const void* src, int row_bytes, bool async) {
      vq_copy_to_shared(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
                        uint64_t(tile) * TQ_TV * row_bytes, uint64_t(n) * row_bytes, TQ_TV * row_bytes, async);
    };
    copy(K[b], codes, CODE_BYTES, async_codes);
    copy(Z[b], signs, D / 8, async_signs);
    copy(NM[b], norms, 2, async_norms);
    if (MSE_BITS > 0) {
      copy(RN[b], residual_norms, 2, async_residual_norms);
    }
  };
  const uint32_t tiles = (n + TQ_TV - 1) / TQ_TV;
  if (blockIdx.x < tiles) {
    request(blockIdx.x, 0);
    vq_copy_wait();
  }
  __syncthreads();  // C and the first tile are staged
  int buf = 0;
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
    const bool next = tile + gridDim.x < tiles;
    if (next) {
      request(tile + gridDim.x, buf ^ 1);  // buffer last read in the previous tile, before its barrier
    }
    __half* Uh = U[buf][0];
    __half* Ul = U[buf][1];
    const uint32_t* Kb = K[buf];
    // Every read of the staged buffer precedes this tile's barrier, after
    // which the next tile's request() may rewrite it.
    float nv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        nv[mt][hr] = __half2float(NM[buf][mt * 16 + g + 8 * hr]);
      }
    }
    // Sᵀ z for row block pm, n-tiles first_nt..: each fragment read once.
    float p[NTP][4] = {};
    {
      // Only the words of this k-step are live: tq_sign_a reads word ks / 2.
      uint32_t w[2][D / 32];
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        if (ks % 2 == 0) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            w[hr][ks / 2] = Z[buf][(pm * 16 + g + 8 * hr) * SIGN_ROW + ks / 2] >> (2 * q);
          }
        }
        uint32_t a[4];
        tq_sign_a<D>(a, w, ks);
#pragma unroll
        for (int j = 0; j < NTP; ++j) {
          const uint4 f = vq_shared_load4(sketch_frags + (j * KS + ks) * 32);
          const uint32_t hi[2] = {f.x, f.y};
          const uint32_t lo[2] = {f.z, f.w};
          vq_mma_split(p[j], a, hi, lo);
        }
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int vl = pm * 16 + g + 8 * hr;
      const float a = MSE_BITS > 0 ? __fmul_rn(scale, __half2float(RN[buf][vl])) : scale;
#pragma unroll
      for (int j = 0; j < NTP; ++j) {
        const int col = 8 * (first_nt + j) + 2 * q;
        // Codes col and col + 1: 2 MSE_BITS bits at bit col MSE_BITS of
        // the row (4-byte aligned), within two of its words.
        uint32_t codes2 = 0;
        if (MSE_BITS > 0) {
          const int b0 = col * MSE_BITS;
          const uint32_t* row = Kb + vl * (CODE_BYTES / 4);
          codes2 = __funnelshift_r(row[b0 / 32], row[b0 / 32 + 1], unsigned(b0 % 32));
        }
        float u[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const unsigned code = (codes2 >> (e * MSE_BITS)) & ((1u << MSE_BITS) - 1u);
          const float c = MSE_BITS > 0 ? C[code] : 0.0f;
          u[e] = __fadd_rn(c, __fmul_rn(a, __fmul_rn(p[j][2 * hr + e], SU[col + e])));
        }
        uint32_t hi;
        uint32_t lo;
        vq_split_pair(u[0], u[1], hi, lo);
        *reinterpret_cast<uint32_t*>(&Uh[vl * US + col]) = hi;
        *reinterpret_cast<uint32_t*>(&Ul[vl * US + col]) = lo;
      }
    }
    vq_copy_wait();  // the next tile's copies: complete for the block after the barrier
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float acc[NTW][4] = {};
      tq_split_product<D, US>(acc, Uh, Ul, mt, [&](int nt, int ks, uint32_t(&hi)[2], uint32_t(&lo)[2]) {
        hi[0] = rot.hi[nt][ks][0], hi[1] = rot.hi[nt][ks][1], lo[0] = rot.lo[nt][ks][0], lo[1] = rot.lo[nt][ks][1];
      });
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int vl = mt * 16 + g + 8 * hr;
        const uint64_t v = v0 + vl;
        if (v < n) {
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt) {
            float o[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              o[e] = __fmul_rn(__fmul_rn(acc[nt][2 * hr + e], rot.unscale[nt][e]), nv[mt][hr]);
            }
            vq_store_n<2>(y + v * D + 8 * (NTW * warp + nt) + 2 * q, o);
          }
        }
      }
    }
  }
}

// Without a rotation or with Hadamard signs: the product's rows go to P,
// row-major, and each warp then finishes 4 of the tile's vectors on its own,
// a vector across the warp with lane l holding coordinates E l .. E l + E - 1
// (E = D / 32): its codes from one coalesced read of the row, the centroids
// from shared memory, and the butterflies in registers, E log2 E of them in
// the lane and 5 stages across lanes by shuffles, each stage's pairs added
// and subtracted as cpu::turboquant::fwht does. P is double-buffered: one
// barrier per tile.
template <int D, int MSE_BITS, bool ROTATE, typename T>
__device__ void tq_prod_decode_tensor_cores_rows(const uint8_t* codes, const uint8_t* signs, const __half* norms,
                                                 const __half* residual_norms, const float* rotation,
                                                 const float* centroids, const float* sketch, T* y, uint32_t n,
                                                 float scale) {
  using Frags = TqSplitFragments<D>;
  constexpr int E = D / 32;
  constexpr int PS = D + 8;  // P's row stride: the fragments' 8-byte writes spread over the banks
  constexpr int CODE_BYTES = D * MSE_BITS / 8;
  constexpr int CODE_WORDS = CODE_BYTES / 4;  // at most 28: one per lane
  constexpr int CENTROIDS = 1 << MSE_BITS;
  constexpr unsigned CODE_MASK = (1u << MSE_BITS) - 1u;
  static_assert(D == 64 || D == 128, "tensor-core decode: D = 64 or 128");
  static_assert(CODE_WORDS <= 32, "a code row fits one word per lane");
  __shared__ __align__(16) float P[2][TQ_TV * PS];
  __shared__ float C[CENTROIDS];
  tq_stage_table(C, centroids, MSE_BITS > 0 ? CENTROIDS : 0);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int q = lane % 4;
  // This lane's rotation signs and the code bits' place in the row.
  float sgn[E];
#pragma unroll
  for (int b = 0; b < E; ++b) {
    sgn[b] = ROTATE ? rotation[E * lane + b] : 1.0f;
  }
  const float rscale = ROTATE ? __fdiv_rn(1.0f, __fsqrt_rn(float(D))) : 1.0f;
  const bool wide_codes = vq_aligned(codes, 4);
  Frags frags;
  frags.load(sketch);
  const bool wide_signs = vq_aligned(signs, 4);
  const uint32_t tiles = (n + TQ_TV - 1) / TQ_TV;
  int buf = 0;
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
    constexpr int PER_WARP = TQ_TV / 8;
    // This warp's vectors for the second half, requested first so their
    // latency hides behind the products: a word of each code row per lane,
    // the norms (rows past n read row n - 1 and are not stored).
    unsigned word[PER_WARP];
    float rnorm[PER_WARP];
    float norm[PER_WARP];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
      const uint64_t v = min(v0 + PER_WARP * warp + i, uint64_t(n) - 1);
      word[i] = 0;
      rnorm[i] = 1.0f;
      if constexpr (MSE_BITS > 0) {
        const uint8_t* row = codes + v * CODE_BYTES;
        if (lane < CODE_WORDS) {
          word[i] = uint32_t(vq_read_bytes<4>(row + 4 * lane, wide_codes));
        }
        rnorm[i] = __half2float(residual_norms[v]);
      }
      norm[i] = __half2float(norms[v]);
    }
    float* Pb = P[buf];
#pragma unroll
    for (int mt = 0; mt < TQ_TV / 16; ++mt) {
      float p[Frags::NTW][4];
      frags.sign_product(p, signs, wide_signs, v0 + mt * 16, n);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
        for (int nt = 0; nt < Frags::NTW; ++nt) {
          const int col = 8 * (Frags::NTW * warp + nt) + 2 * q;
          *reinterpret_cast<float2*>(&Pb[(mt * 16 + g + 8 * hr) * PS + col]) =
              make_float2(p[nt][2 * hr], p[nt][2 * hr + 1]);
        }
      }
    }
    // Also orders C's writes before the first reads.
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
      const int vl = PER_WARP * warp + i;
      const uint64_t v = v0 + vl;
      float u[E];
      const float4* src = reinterpret_cast<const float4*>(&Pb[vl * PS + E * lane]);
      if constexpr (E == 4) {
        const float4 t = src[0];
        u[0] = t.x, u[1] = t.y, u[2] = t.z, u[3] = t.w;
      } else {
        const float2 t = *reinterpret_cast<const float2*>(src);
        u[0] = t.x, u[1] = t.y;
      }
      unsigned bits = 0;
      float a = scale;
      if constexpr (MSE_BITS > 0) {
        bits = tq_lane_code_bits<E, MSE_BITS>(word[i], lane);
        a = __fmul_rn(scale, rnorm[i]);
      }
#pragma unroll
      for (int b = 0; b < E; ++b) {
        const float c = MSE_BITS > 0 ? C[(bits >> (b * MSE_BITS)) & CODE_MASK] : 0.0f;
        u[b] = __fadd_rn(c, __fmul_rn(a, u[b]));
      }
      float o[E];
      tq_warp_finish<E, ROTATE>(u, sgn, rscale, norm[i], o, lane);
      if (v < n) {
        vq_store_n<E>(y + v * D + E * lane, o);
      }
    }
  }
}

// RVQ decode with a dense Π (above). Per tile: u for the tile's vectors into
// U (high and low float16 parts, row-major, double-buffered: one barrier per
// tile), then each warp's columns of the tile by mma, stored from the
// accumulators. Thread t computes u for D/8 consecutive coordinates of the
// tile's vector t/8, from codes it requested one tile ahead (with the norms
// of its accumulator rows), so their latency hides behind a tile of work.
template <int D, int B1_BITS, int B2_BITS, typename T>
__device__ void tq_rvq_decode_tensor_cores(const uint8_t* codes1, const uint8_t* codes2, const __half* norms,
                                           const float* rotation, const float* centroids1, const float* centroids2,
                                           T* y, uint32_t n) {
  using Frags = TqSplitFragments<D>;
  constexpr int US = D + 8;  // U's row stride: ldmatrix's rows land on distinct banks
  constexpr int N1 = 1 << B1_BITS;
  constexpr int N2 = 1 << B2_BITS;
  constexpr int K = TQ_TV * D / 256;  // coordinates per thread
  constexpr int GROUPS = K / 8;       // of 8 codes: B bytes each
  constexpr int MT = TQ_TV / 16;
  static_assert(D == 64 || D == 128, "tensor-core decode: D = 64 or 128");
  __shared__ __align__(16) __half U[2][2][TQ_TV * US];  // [buffer][high, low]
  __shared__ float C1[N1];
  __shared__ float C2[N2];
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int g = (tid % 32) / 4;
  const int q = tid % 4;
  tq_stage_table(C1, centroids1, N1);
  tq_stage_table(C2, centroids2, N2);
  Frags frags;
  frags.load(rotation);
  const bool wide = vq_aligned(codes1, 8) && vq_aligned(codes2, 8);
  // The codes of this thread's coordinates in tile `tile` (zeros past n:
  // never stored), and the norms of its accumulator rows (past n: row n - 1).
  unsigned long long k1[GROUPS];
  unsigned long long k2[GROUPS];
  float norm[MT][2];
  auto request = [&](uint32_t tile) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
    const uint64_t v = v0 + tid / 8;
#pragma unroll
    for (int gr = 0; gr < GROUPS; ++gr) {
      const uint64_t group = v * (D / 8) + (tid % 8) * GROUPS + gr;  // 8-code groups from the start
      const uint8_t* p1 = codes1 + group * B1_BITS;
      const uint8_t* p2 = codes2 + group * B2_BITS;
      k1[gr] = v < n ? vq_read_bytes<B1_BITS>(p1, wide) : 0ull;
      k2[gr] = v < n ? vq_read_bytes<B2_BITS>(p2, wide) : 0ull;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        norm[mt][hr] = __half2float(norms[min(v0 + mt * 16 + g + 8 * hr, uint64_t(n) - 1)]);
      }
    }
  };
  const uint32_t tiles = (n + TQ_TV - 1) / TQ_TV;
  if (blockIdx.x < tiles) {
    request(blockIdx.x);
  }
  __syncthreads();  // C1 and C2 are written
  int buf = 0;
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
    float u[K];
#pragma unroll
    for (int gr = 0; gr < GROUPS; ++gr) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const unsigned a = unsigned(k1[gr] >> (c * B1_BITS)) & unsigned(N1 - 1);
        const unsigned b = unsigned(k2[gr] >> (c * B2_BITS)) & unsigned(N2 - 1);
        u[8 * gr + c] = __fadd_rn(C1[a], C2[b]);
      }
    }
    float nrm[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      nrm[mt][0] = norm[mt][0];
      nrm[mt][1] = norm[mt][1];
    }
    if (tile + gridDim.x < tiles) {
      request(tile + gridDim.x);
    }
    __half* Uh = U[buf][0];
    __half* Ul = U[buf][1];
    {
      uint32_t hi[K / 2];
      uint32_t lo[K / 2];
#pragma unroll
      for (int i = 0; i < K / 2; ++i) {
        vq_split_pair(u[2 * i], u[2 * i + 1], hi[i], lo[i]);
      }
      const int at = (tid / 8) * US + (tid % 8) * K;
#pragma unroll
      for (int i = 0; i < K / 8; ++i) {
        *reinterpret_cast<uint4*>(&Uh[at + 8 * i]) = make_uint4(hi[4 * i], hi[4 * i + 1], hi[4 * i + 2], hi[4 * i + 3]);
        *reinterpret_cast<uint4*>(&Ul[at + 8 * i]) = make_uint4(lo[4 * i], lo[4 * i + 1], lo[4 * i + 2], lo[4 * i + 3]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float acc[Frags::NTW][4] = {};
      tq_split_product<D, US>(acc, Uh, Ul, mt, [&](int nt, int ks, uint32_t(&hi)[2], uint32_t(&lo)[2]) {
        hi[0] = frags.hi[nt][ks][0], hi[1] = frags.hi[nt][ks][1], lo[0] = frags.lo[nt][ks][0], lo[1] = frags.lo[nt][ks][1];
      });
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const uint64_t v = v0 + mt * 16 + g + 8 * hr;
        if (v < n) {
#pragma unroll
          for (int nt = 0; nt < Frags::NTW; ++nt) {
            float o[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              o[e] = __fmul_rn(__fmul_rn(acc[nt][2 * hr + e], frags.unscale[nt][e]), nrm[mt][hr]);
            }
            vq_store_n<2>(y + v * D + 8 * (Frags::NTW * warp + nt) + 2 * q, o);
          }
        }
      }
    }
  }
}
