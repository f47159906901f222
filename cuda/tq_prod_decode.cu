// tq_prod_decode: inverse of tq_prod_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (c[code] + scale · ‖r‖ · Sᵀ z), z the ±1 signs (‖r‖ = 1 and no
// codes when B_BITS = 1: codes, residual_norms and centroids are placeholders).
// sizes = {N, float bits of scale = √(π/2)/D}. A block of 256 threads
// decodes TQ_TV vectors (tq_common.cuh's tiles): the sketch product starts
// from the centroid, its result goes back to shared memory for the rotation
// product (with HADAMARD, rotation is the signs: butterflies instead). Sums
// in order with round-to-nearest intrinsics, as crate::cpu::turboquant.
// With TC (float16 or bfloat16 output, D = 64 or 128) the sketch product
// runs on the tensor cores instead (tq_tensor_cores.cuh): without a
// rotation or with Hadamard signs each warp then finishes whole vectors in
// registers, the butterflies by shuffles; a dense rotation's product runs
// on the tensor cores too.
constexpr int MSE_BITS = B_BITS - 1;
const uint32_t n = vq_size(params_shape, 0);
const float scale = __uint_as_float(vq_size(params_shape, 1));
if constexpr (TC && ROTATE && !HADAMARD) {
  tq_prod_decode_tensor_cores_dense<D, MSE_BITS>(codes, signs, norms, residual_norms, rotation, centroids, sketch, y, n,
                                                 scale);
} else if constexpr (TC) {
  tq_prod_decode_tensor_cores_rows<D, MSE_BITS, ROTATE>(codes, signs, norms, residual_norms, rotation, centroids,
                                                        sketch, y, n, scale);
} else {
  constexpr int CODE_BYTES = D * MSE_BITS / 8;
  constexpr int CH = TQ_CHUNKS(D);
  __shared__ __align__(16) float V[D * TQ_VS];
  __shared__ __align__(16) float Bs[TQ_BS(D)];
  const uint64_t v0 = uint64_t(blockIdx.x) * TQ_TV;
  const int tid = threadIdx.x;
  const int ty = tid / 32;
  for (int e = tid; e < TQ_TV * D; e += 256) {
    const int v = e / D;
    const int k = e % D;
    float z = 0.0f;
    if (v0 + v < n) {
      const float rn = MSE_BITS > 0 ? __half2float(residual_norms[v0 + v]) : 1.0f;
      const float a = __fmul_rn(scale, rn);
      z = ((signs[(v0 + v) * (D / 8) + k / 8] >> (k % 8)) & 1) != 0 ? a : -a;
    }
    V[k * TQ_VS + v] = z;
  }
  float acc[4][CH * 4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const uint64_t v = v0 + ty * 4 + a;
#pragma unroll
    for (int k = 0; k < CH * 4; ++k) {
      const int col = tq_lane_col(k);
      acc[a][k] = (MSE_BITS > 0 && col < D && v < n)
                      ? centroids[vq_code_at(codes + v * CODE_BYTES, unsigned(col), unsigned(MSE_BITS > 0 ? MSE_BITS : 1))]
                      : 0.0f;
    }
  }
  __syncthreads();
  tq_ordered_gemm<D, true>(acc, V, sketch, Bs);
  if (ROTATE) {
    tq_spill_tile<D>(acc, V);
    __syncthreads();
    tq_unrotate_tile<D, true, HADAMARD>(acc, V, rotation, Bs);
  }
  tq_store_tile<D>(acc, y, norms, v0, n);
}
