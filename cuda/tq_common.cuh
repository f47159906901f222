// Shared by the TurboQuant CUDA kernels (placed before the kernel, in the
// global namespace, after MLX's device utilities, which bring the half and
// bfloat16 types).

// ---------------------------------------------------------------------------
// Block tiles of the TurboQuant codecs: a block of 256 threads owns TQ_TV
// vectors of size D. Their working values live transposed in shared memory,
// V[j * TQ_VS + v] (coordinate j of vector v; V 16-byte aligned). Warp w
// (ty) owns vectors 4w..4w+3, lane tx the columns c * 128 + 4 tx + b
// (c < TQ_CHUNKS(D), b < 4), so the 16 products of a slice step are one
// broadcast 16-byte read of V and one 16-byte read of the staged matrix
// slice. The stride, a multiple of 4 for those reads, is 4 banks past 32:
// a lane's 16-byte column accesses are 4-way conflicts, not 16-way.
constexpr int TQ_TV = 32;
constexpr int TQ_VS = TQ_TV + 4;
constexpr int TQ_KC = 8;
#define TQ_CHUNKS(D) (((D) + 127) / 128)
#define TQ_CP(D) (TQ_CHUNKS(D) * 128 + 4)

// The column of acc[a][k] in this lane's share of the tile (above).
__device__ __forceinline__ int tq_lane_col(int k) {
  return (k / 4) * 128 + (threadIdx.x % 32) * 4 + k % 4;
}

// Floats of the matrix slices tq_ordered_gemm stages: two slices where they
// fit beside V in the 48 KB of static shared memory (D <= 128), else one.
#define TQ_BUFS(D) (TQ_CHUNKS(D) == 1 ? 2 : 1)
#define TQ_BS(D) (TQ_BUFS(D) * TQ_KC * TQ_CP(D))

// acc[a][4c + b] += sum over j of V[j][4ty + a] * M(col, j), col = 128c + 4tx
// + b, j = 0, 1, ..., D - 1 in order, each product and sum rounded to nearest
// (crate::cpu's OrderedDots order), or with FUSED each term one fma (half the
// instructions; not bit for bit the CPU's). M(i, j) = m[i * D + j], or
// m[j * D + i] when TRANSPOSED. Bs ([TQ_BS(D)], 16-byte aligned) stages TQ_KC rows of M at
// a time; each thread requests its share of the next slice before it works
// on the current one, so the slice's latency hides behind the products. Ends
// with a barrier: V and Bs may be rewritten after.
template <int D, bool TRANSPOSED, bool FUSED = false>
__device__ __forceinline__ void tq_ordered_gemm(float (&acc)[4][TQ_CHUNKS(D) * 4], const float* V,
                                                const float* m, float* Bs) {
  constexpr int CH = TQ_CHUNKS(D);
  constexpr int CP = TQ_CP(D);
  constexpr int SLICE = TQ_KC * CP;
  // Columns 128 CH.. of a slice row only pad its stride and are never read:
  // a slice stages TQ_KC * 128 CH values, 4 CH per thread.
  constexpr int COLS = CH * 128;
  constexpr int PER = TQ_KC * COLS / 256;
  constexpr bool DOUBLE = TQ_BUFS(D) == 2;
  const int tid = threadIdx.x;
  const int ty = tid / 32;
  const int tx = tid % 32;
  // Staged element e of a slice: row j of the slice, column col.
  auto place = [&](int e, int& j, int& col) {
    if (TRANSPOSED) {
      j = e / COLS;
      col = e % COLS;
    } else {
      col = e / TQ_KC;
      j = e % TQ_KC;
    }
  };
  float next[PER];
  auto fetch = [&](int j0) {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      int j;
      int col;
      place(tid + p * 256, j, col);
      next[p] = col < D ? (TRANSPOSED ? m[(j0 + j) * D + col] : m[col * D + j0 + j]) : 0.0f;
    }
  };
  auto put = [&](float* buf) {
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      int j;
      int col;
      place(tid + p * 256, j, col);
      buf[j * CP + col] = next[p];
    }
  };
  fetch(0);
  put(Bs);
  __syncthreads();
  int cur = 0;
  // D is a multiple of 8 = TQ_KC: slices are whole.
  for (int j0 = 0; j0 < D; j0 += TQ_KC) {
    const bool more = j0 + TQ_KC < D;
    if (more) {
      fetch(j0 + TQ_KC);
    }
    const float* B = Bs + cur * SLICE;
#pragma unroll
    for (int j = 0; j < TQ_KC; ++j) {
      const float4 vv = *reinterpret_cast<const float4*>(&V[(j0 + j) * TQ_VS + ty * 4]);
      const float av[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const float4 bv = *reinterpret_cast<const float4*>(&B[j * CP + c * 128 + tx * 4]);
        const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int a = 0; a < 4; ++a) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            acc[a][c * 4 + b] = FUSED ? __fmaf_rn(br[b], av[a], acc[a][c * 4 + b])
                                      : __fadd_rn(acc[a][c * 4 + b], __fmul_rn(br[b], av[a]));
          }
        }
      }
    }
    if (more) {
      // One buffer: every thread must be done reading it first. Two: the
      // other one was last read before the previous barrier.
      if (!DOUBLE) {
        __syncthreads();
      }
      cur = DOUBLE ? 1 - cur : 0;
      put(Bs + cur * SLICE);
    }
    __syncthreads();
  }
}

