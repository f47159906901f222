// tq_rvq_decode: inverse of tq_rvq_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (centroids1[a] + centroids2[b]); rotation [D, D], or [D] with
// HADAMARD (the signs: Πᵀ y = s ⊙ (H y / √D) by butterflies). sizes =
// {N}. A block of 256 threads decodes TQ_TV vectors (tq_common.cuh's
// tiles); sums in order with round-to-nearest intrinsics, as
// crate::cpu::turboquant. With TC (float16 or bfloat16 output, D = 64 or 128,
// a dense rotation) the rotation's product runs on the tensor cores instead
// (tq_tensor_cores.cuh), blocks walking the tiles. With ROWS (Hadamard
// signs or no rotation, D a multiple of 32 up to 128) each warp decodes
// whole vectors in registers (tq_common.cuh's warp rows), the same
// arithmetic as the tiles'.
const uint32_t n = vq_size(params_shape, 0);
static_assert(!TC || (ROTATE && !HADAMARD), "the tensor-core decode takes a dense rotation");
static_assert(!ROWS || !TC, "one path");
static_assert(!ROWS || !ROTATE || HADAMARD, "warp rows take Hadamard signs or no rotation");
if constexpr (TC) {
  tq_rvq_decode_tensor_cores<D, B1_BITS, B2_BITS>(codes1, codes2, norms, rotation, centroids1, centroids2, y, n);
} else if constexpr (ROWS) {
  tq_rvq_decode_rows<D, B1_BITS, B2_BITS, ROTATE>(codes1, codes2, norms, rotation, centroids1, centroids2, y, n);
} else {
  constexpr int CH = TQ_CHUNKS(D);
  __shared__ __align__(16) float V[D * TQ_VS];
  __shared__ __align__(16) float Bs[(ROTATE && !HADAMARD) ? TQ_BS(D) : 4];
  const uint64_t v0 = uint64_t(blockIdx.x) * TQ_TV;
  const int tid = threadIdx.x;
  for (int e = tid; e < TQ_TV * D; e += 256) {
    const int v = e / D;
    const int i = e % D;
    float yr = 0.0f;
    if (v0 + v < n) {
      const unsigned a = vq_code_at(codes1 + (v0 + v) * (D * B1_BITS / 8), unsigned(i), unsigned(B1_BITS));
      const unsigned b = vq_code_at(codes2 + (v0 + v) * (D * B2_BITS / 8), unsigned(i), unsigned(B2_BITS));
      yr = __fadd_rn(centroids1[a], centroids2[b]);
    }
    V[i * TQ_VS + v] = yr;
  }
  __syncthreads();
  float acc[4][CH * 4];
  tq_unrotate_tile<D, ROTATE, HADAMARD>(acc, V, rotation, Bs);
  tq_store_tile<D>(acc, y, norms, v0, n);
}
