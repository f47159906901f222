// vq_quantize: x T [N, D], codebook T [K, D] -> indices uint32 [N].
// params = {N, K}; template T (element type), D (2, 4 or 8). One thread per
// vector; the vector and the running distance stay in registers.
// Arithmetic matches the CPU kernel bit for bit: float32, `acc += diff * diff`
// per coordinate in order with round-to-nearest intrinsics, which NVRTC never
// contracts into an fma, and a strictly smaller distance wins (ties go to the
// lowest index).
const uint32_t n = params[0];
const uint32_t k = params[1];
const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (i >= n) {
  return;
}
float v[D];
#pragma unroll
for (int j = 0; j < D; ++j) {
  v[j] = static_cast<float>(x[i * D + j]);
}
float best = __int_as_float(0x7f800000);
uint32_t best_i = 0;
for (uint32_t c = 0; c < k; ++c) {
  const uint64_t base = uint64_t(c) * D;
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < D; ++j) {
    const float diff = __fsub_rn(v[j], static_cast<float>(codebook[base + j]));
    acc = __fadd_rn(acc, __fmul_rn(diff, diff));
  }
  if (acc < best) {
    best = acc;
    best_i = c;
  }
}
indices[i] = best_i;
