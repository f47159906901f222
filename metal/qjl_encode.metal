// qjl_encode: k T [N, D], sketch float [m, D] -> signs uint8 [N, ceil(m/8)]
// (bit r of a row = (S k)_r >= 0, bit_pack's 1-bit layout), norms float16
// [N]. params = {N, D, m, nbytes}; template T. One simdgroup of 32 lanes per
// key (grid N * 32, threadgroups a multiple of 32): lane l computes rows
// l, l + 32, ... of S k (float32, in order, no fma); simd_ballot gathers the
// 32 signs of a chunk and lanes 0-3 write its 4 bytes. Lane 0 also sums the
// squares for the norm, in order.
#pragma clang fp contract(off)
const uint n = params[0];
const uint d = params[1];
const uint m = params[2];
const uint nbytes = params[3];
const uint key = thread_position_in_grid.x / 32;
const uint lane = thread_index_in_simdgroup;
if (key >= n) {
  return;
}
const ulong kb = ulong(key) * d;
for (uint base = 0; base < m; base += 32) {
  const uint r = base + lane;
  bool bit = false;
  if (r < m) {
    float acc = 0.0f;
    for (uint j = 0; j < d; ++j) {
      acc += sketch[ulong(r) * d + j] * float(k[kb + j]);
    }
    bit = acc >= 0.0f;
  }
  const uint vote = uint(uint64_t(simd_ballot(bit)) & 0xffffffffull);
  const uint byte = base / 8 + lane;
  if (lane < 4 && byte < nbytes) {
    signs[ulong(key) * nbytes + byte] = uint8_t(vote >> (8 * lane));
  }
}
if (lane == 0) {
  float acc = 0.0f;
  for (uint j = 0; j < d; ++j) {
    const float v = float(k[kb + j]);
    acc += v * v;
  }
  norms[key] = half(sqrt(acc));
}