// V ← H V for each of the tile's vectors (columns; D a power of two): the
// unnormalized Walsh–Hadamard butterflies in place, a stage per barrier with
// each pair owned by one thread (read, then written): cpu::turboquant::fwht's
// order, bit for bit the CPU's. Ends with a barrier.
template <int D>
__device__ __forceinline__ void tq_butterflies(float* V) {
#pragma unroll
  for (int h = 1; h < D; h *= 2) {
    for (int e = threadIdx.x; e < TQ_TV * D / 2; e += 256) {
      const int v = e % TQ_TV;
      const int p = e / TQ_TV;
      const int lo = (p / h) * 2 * h + p % h;
      const float a = V[lo * TQ_VS + v];
      const float b = V[(lo + h) * TQ_VS + v];
      V[lo * TQ_VS + v] = __fadd_rn(a, b);
      V[(lo + h) * TQ_VS + v] = __fsub_rn(a, b);
    }
    __syncthreads();
  }
}

// f(k, col, at) for each of this lane's columns in the tile
// (tq_ordered_gemm's layout): acc[a][k], a < 4, holds column col (which may
// pass D) of the warp's vector 4 ty + a, whose place in V is at + a (at is
// 16-byte aligned).
template <int D, typename F>
__device__ __forceinline__ void tq_each_lane_col(F f) {
  const int ty = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < TQ_CHUNKS(D) * 4; ++k) {
    const int col = tq_lane_col(k);
    f(k, col, col * TQ_VS + ty * 4);
  }
}

// acc ← this lane's columns of the tile in V (tq_ordered_gemm's layout):
// MODE 0 zeros, 1 the values, 2 the values times scale, 3 the values times
// scale times m[col].
template <int D, int MODE>
__device__ __forceinline__ void tq_load_tile(float (&acc)[4][TQ_CHUNKS(D) * 4], const float* V, float scale,
                                             const float* m) {
  tq_each_lane_col<D>([&](int k, int col, int at) {
    float4 u4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (MODE != 0 && col < D) {
      u4 = *reinterpret_cast<const float4*>(&V[at]);
    }
    const float u[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      if constexpr (MODE == 3) {
        acc[a][k] = col < D ? __fmul_rn(__fmul_rn(u[a], scale), m[col]) : 0.0f;
      } else {
        acc[a][k] = MODE == 2 ? __fmul_rn(u[a], scale) : u[a];
      }
    }
  });
}

// The inverse of tq_load_tile<D, 1>: this lane's columns of acc into the
// tile in V, and acc zeroed for the next product. V must be free (a barrier
// after its last reads); the caller's barrier follows.
template <int D>
__device__ __forceinline__ void tq_spill_tile(float (&acc)[4][TQ_CHUNKS(D) * 4], float* V) {
  tq_each_lane_col<D>([&](int k, int col, int at) {
    if (col < D) {
      *reinterpret_cast<float4*>(&V[at]) = make_float4(acc[0][k], acc[1][k], acc[2][k], acc[3][k]);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      acc[a][k] = 0.0f;
    }
  });
}

