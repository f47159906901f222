// tq_prod_encode: TurboQuant-Prod, x T [N, D] -> codes uint8 [N, D*(B_BITS-1)/8],
// signs uint8 [N, D/8], norms float16 [N], residual_norms float16 [N].
// rotation float32 [D, D] (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, by butterflies); not read unless ROTATE, centroids
// float32 [2^(B_BITS-1)] sorted, sketch float32 [D, D], sizes = {N}. With
// B_BITS = 1 codes and residual_norms are 1-element placeholders, never
// written. A block of 256 threads encodes TQ_TV vectors (tq_common.cuh's
// tiles): norms, u = x/‖x‖, y = Π u, codes, the residual r (kept in shared
// memory) and its norm, then the signs of S r, a second tiled product.
// For a float32 input the arithmetic matches
// crate::cpu::turboquant::tq_prod_encode bit for bit (round-to-nearest
// intrinsics, sums in order, the norms in float64). A float16 or bfloat16
// input sums both products' terms by fma, one instruction each instead of
// two: the parity rule for those types lets a code or sign differ from the
// CPU's at a near-tie (the norms stay identical).
// With TC > 0 (float16 or bfloat16 x, a rotation, D = 64 or 128, at least
// 2 bits) both products run on the tensor cores instead
// (tq_encode_tensor_cores.cuh's PROD, with 2 D² + 128 (D + 8) bytes of
// dynamic shared memory), a dense Π in TC parts of x's type.
constexpr int MSE_BITS = B_BITS - 1;
if constexpr (TC > 0) {
  tq_encode_tensor_cores<T, D, MSE_BITS, 0, TC, HADAMARD, true>(x, rotation, centroids, nullptr, codes, signs, norms,
                                                                vq_size(params_shape, 0), sketch, residual_norms);
} else {
  constexpr bool FUSED = sizeof(T) == 2;
  constexpr int K = 1 << MSE_BITS;
  constexpr int CH = TQ_CHUNKS(D);
  __shared__ __align__(16) float V[D * TQ_VS];
  __shared__ __align__(16) float Bs[TQ_BS(D)];
  __shared__ float s_norm[TQ_TV];
  __shared__ float cent[K];
  __shared__ float bounds[K];
  const uint32_t n = vq_size(params_shape, 0);
  const uint64_t v0 = uint64_t(blockIdx.x) * TQ_TV;
  const int tid = threadIdx.x;
  tq_stage_codebook<true>(cent, bounds, centroids, K);
  tq_stage_unit_rows<D, true>(V, s_norm, x, norms, v0, n);
  float acc[4][CH * 4];
  tq_rotate_tile<D, ROTATE, HADAMARD, FUSED>(acc, V, rotation, Bs);
  unsigned code[4][CH * 4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int k = 0; k < CH * 4; ++k) {
      // The number of boundaries below the value (crate::cpu's scalar_codes),
      // by binary search over the sorted boundaries: MSE_BITS steps, none of
      // the boundaries held in registers.
      unsigned c = 0;
      if (MSE_BITS > 0) {
#pragma unroll
        for (int step = K / 2; step >= 1; step /= 2) {
          c += bounds[c + step - 1] < acc[a][k] ? unsigned(step) : 0u;
        }
        acc[a][k] = __fsub_rn(acc[a][k], cent[c]);
      }
      code[a][k] = c;
    }
  }
  if (MSE_BITS > 0) {
    tq_pack_store<D, (MSE_BITS > 0 ? MSE_BITS : 1)>(code, codes, v0, n);
  }
  // Every thread has read u (the product ends with a barrier; without ROTATE
  // this one); V now takes the residual.
  __syncthreads();
  tq_spill_tile<D>(acc, V);
  __syncthreads();
  tq_ordered_gemm<D, false, FUSED>(acc, V, sketch, Bs);
  // The product leaves V (the residual) as it was; its norms after the product
  // keep the other warps from waiting on this one's float64 sums.
  if (MSE_BITS > 0 && tid < TQ_TV && v0 + tid < n) {
    residual_norms[v0 + tid] = __float2half_rn(fminf(tq_norm_col<D>(V, tid), 65504.0f));
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int k = 0; k < CH * 4; ++k) {
      code[a][k] = acc[a][k] >= 0.0f ? 1u : 0u;
    }
  }
  tq_pack_store<D, 1>(code, signs, v0, n);
}
