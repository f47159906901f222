// bit_unpack: packed uint8 [rows, nbytes] -> codes uint8 [rows, n].
// params = {rows, n, nbytes}; template B_BITS. One thread per (row, group of 8
// codes), reading the B_BITS bytes (fewer at the end of a row) that hold them.
// Inputs are indexed directly rather than through local pointers because MLX
// places an input of fewer than 8 elements in `constant` memory, not `device`.
const uint rows = params[0];
const uint n = params[1];
const uint nbytes = params[2];
const uint groups = (n + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= rows * groups) {
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
const uint count = min(8u, n - first);
const ulong mask = (1ul << B_BITS) - 1ul;
const ulong dst = ulong(row) * n + first;
for (uint j = 0; j < count; ++j) {
  codes[dst + j] = uint8_t((word >> (j * B_BITS)) & mask);
}
