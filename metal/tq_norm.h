// Shared by the TurboQuant-Prod and -RVQ kernels (after tq_common.h).

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
