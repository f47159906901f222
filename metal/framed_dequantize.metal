// framed_dequantize: one side of a compressed layer as the buffer a prefill
// chunk attends over, in position order: out [R, S + N + Rc + L, D] holds
// window slots 0..S-1 (sinks), codebook[code] * norm of store slots 0..N-1
// (float32, rounded once to T), window slots recent_at..recent_at+Rc-1, then
// the chunk's L tokens. One pass instead of a dequantization, a multiply by
// the norms and a concatenation, each writing the whole history.
// Template: T (window, chunk and output), D (a multiple of 8), B_BITS.
// Inputs, row-contiguous: window T [R, W, D]; codes uint8 [R, cap, D * B_BITS / 8];
// norms half [R, cap]; table float [2^B_BITS]; chunk T [R, L, D];
// params = {R, S, N, Rc, recent_at, W, cap, L}.
// One thread per 8 consecutive dimensions of one output token.
constexpr uint G = D / 8;
const uint rows = params[0], S = params[1], N = params[2], Rc = params[3];
const uint recent_at = params[4], W = params[5], cap = params[6], L = params[7];
const uint total = S + N + Rc + L;
const ulong e = ulong(thread_position_in_grid.x);
if (e >= ulong(rows) * total * G) {
  return;
}
const uint g = uint(e % G);
const ulong rt = e / G;
const uint t = uint(rt % total);
const ulong r = rt / total;
device T* dst = out + rt * D + g * 8;
if (t >= S && t < S + N) {
  const ulong slot = r * cap + (t - S);
  const device uint8_t* src = codes + slot * (D * B_BITS / 8) + g * B_BITS;
  ulong word = 0;
  for (uint k = 0; k < uint(B_BITS); ++k) {
    word |= ulong(src[k]) << (8 * k);
  }
  const float norm = float(norms[slot]);
  const ulong mask = (1ul << B_BITS) - 1ul;
  for (uint j = 0; j < 8; ++j) {
    dst[j] = T(table[(word >> (j * B_BITS)) & mask] * norm);
  }
  return;
}
const device T* src = t < S ? window + (r * W + t) * D
    : t < S + N + Rc ? window + (r * W + recent_at + (t - S - N)) * D
    : chunk + (r * L + (t - S - N - Rc)) * D;
for (uint j = 0; j < 8; ++j) {
  dst[j] = src[g * 8 + j];
}