// acc ← the tile's y = Π u for the vectors' u in V (this lane's columns, as
// tq_ordered_gemm lays them out). Π: none (y = u) unless ROTATE; the dense
// row-major m [D, D] by tq_ordered_gemm; or, with HADAMARD, H (s ⊙ u) / √D
// from the ±1 signs m [D] (D a power of two), by butterflies on V in place,
// as Rotation::forward. V must not be rewritten before the next barrier.
// FUSED: the dense product by fma (tq_ordered_gemm).
template <int D, bool ROTATE, bool HADAMARD, bool FUSED = false>
__device__ __forceinline__ void tq_rotate_tile(float (&acc)[4][TQ_CHUNKS(D) * 4], float* V, const float* m,
                                               float* Bs) {
  const int tid = threadIdx.x;
  float scale = 1.0f;
  if constexpr (ROTATE && HADAMARD) {
    for (int e = tid; e < TQ_TV * D; e += 256) {
      const int v = e % TQ_TV;
      const int j = e / TQ_TV;
      V[j * TQ_VS + v] = __fmul_rn(V[j * TQ_VS + v], m[j]);
    }
    __syncthreads();
    tq_butterflies<D>(V);
    scale = __fdiv_rn(1.0f, __fsqrt_rn(float(D)));
  }
  tq_load_tile<D, !ROTATE ? 1 : (HADAMARD ? 2 : 0)>(acc, V, scale, m);
  if constexpr (ROTATE && !HADAMARD) {
    tq_ordered_gemm<D, false, FUSED>(acc, V, m, Bs);
  }
}

// acc ← the tile's Πᵀ y for the vectors' y in V (layout as above): y unless
// ROTATE; the dense m [D, D] transposed by tq_ordered_gemm; or, with
// HADAMARD, s ⊙ (H y / √D) from the signs m [D], by butterflies on V in
// place, as Rotation::inverse (scale, then sign). V must not be rewritten
// before the next barrier.
template <int D, bool ROTATE, bool HADAMARD>
__device__ __forceinline__ void tq_unrotate_tile(float (&acc)[4][TQ_CHUNKS(D) * 4], float* V, const float* m,
                                                 float* Bs) {
  float scale = 1.0f;
  if constexpr (ROTATE && HADAMARD) {
    tq_butterflies<D>(V);
    scale = __fdiv_rn(1.0f, __fsqrt_rn(float(D)));
  }
  tq_load_tile<D, !ROTATE ? 1 : (HADAMARD ? 3 : 0)>(acc, V, scale, m);
  if constexpr (ROTATE && !HADAMARD) {
    tq_ordered_gemm<D, true>(acc, V, m, Bs);
  }
}

// Copies rows v0.. of x [n, D] into V as float (rows past n read as 0).
template <int D, typename T>
__device__ __forceinline__ void tq_stage_rows(float* V, const T* x, uint64_t v0, uint32_t n) {
  for (int e = threadIdx.x; e < TQ_TV * D; e += 256) {
    const int v = e / D;
    const int j = e % D;
    V[j * TQ_VS + v] = v0 + v < n ? static_cast<float>(x[(v0 + v) * D + j]) : 0.0f;
  }
}

// u = x/‖x‖ in place for the tile's vectors (0 for a zero vector), the
// norms of V's columns in s_norm; ends with a barrier.
template <int D>
__device__ __forceinline__ void tq_normalize_tile(float* V, const float* s_norm) {
  for (int e = threadIdx.x; e < TQ_TV * D; e += 256) {
    const int v = e % TQ_TV;
    const int j = e / TQ_TV;
    const float s = s_norm[v];
    V[j * TQ_VS + v] = s > 0.0f ? __fdiv_rn(V[j * TQ_VS + v], s) : 0.0f;
  }
  __syncthreads();
}

// ‖column v of V‖ over its D coordinates as crate::quant computes a norm:
// float64 squares summed in order, the root rounded to float32. A float's
// square is exact in float64, so one fma per term rounds as the square
// then the sum do, at half the dependent chain.
template <int D>
__device__ __forceinline__ float tq_norm_col(const float* V, int v) {
  double s2 = 0.0;
  for (int j = 0; j < D; ++j) {
    const double f = static_cast<double>(V[j * TQ_VS + v]);
    s2 = __fma_rn(f, f, s2);
  }
  return __double2float_rn(__dsqrt_rn(s2));
}

