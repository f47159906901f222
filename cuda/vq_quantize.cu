// vq_quantize: x T [N, D], codebook T [K, D] -> indices uint32 [N].
// sizes = {N, K}; template T (element type), D (2, 4 or 8). One thread per
// vector; the vector and the running distance stay in registers. Arithmetic
// matches the CPU kernel bit for bit (quant_common.cuh's vq_nearest_exact).
const uint32_t n = vq_size(params_shape, 0);
const uint32_t k = vq_size(params_shape, 1);
const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (i >= n) {
  return;
}
indices[i] = vq_nearest_exact<D>(x + i * D, k, [&](uint32_t c, int j) {
  return static_cast<float>(codebook[uint64_t(c) * D + j]);
});
