// pq_decode: packed uint8 [N, nbytes], codebook float [K, S] -> y T [N, D],
// sub-vector p of a row = codebook[code p]. params = {N, D, K, nbytes};
// template T, S, C_BITS. One thread per (row, group of 8 sub-vectors). A code
// past the codebook (corrupt input) reads entry 0.
const uint n = params[0];
const uint d = params[1];
const uint kk = params[2];
const uint nbytes = params[3];
const uint per = d / S;
const uint groups = (per + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= n * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint b0 = g * C_BITS;
const uint b1 = min(b0 + uint(C_BITS), nbytes);
const ulong src = ulong(row) * nbytes;
ulong word = 0;
for (uint k = b0; k < b1; ++k) {
  word |= ulong(packed[src + k]) << (8 * (k - b0));
}
const uint first = g * 8;
const uint count = min(8u, per - first);
const ulong mask = (1ul << C_BITS) - 1ul;
for (uint j = 0; j < count; ++j) {
  uint c = uint((word >> (j * C_BITS)) & mask);
  c = c < kk ? c : 0u;
  const ulong dst = ulong(row) * d + ulong(first + j) * S;
  for (int e = 0; e < S; ++e) {
    y[dst + e] = T(codebook[c * S + e]);
  }
}
