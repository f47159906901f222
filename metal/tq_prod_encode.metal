// tq_prod_encode: TurboQuant-Prod, x T [N, D] -> codes uint8 [N, D*(B_BITS-1)/8],
// signs uint8 [N, D/8], norms float16 [N], residual_norms float16 [N].
// rotation float32 [D, D] (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, by butterflies); not read unless ROTATE, centroids
// float32 [2^(B_BITS-1)] sorted, sketch float32 [D, D], params = {N}. With
// B_BITS = 1 there are no MSE bits: codes and residual_norms are 1-element
// placeholders the body never writes. One threadgroup of D threads per vector:
// norm, y = Π x/‖x‖, the MSE code by the codebook's boundaries, the residual
// r = y - c, its norm, the signs of S r, the packing, with no intermediate in
// device memory. Same arithmetic order as crate::cpu::turboquant, no fma.
#pragma clang fp contract(off)
constexpr int MSE_BITS = B_BITS - 1;
constexpr int K = 1 << MSE_BITS;
constexpr int CODE_BYTES = D * MSE_BITS / 8;
threadgroup float u[D];
threadgroup float bounds[K];
threadgroup uchar idx[D];
threadgroup uchar sbit[D];
threadgroup float s_norm[1];
const uint n = params[0];
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
for (int k = i; k < K - 1; k += D) {
  bounds[k] = 0.5f * (centroids[k] + centroids[k + 1]);
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
float y = ROTATE ? tq_rotate_coord<D>(u, i, rotation, HADAMARD) : u[i];
if (MSE_BITS > 0) {
  int code = 0;
  for (int k = 0; k < K - 1; ++k) {
    code += bounds[k] < y ? 1 : 0;
  }
  idx[i] = uchar(code);
  y = y - centroids[code];
}
// Every thread has read u; it now holds the residual.
threadgroup_barrier(mem_flags::mem_threadgroup);
u[i] = y;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (MSE_BITS > 0 && i == 0) {
  residual_norms[v] = half(min(tq_norm(u, D), 65504.0f));
}
float proj = 0.0f;
for (int j = 0; j < D; ++j) {
  proj += sketch[i * D + j] * u[j];
}
sbit[i] = proj >= 0.0f ? 1 : 0;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i % 8 == 0) {
  uint byte = 0;
  for (int j = 0; j < 8; ++j) {
    byte |= uint(sbit[i + j]) << j;
  }
  signs[ulong(v) * (D / 8) + i / 8] = uint8_t(byte);
  if (MSE_BITS > 0) {
    ulong word = 0;
    for (int j = 0; j < 8; ++j) {
      word |= ulong(idx[i + j]) << (j * MSE_BITS);
    }
    const ulong dst = ulong(v) * CODE_BYTES + (i / 8) * MSE_BITS;
    for (int k = 0; k < MSE_BITS; ++k) {
      codes[dst + k] = uint8_t(word >> (8 * k));
    }
  }
}
