// The TurboQuant codecs' tensor-core parts (mma_common.cuh), for float16 and
// bfloat16 data at D = 64 or 128. Placed after tq_common.cuh and
// mma_common.cuh.

// acc ← the tile's Πᵀ y for the vectors' y in V (tq_common.cuh's layout),
// Π the dense row-major m [D, D], on the tensor cores: y and Π split, the
// products hi·hi + hi·lo + lo·hi, for float16 and bfloat16 outputs (D = 64
// or 128). Warp w computes columns 8 (D/64) w onward for all TQ_TV vectors
// into W (V's size and layout), one n-tile at a time so that one set of
// fragments is live; acc then loads from W. Ends with a barrier; V and W may
// be rewritten after the next one.
template <int D>
__device__ void tq_unrotate_tensor_cores(float (&acc)[4][TQ_CHUNKS(D) * 4], const float* V, float* W,
                                         const float* m) {
  static_assert(D == 64 || D == 128, "tensor-core rotation: D = 64 or 128");
  constexpr int KS = D / 16;
  constexpr int NTW = D / 64;
  const int warp = threadIdx.x / 32;
  const int g = (threadIdx.x % 32) / 4;
  const int q = threadIdx.x % 4;
#pragma unroll 1
  for (int nt = 0; nt < NTW; ++nt) {
    // B(k, c) = Π[k][c] (Πᵀ y sums column c of Π against y).
    const int col0 = 8 * (NTW * warp + nt);
    uint32_t bh[KS][2];
    uint32_t bl[KS][2];
    const int shift = vq_split_b<KS>([&](int k) { return m[k * D + col0 + g]; }, bh, bl);
    float unscale[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      unscale[e] = vq_pow2(-__shfl_sync(0xffffffffu, shift, 4 * (2 * q + e)));
    }
#pragma unroll 1
    for (int mt = 0; mt < TQ_TV / 16; ++mt) {
      float prod[4] = {};
      float cross[4] = {};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t ah[4];
        uint32_t al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int v = mt * 16 + g + 8 * (i % 2);
          const int j = ks * 16 + 8 * (i / 2) + 2 * q;
          vq_split_pair(V[j * TQ_VS + v], V[(j + 1) * TQ_VS + v], ah[i], al[i]);
        }
        vq_mma(prod, ah, bh[ks][0], bh[ks][1]);
        vq_mma(cross, ah, bl[ks][0], bl[ks][1]);
        vq_mma(cross, al, bh[ks][0], bh[ks][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int v = mt * 16 + g + 8 * (i / 2);
        W[(col0 + 2 * q + i % 2) * TQ_VS + v] = (prod[i] + cross[i]) * unscale[i % 2];
      }
    }
  }
  __syncthreads();
  tq_load_tile<D, 1>(acc, W, 1.0f, nullptr);
}

