// Shared by the TurboQuant cache kernels.

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's
// layout) starting at byte `base` of `buf`. A macro, so that it reads any
// address space (device, constant or threadgroup) without pointer arguments.
#define VQ_CODE_AT(buf, base, j, bits)                                                             \
  (((uint((buf)[(base) + (((j) * (bits)) >> 3)]) |                                                 \
     ((((j) * (bits)) & 7u) + (bits) > 8u ? uint((buf)[(base) + (((j) * (bits)) >> 3) + 1]) << 8   \
                                           : 0u)) >>                                               \
    (((j) * (bits)) & 7u)) &                                                                       \
   ((1u << (bits)) - 1u))

// ‖v‖ of n floats as crate::quant computes it: float64 squares summed in
// order, the root rounded to float32. Metal has no float64, so the sum is an
// unevaluated pair hi + lo (exact squares by fma, Knuth's two-sum), and the
// float32 root gets one Newton step against the exact remainder: the result is
// the correctly rounded root except within about 2^-40 of a rounding midpoint.
inline float tq_norm(threadgroup const float* v, int n) {
#pragma clang fp contract(off)
  float hi = 0.0f;
  float lo = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float p = v[j] * v[j];
    const float pe = fma(v[j], v[j], -p);
    const float s = hi + p;
    const float bb = s - hi;
    const float e = (hi - (s - bb)) + (p - bb);
    const float t = e + (lo + pe);
    hi = s + t;
    lo = t - (hi - s);
  }
  if (!(hi > 0.0f) || isinf(hi)) {
    return sqrt(hi);
  }
  const float r = sqrt(hi);
  const float rr = r * r;
  const float rre = fma(r, r, -rr);
  const float rem = ((hi - rr) - rre) + lo;
  return r + rem / (2.0f * r);
}
