// TurboQuant-Prod decode with its sketch product on the tensor cores, for
// float16 and bfloat16 outputs (D = 64 or 128). Placed after tq_common.cuh
// and mma_common.cuh.
//
// y = ‖x‖ Πᵀ (c[code] + a Sᵀ z) with z the ±1 signs and a = scale · ‖r‖:
// Sᵀ z is one mma.sync product per tile, ±1 (exact in float16) against the
// split sketch, so every product is exact and only the sums' order differs
// from the exact path (float32 rounding, far below the output's). The rest
// (centroids, the rotation's inverse, the norms) is the exact path's.
//
// A block of 256 threads holds the split sketch in registers as B fragments
// (warp w owns columns 8 (D/64) w onward) and walks tiles of TQ_TV vectors,
// grid-stride: the product's rows go to V with their centroid added, then
// tq_unrotate_tile and tq_store_tile finish the tile as in the exact path.
template <int D, int MSE_BITS, bool ROTATE, bool HADAMARD, typename T>
__device__ void tq_prod_decode_tensor_cores(const uint8_t* codes, const uint8_t* signs, const __half* norms,
                                            const __half* residual_norms, const float* rotation,
                                            const float* centroids, const float* sketch, T* y, float* V, float* Bs,
                                            uint32_t n, float scale) {
  static_assert(D == 64 || D == 128, "tensor-core decode: D = 64 or 128");
  constexpr int KS = D / 16;       // k-steps (sketch rows) of an mma
  constexpr int NTW = D / 64;      // n-tiles (8 columns) per warp: 8 warps cover D
  constexpr int SIGN_WORDS = D / 32;
  constexpr int CODE_BYTES = D * MSE_BITS / 8;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int g = (tid % 32) / 4;
  const int q = tid % 4;

  // B(k, c) = S[k][c]: this lane's column is 8 (NTW warp + nt) + g.
  uint32_t bh[NTW][KS][2];
  uint32_t bl[NTW][KS][2];
  float unscale[NTW][2];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) {
    const int col = 8 * (NTW * warp + nt) + g;
    const int shift = vq_split_b<KS>([&](int k) { return sketch[k * D + col]; }, bh[nt], bl[nt]);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      unscale[nt][e] = vq_pow2(-__shfl_sync(0xffffffffu, shift, 4 * (2 * q + e)));
    }
  }

  const bool wide_signs = vq_aligned(signs, 4);
  const uint32_t tiles = (n + TQ_TV - 1) / TQ_TV;
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint64_t v0 = uint64_t(tile) * TQ_TV;
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
    tq_unrotate_tile<D, ROTATE, HADAMARD>(out, V, rotation, Bs);
    tq_store_tile<D>(out, y, norms, v0, n);
    __syncthreads();  // V and Bs are free for the next tile
  }
}