// TurboQuant-Prod decode with its sketch product on the tensor cores, for
// float16 and bfloat16 outputs (D = 64 or 128).
//
// y = ‖x‖ Πᵀ (c[code] + a Sᵀ z) with z the ±1 signs and a = scale · ‖r‖:
// Sᵀ z is one mma.sync product per tile, ±1 (exact in float16) against the
// split sketch, so every product is exact and only the sums' order differs
// from the exact path (float32 rounding, far below the output's). The
// centroids and norms are the exact path's; the rotation's inverse is its
// butterflies, or a dense Π on the tensor cores (tq_unrotate_tensor_cores,
// into W: V's size, unused otherwise).
//
// A block of 256 threads holds the split sketch in registers as B fragments
// (warp w owns columns 8 (D/64) w onward) and walks tiles of TQ_TV vectors,
// grid-stride: the product's rows go to V with their centroid added, then
// the rotation's inverse and tq_store_tile finish the tile.
template <int D, int MSE_BITS, bool ROTATE, bool HADAMARD, typename T>
__device__ void tq_prod_decode_tensor_cores(const uint8_t* codes, const uint8_t* signs, const __half* norms,
                                            const __half* residual_norms, const float* rotation,
                                            const float* centroids, const float* sketch, T* y, float* V, float* W,
                                            float* Bs, uint32_t n, float scale) {
  static_assert(D == 64 || D == 128, "tensor-core decode: D = 64 or 128");
  constexpr int KS = D / 16;       // k-steps (sketch rows) of an mma
  constexpr int NTW = D / 64;      // n-tiles (8 columns) per warp: 8 warps cover D
  constexpr int SIGN_WORDS = D / 32;
  constexpr int CODE_BYTES = D * MSE_BITS / 8;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int g = (tid % 32) / 4;
  const int q = tid % 4;

  // B(k, c) = S[k][c]: this lane's column is 8 (NTW warp + nt) + g. Held
  // across tiles, unless a dense rotation's fragments need the registers.
  constexpr bool RELOAD = ROTATE && !HADAMARD;
  uint32_t bh[NTW][KS][2];
  uint32_t bl[NTW][KS][2];
  float unscale[NTW][2];
  auto load_sketch = [&]() {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int col = 8 * (NTW * warp + nt) + g;
      const int shift = vq_split_b<KS>([&](int k) { return sketch[k * D + col]; }, bh[nt], bl[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        unscale[nt][e] = vq_pow2(-__shfl_sync(0xffffffffu, shift, 4 * (2 * q + e)));
      }
    }
  };
  if constexpr (!RELOAD) {
    load_sketch();
  }

  const bool wide_signs = vq_aligned(signs, 4);
  const uint32_t tiles = (n + TQ_TV - 1) / TQ_TV;
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
    if constexpr (RELOAD) {
      load_sketch();
    }
#pragma unroll
    for (int mt = 0; mt < TQ_TV / 16; ++mt) {
      // Sign words of this lane's rows g and g + 8 (0 past n: never stored).
      uint32_t w[2][SIGN_WORDS];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const uint64_t v = v0 + mt * 16 + g + 8 * hr;
        const uint8_t* row = signs + v * (D / 8);
#pragma unroll
        for (int i = 0; i < SIGN_WORDS; ++i) {
          w[hr][i] = v >= n ? 0u
                     : wide_signs
                         ? reinterpret_cast<const uint32_t*>(row)[i]
                         : uint32_t(row[4 * i]) | (uint32_t(row[4 * i + 1]) << 8) | (uint32_t(row[4 * i + 2]) << 16) |
                               (uint32_t(row[4 * i + 3]) << 24);
        }
      }
      float acc[NTW][4] = {};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        // Sketch rows 16 ks.. are bytes 2 ks (columns 0-7) and 2 ks + 1 (8-15).
        const int word = ks / 2;
        const int bit = (ks % 2) * 16;
        uint32_t a[4];
        a[0] = vq_sign_pair(w[0][word] >> bit, q);
        a[1] = vq_sign_pair(w[1][word] >> bit, q);
        a[2] = vq_sign_pair(w[0][word] >> (bit + 8), q);
        a[3] = vq_sign_pair(w[1][word] >> (bit + 8), q);
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          vq_mma_split(acc[nt], a, bh[nt][ks], bl[nt][ks]);
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int vl = mt * 16 + g + 8 * hr;
        const uint64_t v = v0 + vl;
        const bool live = v < n;
        const float a = MSE_BITS > 0 && live ? __fmul_rn(scale, __half2float(residual_norms[v])) : scale;
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * (NTW * warp + nt) + 2 * q + e;
            const float c = MSE_BITS > 0 && live
                                ? centroids[vq_code_at(codes + v * CODE_BYTES, unsigned(col), unsigned(MSE_BITS > 0 ? MSE_BITS : 1))]
                                : 0.0f;
            const float p = __fmul_rn(acc[nt][2 * hr + e], unscale[nt][e]);
            V[col * TQ_VS + vl] = live ? __fadd_rn(c, __fmul_rn(a, p)) : 0.0f;
          }
        }
      }
    }
    __syncthreads();
    float out[4][TQ_CHUNKS(D) * 4];
    if constexpr (ROTATE && !HADAMARD) {
      tq_unrotate_tensor_cores<D>(out, V, W, rotation);
    } else {
      tq_unrotate_tile<D, ROTATE, HADAMARD>(out, V, rotation, Bs);
    }
    tq_store_tile<D>(out, y, norms, v0, n);
    __syncthreads();  // V and Bs are free for the next tile
  }
}

