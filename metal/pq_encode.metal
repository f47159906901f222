// pq_encode: x T [N, D], codebook float [K, S] -> packed uint8 [N, nbytes],
// the index of the nearest entry for each of the D/S sub-vectors, packed with
// C_BITS bits (bit_pack's layout). params = {N, D, K, nbytes}; template T, S
// (2, 4 or 8), C_BITS (1, 2, 3, 4 or 8; K <= 2^C_BITS). The codebook (at most
// 256 * 8 floats) is staged in threadgroup memory; one thread per (row, group
// of 8 sub-vectors). Distances as vq_quantize: float32, acc += diff * diff in
// order, a strictly smaller distance wins.
#pragma clang fp contract(off)
threadgroup float cb[2048];
const uint n = params[0];
const uint d = params[1];
const uint kk = params[2];
const uint nbytes = params[3];
for (uint i = thread_index_in_threadgroup; i < kk * S; i += threads_per_threadgroup.x) {
  cb[i] = codebook[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
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
      const float diff = v[e] - cb[c * S + e];
      acc += diff * diff;
    }
    if (acc < best) {
      best = acc;
      best_i = c;
    }
  }
  word |= ulong(best_i) << (j * C_BITS);
}
const uint b0 = g * C_BITS;
const uint b1 = min(b0 + uint(C_BITS), nbytes);
const ulong dst = ulong(row) * nbytes;
for (uint k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
