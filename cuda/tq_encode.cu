// tq_encode: x T [N, D] -> codes uint8 [N, D*B_BITS/8], norms float16 [N].
// rotation float32 [D, D] (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, Π u = H (s ⊙ u) / √D); not read unless ROTATE. centroids
// float32 [2^B_BITS] sorted, N = x's rows. A block of 256 threads encodes
// TQ_TV vectors (tq_common.cuh's tiles): the norms, u = x/‖x‖ in shared
// memory, y = Π u as a tiled product, the nearest centroid per coordinate and
// the packing, with no intermediate in global memory. Arithmetic matches
// crate::cpu::turboquant::tq_encode bit for bit (round-to-nearest
// intrinsics, sequential sums, no fma; the norm in float32).
// With TC > 0 (float16 or bfloat16 x, a rotation, D = 64 or 128) the
// rotation runs on the tensor cores instead (tq_encode_tensor_cores.cuh),
// a dense Π in TC parts of x's type; TABLE (the host's choice for large N
// at 3 or 4 bits) codes by a table of every float16 value's code.
if constexpr (TC > 0) {
  tq_encode_tensor_cores<T, D, B_BITS, 0, TC, HADAMARD, false, TABLE>(x, rotation, centroids, nullptr, codes,
                                                                      nullptr, norms, x_shape[0]);
} else {
  constexpr int CH = TQ_CHUNKS(D);
  constexpr int K = 1 << B_BITS;
  __shared__ __align__(16) float V[D * TQ_VS];
  __shared__ __align__(16) float Bs[(ROTATE && !HADAMARD) ? TQ_BS(D) : 4];
  __shared__ float s_norm[TQ_TV];
  __shared__ __align__(16) float cent[K];
  const uint32_t n = x_shape[0];
  const uint64_t v0 = uint64_t(blockIdx.x) * TQ_TV;
  const int tid = threadIdx.x;
  for (int k = tid; k < K; k += 256) {
    cent[k] = centroids[k];
  }
  tq_stage_unit_rows<D, false>(V, s_norm, x, norms, v0, n);
  float acc[4][CH * 4];
  tq_rotate_tile<D, ROTATE, HADAMARD>(acc, V, rotation, Bs);
  unsigned code[4][CH * 4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int k = 0; k < CH * 4; ++k) {
      float best = __int_as_float(0x7f800000);
      unsigned best_k = 0;
#pragma unroll 4
      for (int c = 0; c < K; ++c) {
        const float diff = __fsub_rn(acc[a][k], cent[c]);
        const float dist = __fmul_rn(diff, diff);
        if (dist < best) {
          best = dist;
          best_k = c;
        }
      }
      code[a][k] = best_k;
    }
  }
  tq_pack_store<D, B_BITS>(code, codes, v0, n);
}
