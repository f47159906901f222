// tq_rvq_decode: inverse of tq_rvq_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (centroids1[a] + centroids2[b]). params = {N}. One block of D threads
// per vector; sums in order with round-to-nearest intrinsics, as crate::cpu::turboquant.
__shared__ float yr[D];
const uint32_t n = params[0];
const uint64_t v = blockIdx.x;
const int i = threadIdx.x;
if (v >= n || i >= D) {
  return;
}
const unsigned a = tq_code_at(codes1 + v * (D * B1_BITS / 8), unsigned(i), unsigned(B1_BITS));
const unsigned b = tq_code_at(codes2 + v * (D * B2_BITS / 8), unsigned(i), unsigned(B2_BITS));
const float yi = __fadd_rn(centroids1[a], centroids2[b]);
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
