// kivi_quantize: x T [N, D] -> packed uint8 [N, nbytes], scales and zeros
// half. params = {N, D, nbytes, G}; template T, B_BITS, PER_CHANNEL.
// scale = half((max - min) / (2^B - 1)), zero = half(min); code =
// round((x - zero) / scale) clamped, 0 where scale is 0, with the rounded
// values; round-to-nearest intrinsics throughout.
//
// PER_CHANNEL (keys): one (scale, zero) per group of G rows and channel,
// [ceil(N/G), D]. When G <= 32 and D is a multiple of 8 (the fast layout,
// chosen by the host with the same test): KIVI_LANES threads per (row group,
// 8 channels), adjacent lanes, each holding up to KIVI_ROWS of the group's
// rows in registers; min and max meet through warp shuffles, so x is read
// once.
// Otherwise one thread per (row group, 8 channels) reads its rows twice.
//
// Values: one (scale, zero) per row and group of G channels (G a multiple of
// 8 dividing D), [N, D/G]; one thread per (row, channel group), which keeps
// the group in registers when G <= 32.
const uint32_t n = params[0];
const uint32_t d = params[1];
const uint32_t nbytes = params[2];
const uint32_t gsize = params[3];
const float levels = float((1u << B_BITS) - 1u);
const float inf = __int_as_float(0x7f800000);
// The keys' fast layout: 8 lanes of 4 rows cover a group of up to 32 rows
// with 32 registers of elements per thread (more would cost occupancy).
constexpr uint32_t KIVI_LANES = 8;
constexpr uint32_t KIVI_ROWS = 4;
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
// round((v - z) / s) (half away from zero) clamped to [0, 2^B - 1], in
// full-rate float and logic instructions. The quotient comes from the
// correctly rounded reciprocal of s, within 2^-23 relative of the divided
// one: it rounds to the same code unless it lies within 1e-3 of a boundary
// k + 0.5 (codes are at most 255, so the two differ by under 1e-4), and only
// then is v - z divided. Clamping first is exact (rounding is monotonic, the
// bounds are integers; NaN clamps to 0) and makes boundaries outside the
// range agree anyway. Adding 2^23 rounds the clamped quotient to an integer,
// ties to even, in the low mantissa bits; a tie rounded down (remainder
// exactly +0.5) goes up, as round() does.
auto code_of = [&](float v, float s, float rs, float z) {
  if (!(s > 0.0f)) {
    return 0u;
  }
  const float a = __fsub_rn(v, z);
  float q = fminf(fmaxf(__fmul_rn(a, rs), 0.0f), levels);
  float big = __fadd_rn(q, 8388608.0f);
  float rem = __fsub_rn(q, __fsub_rn(big, 8388608.0f));
  if (fabsf(fabsf(rem) - 0.5f) < 1e-3f) {
    q = fminf(fmaxf(__fdiv_rn(a, s), 0.0f), levels);
    big = __fadd_rn(q, 8388608.0f);
    rem = __fsub_rn(q, __fsub_rn(big, 8388608.0f));
  }
  return (__float_as_uint(big) - 0x4B000000u) + (rem == 0.5f ? 1u : 0u);
};
if (PER_CHANNEL) {
  const uint32_t cgroups = (d + 7) / 8;
  const uint32_t rgroups = vq_div(n + gsize - 1, gsize);
  if (gsize <= 32 && d % 8 == 0) {
    // Every lane takes part in the shuffles: the grid is a whole number of
    // warps, and a lane past the end works on nothing.
    const uint32_t team = t / KIVI_LANES;
    const uint32_t sub = t % KIVI_LANES;
    const bool live = team < rgroups * cgroups;
    const uint32_t g = live ? vq_div(team, cgroups) : 0;
    const uint32_t c = live ? team - g * cgroups : 0;
    const uint32_t r0 = g * gsize;
    const uint32_t r1 = live ? min(r0 + gsize, n) : r0;
    const bool wide = vq_aligned(x, 16);
    float v[KIVI_ROWS][8];
    float lo[8];
    float hi[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      lo[j] = inf;
      hi[j] = -inf;
    }
#pragma unroll
    for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
      const uint32_t r = r0 + sub * KIVI_ROWS + k;
      if (sub * KIVI_ROWS + k < gsize && r < r1) {
        vq_read8(x + (uint64_t(r) * cgroups + c) * 8, v[k], wide);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          lo[j] = fminf(lo[j], v[k][j]);
          hi[j] = fmaxf(hi[j], v[k][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (uint32_t o = 1; o < KIVI_LANES; o *= 2) {
        lo[j] = fminf(lo[j], __shfl_xor_sync(0xffffffffu, lo[j], o));
        hi[j] = fmaxf(hi[j], __shfl_xor_sync(0xffffffffu, hi[j], o));
      }
    }
    if (!live) {
      return;
    }
    float s[8];
    float rs[8];
    float z[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j] = __half2float(__float2half_rn(__fdiv_rn(__fsub_rn(hi[j], lo[j]), levels)));
      rs[j] = __frcp_rn(s[j]);
      z[j] = __half2float(__float2half_rn(lo[j]));
    }
    if (sub == 0) {
      vq_store8(scales + uint64_t(g) * d + c * 8, s);
      vq_store8(zeros + uint64_t(g) * d + c * 8, z);
    }
#pragma unroll
    for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
      const uint32_t r = r0 + sub * KIVI_ROWS + k;
      if (sub * KIVI_ROWS + k < gsize && r < r1) {
        uint64_t word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          word |= uint64_t(code_of(v[k][j], s[j], rs[j], z[j])) << (j * B_BITS);
        }
        vq_store_bytes<B_BITS>(packed + (uint64_t(r) * cgroups + c) * B_BITS, word);
      }
    }
    return;
  }
  if (t >= rgroups * cgroups) {
    return;
  }
  const uint32_t g = t / cgroups;
  const uint32_t first = (t % cgroups) * 8;
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
  float rs[8];
  for (uint32_t j = 0; j < count; ++j) {
    rs[j] = __frcp_rn(s[j]);
  }
  const uint32_t b0 = (first / 8) * B_BITS;
  const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
  for (uint32_t r = r0; r < r1; ++r) {
    uint64_t word = 0;
    for (uint32_t j = 0; j < count; ++j) {
      word |= uint64_t(code_of(static_cast<float>(x[uint64_t(r) * d + first + j]), s[j], rs[j], z[j])) << (j * B_BITS);
    }
    for (uint32_t k = b0; k < b1; ++k) {
      packed[uint64_t(r) * nbytes + k] = uint8_t(word >> (8 * (k - b0)));
    }
  }
} else {
  const uint32_t per_row = vq_div(d, gsize);
  if (t >= n * per_row) {
    return;
  }
  const uint64_t base = uint64_t(t) * gsize;
  const uint64_t dst = uint64_t(t) * (gsize / 8) * B_BITS;
  const uint32_t chunks = gsize / 8;
  const bool wide = vq_aligned(x, 16);
  if (chunks <= 4) {
    float v[4][8];
    float lo = inf;
    float hi = -inf;
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      if (k < chunks) {
        vq_read8(x + base + k * 8, v[k], wide);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          lo = fminf(lo, v[k][j]);
          hi = fmaxf(hi, v[k][j]);
        }
      }
    }
    const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), levels));
    const __half hz = __float2half_rn(lo);
    scales[t] = hs;
    zeros[t] = hz;
    const float s = __half2float(hs);
    const float rs = __frcp_rn(s);
    const float z = __half2float(hz);
    uint64_t word[4];
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      word[k] = 0;
      if (k < chunks) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          word[k] |= uint64_t(code_of(v[k][j], s, rs, z)) << (j * B_BITS);
        }
      }
    }
    // A full group of 32 is 4 B_BITS contiguous bytes: one or two stores
    // where the width allows it, rather than four narrow ones.
    uint8_t* out = packed + dst;
    if constexpr (B_BITS == 1 || B_BITS == 2 || B_BITS == 4 || B_BITS == 8) {
      if (chunks == 4 && vq_aligned(out, B_BITS == 1 ? 4 : (B_BITS == 2 ? 8 : 16))) {
        if constexpr (B_BITS == 1) {
          *reinterpret_cast<uint32_t*>(out) = uint32_t(word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24);
        } else if constexpr (B_BITS == 2) {
          *reinterpret_cast<unsigned long long*>(out) = word[0] | word[1] << 16 | word[2] << 32 | word[3] << 48;
        } else if constexpr (B_BITS == 4) {
          *reinterpret_cast<uint4*>(out) = make_uint4(uint32_t(word[0]), uint32_t(word[1]), uint32_t(word[2]), uint32_t(word[3]));
        } else {
          reinterpret_cast<ulonglong2*>(out)[0] = make_ulonglong2(word[0], word[1]);
          reinterpret_cast<ulonglong2*>(out)[1] = make_ulonglong2(word[2], word[3]);
        }
        return;
      }
    }
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      if (k < chunks) {
        vq_store_bytes<B_BITS>(out + k * B_BITS, word[k]);
      }
    }
    return;
  }
  float lo = inf;
  float hi = -inf;
  for (uint32_t k = 0; k < chunks; ++k) {
    float v[8];
    vq_read8(x + base + k * 8, v, wide);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      lo = fminf(lo, v[j]);
      hi = fmaxf(hi, v[j]);
    }
  }
  const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), levels));
  const __half hz = __float2half_rn(lo);
  scales[t] = hs;
  zeros[t] = hz;
  const float s = __half2float(hs);
  const float rs = __frcp_rn(s);
  const float z = __half2float(hz);
  for (uint32_t k = 0; k < chunks; ++k) {
    float v[8];
    vq_read8(x + base + k * 8, v, wide);
    uint64_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      word |= uint64_t(code_of(v[j], s, rs, z)) << (j * B_BITS);
    }
    vq_store_bytes<B_BITS>(packed + dst + k * B_BITS, word);
  }
}
