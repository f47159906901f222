// pq_decode: packed uint8 [N, nbytes], packed_hi uint8 [N, nbytes_hi] (a
// 1-element placeholder when C_BITS has one plane), codebook float [K, S] ->
// y T [N, D], sub-vector p of a row = codebook[code p], the code rebuilt from
// pq_encode's planes. params = {N, D, K, nbytes, nbytes_hi}; template T, S,
// C_BITS (1..12), ITEMS (1, 2 or a multiple of 4). A work item is a (row, sub-vector); each thread
// takes ITEMS of them, blockDim apart (adjacent lanes, adjacent sub-vectors:
// each request coalesced), and makes its requests in three rounds, every
// code, then every entry, then every store, so that a thread waits on two
// latencies rather than two per item. A code past the codebook (corrupt
// input) reads entry 0.
//
// Where the codebook in T fits in PQ_TABLE_BYTES, the block first copies it
// to shared memory, converted to T (the rounding the store would do), and
// reads each entry from there with one load: a warp's scattered entries cost
// a few shared-memory wavefronts where the L1 cache serves one line each.
// Larger codebooks (K = 1024 of 4 float16 is 8 KB: its copy would cost each
// block more reads than its codes) are read through the L1 cache, one load
// per entry where the pointers allow it.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
constexpr uint32_t PQ_TABLE_BYTES = 4096;
__shared__ __align__(16) uint8_t table_bytes[PQ_TABLE_BYTES];
T* table = reinterpret_cast<T*>(table_bytes);
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
const uint32_t nbytes_hi = params[4];
const uint32_t per = d / S;
const uint64_t total = uint64_t(n) * per;
const uint64_t first = uint64_t(blockIdx.x) * ITEMS * blockDim.x + threadIdx.x;
const bool staged = uint64_t(kk) * S * sizeof(T) <= PQ_TABLE_BYTES;
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
if (staged) {
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
    const uint32_t code = c[k0 + k] < kk ? c[k0 + k] : 0u;
    if (staged) {
      vq_copy_n<S>(table + code * S, e[k]);
    } else {
      const float* entry = codebook + code * S;
      float f[S];
      if (vq_aligned(codebook, 4 * S)) {
        if constexpr (S == 2) {
          const float2 a = __ldg(reinterpret_cast<const float2*>(entry));
          f[0] = a.x;
          f[1] = a.y;
        } else {
#pragma unroll
          for (int h = 0; h < S; h += 4) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(entry + h));
            f[h] = a.x;
            f[h + 1] = a.y;
            f[h + 2] = a.z;
            f[h + 3] = a.w;
          }
        }
      } else {
#pragma unroll
        for (int h = 0; h < S; ++h) {
          f[h] = entry[h];
        }
      }
#pragma unroll
      for (int h = 0; h < S; ++h) {
        e[k][h] = static_cast<T>(f[h]);
      }
    }
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
