// kivi_dequantize: packed uint8 [N, nbytes], scales, zeros half -> y T
// [N, D] = zero + scale * code (float32, no fma). sizes = {N, D, nbytes, G};
// template T, B_BITS, PER_CHANNEL (scales [ceil(N/G), D], else [N, D/G]),
// ITEMS.
//
// When D is a multiple of 8 (always so for values) and the pointers allow
// wide accesses, a thread takes one group of 8 channels in ITEMS consecutive
// rows (adjacent lanes, adjacent groups: each request coalesced), requests
// all its codes first, and per row reads B_BITS bytes and writes 8 elements
// with one access each. A key's 8 scales and zeros are read once per row
// group, a value's one of each per row (G is a multiple of 8). Each code
// stays where the packed word holds it: (its bits | 2^23's) - 2^23 is the
// code times 2^pos exactly, and the scale, times 2^-pos exactly (a float16
// scale is far from float32's subnormals), gives the same product, so a code
// costs one logic op and one add before its multiply-add.
// Otherwise one thread per (row, group of 8 codes), ITEMS rows apart.
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t gsize = vq_size(params_shape, 3);
const uint32_t groups = (d + 7) / 8;
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
if (d % 8 == 0 && vq_aligned(packed, vq_bytes_align<B_BITS>()) && vq_aligned(y, 16) &&
    (!PER_CHANNEL || (vq_aligned(scales, 16) && vq_aligned(zeros, 16)))) {
  const uint32_t rset = vq_div(t, groups);
  const uint32_t g = t - rset * groups;
  const uint32_t r0 = rset * ITEMS;
  if (r0 >= n) {
    return;
  }
  unsigned long long words[ITEMS];
  // A value's scale and zero per row, requested with the codes.
  __half row_s[PER_CHANNEL ? 1 : ITEMS];
  __half row_z[PER_CHANNEL ? 1 : ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (r0 + k < n) {
      words[k] = vq_load_bytes<B_BITS>(packed + (uint64_t(r0 + k) * groups + g) * B_BITS);
      if (!PER_CHANNEL) {
        // G divides D here (a multiple of 8 dividing it): no carry from the row.
        const uint64_t p = uint64_t(r0 + k) * vq_div(d, gsize) + vq_div(g * 8, gsize);
        row_s[PER_CHANNEL ? 0 : k] = scales[p];
        row_z[PER_CHANNEL ? 0 : k] = zeros[p];
      }
    }
  }
  float s[8];
  float z[8];
  // The row group whose scales s and z hold ends before row `until`.
  uint32_t until = 0;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const uint32_t row = r0 + k;
    if (row >= n) {
      return;
    }
    if (PER_CHANNEL) {
      if (row >= until) {
        const uint32_t rg = vq_div(row, gsize);
        until = (rg + 1) * gsize;
        const uint64_t p = uint64_t(rg) * d + g * 8;
        vq_load8(scales + p, s);
        vq_load8(zeros + p, z);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s[j] = __fmul_rn(s[j], vq_code_unscale<B_BITS>(j));
        }
      }
    } else {
      const float s0 = __half2float(row_s[PER_CHANNEL ? 0 : k]);
      const float z0 = __half2float(row_z[PER_CHANNEL ? 0 : k]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j] = __fmul_rn(s0, vq_code_unscale<B_BITS>(j));
        z[j] = z0;
      }
    }
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = __fadd_rn(z[j], __fmul_rn(s[j], vq_code_scaled<B_BITS>(words[k], j)));
    }
    vq_store8(y + (uint64_t(row) * groups + g) * 8, v);
  }
  return;
}
constexpr uint64_t mask = (uint64_t(1) << B_BITS) - 1;
const uint64_t threads = uint64_t(vq_div(n + ITEMS - 1, ITEMS)) * groups;
#pragma unroll 1
for (int k = 0; k < ITEMS; ++k) {
  const uint64_t item = t + k * threads;
  if (item >= uint64_t(n) * groups) {
    return;
  }
  const uint32_t row = uint32_t(item / groups);
  const uint32_t first = uint32_t(item - uint64_t(row) * groups) * 8;
  const uint32_t b0 = (first / 8) * B_BITS;
  const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
  const uint64_t src = uint64_t(row) * nbytes;
  uint64_t word = 0;
  for (uint32_t b = b0; b < b1; ++b) {
    word |= uint64_t(packed[src + b]) << (8 * (b - b0));
  }
  const uint32_t count = min(8u, d - first);
  const uint64_t dst = uint64_t(row) * d + first;
  for (uint32_t j = 0; j < count; ++j) {
    const uint32_t ch = first + j;
    const uint64_t p = PER_CHANNEL ? uint64_t(row / gsize) * d + ch : (uint64_t(row) * d + ch) / gsize;
    const float code = float((word >> (j * B_BITS)) & mask);
    y[dst + j] = static_cast<T>(__fadd_rn(__half2float(zeros[p]), __fmul_rn(__half2float(scales[p]), code)));
  }
}
