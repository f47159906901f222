// pq_decode: packed uint8 [N, nbytes], packed_hi uint8 [N, nbytes_hi] (a
// 1-element placeholder when C_BITS has one plane), codebook float [K, S] ->
// y T [N, D], sub-vector p of a row = codebook[code p], the code rebuilt from
// pq_encode's planes. params = {N, D, K, nbytes, nbytes_hi}; template T, S,
// C_BITS (1..12). One thread per (row, group of 8 sub-vectors). A code past
// the codebook (corrupt input) reads entry 0. When the sub-vectors per row
// are a multiple of 8 the groups tile the planes and the output: a thread
// reads its bytes of each plane with one access, each codebook entry with
// one, and writes each sub-vector with one.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
const uint32_t nbytes_hi = params[4];
const uint32_t per = d / S;
const uint32_t groups = (per + 7) / 8;
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
if (t >= n * groups) {
  return;
}
const uint64_t mask = (uint64_t(1) << LO_BITS) - 1;
const uint64_t mask_hi = (uint64_t(1) << HI_BITS) - 1;
if (per % 8 == 0 && vq_aligned(packed, vq_bytes_align<LO_BITS>()) &&
    (HI_BITS == 0 || vq_aligned(packed_hi, vq_bytes_align<(HI_BITS > 0 ? HI_BITS : 1)>())) && vq_aligned(y, 16) &&
    vq_aligned(codebook, 4 * S)) {
  const uint64_t word = vq_load_bytes<LO_BITS>(packed + uint64_t(t) * LO_BITS);
  uint64_t word_hi = 0;
  if (HI_BITS > 0) {
    word_hi = vq_load_bytes<(HI_BITS > 0 ? HI_BITS : 1)>(packed_hi + uint64_t(t) * HI_BITS);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t c = uint32_t((word >> (j * LO_BITS)) & mask);
    if (HI_BITS > 0) {
      c |= uint32_t((word_hi >> (j * HI_BITS)) & mask_hi) << LO_BITS;
    }
    c = c < kk ? c : 0u;
    float e[S];
    const float* entry = codebook + c * S;
    if constexpr (S == 2) {
      const float2 a = __ldg(reinterpret_cast<const float2*>(entry));
      e[0] = a.x; e[1] = a.y;
    } else {
#pragma unroll
      for (int h = 0; h < S; h += 4) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(entry + h));
        e[h] = a.x; e[h + 1] = a.y; e[h + 2] = a.z; e[h + 3] = a.w;
      }
    }
    vq_store_n<S>(y + (uint64_t(t) * 8 + j) * S, e);
  }
  return;
}
const uint32_t row = t / groups;
const uint32_t g = t % groups;
const uint32_t b0 = g * LO_BITS;
const uint32_t b1 = min(b0 + uint32_t(LO_BITS), nbytes);
const uint64_t src = uint64_t(row) * nbytes;
uint64_t word = 0;
for (uint32_t k = b0; k < b1; ++k) {
  word |= uint64_t(packed[src + k]) << (8 * (k - b0));
}
uint64_t word_hi = 0;
if (HI_BITS > 0) {
  const uint32_t h0 = g * HI_BITS;
  const uint32_t h1 = min(h0 + uint32_t(HI_BITS), nbytes_hi);
  const uint64_t src_hi = uint64_t(row) * nbytes_hi;
  for (uint32_t k = h0; k < h1; ++k) {
    word_hi |= uint64_t(packed_hi[src_hi + k]) << (8 * (k - h0));
  }
}
const uint32_t first = g * 8;
const uint32_t count = min(8u, per - first);
for (uint32_t j = 0; j < count; ++j) {
  uint32_t c = uint32_t((word >> (j * LO_BITS)) & mask);
  if (HI_BITS > 0) {
    c |= uint32_t((word_hi >> (j * HI_BITS)) & mask_hi) << LO_BITS;
  }
  c = c < kk ? c : 0u;
  const uint64_t dst = uint64_t(row) * d + uint64_t(first + j) * S;
#pragma unroll
  for (int e = 0; e < S; ++e) {
    y[dst + e] = static_cast<T>(codebook[c * S + e]);
  }
}
