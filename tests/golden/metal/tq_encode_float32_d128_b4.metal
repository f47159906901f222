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
template <typename T, int D, int B_BITS, bool ROTATE, bool HADAMARD>
[[kernel]] void custom_kernel_veloxquant_tq_encode__float_128_4_1_0_float_float_float_uint8_t_float16_t(
  const device float* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  const device float* rotation [[buffer(2)]],
  const device float* centroids [[buffer(3)]],
  device uint8_t* codes [[buffer(4)]],
  device float16_t* norms [[buffer(5)]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {
// tq_encode: x T [N, D] -> codes uint8 [N, D*B_BITS/8], norms float16 [N].
// rotation float32 [D, D] (row-major Π), or [D] (HADAMARD: the signs of a
// Hadamard rotation, Π u = H (s ⊙ u) / √D); not read unless ROTATE.
// centroids float32 [2^B_BITS] sorted,
// N = x's rows. One threadgroup of D threads per vector: the norm,
// y = Π x/‖x‖, the nearest centroid per coordinate and the packing, with no
// intermediate in device memory. Same arithmetic order as the CPU kernel,
// never contracted into an fma.
#pragma clang fp contract(off)
constexpr int ROW_BYTES = D * B_BITS / 8;
constexpr int K = 1 << B_BITS;
threadgroup float u[D];
threadgroup uchar idx[D];
threadgroup float s_norm[1];
const uint n = uint(x_shape[0]);
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
const float xi = float(x[ulong(v) * D + i]);
u[i] = xi;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i == 0) {
  float s2 = 0.0f;
  for (int j = 0; j < D; ++j) {
    s2 += u[j] * u[j];
  }
  s_norm[0] = sqrt(s2);
  norms[v] = half(min(s_norm[0], 65504.0f));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float s = s_norm[0];
u[i] = s > 0.0f ? xi / s : 0.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float y = ROTATE ? tq_rotate_coord<D>(u, i, rotation, HADAMARD) : u[i];
float best = INFINITY;
int best_k = 0;
for (int k = 0; k < K; ++k) {
  const float diff = y - centroids[k];
  const float dist = diff * diff;
  if (dist < best) {
    best = dist;
    best_k = k;
  }
}
idx[i] = uchar(best_k);
threadgroup_barrier(mem_flags::mem_threadgroup);
if (i % 8 == 0) {
  ulong word = 0;
  for (int j = 0; j < 8; ++j) {
    word |= ulong(idx[i + j]) << (j * B_BITS);
  }
  const ulong dst = ulong(v) * ROW_BYTES + (i / 8) * B_BITS;
  for (int k = 0; k < B_BITS; ++k) {
    codes[dst + k] = uint8_t(word >> (8 * k));
  }
}

}

template [[host_name("custom_kernel_veloxquant_tq_encode__float_128_4_1_0_float_float_float_uint8_t_float16_t")]] [[kernel]] decltype(custom_kernel_veloxquant_tq_encode__float_128_4_1_0_float_float_float_uint8_t_float16_t<float, 128, 4, 1, 0>) custom_kernel_veloxquant_tq_encode__float_128_4_1_0_float_float_float_uint8_t_float16_t<float, 128, 4, 1, 0>;
