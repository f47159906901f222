// pq_decode: packed uint8 [N, nbytes], packed_hi uint8 [N, nbytes_hi] (not
// read when C_BITS has one plane: the host passes `packed` again), codebook
// float [K, S] -> y T [N, D], sub-vector p of a row = codebook[code p],
// the code rebuilt from pq_encode's planes. params = {N, D, K, nbytes,
// nbytes_hi}; template T, S, C_BITS (1..12). One thread per (row, group of 8
// sub-vectors). A code past the codebook (corrupt input) reads entry 0.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
const uint n = params[0];
const uint d = params[1];
const uint kk = params[2];
const uint nbytes = params[3];
const uint nbytes_hi = params[4];
const uint per = d / S;
const uint groups = (per + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= n * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint b0 = g * LO_BITS;
const uint b1 = min(b0 + uint(LO_BITS), nbytes);
const ulong src = ulong(row) * nbytes;
ulong word = 0;
for (uint k = b0; k < b1; ++k) {
  word |= ulong(packed[src + k]) << (8 * (k - b0));
}
ulong word_hi = 0;
if (HI_BITS > 0) {
  const uint h0 = g * HI_BITS;
  const uint h1 = min(h0 + uint(HI_BITS), nbytes_hi);
  const ulong src_hi = ulong(row) * nbytes_hi;
  for (uint k = h0; k < h1; ++k) {
    word_hi |= ulong(packed_hi[src_hi + k]) << (8 * (k - h0));
  }
}
const uint first = g * 8;
const uint count = min(8u, per - first);
const ulong mask = (1ul << LO_BITS) - 1ul;
const ulong mask_hi = (1ul << HI_BITS) - 1ul;
for (uint j = 0; j < count; ++j) {
  uint c = uint((word >> (j * LO_BITS)) & mask);
  if (HI_BITS > 0) {
    c |= uint((word_hi >> (j * HI_BITS)) & mask_hi) << LO_BITS;
  }
  c = c < kk ? c : 0u;
  const ulong dst = ulong(row) * d + ulong(first + j) * S;
  for (int e = 0; e < S; ++e) {
    y[dst + e] = T(codebook[c * S + e]);
  }
}
