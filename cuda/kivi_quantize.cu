// kivi_quantize: x T [N, D] -> packed uint8 [N, nbytes], scales and zeros
// half. params = {N, D, nbytes, G}; template T, B_BITS, PER_CHANNEL.
// PER_CHANNEL (keys): one (scale, zero) per group of G rows and channel,
// [ceil(N/G), D]; one thread per (row group, 8 channels). Otherwise (values):
// one per row and group of G channels (G a multiple of 8), [N, D/G]; one
// thread per (row, channel group). scale = half((max - min) / (2^B - 1)),
// zero = half(min); code = round((x - zero) / scale) clamped, 0 where scale
// is 0, with the rounded values; round-to-nearest intrinsics throughout.
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t nbytes = params[2];
const uint32_t gsize = params[3];
const float levels = float((1u << B_BITS) - 1u);
const float inf = __int_as_float(0x7f800000);
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (PER_CHANNEL) {
  const uint32_t cgroups = (d + 7) / 8;
  const uint32_t rgroups = (n + gsize - 1) / gsize;
  if (t >= uint64_t(rgroups) * cgroups) {
    return;
  }
  const uint32_t g = uint32_t(t / cgroups);
  const uint32_t first = uint32_t(t % cgroups) * 8;
  const uint32_t count = min(8u, d - first);
  const uint32_t r0 = g * gsize;
  const uint32_t r1 = min(r0 + gsize, n);
  float lo[8];
  float hi[8];
#pragma unroll
  for (uint32_t j = 0; j < 8; ++j) {
    lo[j] = inf;
    hi[j] = -inf;
  }
  for (uint32_t r = r0; r < r1; ++r) {
    for (uint32_t j = 0; j < count; ++j) {
      const float v = static_cast<float>(x[uint64_t(r) * d + first + j]);
      lo[j] = fminf(lo[j], v);
      hi[j] = fmaxf(hi[j], v);
    }
  }
  float s[8];
  float z[8];
  for (uint32_t j = 0; j < count; ++j) {
    const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(hi[j], lo[j]), levels));
    const __half hz = __float2half_rn(lo[j]);
    scales[uint64_t(g) * d + first + j] = hs;
    zeros[uint64_t(g) * d + first + j] = hz;
    s[j] = __half2float(hs);
    z[j] = __half2float(hz);
  }
  const uint32_t b0 = (first / 8) * B_BITS;
  const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
  for (uint32_t r = r0; r < r1; ++r) {
    uint64_t word = 0;
    for (uint32_t j = 0; j < count; ++j) {
      const float v = static_cast<float>(x[uint64_t(r) * d + first + j]);
      const uint32_t c =
          s[j] > 0.0f ? uint32_t(fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(v, z[j]), s[j])), 0.0f), levels)) : 0u;
      word |= uint64_t(c) << (j * B_BITS);
    }
    for (uint32_t k = b0; k < b1; ++k) {
      packed[uint64_t(r) * nbytes + k] = uint8_t(word >> (8 * (k - b0)));
    }
  }
} else {
  const uint32_t per_row = d / gsize;
  if (t >= uint64_t(n) * per_row) {
    return;
  }
  const uint64_t base = t * gsize;
  float lo = inf;
  float hi = -inf;
  for (uint32_t j = 0; j < gsize; ++j) {
    const float v = static_cast<float>(x[base + j]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), levels));
  const __half hz = __float2half_rn(lo);
  scales[t] = hs;
  zeros[t] = hz;
  const float s = __half2float(hs);
  const float z = __half2float(hz);
  const uint64_t row = t / per_row;
  const uint64_t dst = row * nbytes + (t % per_row) * (gsize / 8) * B_BITS;
  for (uint32_t j0 = 0; j0 < gsize; j0 += 8) {
    uint64_t word = 0;
#pragma unroll
    for (uint32_t j = 0; j < 8; ++j) {
      const float v = static_cast<float>(x[base + j0 + j]);
      const uint32_t c = s > 0.0f ? uint32_t(fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(v, z), s)), 0.0f), levels)) : 0u;
      word |= uint64_t(c) << (j * B_BITS);
    }
#pragma unroll
    for (uint32_t k = 0; k < uint32_t(B_BITS); ++k) {
      packed[dst + (j0 / 8) * B_BITS + k] = uint8_t(word >> (8 * k));
    }
  }
}
