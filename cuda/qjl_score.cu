// qjl_score: S q float [Q, m] (qjl_sketch_query's output), signs uint8
// [N, nbytes], norms half [N] -> scores float [Q, N] = (sqrt(pi/2)/m *
// norm) * sum_r +-(S q_i)_r, the sign from bit r of the key. sizes = {N, m,
// nbytes, Q}. Each block copies S q (Q m <= 4096 floats); its threads then
// stride over the keys. The host caps the grid at about one resident wave,
// so that few blocks repeat the tables' set-up.
//
// Fast path (m a multiple of 4, Q <= 8 and 4 m NQ <= 4096 for NQ = 4 or 8
// query slots): the block turns S q into nibble tables. For sketch rows
// 4g..4g+3 and the queries 2p and 2p + 1, entry c of row (g, p) holds the two
// sums over h < 4 of +-(S q_i)_{4g+h}, + where bit h of c is set: a key costs
// one 8-byte shared read per 4 sign bits and 2 queries, and one add per
// query. A row's 16 entries span the 32 banks once, so the lanes' reads never
// conflict (16-byte entries of 4 queries put c and c + 8 in the same banks:
// the kernel took 40% longer with them). Otherwise a key's bits are
// walked one by one. The sums run in another order than crate::cpu's byte
// tables: scores agree to float32 rounding.
__shared__ __align__(16) float tab[4096];
__shared__ float sqs[1024];
const uint32_t n = vq_size(params_shape, 0);
const uint32_t m = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t nq = vq_size(params_shape, 3);
const uint32_t tid = threadIdx.x;
constexpr uint32_t QS_WORDS = 8;
const uint32_t slots = nq <= 4 ? 4u : 8u;
const bool tables = nq <= 8 && m % 4 == 0 && 4 * m * slots <= 4096 && nq * m <= 1024;
// S q goes to sqs ([Q][m]) for the tables, else straight to tab (Q m <= 4096).
float* own_sq = tables ? sqs : tab;
const float base = __fdiv_rn(__fsqrt_rn(1.57079632679489662f), float(m));
for (uint32_t e = tid; e < nq * m; e += blockDim.x) {
  own_sq[e] = sq[e];
}
__syncthreads();
if (tables) {
  // Entry e = ((g * slots / 2 + p) * 16 + c) * 2 + i % 2 for query i = 2 p +
  // i % 2; slots past nq hold 0.
  for (uint32_t e = tid; e < 4 * m * slots; e += blockDim.x) {
    const uint32_t i = 2 * ((e / 32) % (slots / 2)) + e % 2;
    const uint32_t c = (e / 2) % 16;
    const uint32_t g = e / (slots * 16);
    float v = 0.0f;
    if (i < nq) {
#pragma unroll
      for (uint32_t h = 0; h < 4; ++h) {
        const float s = sqs[i * m + 4 * g + h];
        v = __fadd_rn(v, (c >> h) & 1u ? s : -s);
      }
    }
    tab[e] = v;
  }
  __syncthreads();
}
const uint32_t stride = gridDim.x * blockDim.x;
const uint32_t tab_base = static_cast<uint32_t>(__cvta_generic_to_shared(tab));
const bool wide = tables && nbytes % 16 == 0 && vq_aligned(signs, 16);
const bool words = tables && nbytes % 4 == 0 && vq_aligned(signs, 4);
for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride) {
  const float scale = __fmul_rn(base, __half2float(norms[t]));
  const uint8_t* key = signs + uint64_t(t) * nbytes;
  if (tables) {
    uint32_t bits[QS_WORDS];
#pragma unroll
    for (uint32_t w = 0; w < QS_WORDS; w += 4) {
      if (w * 4 < nbytes) {
        if (wide) {
          const uint4 u = *reinterpret_cast<const uint4*>(key + w * 4);
          bits[w] = u.x;
          bits[w + 1] = u.y;
          bits[w + 2] = u.z;
          bits[w + 3] = u.w;
        } else {
#pragma unroll
          for (uint32_t h = 0; h < 4; ++h) {
            uint32_t word = 0;
            if ((w + h) * 4 < nbytes && words) {
              word = reinterpret_cast<const uint32_t*>(key)[w + h];
            } else {
              for (uint32_t y = 0; y < 4 && (w + h) * 4 + y < nbytes; ++y) {
                word |= uint32_t(key[(w + h) * 4 + y]) << (8 * y);
              }
            }
            bits[w + h] = word;
          }
        }
      }
    }
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] = 0.0f;
    }
    if (slots == 4) {
      qjl_table_sums<4, QS_WORDS>(acc, bits, m, tab_base);
    } else {
      qjl_table_sums<8, QS_WORDS>(acc, bits, m, tab_base);
    }
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      if (i < nq) {
        scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc[i]);
      }
    }
    continue;
  }
  for (uint32_t i = 0; i < nq; ++i) {
    float acc = 0.0f;
    for (uint32_t r = 0; r < m; ++r) {
      const float v = tab[i * m + r];
      acc = __fadd_rn(acc, (key[r / 8] >> (r % 8)) & 1u ? v : -v);
    }
    scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc);
  }
}
