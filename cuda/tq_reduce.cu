// tq_reduce: combine the splits of each query row (tq_attention, tq_decode,
// kv_attention) and, with ROTATE, bring it back from the rotated value frame:
// out = Πᵀ (Σ_s e^(m_s - M) acc_s) / (Σ_s e^(m_s - M) l_s). Rows with no
// visible token give zeros. Template T, D, ROTATE; part_m is [R, S] (rows,
// splits); out has R * D elements in any shape. One block of D threads per
// row.
__shared__ float a[D];
const uint32_t R = part_m_shape[0], S = part_m_shape[1];
const uint64_t row = blockIdx.x;
const int i = threadIdx.x;
if (row >= R || i >= D) {
  return;
}
const float ninf = -__int_as_float(0x7f800000);
float M = ninf;
// Unrolled so that many independent loads are in flight (few blocks run).
#pragma unroll 8
for (uint32_t s = 0; s < S; ++s) M = fmaxf(M, part_m[row * S + s]);
float lsum = 0.0f, ai = 0.0f;
if (M != ninf) {
#pragma unroll 8
  for (uint32_t s = 0; s < S; ++s) {
    const float w = expf(part_m[row * S + s] - M);
    lsum += w * part_l[row * S + s];
    ai += w * part_acc[(row * S + s) * D + i];
  }
}
a[i] = lsum > 0.0f ? ai / lsum : 0.0f;
__syncthreads();
float y = a[i];
if (ROTATE) {
  y = 0.0f;
#pragma unroll 8
  for (int j = 0; j < D; ++j) y += rot_v[j * D + i] * a[j];
}
out[row * D + i] = static_cast<T>(y);
