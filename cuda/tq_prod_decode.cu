// tq_prod_decode: inverse of tq_prod_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (c[code] + scale · ‖r‖ · Sᵀ z), z the ±1 signs (‖r‖ = 1 and no
// codes when B_BITS = 1: codes, residual_norms and centroids are placeholders).
// params = {N, float bits of scale = √(π/2)/D}. One block of D threads per
// vector; sums in order with round-to-nearest intrinsics, as crate::cpu::turboquant.
constexpr int MSE_BITS = B_BITS - 1;
constexpr int CODE_BYTES = D * MSE_BITS / 8;
__shared__ float z[D];
__shared__ float yr[D];
const uint32_t n = params[0];
const float scale = __uint_as_float(params[1]);
const uint64_t v = blockIdx.x;
const int i = threadIdx.x;
if (v >= n || i >= D) {
  return;
}
float yi = 0.0f;
float rn = 1.0f;
if (MSE_BITS > 0) {
  yi = centroids[tq_code_at(codes + v * CODE_BYTES, unsigned(i), unsigned(MSE_BITS))];
  rn = __half2float(residual_norms[v]);
}
const float a = __fmul_rn(scale, rn);
z[i] = ((signs[v * (D / 8) + i / 8] >> (i % 8)) & 1) != 0 ? a : -a;
__syncthreads();
for (int k = 0; k < D; ++k) {
  yi = __fadd_rn(yi, __fmul_rn(z[k], sketch[k * D + i]));
}
yr[i] = yi;
__syncthreads();
float o = yi;
if (ROTATE) {
  o = 0.0f;
  for (int k = 0; k < D; ++k) {
    o = __fadd_rn(o, __fmul_rn(rotation[k * D + i], yr[k]));
  }
}
y[v * D + i] = static_cast<T>(__fmul_rn(o, __half2float(norms[v])));