// TurboQuant-Prod encode's second stage on the tensor cores, for float16 and
// bfloat16 inputs (D = 64 or 128): the signs of S r for the tile's residuals
// r in V (tq_common.cuh's layout), written to signs [N, D/8]. Each residual
// is scaled by a power of two (no sign changes) and split like the sketch,
// so r S keeps about 22 bits of both: hi·hi + hi·lo + lo·hi. A sign may
// differ from the exact path's only where (S r)_k is within float32 rounding
// of zero (the parity rule's near-ties). s_scale holds TQ_TV floats; V and
// s_scale may be rewritten after the next barrier.
template <int D>
__device__ void tq_sketch_signs_tensor_cores(const float* V, float* s_scale, const float* sketch, uint8_t* signs,
                                             uint64_t v0, uint32_t n) {
  static_assert(D == 64 || D == 128, "tensor-core sketch: D = 64 or 128");
  constexpr int KS = D / 16;
  constexpr int NTW = D / 64;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int g = (tid % 32) / 4;
  const int q = tid % 4;
  // Per-vector scales: 8 lanes per vector, each scanning D/8 coordinates.
  {
    const int v = tid / 8;
    float amax = 0.0f;
    for (int j = tid % 8; j < D; j += 8) {
      amax = fmaxf(amax, fabsf(V[j * TQ_VS + v]));
    }
#pragma unroll
    for (int o = 1; o < 8; o *= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    if (tid % 8 == 0) {
      s_scale[v] = vq_pow2(amax > 0.0f && isfinite(amax) ? max(-126, min(126, 14 - ilogbf(amax))) : 0);
    }
  }
  // B(k, c) = S[c][k]: this lane's column (sketch row) is 8 (NTW warp + nt) + g.
  uint32_t bh[NTW][KS][2];
  uint32_t bl[NTW][KS][2];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) {
    const float* row = sketch + (8 * (NTW * warp + nt) + g) * D;
    vq_split_b<KS>([&](int k) { return row[k]; }, bh[nt], bl[nt]);
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < TQ_TV / 16; ++mt) {
    const int r0 = mt * 16 + g;
    const float sc0 = s_scale[r0];
    const float sc1 = s_scale[r0 + 8];
    float acc[NTW][4] = {};
    float cross[NTW][4] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t ah[4];
      uint32_t al[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // Register i: row r0 (+8 for odd i), columns 2q, 2q + 1 (+8 for i >= 2).
        const int v = r0 + 8 * (i % 2);
        const int j = ks * 16 + 8 * (i / 2) + 2 * q;
        const float sc = i % 2 ? sc1 : sc0;
        vq_split_pair(V[j * TQ_VS + v] * sc, V[(j + 1) * TQ_VS + v] * sc, ah[i], al[i]);
      }
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        vq_mma(acc[nt], ah, bh[nt][ks][0], bh[nt][ks][1]);
        vq_mma(cross[nt], ah, bl[nt][ks][0], bl[nt][ks][1]);
        vq_mma(cross[nt], al, bh[nt][ks][0], bh[nt][ks][1]);
      }
    }
    // Bits 2q, 2q + 1 of byte NTW warp + nt for rows r0 and r0 + 8; the
    // group's four lanes OR them into whole bytes.
    uint32_t bytes[2] = {0u, 0u};
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const float p0 = acc[nt][2 * hr] + cross[nt][2 * hr];
        const float p1 = acc[nt][2 * hr + 1] + cross[nt][2 * hr + 1];
        uint32_t b = ((p0 >= 0.0f ? 1u : 0u) | (p1 >= 0.0f ? 2u : 0u)) << (2 * q);
        b |= __shfl_xor_sync(0xffffffffu, b, 1);
        b |= __shfl_xor_sync(0xffffffffu, b, 2);
        bytes[hr] |= b << (8 * nt);
      }
    }
    if (q < 2) {
      const uint64_t v = v0 + r0 + 8 * q;
      if (v < n) {
        uint8_t* dst = signs + v * (D / 8) + NTW * warp;
        if constexpr (NTW == 2) {
          *reinterpret_cast<uint16_t*>(dst) = uint16_t(bytes[q]);
        } else {
          *dst = uint8_t(bytes[q]);
        }
      }
    }
  }
}
