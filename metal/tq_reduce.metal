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
