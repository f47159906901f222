// pq_decode: packed uint8 [N, nbytes], packed_hi uint8 [N, nbytes_hi] (not
// read when C_BITS has one plane: the host passes `packed` again), codebook
// float [K, S] -> y T [N, D], sub-vector p of a row = codebook[code p],
// the code rebuilt from pq_encode's planes. sizes = {N, D, K, nbytes,
// nbytes_hi}; template T, S, C_BITS (1..12), TABLE_BYTES, ITEMS, QUADS (the
// host picks the layout by the codebook's size in T). A code past the
// codebook (corrupt input) reads entry 0.
//
// TABLE_BYTES > 0: each block copies the codebook to shared memory,
// converted to T (the rounding the store would do), and reads each entry
// from there: a warp's scattered entries cost a few shared-memory
// wavefronts where the L1 cache serves one line each. TABLE_BYTES = 0: the
// entries are read through the L1 cache, one load per entry where the
// pointers allow it.
//
// QUADS = 0, items: a work item is a (row, sub-vector); each thread takes
// ITEMS of them, blockDim apart (adjacent lanes, adjacent sub-vectors: each
// request coalesced), and makes its requests in three rounds, every code,
// then every entry, then every store, so that a thread waits on two
// latencies rather than two per item. The grid covers every item; a block
// requests its codes before it copies a (small) codebook.
//
// QUADS > 0, quads (a codebook too large to copy once per block of items):
// a work item is 4 consecutive sub-vectors of y, whose codes, where rows
// hold whole quads and each plane's bits are even, are whole bytes of each
// plane (one load per plane). Each thread takes QUADS quads per round,
// blockDim apart; the host caps the grid and each block strides over the
// rounds, so that the copy is paid once per block.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
constexpr int HI_W = HI_BITS > 0 ? HI_BITS : 1;
__shared__ __align__(16) uint8_t table_bytes[TABLE_BYTES > 0 ? TABLE_BYTES : 16];
T* table = reinterpret_cast<T*>(table_bytes);
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t kk = vq_size(params_shape, 2);
const uint32_t nbytes = vq_size(params_shape, 3);
const uint32_t nbytes_hi = vq_size(params_shape, 4);
const uint32_t per = d / S;
const uint64_t total = uint64_t(n) * per;
auto stage = [&]() {
  if ((kk * S) % 4 == 0 && vq_aligned(codebook, 16)) {
#pragma unroll 4
    for (uint32_t i = threadIdx.x; i < kk * S / 4; i += blockDim.x) {
      const float4 a = reinterpret_cast<const float4*>(codebook)[i];
      const float f[4] = {a.x, a.y, a.z, a.w};
      __align__(8) T h[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        h[j] = static_cast<T>(f[j]);
      }
      vq_copy_n<4>(h, table + 4 * i);
    }
  } else {
    for (uint32_t i = threadIdx.x; i < kk * S; i += blockDim.x) {
      table[i] = static_cast<T>(codebook[i]);
    }
  }
  __syncthreads();
};
// Entry `code` (checked against K) into e.
auto entry = [&](uint32_t code, T* e) {
  code = code < kk ? code : 0u;
  if (TABLE_BYTES > 0) {
    vq_copy_n<S>(table + code * S, e);
    return;
  }
  const float* src = codebook + code * S;
  float f[S];
  if (vq_aligned(codebook, 4 * S)) {
    if constexpr (S == 2) {
      const float2 a = __ldg(reinterpret_cast<const float2*>(src));
      f[0] = a.x;
      f[1] = a.y;
    } else {
#pragma unroll
      for (int h = 0; h < S; h += 4) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(src + h));
        f[h] = a.x;
        f[h + 1] = a.y;
        f[h + 2] = a.z;
        f[h + 3] = a.w;
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < S; ++h) {
      f[h] = src[h];
    }
  }
