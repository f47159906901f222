// qjl_score: q T [Q, D], sketch float [m, D], signs uint8 [N, nbytes], norms
// half [N] -> scores float [Q, N] = (sqrt(pi/2)/m * norm) * sum_r +-(S q)_r,
// the sign from bit r of the key, summed over r in order. params = {N, D, m,
// nbytes, Q}; template T. Each block first computes S q (Q * m <= 4096
// floats) into shared memory, a thread per sketch row and 8 queries at a
// time; its threads then stride over the keys. The host caps the grid at
// about one resident wave (shared memory allows 8 blocks of 256 per SM), so
// that few blocks compute S q: it costs a block about one key per thread. A key's signs are read at once into
// registers and each bit serves all Q queries (up to 8 running sums in
// registers); a sign flips a term by its sign bit.
__shared__ __align__(16) float sq[4096];
// Slices of QS_J sketch columns for a block's worth of rows (at most 256),
// and the queries' matching columns, so that global reads are coalesced and
// the sums read only shared memory; each thread then owns a row and runs its
// sums over the columns in order.
constexpr uint32_t QS_J = 8;
__shared__ float st[QS_J][257];
__shared__ float qt[8][QS_J];
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t m = params[2];
const uint32_t nbytes = params[3];
const uint32_t nq = params[4];
const uint32_t tid = threadIdx.x;
for (uint32_t r0 = 0; r0 < m; r0 += blockDim.x) {
  const uint32_t r = r0 + tid;
  for (uint32_t q0 = 0; q0 < nq; q0 += 8) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] = 0.0f;
    }
    for (uint32_t j0 = 0; j0 < d; j0 += QS_J) {
      __syncthreads();
      for (uint32_t e = tid; e < blockDim.x * QS_J; e += blockDim.x) {
        const uint32_t row = r0 + e / QS_J;
        const uint32_t j = j0 + e % QS_J;
        st[e % QS_J][e / QS_J] = (row < m && j < d) ? sketch[uint64_t(row) * d + j] : 0.0f;
      }
      for (uint32_t e = tid; e < 8 * QS_J; e += blockDim.x) {
        const uint32_t i = q0 + e / QS_J;
        const uint32_t j = j0 + e % QS_J;
        qt[e / QS_J][e % QS_J] = (i < nq && j < d) ? static_cast<float>(q[uint64_t(i) * d + j]) : 0.0f;
      }
      __syncthreads();
      const uint32_t jn = min(QS_J, d - j0);
      for (uint32_t jj = 0; jj < jn; ++jj) {
        const float sv = st[jj][tid];
#pragma unroll
        for (uint32_t i = 0; i < 8; ++i) {
          if (q0 + i < nq) {
            acc[i] = __fadd_rn(acc[i], __fmul_rn(sv, qt[i][jj]));
          }
        }
      }
    }
    if (r < m) {
#pragma unroll
      for (uint32_t i = 0; i < 8; ++i) {
        if (q0 + i < nq) {
          sq[(q0 + i) * m + r] = acc[i];
        }
      }
    }
  }
}
__syncthreads();
const float base = __fdiv_rn(__fsqrt_rn(1.57079632679489662f), float(m));
// Fast path: up to 8 queries and 512 sketch rows (m a multiple of 4, so a
// float4 run of S q never straddles m); a key's signs come in as 32-bit
// words, 16 bytes at a time where aligned.
constexpr uint32_t QS_WORDS = 16;
const bool words = nq <= 8 && nbytes % 4 == 0 && nbytes <= 4 * QS_WORDS && m % 4 == 0 && vq_aligned(signs, 4);
const bool wide = words && nbytes % 16 == 0 && vq_aligned(signs, 16);
const uint32_t stride = gridDim.x * blockDim.x;
const uint32_t sq_base = static_cast<uint32_t>(__cvta_generic_to_shared(sq));
for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride) {
  const float scale = __fmul_rn(base, __half2float(norms[t]));
  const uint8_t* key = signs + uint64_t(t) * nbytes;
  if (words) {
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
            bits[w + h] = (w + h) * 4 < nbytes ? reinterpret_cast<const uint32_t*>(key)[w + h] : 0u;
          }
        }
      }
    }
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] = 0.0f;
    }
    if (nq <= 4) {
      qjl_signed_sums<4, QS_WORDS>(acc, bits, nbytes, m, sq_base);
    } else {
      qjl_signed_sums<8, QS_WORDS>(acc, bits, nbytes, m, sq_base);
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
      const float v = sq[i * m + r];
      acc = __fadd_rn(acc, (key[r / 8] >> (r % 8)) & 1u ? v : -v);
    }
    scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc);
  }
}