// Packs this lane's 4 codes of `bits` bits per vector with its neighbour's
// (lane tx + 1 holds the next 4 columns) and lets even lanes store the 8
// codes' `bits` bytes: row v of `out` ([n, D * bits / 8]).
template <int D, int BITS>
__device__ __forceinline__ void tq_pack_store(const unsigned (&code)[4][TQ_CHUNKS(D) * 4], uint8_t* out,
                                              uint64_t v0, uint32_t n) {
  const int ty = threadIdx.x / 32;
  const int tx = threadIdx.x % 32;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int c = 0; c < TQ_CHUNKS(D); ++c) {
      unsigned w = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        w |= code[a][c * 4 + b] << (b * BITS);
      }
      const unsigned high = __shfl_down_sync(0xffffffffu, w, 1);
      const int col = c * 128 + tx * 4;
      const uint64_t v = v0 + ty * 4 + a;
      if (tx % 2 == 0 && col < D && v < n) {
        const unsigned long long word = static_cast<unsigned long long>(w) |
                                        (static_cast<unsigned long long>(high) << (4 * BITS));
        vq_store_bytes<BITS>(out + v * (D * BITS / 8) + (col / 8) * BITS, word);
      }
    }
  }
}

// y[v, col] = T(acc · ‖x_v‖) for the tile's vectors and this lane's columns,
// four consecutive elements per store.
template <int D, typename T>
__device__ __forceinline__ void tq_store_tile(const float (&acc)[4][TQ_CHUNKS(D) * 4], T* y, const __half* norms,
                                              uint64_t v0, uint32_t n) {
  const int ty = threadIdx.x / 32;
  const int tx = threadIdx.x % 32;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const uint64_t v = v0 + ty * 4 + a;
    if (v >= n) {
      continue;
    }
    const float nv = __half2float(norms[v]);
#pragma unroll
    for (int c = 0; c < TQ_CHUNKS(D); ++c) {
      const int col = c * 128 + tx * 4;
      if (col < D) {
        float o[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          o[b] = __fmul_rn(acc[a][c * 4 + b], nv);
        }
        vq_store_n<4>(y + v * D + col, o);
      }
    }
  }
}

// The exact encoders' codebook tables, by the block's 256 threads (a
// barrier must follow): for k < count, cent[k] = centroids[k] (CENT) and,
// below the last, mids[k] = the midpoint of centroids k and k + 1 rounded
// as crate::cpu's scalar_boundaries (a code counts the midpoints below y).
template <bool CENT>
__device__ __forceinline__ void tq_stage_codebook(float* cent, float* mids, const float* centroids, int count) {
  for (int k = threadIdx.x; k < count; k += 256) {
    if constexpr (CENT) {
      cent[k] = centroids[k];
    }
    if (k + 1 < count) {
      mids[k] = __fmul_rn(0.5f, __fadd_rn(centroids[k], centroids[k + 1]));
    }
  }
}

// The exact encoders' first steps for the tile at v0: its rows staged in
// V, each vector's norm (NORM64: tq_norm_col's float64 sum; else float32
// squares summed in order, as crate::cpu::turboquant::tq_encode) into
// s_norm and, as float16 (at most 65504), into norms; then u = x/‖x‖ in V
// (tq_normalize_tile, which ends with a barrier).
template <int D, bool NORM64, typename T>
__device__ __forceinline__ void tq_stage_unit_rows(float* V, float* s_norm, const T* x, __half* norms, uint64_t v0,
                                                   uint32_t n) {
  const int tid = threadIdx.x;
  tq_stage_rows<D>(V, x, v0, n);
  __syncthreads();
  if (tid < TQ_TV) {
    float s;
    if constexpr (NORM64) {
      s = tq_norm_col<D>(V, tid);
    } else {
      float s2 = 0.0f;
      for (int j = 0; j < D; ++j) {
        const float f = V[j * TQ_VS + tid];
        s2 = __fadd_rn(s2, __fmul_rn(f, f));
      }
      s = __fsqrt_rn(s2);
    }
    s_norm[tid] = s;
    if (v0 + tid < n) {
      norms[v0 + tid] = __float2half_rn(fminf(s, 65504.0f));
    }
  }
  __syncthreads();
  tq_normalize_tile<D>(V, s_norm);
}

