// tq_prod_encode: TurboQuant-Prod, x T [N, D] -> codes uint8 [N, D*(B_BITS-1)/8],
// signs uint8 [N, D/8], norms float16 [N], residual_norms float16 [N].
// rotation float32 [D, D] (row-major Π; not read unless ROTATE), centroids
// float32 [2^(B_BITS-1)] sorted, sketch float32 [D, D], params = {N}. With
// B_BITS = 1 codes and residual_norms are 1-element placeholders, never
// written. One block of D threads per vector; arithmetic matches
// crate::cpu::turboquant::tq_prod_encode bit for bit (round-to-nearest
// intrinsics, sums in order, the norms in float64 as crate::quant).
constexpr int MSE_BITS = B_BITS - 1;
constexpr int K = 1 << MSE_BITS;
constexpr int CODE_BYTES = D * MSE_BITS / 8;
__shared__ float u[D];
__shared__ float bounds[K];
__shared__ unsigned char idx[D];
__shared__ unsigned char sbit[D];
__shared__ float s_norm[1];
const uint32_t n = params[0];
const uint64_t v = blockIdx.x;
const int i = threadIdx.x;
if (v >= n || i >= D) {
  return;
}
for (int k = i; k < K - 1; k += D) {
  bounds[k] = __fmul_rn(0.5f, __fadd_rn(centroids[k], centroids[k + 1]));
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
if (MSE_BITS > 0) {
  int code = 0;
  for (int k = 0; k < K - 1; ++k) {
    code += bounds[k] < y ? 1 : 0;
  }
  idx[i] = static_cast<unsigned char>(code);
  y = __fsub_rn(y, centroids[code]);
}
// Every thread has read u; it now holds the residual.
__syncthreads();
u[i] = y;
__syncthreads();
if (MSE_BITS > 0 && i == 0) {
  residual_norms[v] = __float2half_rn(fminf(tq_norm(u, D), 65504.0f));
}
float proj = 0.0f;
for (int j = 0; j < D; ++j) {
  proj = __fadd_rn(proj, __fmul_rn(sketch[i * D + j], u[j]));
}
sbit[i] = proj >= 0.0f ? 1 : 0;
__syncthreads();
if (i % 8 == 0) {
  unsigned byte = 0;
  for (int j = 0; j < 8; ++j) {
    byte |= unsigned(sbit[i + j]) << j;
  }
  signs[v * (D / 8) + i / 8] = uint8_t(byte);
  if (MSE_BITS > 0) {
    uint64_t word = 0;
    for (int j = 0; j < 8; ++j) {
      word |= uint64_t(idx[i + j]) << (j * MSE_BITS);
    }
    uint8_t* dst = codes + v * CODE_BYTES + (i / 8) * MSE_BITS;
    for (int k = 0; k < MSE_BITS; ++k) {
      dst[k] = uint8_t(word >> (8 * k));
    }
  }
}
