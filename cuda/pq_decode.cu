// pq_decode: packed uint8 [N, nbytes], codebook float [K, S] -> y T [N, D],
// sub-vector p of a row = codebook[code p]. params = {N, D, K, nbytes};
// template T, S, C_BITS. One thread per (row, group of 8 sub-vectors). A code
// past the codebook (corrupt input) reads entry 0.
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
const uint32_t per = d / S;
const uint32_t groups = (per + 7) / 8;
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (t >= uint64_t(n) * groups) {
  return;
}
const uint32_t row = uint32_t(t / groups);
const uint32_t g = uint32_t(t % groups);
const uint32_t b0 = g * C_BITS;
const uint32_t b1 = min(b0 + uint32_t(C_BITS), nbytes);
const uint64_t src = uint64_t(row) * nbytes;
uint64_t word = 0;
for (uint32_t k = b0; k < b1; ++k) {
  word |= uint64_t(packed[src + k]) << (8 * (k - b0));
}
const uint32_t first = g * 8;
const uint32_t count = min(8u, per - first);
const uint64_t mask = (uint64_t(1) << C_BITS) - 1;
for (uint32_t j = 0; j < count; ++j) {
  uint32_t c = uint32_t((word >> (j * C_BITS)) & mask);
  c = c < kk ? c : 0u;
  const uint64_t dst = uint64_t(row) * d + uint64_t(first + j) * S;
#pragma unroll
  for (int e = 0; e < S; ++e) {
    y[dst + e] = static_cast<T>(codebook[c * S + e]);
  }
}
