// qjl_score: q T [Q, D], sketch float [m, D], signs uint8 [N, nbytes], norms
// half [N] -> scores float [Q, N] = (sqrt(pi/2)/m * norm) * sum_r +-(S q)_r,
// the sign from bit r of the key. params = {N, D, m, nbytes, Q}; template T.
// Each block first computes S q (Q * m <= 4096 floats) into shared memory,
// then one thread per key reads its signs once for all Q queries.
__shared__ float sq[4096];
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t m = params[2];
const uint32_t nbytes = params[3];
const uint32_t nq = params[4];
for (uint32_t i = threadIdx.x; i < nq * m; i += blockDim.x) {
  const uint64_t qb = uint64_t(i / m) * d;
  const uint64_t sb = uint64_t(i % m) * d;
  float acc = 0.0f;
  for (uint32_t j = 0; j < d; ++j) {
    acc = __fadd_rn(acc, __fmul_rn(sketch[sb + j], static_cast<float>(q[qb + j])));
  }
  sq[i] = acc;
}
__syncthreads();
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (t >= n) {
  return;
}
const float scale = __fmul_rn(__fdiv_rn(__fsqrt_rn(1.57079632679489662f), float(m)), __half2float(norms[t]));
const uint64_t sb = t * nbytes;
for (uint32_t i = 0; i < nq; ++i) {
  float acc = 0.0f;
  for (uint32_t r = 0; r < m; ++r) {
    const float v = sq[i * m + r];
    acc = __fadd_rn(acc, (signs[sb + r / 8] >> (r % 8)) & 1u ? v : -v);
  }
  scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc);
}
