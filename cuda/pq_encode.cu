// pq_encode: x T [N, D], codebook float [K, S] -> packed uint8 [N, nbytes] and
// packed_hi uint8 [N, nbytes_hi], the index of the nearest entry for each of
// the D/S sub-vectors in crate::quant::pq's planes: C_BITS in 1, 2, 3, 4, 8 is
// one plane (packed_hi a 1-element placeholder, never written); 5..7 store the
// low 4 bits in packed and the rest in packed_hi; 9..12 the low 8 and the rest.
// Each plane uses bit_pack's layout. params = {N, D, K, nbytes, nbytes_hi};
// template T, S (2, 4 or 8), C_BITS (1..12; K <= 2^C_BITS), STAGED (the
// codebook, at most STAGE_FLOATS floats, is copied to shared memory; otherwise
// read from global memory). One thread per (row, group of 8 sub-vectors).
// Distances as vq_quantize: float32, acc += diff * diff in order with
// round-to-nearest intrinsics, a strictly smaller distance wins.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
constexpr uint32_t STAGE_FLOATS = 4096;
__shared__ float cb[STAGED ? STAGE_FLOATS : 1];
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
const uint32_t nbytes_hi = params[4];
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
const uint32_t count = min(8u, per - first);
uint64_t word = 0;
uint64_t word_hi = 0;
for (uint32_t j = 0; j < count; ++j) {
  const uint64_t src = uint64_t(row) * d + uint64_t(first + j) * S;
  float v[S];
#pragma unroll
  for (int e = 0; e < S; ++e) {
    v[e] = static_cast<float>(x[src + e]);
  }
  float best = __int_as_float(0x7f800000);
  uint32_t best_i = 0;
  for (uint32_t c = 0; c < kk; ++c) {
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < S; ++e) {
      const float diff = __fsub_rn(v[e], STAGED ? cb[c * S + e] : codebook[c * S + e]);
      acc = __fadd_rn(acc, __fmul_rn(diff, diff));
    }
    if (acc < best) {
      best = acc;
      best_i = c;
    }
  }
  word |= uint64_t(best_i & ((1u << LO_BITS) - 1u)) << (j * LO_BITS);
  word_hi |= uint64_t(best_i >> LO_BITS) << (j * (HI_BITS > 0 ? HI_BITS : 1));
}
const uint32_t b0 = g * LO_BITS;
const uint32_t b1 = min(b0 + uint32_t(LO_BITS), nbytes);
const uint64_t dst = uint64_t(row) * nbytes;
for (uint32_t k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}
if (HI_BITS > 0) {
  const uint32_t h0 = g * HI_BITS;
  const uint32_t h1 = min(h0 + uint32_t(HI_BITS), nbytes_hi);
  const uint64_t dst_hi = uint64_t(row) * nbytes_hi;
  for (uint32_t k = h0; k < h1; ++k) {
    packed_hi[dst_hi + k] = uint8_t(word_hi >> (8 * (k - h0)));
  }
}
