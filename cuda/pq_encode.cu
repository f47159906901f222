// pq_encode: x T [N, D], codebook float [K, S] -> packed uint8 [N, nbytes],
// the index of the nearest entry for each of the D/S sub-vectors, packed with
// C_BITS bits (bit_pack's layout). params = {N, D, K, nbytes}; template T, S
// (2, 4 or 8), C_BITS (1, 2, 3, 4 or 8; K <= 2^C_BITS). The codebook (at most
// 256 * 8 floats) is staged in shared memory; one thread per (row, group of 8
// sub-vectors). Distances as vq_quantize: float32, acc += diff * diff in
// order with round-to-nearest intrinsics, a strictly smaller distance wins.
__shared__ float cb[2048];
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
for (uint32_t i = threadIdx.x; i < kk * S; i += blockDim.x) {
  cb[i] = codebook[i];
}
__syncthreads();
const uint32_t per = d / S;
const uint32_t groups = (per + 7) / 8;
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (t >= uint64_t(n) * groups) {
  return;
}
const uint32_t row = uint32_t(t / groups);
const uint32_t g = uint32_t(t % groups);
const uint32_t first = g * 8;
const uint32_t count = min(8u, per - first);
uint64_t word = 0;
for (uint32_t j = 0; j < count; ++j) {
  const uint64_t src = uint64_t(row) * d + uint64_t(first + j) * S;
  float v[S];
#pragma unroll
  for (int e = 0; e < S; ++e) {
    v[e] = static_cast<float>(x[src + e]);
  }
  float best = __int_as_float(0x7f800000);
  uint32_t best_i = 0;
  for (uint32_t c = 0; c < kk; ++c) {
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < S; ++e) {
      const float diff = __fsub_rn(v[e], cb[c * S + e]);
      acc = __fadd_rn(acc, __fmul_rn(diff, diff));
    }
    if (acc < best) {
      best = acc;
      best_i = c;
    }
  }
  word |= uint64_t(best_i) << (j * C_BITS);
}
const uint32_t b0 = g * C_BITS;
const uint32_t b1 = min(b0 + uint32_t(C_BITS), nbytes);
const uint64_t dst = uint64_t(row) * nbytes;
for (uint32_t k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
