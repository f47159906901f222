template <typename T, int D>
[[kernel]] void custom_kernel_vq_quantize__float16_t_2_float16_t_float16_t_uint32_tc_uint32_t(
  const device float16_t* x [[buffer(0)]],
  const device float16_t* codebook [[buffer(1)]],
  const constant uint32_t* params [[buffer(2)]],
  device uint32_t* indices [[buffer(3)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
// vq_quantize: x T [N, D], codebook T [K, D] -> indices uint32 [N].
// params = {N, K}; template T (element type), D (2, 4 or 8). One thread per
// vector; the vector and the running distance stay in registers.
// Arithmetic matches the CPU kernel bit for bit: float32, `acc += diff * diff`
// per coordinate in order, never fused into an fma (hence the pragma), and a
// strictly smaller distance wins so ties go to the lowest index.
#pragma clang fp contract(off)
const uint n = params[0];
const uint k = params[1];
const uint i = thread_position_in_grid.x;
if (i >= n) {
  return;
}
float v[D];
for (int j = 0; j < D; ++j) {
  v[j] = float(x[ulong(i) * D + j]);
}
float best = INFINITY;
uint best_i = 0;
for (uint c = 0; c < k; ++c) {
  const ulong base = ulong(c) * D;
  float acc = 0.0f;
  for (int j = 0; j < D; ++j) {
    const float diff = v[j] - float(codebook[base + j]);
    acc += diff * diff;
  }
  if (acc < best) {
    best = acc;
    best_i = c;
  }
}
indices[i] = best_i;

}

template [[host_name("custom_kernel_vq_quantize__float16_t_2_float16_t_float16_t_uint32_tc_uint32_t")]] [[kernel]] decltype(custom_kernel_vq_quantize__float16_t_2_float16_t_float16_t_uint32_tc_uint32_t<float16_t, 2>) custom_kernel_vq_quantize__float16_t_2_float16_t_float16_t_uint32_tc_uint32_t<float16_t, 2>;
