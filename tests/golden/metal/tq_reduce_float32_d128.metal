template <typename T, int D, bool ROTATE>
[[kernel]] void custom_kernel_veloxquant_tq_reduce__float_128_1_float_float_float_float_float(
  const device float* part_m [[buffer(0)]],
  const constant int* part_m_shape [[buffer(1)]],
  const device float* part_l [[buffer(2)]],
  const device float* part_acc [[buffer(3)]],
  const device float* rot_v [[buffer(4)]],
  device float* out [[buffer(5)]],
  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]],
  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {
// tq_reduce: combine the splits of each query row (tq_attention, tq_decode,
// kv_attention) and, with ROTATE, bring it back from the rotated value frame:
// out = Πᵀ (Σ_s e^(m_s - M) acc_s) / (Σ_s e^(m_s - M) l_s). Rows with no
// visible token give zeros. Template T, D, ROTATE; part_m is [R, S] (rows,
// splits); out has R * D elements in any shape. One threadgroup of P * D
// threads per row (P = threads_per_threadgroup.x / D, at most RP): part p
// sums splits p, p + P, ... for its dimension, and the rotation's inner
// products split the same way.
constexpr uint RP = 16;
threadgroup float a[D];
threadgroup float part_a[RP * D];
threadgroup float part_w[RP];
threadgroup float max_s[RP * 32];
const uint R = uint(part_m_shape[0]), S = uint(part_m_shape[1]);
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x, threads = threads_per_threadgroup.x;
const uint P = threads / uint(D);
const uint i = tid % uint(D), p = tid / uint(D);
if (row >= R) {
  return;
}
const device float* m = part_m + ulong(row) * S;
float M = -INFINITY;
for (uint s = tid; s < S; s += threads) M = max(M, m[s]);
M = simd_max(M);
if (thread_index_in_simdgroup == 0) max_s[tid / 32] = M;
threadgroup_barrier(mem_flags::mem_threadgroup);
M = -INFINITY;
for (uint w = 0; w < (threads + 31) / 32; ++w) M = max(M, max_s[w]);
float lsum = 0.0f, ai = 0.0f;
if (M != -INFINITY && p < P) {
  for (uint s = p; s < S; s += P) {
    const float w = exp(m[s] - M);
    lsum += w * part_l[ulong(row) * S + s];
    ai += w * part_acc[(ulong(row) * S + s) * D + i];
  }
}
if (p < P) {
  part_a[p * D + i] = ai;
  if (i == 0) part_w[p] = lsum;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid < uint(D)) {
  float num = 0.0f, den = 0.0f;
  for (uint q = 0; q < P; ++q) {
    num += part_a[q * D + tid];
    den += part_w[q];
  }
  a[tid] = den > 0.0f ? num / den : 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (!ROTATE) {
  if (tid < uint(D)) out[ulong(row) * D + tid] = T(a[tid]);
  return;
}
// y_i = Σ_j a_j Π[j][i]: part p takes j = p, p + P, ...
float y = 0.0f;
if (p < P) {
  for (uint j = p; j < uint(D); j += P) y += rot_v[j * D + i] * a[j];
  part_a[p * D + i] = y;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid < uint(D)) {
  y = 0.0f;
  for (uint q = 0; q < P; ++q) y += part_a[q * D + tid];
  out[ulong(row) * D + tid] = T(y);
}

}

template [[host_name("custom_kernel_veloxquant_tq_reduce__float_128_1_float_float_float_float_float")]] [[kernel]] decltype(custom_kernel_veloxquant_tq_reduce__float_128_1_float_float_float_float_float<float, 128, 1>) custom_kernel_veloxquant_tq_reduce__float_128_1_float_float_float_float_float<float, 128, 1>;
