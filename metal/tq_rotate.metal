// tq_rotate: the decode queries in the keys' rotated frame, scaled once per
// call: out[b, h, l] = SCALE * Π q[b, h, l] in float32. Template T, D, QR
// (query rows a threadgroup serves), SCALE (float32 bits). q [B, Hq, L, D]
// is read through its strides, rot [D, D] float32 row-major, out
// [B, Hq, L, D] contiguous. Threadgroup k serves rows QR (k / ceil(D / 32))
// on and output dimensions 32 (k % ceil(D / 32)) on; its rows are staged
// once, then each thread takes (row, dimension) pairs.
threadgroup float xs[QR * D];
const uint Hq = uint(q_shape[1]), L = uint(q_shape[2]);
const uint rows = uint(q_shape[0]) * Hq * L;
const uint col_blocks = (uint(D) + 31) / 32;
const uint k = threadgroup_position_in_grid.x;
const uint r0 = (k / col_blocks) * QR, c0 = (k % col_blocks) * 32;
const uint tid = thread_position_in_threadgroup.x, threads = threads_per_threadgroup.x;
for (uint e = tid; e < uint(QR * D); e += threads) {
  const uint r = r0 + e / D, j = e % D;
  float x = 0.0f;
  if (r < rows) {
    const uint b = r / (Hq * L), h = (r / L) % Hq, l = r % L;
    x = float(q[long(b) * q_strides[0] + long(h) * q_strides[1] + long(l) * q_strides[2] + long(j) * q_strides[3]]);
  }
  xs[e] = x;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float scale = as_type<float>(SCALE);
for (uint e = tid; e < uint(QR) * 32; e += threads) {
  const uint r = e / 32, i = c0 + e % 32;
  if (r0 + r >= rows || i >= uint(D)) continue;
  float y = 0.0f;
  for (int j = 0; j < D; ++j) y += rot[ulong(i) * D + j] * xs[r * D + j];
  out[ulong(r0 + r) * D + i] = y * scale;
}
