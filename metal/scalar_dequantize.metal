// scalar_dequantize: packed uint8 [N, nbytes], codebook float [2^B_BITS] ->
// y T [N, D] = codebook[code]. params = {N, D, nbytes}; template T, B_BITS.
// One thread per (row, group of 8 codes), reading the B_BITS bytes (fewer at
// the end of a row) that hold them.
const uint n = params[0];
const uint d = params[1];
const uint nbytes = params[2];
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
  y[dst + j] = T(codebook[(word >> (j * B_BITS)) & mask]);
}
