// tq_rvq_encode: TurboQuant-RVQ, x T [N, D] -> codes1 uint8 [N, D*B1_BITS/8],
// codes2 uint8 [N, D*B2_BITS/8], norms float16 [N]. rotation float32 [D, D]
// (row-major Π; not read unless ROTATE), centroids1 float32 [2^B1_BITS] and
// centroids2 float32 [2^B2_BITS] sorted, params = {N}. One block of D threads
// per vector; arithmetic matches crate::cpu::turboquant::tq_rvq_encode bit for
// bit (round-to-nearest intrinsics, sums in order, the norm in float64).
constexpr int K1 = 1 << B1_BITS;
constexpr int K2 = 1 << B2_BITS;
__shared__ float u[D];
__shared__ float bounds1[K1];
__shared__ float bounds2[K2];
__shared__ unsigned char idx1[D];
__shared__ unsigned char idx2[D];
__shared__ float s_norm[1];
const uint32_t n = params[0];
const uint64_t v = blockIdx.x;
const int i = threadIdx.x;
if (v >= n || i >= D) {
  return;
}
for (int k = i; k < K1 - 1; k += D) {
  bounds1[k] = __fmul_rn(0.5f, __fadd_rn(centroids1[k], centroids1[k + 1]));
}
for (int k = i; k < K2 - 1; k += D) {
  bounds2[k] = __fmul_rn(0.5f, __fadd_rn(centroids2[k], centroids2[k + 1]));
}
const float xi = static_cast<float>(x[v * D + i]);
u[i] = xi;
__syncthreads();
if (i == 0) {
  s_norm[0] = tq_norm(u, D);
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
int a = 0;
for (int k = 0; k < K1 - 1; ++k) {
  a += bounds1[k] < y ? 1 : 0;
}
const float r = __fsub_rn(y, centroids1[a]);
int b = 0;
for (int k = 0; k < K2 - 1; ++k) {
  b += bounds2[k] < r ? 1 : 0;
}
idx1[i] = static_cast<unsigned char>(a);
idx2[i] = static_cast<unsigned char>(b);
__syncthreads();
if (i % 8 == 0) {
  uint64_t w1 = 0;
  uint64_t w2 = 0;
  for (int j = 0; j < 8; ++j) {
    w1 |= uint64_t(idx1[i + j]) << (j * B1_BITS);
    w2 |= uint64_t(idx2[i + j]) << (j * B2_BITS);
  }
  uint8_t* d1 = codes1 + v * (D * B1_BITS / 8) + (i / 8) * B1_BITS;
  for (int k = 0; k < B1_BITS; ++k) {
    d1[k] = uint8_t(w1 >> (8 * k));
  }
  uint8_t* d2 = codes2 + v * (D * B2_BITS / 8) + (i / 8) * B2_BITS;
  for (int k = 0; k < B2_BITS; ++k) {
    d2[k] = uint8_t(w2 >> (8 * k));
  }
}
