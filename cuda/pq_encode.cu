// pq_encode: x T [N, D], codebook float [K, S] -> packed uint8 [N, nbytes] and
// packed_hi uint8 [N, nbytes_hi], the index of the nearest entry for each of
// the D/S sub-vectors in crate::quant::pq's planes: C_BITS in 1, 2, 3, 4, 8 is
// one plane (packed_hi a 1-element placeholder, never written); 5..7 store the
// low 4 bits in packed and the rest in packed_hi; 9..12 the low 8 and the rest.
// Each plane uses bit_pack's layout. sizes = {N, D, K, nbytes, nbytes_hi};
// template T, S (2, 4 or 8), C_BITS (1..12; K <= 2^C_BITS), STAGED (the
// codebook, at most STAGE_FLOATS floats, is copied to shared memory; otherwise
// read from global memory), TC (float16 or bfloat16 x: the search on the
// tensor cores, pq_encode_tensor_cores.cuh; blocks of 256 threads walk chunks
// of rows). Otherwise one thread per (row, group of 8 sub-vectors), distances
// as vq_quantize: float32, acc += diff * diff in order with round-to-nearest
// intrinsics, a strictly smaller distance wins.
if constexpr (TC) {
  pq_encode_tensor_cores<T, S, C_BITS>(x, codebook, params_shape, packed, packed_hi);
} else {
  constexpr uint32_t STAGE_FLOATS = 4096;
  __shared__ float cb[STAGED ? STAGE_FLOATS : 1];
  const uint32_t n = vq_size(params_shape, 0);
  const uint32_t d = vq_size(params_shape, 1);
  const uint32_t kk = vq_size(params_shape, 2);
  const uint32_t nbytes = vq_size(params_shape, 3);
  const uint32_t nbytes_hi = vq_size(params_shape, 4);
  if (STAGED) {
    for (uint32_t i = threadIdx.x; i < kk * S; i += blockDim.x) {
      cb[i] = codebook[i];
    }
    __syncthreads();
  }
  const uint32_t per = d / S;
  const uint32_t groups = (per + 7) / 8;
  const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= uint64_t(n) * groups) {
    return;
  }
  const uint32_t row = uint32_t(t / groups);
  const uint32_t g = uint32_t(t % groups);
  const uint32_t first = g * 8;
  const T* xr = x + uint64_t(row) * d + uint64_t(first) * S;
  pq_store_group<C_BITS>(
      [&](uint32_t j) {
        return vq_nearest_exact<S>(xr + j * S, kk,
                                   [&](uint32_t e, int c) { return STAGED ? cb[e * S + c] : codebook[e * S + c]; });
      },
      min(8u, per - first), row, g, nbytes, nbytes_hi, packed, packed_hi);
}
