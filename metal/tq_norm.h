// Shared by the TurboQuant codec kernels: tq_encode, and (after
// tq_common.h) the Prod and RVQ kernels. Needs nothing from tq_common.h.

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

// (H u)_i, unnormalized, for this thread's coordinate i of u (threadgroup
// memory, D threads, D a power of two, every one calling): the butterflies
// in place in cpu::turboquant::fwht's order, both operands of a pair read
// before a barrier and written after it.
template <int D>
inline float tq_butterflies(threadgroup float* u, int i) {
#pragma clang fp contract(off)
  for (int h = 1; h < D; h *= 2) {
    const int lo = i & ~h;
    const float a = u[lo];
    const float b = u[lo + h];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    u[i] = (i & h) ? a - b : a + b;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return u[i];
}

// (Π u)_i for this thread's coordinate i of u (threadgroup memory, one
// thread per coordinate, D threads; every thread must call it): the dense
// row-major Π [D, D] summed in order, or with `hadamard` the ±1 signs s [D]
// of Π u = H (s ⊙ u) / √D, by butterflies on u in place (both operands of a
// pair read before a barrier, written after it): cpu::turboquant::fwht's
// order, bit for bit the CPU's.
template <int D>
inline float tq_rotate_coord(threadgroup float* u, int i, const device float* rotation, bool hadamard) {
#pragma clang fp contract(off)
  if (hadamard) {
    u[i] = u[i] * rotation[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return tq_butterflies<D>(u, i) * (1.0f / precise::sqrt(float(D)));
  }
  float y = 0.0f;
  for (int j = 0; j < D; ++j) {
    y += rotation[i * D + j] * u[j];
  }
  return y;
}

// (Πᵀ y)_i for this thread's coordinate i of y (threadgroup memory, D
// threads, every one calling): the dense Π [D, D] walked down column i in
// order, or with `hadamard` the signs s [D]: s_i (H y / √D)_i by butterflies
// on y in place, as Rotation::inverse (scale, then sign).
template <int D>
inline float tq_unrotate_coord(threadgroup float* y, int i, const device float* rotation, bool hadamard) {
#pragma clang fp contract(off)
  if (hadamard) {
    return tq_butterflies<D>(y, i) * (1.0f / precise::sqrt(float(D))) * rotation[i];
  }
  float o = 0.0f;
  for (int k = 0; k < D; ++k) {
    o += rotation[k * D + i] * y[k];
  }
  return o;
}