// dst[i] = src[i] for i < count, by the block's threads (a barrier must
// follow before other threads read dst).
__device__ __forceinline__ void tq_stage_table(float* dst, const float* src, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    dst[i] = src[i];
  }
}

// ---------------------------------------------------------------------------
// Warp rows: a warp holds a vector of D = 32 E coordinates, lane l the E
// consecutive coordinates E l .. E l + E - 1, so that a row's codes are one
// coalesced read (a word per lane) and its values one store per lane.

// The E * BITS code bits of this lane's coordinates (its first code in the
// low bits), from `word`: word `lane` of the code row, as lane `lane` read
// it (lanes past the row's words hold anything). Every lane must call.
template <int E, int BITS>
__device__ __forceinline__ unsigned tq_lane_code_bits(unsigned word, int lane) {
  static_assert(E * BITS <= 32, "a lane's codes fit one word");
  const unsigned bit = unsigned(E * BITS * lane);
  const unsigned w0 = __shfl_sync(0xffffffffu, word, int(bit / 32));
  if constexpr (32 % (E * BITS) == 0) {
    return w0 >> (bit % 32);  // never across a word boundary
  } else {
    const unsigned w1 = __shfl_sync(0xffffffffu, word, int(bit / 32 + 1) % 32);
    return __funnelshift_r(w0, w1, bit % 32);
  }
}

// u <- H u (unnormalised) for a vector held by LANES consecutive lanes, E
// coordinates each, as cpu::turboquant::fwht: for h = 1, 2, 4, ... each
// pair (j, j + h) becomes (u_j + u_{j+h}, u_j - u_{j+h}); the first log2 E
// stages within the lane, the log2 LANES others across lanes by shuffles
// (every lane of the warp must call).
template <int E, int LANES = 32>
__device__ __forceinline__ void tq_warp_fwht(float (&u)[E], int lane) {
  static_assert((E & (E - 1)) == 0 && (LANES & (LANES - 1)) == 0 && LANES <= 32, "powers of two");
#pragma unroll
  for (int h = 1; h < E; h *= 2) {
#pragma unroll
    for (int b = 0; b < E; ++b) {
      if ((b & h) == 0) {
        const float x0 = u[b];
        const float x1 = u[b + h];
        u[b] = __fadd_rn(x0, x1);
        u[b + h] = __fsub_rn(x0, x1);
      }
    }
  }
#pragma unroll
  for (int hl = 1; hl < LANES; hl *= 2) {
    // The pair's lower coordinate gets lower + upper, the upper one
    // lower - upper: o ± u, with ±u exact, so one rounding as fwht's.
    const float pm = (lane & hl) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int b = 0; b < E; ++b) {
      const float o = __shfl_xor_sync(0xffffffffu, u[b], hl);
      u[b] = __fmaf_rn(u[b], pm, o);
    }
  }
}

// The end of a warp-rows decode, this lane's E values of the vector (held
// by LANES lanes): o = ‖x‖ s ⊙ (H u) / √D with ROTATE (s the lane's signs,
// rscale = 1/√D), else ‖x‖ u, in the tiles' float32 operations and order.
// Every lane must call (the butterflies shuffle).
template <int E, bool ROTATE, int LANES = 32>
__device__ __forceinline__ void tq_warp_finish(float (&u)[E], const float (&sgn)[E], float rscale, float norm,
                                               float (&o)[E], int lane) {
  if constexpr (ROTATE) {
    tq_warp_fwht<E, LANES>(u, lane);
  }
#pragma unroll
  for (int b = 0; b < E; ++b) {
    const float r = ROTATE ? __fmul_rn(__fmul_rn(u[b], rscale), sgn[b]) : u[b];
    o[b] = __fmul_rn(r, norm);
  }
}

