// qjl_encode: k T [N, D], sketch float [m, D] -> signs uint8 [N, ceil(m/8)]
// (bit r of a row = (S k)_r >= 0, bit_pack's 1-bit layout), norms half [N].
// params = {N, D, m, nbytes}; template T. One warp per key (grid N * 32,
// blocks a multiple of 32): lane l computes rows l, l + 32, ... of S k
// (float32, in order, round-to-nearest intrinsics, no fma); __ballot_sync
// gathers the 32 signs of a chunk and lanes 0-3 write its 4 bytes. Lane 0
// also sums the squares for the norm, in order.
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t m = params[2];
const uint32_t nbytes = params[3];
const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
const uint64_t key = tid / 32;
const uint32_t lane = threadIdx.x % 32;
if (key >= n) {
  return;
}
const uint64_t kb = key * d;
for (uint32_t base = 0; base < m; base += 32) {
  const uint32_t r = base + lane;
  bool bit = false;
  if (r < m) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < d; ++j) {
      acc = __fadd_rn(acc, __fmul_rn(sketch[uint64_t(r) * d + j], static_cast<float>(k[kb + j])));
    }
    bit = acc >= 0.0f;
  }
  const uint32_t vote = __ballot_sync(0xffffffffu, bit);
  const uint32_t byte = base / 8 + lane;
  if (lane < 4 && byte < nbytes) {
    signs[key * nbytes + byte] = uint8_t(vote >> (8 * lane));
  }
}
if (lane == 0) {
  float acc = 0.0f;
  for (uint32_t j = 0; j < d; ++j) {
    const float v = static_cast<float>(k[kb + j]);
    acc = __fadd_rn(acc, __fmul_rn(v, v));
  }
  norms[key] = __float2half_rn(__fsqrt_rn(acc));
}
