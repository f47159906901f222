// tq_reduce: combine the splits of each query row (tq_attention, tq_decode,
// kv_attention) and, with ROTATE, bring it back from the rotated value frame:
// out = Πᵀ (Σ_s e^(m_s - M) acc_s) / (Σ_s e^(m_s - M) l_s). Rows with no
// visible token give zeros. Template T, D, ROTATE; part_m is [R, S] (rows,
// splits); out has R * D elements in any shape. One block of P * D threads
// per row (P = blockDim.x / D, at most RP): part p sums splits p, p + P, ...
// for its dimension, and the rotation's inner products split the same way,
// so that few dependent loads stand in each thread's way.
constexpr int RP = 16;
__shared__ float a[D];
__shared__ float part_a[RP * D];
__shared__ float part_w[RP];
__shared__ float max_s[RP * 32];
const uint32_t R = part_m_shape[0], S = part_m_shape[1];
const uint64_t row = blockIdx.x;
const uint32_t tid = threadIdx.x, P = blockDim.x / D;
const uint32_t i = tid % D, p = tid / D;
const float ninf = -__int_as_float(0x7f800000);
if (row >= R) {
  return;
}
const float* m = part_m + row * S;
float M = ninf;
for (uint32_t s = tid; s < S; s += blockDim.x) M = fmaxf(M, m[s]);
#pragma unroll
for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
if ((tid & 31u) == 0) max_s[tid >> 5] = M;
__syncthreads();
M = ninf;
for (uint32_t w = 0; w < (blockDim.x + 31) / 32; ++w) M = fmaxf(M, max_s[w]);
float lsum = 0.0f, ai = 0.0f;
if (M != ninf && p < P) {
#pragma unroll 8
  for (uint32_t s = p; s < S; s += P) {
    const float w = expf(m[s] - M);
    lsum += w * part_l[row * S + s];
    ai += w * part_acc[(row * S + s) * D + i];
  }
}
if (p < P) {
  part_a[p * D + i] = ai;
  if (i == 0) part_w[p] = lsum;
}
__syncthreads();
if (tid < uint32_t(D)) {
  float num = 0.0f, den = 0.0f;
  for (uint32_t q = 0; q < P; ++q) {
    num += part_a[q * D + tid];
    den += part_w[q];
  }
  a[tid] = den > 0.0f ? num / den : 0.0f;
}
__syncthreads();
if (!ROTATE) {
  if (tid < uint32_t(D)) out[row * D + tid] = static_cast<T>(a[tid]);
  return;
}
// y_i = Σ_j a_j Π[j][i]: part p takes j = p, p + P, ...
float y = 0.0f;
if (p < P) {
#pragma unroll 8
  for (uint32_t j = p; j < uint32_t(D); j += P) y += rot_v[j * D + i] * a[j];
  part_a[p * D + i] = y;
}
__syncthreads();
if (tid < uint32_t(D)) {
  y = 0.0f;
  for (uint32_t q = 0; q < P; ++q) y += part_a[q * D + tid];
  out[row * D + tid] = static_cast<T>(y);
}
