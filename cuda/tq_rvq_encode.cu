// tq_rvq_encode: TurboQuant-RVQ, x T [N, D] -> codes1 uint8 [N, D*B1_BITS/8],
// codes2 uint8 [N, D*B2_BITS/8], norms float16 [N]. rotation float32 [D, D]
// (row-major Π), or [D] (HADAMARD: the signs of a Hadamard rotation,
// by butterflies); not read unless ROTATE, centroids1 float32 [2^B1_BITS] and
// centroids2 float32 [2^B2_BITS] sorted, sizes = {N}. A block of 256 threads
// encodes TQ_TV vectors (tq_common.cuh's tiles): norms, u = x/‖x‖, y = Π u,
// the first code, the residual's code, both packed. Arithmetic matches
// crate::cpu::turboquant::tq_rvq_encode bit for bit (round-to-nearest
// intrinsics, sums in order, the norm in float64).
// With TC > 0 (float16 or bfloat16 x, a rotation, D = 64 or 128) the
// rotation runs on the tensor cores instead (tq_encode_tensor_cores.cuh),
// a dense Π in TC parts of x's type; TABLE (the host's choice for large N
// at 3 or 4 first-stage bits) codes the first stage by a table of every
// float16 value's code.
if constexpr (TC > 0) {
  tq_encode_tensor_cores<T, D, B1_BITS, B2_BITS, TC, HADAMARD, false, TABLE>(x, rotation, centroids1, centroids2,
                                                                             codes1, codes2, norms, vq_size(params_shape, 0));
} else {
  constexpr int CH = TQ_CHUNKS(D);
  constexpr int K1 = 1 << B1_BITS;
  constexpr int K2 = 1 << B2_BITS;
  __shared__ __align__(16) float V[D * TQ_VS];
  __shared__ __align__(16) float Bs[(ROTATE && !HADAMARD) ? TQ_BS(D) : 4];
  __shared__ float s_norm[TQ_TV];
  __shared__ float cent1[K1];
  __shared__ float bounds1[K1];
  __shared__ float bounds2[K2];
  const uint32_t n = vq_size(params_shape, 0);
  const uint64_t v0 = uint64_t(blockIdx.x) * TQ_TV;
  tq_stage_codebook<true>(cent1, bounds1, centroids1, K1);
  tq_stage_codebook<false>(nullptr, bounds2, centroids2, K2);
  tq_stage_unit_rows<D, true>(V, s_norm, x, norms, v0, n);
  float acc[4][CH * 4];
  tq_rotate_tile<D, ROTATE, HADAMARD>(acc, V, rotation, Bs);
  unsigned code1[4][CH * 4];
  unsigned code2[4][CH * 4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int k = 0; k < CH * 4; ++k) {
      const float y = acc[a][k];
      unsigned c1 = 0;
      for (int c = 0; c < K1 - 1; ++c) {
        c1 += bounds1[c] < y ? 1u : 0u;
      }
      const float r = __fsub_rn(y, cent1[c1]);
      unsigned c2 = 0;
      for (int c = 0; c < K2 - 1; ++c) {
        c2 += bounds2[c] < r ? 1u : 0u;
      }
      code1[a][k] = c1;
      code2[a][k] = c2;
    }
  }
  tq_pack_store<D, B1_BITS>(code1, codes1, v0, n);
  tq_pack_store<D, B2_BITS>(code2, codes2, v0, n);
}
