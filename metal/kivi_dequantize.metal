// kivi_dequantize: packed uint8 [N, nbytes], scales, zeros float16 -> y T
// [N, D] = zero + scale * code (float32, no fma). params = {N, D, nbytes, G};
// template T, B_BITS, PER_CHANNEL (scales [ceil(N/G), D], else [N, D/G]).
// One thread per (row, group of 8 codes).
#pragma clang fp contract(off)
const uint n = params[0];
const uint d = params[1];
const uint nbytes = params[2];
const uint gsize = params[3];
const uint groups = (d + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= n * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint b0 = g * B_BITS;
const uint b1 = min(b0 + uint(B_BITS), nbytes);
const ulong src = ulong(row) * nbytes;
ulong word = 0;
for (uint k = b0; k < b1; ++k) {
  word |= ulong(packed[src + k]) << (8 * (k - b0));
}
const uint first = g * 8;
const uint count = min(8u, d - first);
const ulong mask = (1ul << B_BITS) - 1ul;
const ulong dst = ulong(row) * d + first;
for (uint j = 0; j < count; ++j) {
  const uint ch = first + j;
  const ulong p = PER_CHANNEL ? ulong(row / gsize) * d + ch : (ulong(row) * d + ch) / gsize;
  const float code = float((word >> (j * B_BITS)) & mask);
  y[dst + j] = T(float(zeros[p]) + float(scales[p]) * code);
}
