// kivi_dequantize: packed uint8 [N, nbytes], scales, zeros half -> y T
// [N, D] = zero + scale * code (float32, no fma). params = {N, D, nbytes, G};
// template T, B_BITS, PER_CHANNEL (scales [ceil(N/G), D], else [N, D/G]).
// One thread per (row, group of 8 codes). When D is a multiple of 8 (always
// so for values) the groups tile the arrays: a thread reads its B_BITS bytes,
// its 8 scales and zeros (keys; one of each for values, as G is a multiple
// of 8) and writes its 8 elements with wide accesses.
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t nbytes = params[2];
const uint32_t gsize = params[3];
const uint32_t groups = (d + 7) / 8;
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
if (t >= n * groups) {
  return;
}
constexpr uint64_t mask = (uint64_t(1) << B_BITS) - 1;
const uint32_t row = vq_div(t, groups);
const uint32_t first = (t - row * groups) * 8;
if (d % 8 == 0 && vq_aligned(packed, vq_bytes_align<B_BITS>()) && vq_aligned(y, 16) &&
    (!PER_CHANNEL || (vq_aligned(scales, 16) && vq_aligned(zeros, 16)))) {
  const uint64_t word = vq_load_bytes<B_BITS>(packed + uint64_t(t) * B_BITS);
  float s[8];
  float z[8];
  if (PER_CHANNEL) {
    const uint64_t p = uint64_t(vq_div(row, gsize)) * d + first;
    vq_load8(scales + p, s);
    vq_load8(zeros + p, z);
  } else {
    // G divides D here (a multiple of 8 dividing it): no carry from the row.
    const uint64_t p = uint64_t(row) * vq_div(d, gsize) + vq_div(first, gsize);
    const float s0 = __half2float(scales[p]);
    const float z0 = __half2float(zeros[p]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j] = s0;
      z[j] = z0;
    }
  }
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = __fadd_rn(z[j], __fmul_rn(s[j], vq_code_float(vq_code<B_BITS>(word, j))));
  }
  vq_store8(y + uint64_t(t) * 8, v);
  return;
}
const uint32_t b0 = (first / 8) * B_BITS;
const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
const uint64_t src = uint64_t(row) * nbytes;
uint64_t word = 0;
for (uint32_t k = b0; k < b1; ++k) {
  word |= uint64_t(packed[src + k]) << (8 * (k - b0));
}
const uint32_t count = min(8u, d - first);
const uint64_t dst = uint64_t(row) * d + first;
for (uint32_t j = 0; j < count; ++j) {
  const uint32_t ch = first + j;
  const uint64_t p = PER_CHANNEL ? uint64_t(row / gsize) * d + ch : (uint64_t(row) * d + ch) / gsize;
  const float code = float((word >> (j * B_BITS)) & mask);
  y[dst + j] = static_cast<T>(__fadd_rn(__half2float(zeros[p]), __fmul_rn(__half2float(scales[p]), code)));
}