// RVQ decode in lane rows, without a rotation or with Hadamard signs (D a
// multiple of 32 up to 128): y = ‖x‖ s ⊙ (H u) / √D, u = c1[a] + c2[b], the
// exact tiles' float32 operations in their order (so bit for bit the same),
// without their shared-memory round trips and barriers. A lane holds 32
// consecutive coordinates of a vector and L = D / 32 consecutive lanes a
// vector, so the butterflies' first five stages stay in the lane and only
// log2 L cross lanes (a warp holding one vector, as tq_prod_decode's rows
// do, spends five stages of shuffles on it: the bound of that layout). A
// lane reads its B words of each code row directly. Blocks of 256 threads
// walk passes of 8 (32 / L) vectors, grid-stride; a pass's code words and
// norms are requested a pass ahead.
template <int D, int B1_BITS, int B2_BITS, bool ROTATE, typename T>
__device__ void tq_rvq_decode_rows(const uint8_t* codes1, const uint8_t* codes2, const __half* norms,
                                   const float* signs, const float* centroids1, const float* centroids2, T* y,
                                   uint32_t n) {
  constexpr int L = D / 32;
  constexpr int VW = 32 / L;  // vectors a warp holds; at L = 3 lanes 30 and 31 idle
  constexpr int VB = 8 * VW;  // vectors a block pass decodes
  constexpr int N1 = 1 << B1_BITS;
  constexpr int N2 = 1 << B2_BITS;
  static_assert(D % 32 == 0 && D <= 128, "lane rows: D a multiple of 32 up to 128");
  static_assert(!ROTATE || (L & (L - 1)) == 0, "butterflies across a power of two of lanes");
  __shared__ float C1[N1];
  __shared__ float C2[N2];
  tq_stage_table(C1, centroids1, N1);
  tq_stage_table(C2, centroids2, N2);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int part = lane % L;  // coordinates 32 part .. 32 part + 31
  const int slot = lane / L;  // the warp's vector
  float sgn[32];
#pragma unroll
  for (int b = 0; b < 32; ++b) {
    sgn[b] = ROTATE ? signs[32 * part + b] : 1.0f;
  }
  const float rscale = ROTATE ? __fdiv_rn(1.0f, __fsqrt_rn(float(D))) : 1.0f;
  // A code row is 4 B L bytes, a lane's part B words of it.
  const bool wide = vq_aligned(codes1, 4) && vq_aligned(codes2, 4);
  unsigned word1[B1_BITS];
  unsigned word2[B2_BITS];
  float norm;
  // Rows past n (and idle lanes) read row n - 1 and are not stored.
  auto request = [&](uint32_t pass) {
    const uint64_t v = min(uint64_t(pass) * VB + VW * warp + min(slot, VW - 1), uint64_t(n) - 1);
    const uint8_t* r1 = codes1 + (v * L + part) * (4 * B1_BITS);
    const uint8_t* r2 = codes2 + (v * L + part) * (4 * B2_BITS);
#pragma unroll
    for (int k = 0; k < B1_BITS; ++k) word1[k] = unsigned(vq_read_bytes<4>(r1 + 4 * k, wide));
#pragma unroll
    for (int k = 0; k < B2_BITS; ++k) word2[k] = unsigned(vq_read_bytes<4>(r2 + 4 * k, wide));
    norm = __half2float(norms[v]);
  };
  const uint32_t passes = (n + VB - 1) / VB;
  if (blockIdx.x < passes) {
    request(blockIdx.x);
  }
  __syncthreads();  // C1 and C2 are written
  for (uint32_t pass = blockIdx.x; pass < passes; pass += gridDim.x) {
    float u[32];
#pragma unroll
    for (int b = 0; b < 32; ++b) {
      u[b] = __fadd_rn(C1[tq_word_code<B1_BITS>(word1, b)], C2[tq_word_code<B2_BITS>(word2, b)]);
    }
    const float nrm = norm;
    if (pass + gridDim.x < passes) {
      request(pass + gridDim.x);
    }
    float o[32];
    tq_warp_finish<32, ROTATE, ROTATE ? L : 1>(u, sgn, rscale, nrm, o, lane);
    const uint64_t v = uint64_t(pass) * VB + VW * warp + slot;
    if (slot < VW && v < n) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        vq_store_n<8>(y + v * D + 32 * part + 8 * k, o + 8 * k);
      }
    }
  }
}
