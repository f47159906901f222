template <typename T, int D, bool ROTATE>
[[kernel]] void custom_kernel_veloxquant_tq_reduce__float16_t_64_1_float_float_float_float_float16_t(
  const device float* part_m [[buffer(0)]],
  const constant int* part_m_shape [[buffer(1)]],
  const device float* part_l [[buffer(2)]],
  const device float* part_acc [[buffer(3)]],
  const device float* rot_v [[buffer(4)]],
  device float16_t* out [[buffer(5)]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {
// tq_reduce: combine the splits of each query row (tq_attention, tq_decode,
// kv_attention) and, with ROTATE, bring it back from the rotated value frame:
// out = Πᵀ (Σ_s e^(m_s - M) acc_s) / (Σ_s e^(m_s - M) l_s). Rows with no
// visible token give zeros. Template T, D, ROTATE; part_m is [R, S] (rows,
// splits); out has R * D elements in any shape. One threadgroup of D
// threads per row.
threadgroup float a[D];
const uint R = uint(part_m_shape[0]), S = uint(part_m_shape[1]);
const uint row = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (row >= R) {
  return;
}
float M = -INFINITY;
for (uint s = 0; s < S; ++s) M = max(M, part_m[ulong(row) * S + s]);
float lsum = 0.0f, ai = 0.0f;
if (M != -INFINITY) {
  for (uint s = 0; s < S; ++s) {
    const float w = exp(part_m[ulong(row) * S + s] - M);
    lsum += w * part_l[ulong(row) * S + s];
    ai += w * part_acc[(ulong(row) * S + s) * D + i];
  }
}
a[i] = lsum > 0.0f ? ai / lsum : 0.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
float y = a[i];
if (ROTATE) {
  y = 0.0f;
  for (int j = 0; j < D; ++j) y += rot_v[j * D + i] * a[j];
}
out[ulong(row) * D + i] = T(y);

}

template [[host_name("custom_kernel_veloxquant_tq_reduce__float16_t_64_1_float_float_float_float_float16_t")]] [[kernel]] decltype(custom_kernel_veloxquant_tq_reduce__float16_t_64_1_float_float_float_float_float16_t<float16_t, 64, 1>) custom_kernel_veloxquant_tq_reduce__float16_t_64_1_float_float_float_float_float16_t<float16_t, 64, 1>;
