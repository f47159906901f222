// pq_encode: x T [N, D], codebook float [K, S] -> packed uint8 [N, nbytes] and
// packed_hi uint8 [N, nbytes_hi], the index of the nearest entry for each of
// the D/S sub-vectors in crate::quant::pq's planes: C_BITS in 1, 2, 3, 4, 8 is
// one plane (packed_hi a 1-element placeholder, never written); 5..7 store the
// low 4 bits in packed and the rest in packed_hi; 9..12 the low 8 and the rest.
// Each plane uses bit_pack's layout. params = {N, D, K, nbytes, nbytes_hi};
// template T, S (2, 4 or 8), C_BITS (1..12; K <= 2^C_BITS), STAGED (the
// codebook, at most STAGE_FLOATS floats, is copied to threadgroup memory;
// otherwise read from device memory). One thread per (row, group of 8
// sub-vectors). Distances as vq_quantize: float32, acc += diff * diff in
// order, a strictly smaller distance wins.
#pragma clang fp contract(off)
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
constexpr uint STAGE_FLOATS = 4096;
threadgroup float cb[STAGED ? STAGE_FLOATS : 1];
const uint n = params[0];
const uint d = params[1];
const uint kk = params[2];
const uint nbytes = params[3];
const uint nbytes_hi = params[4];
if (STAGED) {
  for (uint i = thread_index_in_threadgroup; i < kk * S; i += threads_per_threadgroup.x) {
    cb[i] = codebook[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
const uint per = d / S;
const uint groups = (per + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= n * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint first = g * 8;
const uint count = min(8u, per - first);
ulong word = 0;
ulong word_hi = 0;
for (uint j = 0; j < count; ++j) {
  const ulong src = ulong(row) * d + ulong(first + j) * S;
  float v[S];
  for (int e = 0; e < S; ++e) {
    v[e] = float(x[src + e]);
  }
  float best = INFINITY;
  uint best_i = 0;
  for (uint c = 0; c < kk; ++c) {
    float acc = 0.0f;
    for (int e = 0; e < S; ++e) {
      const float diff = v[e] - (STAGED ? cb[c * S + e] : codebook[c * S + e]);
      acc += diff * diff;
    }
    if (acc < best) {
      best = acc;
      best_i = c;
    }
  }
  word |= ulong(best_i & ((1u << LO_BITS) - 1u)) << (j * LO_BITS);
  word_hi |= ulong(best_i >> LO_BITS) << (j * (HI_BITS > 0 ? HI_BITS : 1));
}
const uint b0 = g * LO_BITS;
const uint b1 = min(b0 + uint(LO_BITS), nbytes);
const ulong dst = ulong(row) * nbytes;
for (uint k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
if (HI_BITS > 0) {
  const uint h0 = g * HI_BITS;
  const uint h1 = min(h0 + uint(HI_BITS), nbytes_hi);
  const ulong dst_hi = ulong(row) * nbytes_hi;
  for (uint k = h0; k < h1; ++k) {
    packed_hi[dst_hi + k] = uint8_t(word_hi >> (8 * (k - h0)));
  }
}
