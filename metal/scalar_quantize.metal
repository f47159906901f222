// scalar_quantize: x T [N, D], codebook float [2^B_BITS] (sorted) -> packed
// uint8 [N, nbytes], bit_pack's layout. params = {N, D, nbytes}; template T,
// B_BITS. One thread per (row, group of 8 codes), as bit_pack. The code of v
// is the number of boundaries 0.5 * (c[i] + c[i+1]) strictly below v, found
// by a binary search of B_BITS unrolled steps over the boundaries, which the
// threadgroup computes once into threadgroup memory.
#pragma clang fp contract(off)
threadgroup float bounds[256];
const uint n = params[0];
const uint d = params[1];
const uint nbytes = params[2];
constexpr uint K = 1u << B_BITS;
for (uint i = thread_index_in_threadgroup; i + 1 < K; i += threads_per_threadgroup.x) {
  bounds[i] = 0.5f * (codebook[i] + codebook[i + 1]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint groups = (d + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= n * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint first = g * 8;
const uint count = min(8u, d - first);
const ulong src = ulong(row) * d + first;
ulong word = 0;
for (uint j = 0; j < count; ++j) {
  const float v = float(x[src + j]);
  uint pos = 0;
  for (uint step = K / 2; step > 0; step /= 2) {
    if (bounds[pos + step - 1] < v) {
      pos += step;
    }
  }
  word |= ulong(pos) << (j * B_BITS);
}
const uint b0 = g * B_BITS;
const uint b1 = min(b0 + uint(B_BITS), nbytes);
const ulong dst = ulong(row) * nbytes;
for (uint k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
