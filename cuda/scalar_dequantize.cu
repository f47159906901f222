// scalar_dequantize: packed uint8 [N, nbytes], codebook float [2^B_BITS] ->
// y T [N, D] = codebook[code]. sizes = {N, D, nbytes}; template T, B_BITS.
// One thread per (row, group of 8 codes); the block stages the codebook in
// shared memory. When D is a multiple of 8 the groups tile the arrays with no
// gaps, so a thread reads its B_BITS bytes and writes its 8 elements with one
// wide access each (where the pointers allow it).
constexpr uint32_t K = 1u << B_BITS;
constexpr uint64_t mask = (uint64_t(1) << B_BITS) - 1;
__shared__ float cb[K];
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t groups = (d + 7) / 8;
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
const bool live = t < uint64_t(n) * groups;
const bool fast = d % 8 == 0 && vq_aligned(packed, vq_bytes_align<B_BITS>()) && vq_aligned(y, 16);
// The codes are requested before the block waits for its codebook, so that
// the two latencies overlap.
const uint64_t word = live && fast ? vq_load_bytes<B_BITS>(packed + t * B_BITS) : 0;
for (uint32_t i = threadIdx.x; i < K; i += blockDim.x) {
  cb[i] = codebook[i];
}
__syncthreads();
if (!live) {
  return;
}
if (fast) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = cb[vq_code<B_BITS>(word, j)];
  }
  vq_store8(y + t * 8, v);
  return;
}
const uint32_t row = uint32_t(t / groups);
const uint32_t g = uint32_t(t % groups);
const uint32_t b0 = g * B_BITS;
const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
const uint64_t src = uint64_t(row) * nbytes;
uint64_t bytes = 0;
for (uint32_t k = b0; k < b1; ++k) {
  bytes |= uint64_t(packed[src + k]) << (8 * (k - b0));
}
const uint32_t first = g * 8;
const uint32_t count = min(8u, d - first);
const uint64_t dst = uint64_t(row) * d + first;
for (uint32_t j = 0; j < count; ++j) {
  y[dst + j] = static_cast<T>(cb[(bytes >> (j * B_BITS)) & mask]);
}
