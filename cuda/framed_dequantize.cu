// framed_dequantize: one side of a compressed layer as the buffer a prefill
// chunk attends over, in position order: out [R, S + N + Rc + L, D] holds
// window slots 0..S-1 (sinks), codebook[code] * norm of store slots 0..N-1
// (float32, rounded once to T), window slots recent_at..recent_at+Rc-1, then
// the chunk's L tokens. One pass instead of a dequantization, a multiply by
// the norms and a concatenation, each writing the whole history.
// Template: T (window, chunk and output), D (a multiple of 8), B_BITS.
// Inputs, row-contiguous: window T [R, W, D]; codes uint8 [R, cap, D * B_BITS / 8];
// norms half [R, cap]; table float [2^B_BITS]; chunk T [R, L, D];
// params: the sizes {R, S, N, Rc, recent_at, W, cap, L} (`vq_size`).
// One thread per 8 consecutive dimensions of one output token: its B_BITS
// code bytes or its 8 elements read, and 8 elements written, as one wide
// access each where the pointers allow it.
constexpr uint32_t G = D / 8;
constexpr uint32_t ROW_BYTES = D * B_BITS / 8;
const uint32_t rows = vq_size(params_shape, 0), S = vq_size(params_shape, 1), N = vq_size(params_shape, 2);
const uint32_t Rc = vq_size(params_shape, 3), recent_at = vq_size(params_shape, 4), W = vq_size(params_shape, 5);
const uint32_t cap = vq_size(params_shape, 6), L = vq_size(params_shape, 7);
const uint32_t total = S + N + Rc + L;
// The launch holds fewer than 2^31 threads (the host's grid_1d): 32-bit
// index arithmetic, whose divisions by the runtime `total` are a few
// instructions where 64-bit ones are a software routine.
const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
if (e >= rows * total * G) {
  return;
}
const uint32_t g = e % G;
const uint32_t rt = e / G;
const uint32_t t = rt % total;
const uint32_t r = rt / total;
T* dst = out + uint64_t(rt) * D + g * 8;
const bool wide = vq_aligned(out, 16) && vq_aligned(window, 16) && vq_aligned(chunk, 16);
if (t >= S && t < S + N) {
  const uint64_t slot = uint64_t(r) * cap + (t - S);
  const uint8_t* src = codes + slot * ROW_BYTES + g * B_BITS;
  uint64_t word = 0;
#pragma unroll
  for (int k = 0; k < B_BITS; ++k) {
    word |= uint64_t(src[k]) << (8 * k);
  }
  const float norm = static_cast<float>(norms[slot]);
  constexpr uint64_t mask = (uint64_t(1) << B_BITS) - 1;
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = table[(word >> (j * B_BITS)) & mask] * norm;
  }
  if (wide) {
    vq_store8(dst, v);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      dst[j] = static_cast<T>(v[j]);
    }
  }
  return;
}
const T* src = t < S ? window + (uint64_t(r) * W + t) * D
    : t < S + N + Rc ? window + (uint64_t(r) * W + recent_at + (t - S - N)) * D
    : chunk + (uint64_t(r) * L + (t - S - N - Rc)) * D;
src += g * 8;
if (wide) {
  constexpr int WORDS = 8 * int(sizeof(T)) / 16;
#pragma unroll
  for (int w = 0; w < WORDS; ++w) {
    reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(src)[w];
  }
} else {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    dst[j] = src[j];
  }
}
