// qjl_encode: k T [N, D], sketch float [m, D] -> signs uint8 [N, ceil(m/8)]
// (bit r of a row = (S k)_r >= 0, bit_pack's 1-bit layout), norms half [N].
// sizes = {N, D, m, nbytes}; template T, TC_D, TC_M.
// With TC_M > 0 (float16 keys, D = TC_D, m = TC_M) the projections run on
// the tensor cores (qjl_tensor_cores.cuh); what follows is the exact path.
// The projections are a matrix product K Sᵀ, computed as a tiled SGEMM whose
// sums keep crate::cpu's order: each (key, r) adds its D products in order,
// float32 round-to-nearest intrinsics, no fma. A block of 256 threads owns
// 64 keys x 64 sketch rows (blocks = key tiles x row tiles, row tile fastest)
// and walks D in slices of KC staged in shared memory; a thread holds a
// 4 x 4 register tile. Signs: a thread's 4 bits per key and its neighbour
// lane's 4 make one byte. The row-tile-0 blocks also sum each key's squares
// (in order, from the staged slices) for the norm.
if constexpr (TC_M > 0) {
  qjl_encode_tensor_cores<TC_D, TC_M>(reinterpret_cast<const __half*>(k), sketch, signs, norms, vq_size(params_shape, 0));
  return;
}
constexpr int TK = 64;
constexpr int TR = 64;
constexpr int KC = 16;
constexpr int PAD = TK + 4;
__shared__ __align__(16) float ks[KC][PAD];
__shared__ __align__(16) float ss[KC][PAD];
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t m = vq_size(params_shape, 2);
const uint32_t nbytes = vq_size(params_shape, 3);
const uint32_t rtiles = (m + TR - 1) / TR;
const uint32_t key0 = (blockIdx.x / rtiles) * TK;
const uint32_t row0 = (blockIdx.x % rtiles) * TR;
const uint32_t tid = threadIdx.x;
const uint32_t tx = tid % 16;  // rows row0 + tx * 4 + b
const uint32_t ty = tid / 16;  // keys key0 + ty * 4 + a
const bool norm_tile = row0 == 0 && tx == 0;
float acc[4][4];
float nrm[4];
#pragma unroll
for (int a = 0; a < 4; ++a) {
  nrm[a] = 0.0f;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    acc[a][b] = 0.0f;
  }
}
for (uint32_t j0 = 0; j0 < d; j0 += KC) {
  const uint32_t kc = min(uint32_t(KC), d - j0);
#pragma unroll
  for (int i = 0; i < TK * KC / 256; ++i) {
    const uint32_t e = tid + 256 * i;
    const uint32_t r = e / KC;
    const uint32_t j = e % KC;
    const uint32_t key = key0 + r;
    const uint32_t row = row0 + r;
    ks[j][r] = (key < n && j < kc) ? static_cast<float>(k[uint64_t(key) * d + j0 + j]) : 0.0f;
    ss[j][r] = (row < m && j < kc) ? sketch[uint64_t(row) * d + j0 + j] : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    if (j < kc) {
      const float4 kv = *reinterpret_cast<const float4*>(&ks[j][ty * 4]);
      const float4 sv = *reinterpret_cast<const float4*>(&ss[j][tx * 4]);
      const float kr[4] = {kv.x, kv.y, kv.z, kv.w};
      const float sr[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
      for (int a = 0; a < 4; ++a) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          acc[a][b] = __fadd_rn(acc[a][b], __fmul_rn(sr[b], kr[a]));
        }
      }
      if (norm_tile) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          nrm[a] = __fadd_rn(nrm[a], __fmul_rn(kr[a], kr[a]));
        }
      }
    }
  }
  __syncthreads();
}
#pragma unroll
for (int a = 0; a < 4; ++a) {
  const uint32_t key = key0 + ty * 4 + a;
  uint32_t bits = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const uint32_t row = row0 + tx * 4 + b;
    bits |= (row < m && acc[a][b] >= 0.0f) ? (1u << b) : 0u;
  }
  // Lanes 2i and 2i + 1 hold rows 8i..8i+3 and 8i+4..8i+7 of the same keys.
  const uint32_t high = __shfl_down_sync(0xffffffffu, bits, 1);
  const uint32_t byte = (row0 + tx * 4) / 8;
  if (tx % 2 == 0 && key < n && byte < nbytes) {
    signs[uint64_t(key) * nbytes + byte] = uint8_t(bits | (high << 4));
  }
  if (norm_tile && key < n) {
    norms[key] = __float2half_rn(__fsqrt_rn(nrm[a]));
  }
}
