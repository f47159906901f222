// pq_decode: packed uint8 [N, nbytes], packed_hi uint8 [N, nbytes_hi] (a
// 1-element placeholder when C_BITS has one plane), codebook float [K, S] ->
// y T [N, D], sub-vector p of a row = codebook[code p], the code rebuilt from
// pq_encode's planes. params = {N, D, K, nbytes, nbytes_hi}; template T, S,
// C_BITS (1..12). One thread per (row, sub-vector): adjacent lanes write
// adjacent sub-vectors, each with one store, and read each codebook entry
// with one load where the pointers allow it. A code past the codebook
// (corrupt input) reads entry 0.
constexpr int LO_BITS = (C_BITS <= 4 || C_BITS == 8) ? C_BITS : (C_BITS < 8 ? 4 : 8);
constexpr int HI_BITS = C_BITS - LO_BITS;
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t kk = params[2];
const uint32_t nbytes = params[3];
const uint32_t nbytes_hi = params[4];
const uint32_t per = d / S;
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
if (t >= n * per) {
  return;
}
const uint32_t row = vq_div(t, per);
const uint32_t p = t - row * per;
uint32_t c = vq_code_at(packed + uint64_t(row) * nbytes, p, LO_BITS);
if (HI_BITS > 0) {
  c |= vq_code_at(packed_hi + uint64_t(row) * nbytes_hi, p, HI_BITS > 0 ? HI_BITS : 1) << LO_BITS;
}
c = c < kk ? c : 0u;
const float* entry = codebook + c * S;
float e[S];
if (vq_aligned(codebook, 4 * S)) {
  if constexpr (S == 2) {
    const float2 a = __ldg(reinterpret_cast<const float2*>(entry));
    e[0] = a.x;
    e[1] = a.y;
  } else {
#pragma unroll
    for (int h = 0; h < S; h += 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(entry + h));
      e[h] = a.x;
      e[h + 1] = a.y;
      e[h + 2] = a.z;
      e[h + 3] = a.w;
    }
  }
} else {
#pragma unroll
  for (int h = 0; h < S; ++h) {
    e[h] = entry[h];
  }
}
T* dst = y + uint64_t(t) * S;
if (vq_aligned(dst, S * sizeof(T))) {
  vq_store_n<S>(dst, e);
} else {
#pragma unroll
  for (int h = 0; h < S; ++h) {
    dst[h] = static_cast<T>(e[h]);
  }
}