#pragma unroll
  for (int h = 0; h < S; ++h) {
    e[h] = static_cast<T>(f[h]);
  }
};
if constexpr (QUADS > 0) {
  static_assert(QUADS == 0 || TABLE_BYTES > 0, "quads read a staged codebook");
  constexpr int LO_NB = LO_BITS / 2;
  constexpr int HI_NB = HI_BITS / 2 > 0 ? HI_BITS / 2 : 1;
  constexpr bool EVEN_PLANES = LO_BITS % 2 == 0 && HI_BITS % 2 == 0;
  constexpr int QUAD = 4 * S;
  // Quads whose entries a batch holds: at most 64 bytes of registers.
  constexpr int QB_FIT = 64 / (QUAD * int(sizeof(T))) > 0 ? 64 / (QUAD * int(sizeof(T))) : 1;
  constexpr int QB = QB_FIT < QUADS ? QB_FIT : (QUADS > 0 ? QUADS : 1);
  // Fewer than 2^31 quads (the host checks).
  const uint32_t quads = uint32_t((total + 3) / 4);
  stage();
  const bool whole = EVEN_PLANES && per % 4 == 0;
  const uint32_t per_quads = per / 4;
  const bool lo_wide = vq_aligned(packed, vq_bytes_align<LO_NB>()) && nbytes % vq_bytes_align<LO_NB>() == 0;
  const bool hi_wide = vq_aligned(packed_hi, vq_bytes_align<HI_NB>()) && nbytes_hi % vq_bytes_align<HI_NB>() == 0;
  constexpr uint32_t QUAD_BYTES = QUAD * sizeof(T);
  const bool y_wide = vq_aligned(y, QUAD_BYTES % 16 == 0 ? 16u : QUAD_BYTES);
  // The 4 codes of quad q.
  auto quad_codes = [&](uint32_t q, uint32_t (&c)[4]) {
    if (whole) {
      const uint32_t row = vq_div(q, per_quads);
      const uint32_t j = q - row * per_quads;
      const uint32_t lo = uint32_t(vq_read_bytes<LO_NB>(packed + uint64_t(row) * nbytes + j * LO_NB, lo_wide));
      uint32_t hi = 0;
      if (HI_BITS > 0) {
        hi = uint32_t(vq_read_bytes<HI_NB>(packed_hi + uint64_t(row) * nbytes_hi + j * HI_NB, hi_wide));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        c[i] = (lo >> (i * LO_BITS)) & ((1u << LO_BITS) - 1u);
        if (HI_BITS > 0) {
          c[i] |= ((hi >> (i * HI_W)) & ((1u << HI_W) - 1u)) << LO_BITS;
        }
      }
      return;
    }
    const uint64_t first = uint64_t(q) * 4;
    uint32_t row = uint32_t(first / per);
    uint32_t p = uint32_t(first - uint64_t(row) * per);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c[i] = 0;
      if (first + i < total) {
        c[i] = vq_code_at(packed + uint64_t(row) * nbytes, p, LO_BITS);
        if (HI_BITS > 0) {
          c[i] |= vq_code_at(packed_hi + uint64_t(row) * nbytes_hi, p, HI_W) << LO_BITS;
        }
      }
      if (++p == per) {
        p = 0;
        ++row;
      }
    }
  };
  const uint32_t round = QUADS * blockDim.x;
  for (uint32_t q0 = blockIdx.x * round + threadIdx.x; q0 < quads; q0 += gridDim.x * round) {
    uint32_t c[QUADS > 0 ? QUADS : 1][4];
#pragma unroll
    for (int k = 0; k < QUADS; ++k) {
      const uint32_t q = q0 + k * blockDim.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        c[k][i] = 0;
      }
      if (q < quads) {
        quad_codes(q, c[k]);
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < QUADS; k0 += QB) {
      __align__(16) T e[QB][QUAD];
#pragma unroll
      for (int k = 0; k < QB; ++k) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          entry(c[k0 + k][i], &e[k][i * S]);
        }
      }
#pragma unroll
      for (int k = 0; k < QB; ++k) {
        const uint32_t q = q0 + (k0 + k) * blockDim.x;
        if (q >= quads) {
          continue;
        }
        T* dst = y + uint64_t(q) * QUAD;
        if (y_wide && uint64_t(q) * 4 + 4 <= total) {
          vq_copy_n<QUAD>(e[k], dst);
        } else {
#pragma unroll
          for (int h = 0; h < QUAD; ++h) {
            if (uint64_t(q) * 4 + h / S < total) {
              dst[h] = e[k][h];
            }
          }
        }
      }
    }
  }
} else {
  const uint64_t first = uint64_t(blockIdx.x) * ITEMS * blockDim.x + threadIdx.x;
  // The first item's (row, sub-vector) by one division; the next ones step by
  // blockDim = step_rows * per + step_p.
  uint32_t row = first < total ? uint32_t(first / per) : 0u;
  uint32_t p = uint32_t(first - uint64_t(row) * per);
  const uint32_t step_rows = vq_div(blockDim.x, per);
  const uint32_t step_p = blockDim.x - step_rows * per;
  uint32_t c[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const uint64_t item = first + uint64_t(k) * blockDim.x;
    c[k] = 0;
    if (item < total) {
      c[k] = vq_code_at(packed + uint64_t(row) * nbytes, p, LO_BITS);
      if (HI_BITS > 0) {
        c[k] |= vq_code_at(packed_hi + uint64_t(row) * nbytes_hi, p, HI_BITS > 0 ? HI_BITS : 1) << LO_BITS;
      }
    }
    row += step_rows;
    p += step_p;
    if (p >= per) {
      p -= per;
      ++row;
    }
  }
  if (TABLE_BYTES > 0) {
    stage();
  }
  if (first >= total) {
    return;
  }
  // Entries and stores in batches of up to 4 items, so that the entries in
  // flight stay within registers for every S and T.
  constexpr int BATCH = ITEMS < 4 ? ITEMS : 4;
#pragma unroll
  for (int k0 = 0; k0 < ITEMS; k0 += BATCH) {
    __align__(16) T e[BATCH][S];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      entry(c[k0 + k], e[k]);
    }
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const uint64_t item = first + uint64_t(k0 + k) * blockDim.x;
      if (item < total) {
        T* dst = y + item * S;
        if (vq_aligned(dst, S * sizeof(T))) {
          vq_copy_n<S>(e[k], dst);
        } else {
#pragma unroll
          for (int h = 0; h < S; ++h) {
            dst[h] = e[k][h];
          }
        }
      }
    }
  }
}
