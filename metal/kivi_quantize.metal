// kivi_quantize: x T [N, D] -> packed uint8 [N, nbytes], scales and zeros
// float16. params = {N, D, nbytes, G}; template T, B_BITS, PER_CHANNEL.
// PER_CHANNEL (keys): one (scale, zero) per group of G rows and channel,
// [ceil(N/G), D]; one thread per (row group, 8 channels) reads its 8 columns
// of the group twice (min/max, then codes). Otherwise (values): one per row
// and group of G channels (G a multiple of 8), [N, D/G]; one thread per
// (row, channel group). scale = half((max - min) / (2^B - 1)), zero =
// half(min); code = round((x - zero) / scale) clamped, 0 where scale is 0,
// with the rounded values, as the CPU kernel.
#pragma clang fp contract(off)
const uint n = params[0];
const uint d = params[1];
const uint nbytes = params[2];
const uint gsize = params[3];
const float levels = float((1u << B_BITS) - 1u);
const uint t = thread_position_in_grid.x;
if (PER_CHANNEL) {
  const uint cgroups = (d + 7) / 8;
  const uint rgroups = (n + gsize - 1) / gsize;
  if (t >= rgroups * cgroups) {
    return;
  }
  const uint g = t / cgroups;
  const uint first = (t % cgroups) * 8;
  const uint count = min(8u, d - first);
  const uint r0 = g * gsize;
  const uint r1 = min(r0 + gsize, n);
  float lo[8];
  float hi[8];
  for (uint j = 0; j < 8; ++j) {
    lo[j] = INFINITY;
    hi[j] = -INFINITY;
  }
  for (uint r = r0; r < r1; ++r) {
    for (uint j = 0; j < count; ++j) {
      const float v = float(x[ulong(r) * d + first + j]);
      lo[j] = min(lo[j], v);
      hi[j] = max(hi[j], v);
    }
  }
  float s[8];
  float z[8];
  for (uint j = 0; j < count; ++j) {
    const half hs = half((hi[j] - lo[j]) / levels);
    const half hz = half(lo[j]);
    scales[ulong(g) * d + first + j] = hs;
    zeros[ulong(g) * d + first + j] = hz;
    s[j] = float(hs);
    z[j] = float(hz);
  }
  const uint b0 = (first / 8) * B_BITS;
  const uint b1 = min(b0 + uint(B_BITS), nbytes);
  for (uint r = r0; r < r1; ++r) {
    ulong word = 0;
    for (uint j = 0; j < count; ++j) {
      const float v = float(x[ulong(r) * d + first + j]);
      const uint c = s[j] > 0.0f ? uint(clamp(round((v - z[j]) / s[j]), 0.0f, levels)) : 0u;
      word |= ulong(c) << (j * B_BITS);
    }
    for (uint k = b0; k < b1; ++k) {
      packed[ulong(r) * nbytes + k] = uint8_t(word >> (8 * (k - b0)));
    }
  }
} else {
  const uint per_row = d / gsize;
  if (t >= n * per_row) {
    return;
  }
  const ulong base = ulong(t) * gsize;
  float lo = INFINITY;
  float hi = -INFINITY;
  for (uint j = 0; j < gsize; ++j) {
    const float v = float(x[base + j]);
    lo = min(lo, v);
    hi = max(hi, v);
  }
  const half hs = half((hi - lo) / levels);
  const half hz = half(lo);
  scales[t] = hs;
  zeros[t] = hz;
  const float s = float(hs);
  const float z = float(hz);
  const uint row = t / per_row;
  const ulong dst = ulong(row) * nbytes + ulong(t % per_row) * (gsize / 8) * B_BITS;
  for (uint j0 = 0; j0 < gsize; j0 += 8) {
    ulong word = 0;
    for (uint j = 0; j < 8; ++j) {
      const float v = float(x[base + j0 + j]);
      const uint c = s > 0.0f ? uint(clamp(round((v - z) / s), 0.0f, levels)) : 0u;
      word |= ulong(c) << (j * B_BITS);
    }
    for (uint k = 0; k < uint(B_BITS); ++k) {
      packed[dst + (j0 / 8) * B_BITS + k] = uint8_t(word >> (8 * k));
    }
  }
}
