// tq_encode: x T [N, D] -> codes uint8 [N, D*B_BITS/8], norms float16 [N].
// rotation float32 [D, D] (row-major Π; not read unless ROTATE), centroids float32 [2^B_BITS] sorted,
// N = x's rows. One block of D threads per vector: the norm, y = Π x/‖x‖, the
// nearest centroid per coordinate and the packing, with no intermediate in
// global memory. Arithmetic matches crate::cpu::turboquant::tq_encode bit for
// bit (round-to-nearest intrinsics, sequential sums, no fma).
constexpr int ROW_BYTES = D * B_BITS / 8;
constexpr int K = 1 << B_BITS;
__shared__ float u[D];
__shared__ unsigned char idx[D];
__shared__ float s_norm[1];
const uint32_t n = x_shape[0];
const uint64_t v = blockIdx.x;
const int i = threadIdx.x;
if (v >= n || i >= D) {
  return;
}
const float xi = static_cast<float>(x[v * D + i]);
u[i] = xi;
__syncthreads();
if (i == 0) {
  float s2 = 0.0f;
  for (int j = 0; j < D; ++j) {
    s2 = __fadd_rn(s2, __fmul_rn(u[j], u[j]));
  }
  s_norm[0] = __fsqrt_rn(s2);
  norms[v] = __float2half_rn(fminf(s_norm[0], 65504.0f));
}
__syncthreads();
const float s = s_norm[0];
u[i] = s > 0.0f ? __fdiv_rn(xi, s) : 0.0f;
__syncthreads();
float y = u[i];
if (ROTATE) {
  y = 0.0f;
  for (int j = 0; j < D; ++j) {
    y = __fadd_rn(y, __fmul_rn(rotation[i * D + j], u[j]));
  }
}
float best = __int_as_float(0x7f800000);
int best_k = 0;
#pragma unroll
for (int k = 0; k < K; ++k) {
  const float diff = __fsub_rn(y, centroids[k]);
  const float dist = __fmul_rn(diff, diff);
  if (dist < best) {
    best = dist;
    best_k = k;
  }
}
idx[i] = static_cast<unsigned char>(best_k);
__syncthreads();
if (i % 8 == 0) {
  uint64_t word = 0;
  for (int j = 0; j < 8; ++j) {
    word |= uint64_t(idx[i + j]) << (j * B_BITS);
  }
  uint8_t* dst = codes + v * ROW_BYTES + (i / 8) * B_BITS;
  for (int k = 0; k < B_BITS; ++k) {
    dst[k] = uint8_t(word >> (8 * k));
  }
}
