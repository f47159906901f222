// scalar_quantize: x T [N, D], codebook float [2^B_BITS] (sorted) -> packed
// uint8 [N, nbytes], bit_pack's layout. params = {N, D, nbytes}; template T,
// B_BITS. One thread per (row, group of 8 codes), as bit_pack. The code of v
// is the number of boundaries 0.5 * (c[i] + c[i+1]) strictly below v, found
// by a binary search of B_BITS unrolled steps over the boundaries, which the
// block computes once into shared memory. When D is a multiple of 8 a thread
// reads its 8 elements and writes its B_BITS bytes with one wide access each.
__shared__ float bounds[256];
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t nbytes = params[2];
constexpr uint32_t K = 1u << B_BITS;
const uint32_t groups = (d + 7) / 8;
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
const bool live = t < uint64_t(n) * groups;
const bool fast = d % 8 == 0 && vq_aligned(x, 16) && vq_aligned(packed, vq_bytes_align<B_BITS>());
// The elements are requested before the block waits for its boundaries, so
// that the two latencies overlap.
float v[8];
if (live && fast) {
  vq_load8(x + t * 8, v);
}
for (uint32_t i = threadIdx.x; i + 1 < K; i += blockDim.x) {
  bounds[i] = __fmul_rn(0.5f, __fadd_rn(codebook[i], codebook[i + 1]));
}
__syncthreads();
if (!live) {
  return;
}
// The search walks a shared-window byte address, so that each step is a
// load at a constant offset, a compare and a predicated add.
const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(bounds));
auto code_of = [&](float e) {
  uint32_t at = base;
#pragma unroll
  for (uint32_t step = K / 2; step > 0; step /= 2) {
    float b;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(b) : "r"(at + (step - 1) * 4));
    if (b < e) {
      at += step * 4;
    }
  }
  return (at - base) / 4;
};
if (fast) {
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    word |= uint64_t(code_of(v[j])) << (j * B_BITS);
  }
  vq_store_bytes<B_BITS>(packed + t * B_BITS, word);
  return;
}
const uint32_t row = uint32_t(t / groups);
const uint32_t g = uint32_t(t % groups);
const uint32_t first = g * 8;
const uint32_t count = min(8u, d - first);
const uint64_t src = uint64_t(row) * d + first;
uint64_t word = 0;
for (uint32_t j = 0; j < count; ++j) {
  word |= uint64_t(code_of(static_cast<float>(x[src + j]))) << (j * B_BITS);
}
const uint32_t b0 = g * B_BITS;
const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
const uint64_t dst = uint64_t(row) * nbytes;
for (uint32_t k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
