// tq_rvq_encode: TurboQuant-RVQ, x T [N, D] -> codes1 uint8 [N, D*B1_BITS/8],
// codes2 uint8 [N, D*B2_BITS/8], norms float16 [N]. rotation float32 [D, D]
// (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, by butterflies); not read unless ROTATE, centroids1 float32 [2^B1_BITS] and
// centroids2 float32 [2^B2_BITS] sorted, params = {N}. One threadgroup of D
// threads per vector: norm, y = Π x/‖x‖, code a of y by centroids1's
// boundaries, code b of y - centroids1[a] by centroids2's, both packed, with no
// intermediate in device memory. Same arithmetic order as
// crate::cpu::turboquant, no fma.
#pragma clang fp contract(off)
constexpr int K1 = 1 << B1_BITS;
constexpr int K2 = 1 << B2_BITS;
threadgroup float u[D];
threadgroup float bounds1[K1];
threadgroup float bounds2[K2];
threadgroup uchar idx1[D];
threadgroup uchar idx2[D];
threadgroup float s_norm[1];
const uint n = params[0];
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
for (int k = i; k < K1 - 1; k += D) {
  bounds1[k] = 0.5f * (centroids1[k] + centroids1[k + 1]);
}
for (int k = i; k < K2 - 1; k += D) {
  bounds2[k] = 0.5f * (centroids2[k] + centroids2[k + 1]);
}
const float xi = float(x[ulong(v) * D + i]);
u[i] = xi;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i == 0) {
  s_norm[0] = tq_norm(u, D);
  norms[v] = half(min(s_norm[0], 65504.0f));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float s = s_norm[0];
u[i] = s > 0.0f ? xi / s : 0.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float y = ROTATE ? tq_rotate_coord<D>(u, i, rotation, HADAMARD) : u[i];
int a = 0;
for (int k = 0; k < K1 - 1; ++k) {
  a += bounds1[k] < y ? 1 : 0;
}
const float r = y - centroids1[a];
int b = 0;
for (int k = 0; k < K2 - 1; ++k) {
  b += bounds2[k] < r ? 1 : 0;
}
idx1[i] = uchar(a);
idx2[i] = uchar(b);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i % 8 == 0) {
  ulong w1 = 0;
  ulong w2 = 0;
  for (int j = 0; j < 8; ++j) {
    w1 |= ulong(idx1[i + j]) << (j * B1_BITS);
    w2 |= ulong(idx2[i + j]) << (j * B2_BITS);
  }
  const ulong dst1 = ulong(v) * (D * B1_BITS / 8) + (i / 8) * B1_BITS;
  for (int k = 0; k < B1_BITS; ++k) {
    codes1[dst1 + k] = uint8_t(w1 >> (8 * k));
  }
  const ulong dst2 = ulong(v) * (D * B2_BITS / 8) + (i / 8) * B2_BITS;
  for (int k = 0; k < B2_BITS; ++k) {
    codes2[dst2 + k] = uint8_t(w2 >> (8 * k));
  }
}
