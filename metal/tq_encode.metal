// tq_encode: x T [N, D] -> codes uint8 [N, D*B_BITS/8], norms float16 [N].
// rotation float32 [D, D] (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, Π u = H (s ⊙ u) / √D); not read unless ROTATE.
// centroids float32 [2^B_BITS] sorted,
// N = x's rows. One threadgroup of D threads per vector: the norm,
// y = Π x/‖x‖, the nearest centroid per coordinate and the packing, with no
// intermediate in device memory. Same arithmetic order as the CPU kernel,
// never contracted into an fma.
#pragma clang fp contract(off)
constexpr int ROW_BYTES = D * B_BITS / 8;
constexpr int K = 1 << B_BITS;
threadgroup float u[D];
threadgroup uchar idx[D];
threadgroup float s_norm[1];
const uint n = uint(x_shape[0]);
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
const float xi = float(x[ulong(v) * D + i]);
u[i] = xi;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i == 0) {
  float s2 = 0.0f;
  for (int j = 0; j < D; ++j) {
    s2 += u[j] * u[j];
  }
  s_norm[0] = sqrt(s2);
  norms[v] = half(min(s_norm[0], 65504.0f));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float s = s_norm[0];
u[i] = s > 0.0f ? xi / s : 0.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float y = ROTATE ? tq_rotate_coord<D>(u, i, rotation, HADAMARD) : u[i];
float best = INFINITY;
int best_k = 0;
for (int k = 0; k < K; ++k) {
  const float diff = y - centroids[k];
  const float dist = diff * diff;
  if (dist < best) {
    best = dist;
    best_k = k;
  }
}
idx[i] = uchar(best_k);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i % 8 == 0) {
  ulong word = 0;
  for (int j = 0; j < 8; ++j) {
    word |= ulong(idx[i + j]) << (j * B_BITS);
  }
  const ulong dst = ulong(v) * ROW_BYTES + (i / 8) * B_BITS;
  for (int k = 0; k < B_BITS; ++k) {
    codes[dst + k] = uint8_t(word >> (8 * k));
  }
}
