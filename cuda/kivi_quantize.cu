// kivi_quantize: x T [N, D] -> packed uint8 [N, nbytes], scales and zeros
// half. sizes = {N, D, nbytes, G}; template T, B_BITS, PER_CHANNEL.
// scale = half((max - min) / (2^B - 1)), zero = half(min); code =
// round((x - zero) / scale) (half away from zero) clamped to [0, 2^B - 1],
// 0 where scale is not positive, with the rounded scale and zero: the CPU
// kernel's codes, bit for bit.
//
// PER_CHANNEL (keys): one (scale, zero) per group of G rows and channel,
// [ceil(N/G), D]. Two fast layouts, chosen by the host with the same tests,
// read x once and keep a group's rows in registers:
// - columns, when G <= 32, B_BITS is 1, 2, 4 or 8 and D B_BITS is a
//   multiple of 32: a thread per (row group, 4 bytes of a row), below;
// - teams, at 3 bits when G <= 32 and D is a multiple of 8: KIVI_LANES
//   adjacent lanes per (row group, 8 channels), each holding 32 /
//   KIVI_LANES of the group's rows; min and max meet through warp
//   shuffles, and each lane computes the scales of 8 / KIVI_LANES channels
//   and shares them.
// Where a block covers whole row groups, the codes go through shared memory
// and leave as whole rows. Otherwise one thread per (row group, 8 channels)
// reads its rows twice.
//
// Values: one (scale, zero) per row and group of G channels (G a multiple of
// 8 dividing D), [N, D/G]; one thread per (row, channel group), which keeps
// the group in registers when G <= 32.
//
// The quotient: with s and zero finite, q0 = (x - zero) * rs, rs the
// correctly rounded 1/s, and one Newton step q0 + (a - s q0) rs (both fma)
// give the correctly rounded quotient (Markstein): no division per element.
// A scale that is not positive gives s = rs = 0, whose quotient is 0 (or
// NaN, clamped to 0): code 0 without a branch. An infinite scale or zero
// divides. Rounding half up of the clamped quotient c is floor(c + 0.5):
// two adds rounding down, the second onto 2^23's integer grid, which leaves
// 2^23 + code, whose bits the packing adds in place.
const uint32_t n = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t gsize = vq_size(params_shape, 3);
const float levels = float((1u << B_BITS) - 1u);
const float inf = __int_as_float(0x7f800000);
// Grids hold fewer than 2^31 threads.
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
// A group's (scale, zero) in float16 and the quotient's operands; quant_of
// also sets `divide` where the scale or the zero is infinite.
struct Quant {
  float s;
  float rs;
  float z;
};
auto quant_of = [&](float lo, float hi, __half* hs_out, __half* hz_out, bool& divide) {
  const __half hs = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), levels));
  const __half hz = __float2half_rn(lo);
  *hs_out = hs;
  *hz_out = hz;
  Quant q;
  q.s = __half2float(hs);
  q.z = __half2float(hz);
  if (!(q.s > 0.0f)) {
    q.s = 0.0f;
    q.rs = 0.0f;
  } else {
    q.rs = __frcp_rn(q.s);
    divide = divide || q.s == inf || fabsf(q.z) == inf;
  }
  return q;
};
// 2^23 + code, as a float. Callers pass a constant `divide`, so that each
// loop over elements is compiled once per case.
auto code_big = [&](float v, const Quant& q, bool divide) {
  const float a = __fsub_rn(v, q.z);
  float quot;
  if (divide) {
    quot = q.s > 0.0f ? __fdiv_rn(a, q.s) : 0.0f;
  } else {
    const float q0 = __fmul_rn(a, q.rs);
    quot = __fmaf_rn(__fmaf_rn(-q.s, q0, a), q.rs, q0);
  }
  const float c = fminf(fmaxf(quot, 0.0f), levels);
  return __fadd_rd(__fadd_rd(c, 0.5f), 8388608.0f);
};
auto pack8 = [&](const float (&big)[8]) { return vq_pack_big8<B_BITS>(big); };
constexpr bool HALVES = sizeof(T) == 2;
if (PER_CHANNEL) {
  const uint32_t cgroups = (d + 7) / 8;
  const uint32_t rgroups = vq_div(n + gsize - 1, gsize);
  // The keys' codes of a block's whole row groups, gathered to leave as
  // whole rows (rows padded, so that lanes that hold different rows write
  // different banks).
  constexpr uint32_t KIVI_TILE_BYTES = 8192;
  __shared__ __align__(16) uint8_t tile[KIVI_TILE_BYTES];
  // The tile's first `rows` rows (`stride` bytes apart) to `out`'s rows, in
  // 32-bit words (nbytes a multiple of 4, out aligned to 4).
  auto store_tile_words = [&](uint8_t* out, uint32_t rows, uint32_t stride) {
    const uint32_t per_row = nbytes / 4;
    for (uint32_t i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
      const uint32_t row = vq_div(i, per_row);
      reinterpret_cast<uint32_t*>(out)[i] =
          *reinterpret_cast<const uint32_t*>(tile + row * stride + (i - row * per_row) * 4);
    }
  };
  constexpr bool WORD_CODES = B_BITS == 1 || B_BITS == 2 || B_BITS == 4 || B_BITS == 8;
  if (WORD_CODES && gsize <= 32 && (d * B_BITS) % 32 == 0) {
    // Columns: a thread per (row group, 4 bytes of a row) holds CPT
    // channels of the group's rows, one load per row (a warp reads whole
    // lines of it), and takes their min and max with no shuffle. Its codes
    // of L rows fill a word; the L lanes of a segment then transpose their
    // words, so that each holds one row's word of the segment's channels.
    constexpr uint32_t CPT = 4 / sizeof(T);
    constexpr uint32_t L = 32 / (CPT * B_BITS);
    constexpr uint32_t WORDS = 32 / L;
    constexpr uint32_t E = CPT * B_BITS;
    const uint32_t cols = d / CPT;
    const uint32_t g = vq_div(t, cols);
    const uint32_t col = t - g * cols;
    const bool live = g < rgroups;
    const uint32_t r0 = g * gsize;
    const uint32_t count = live ? min(gsize, n - r0) : 0u;
    // Rows past the group (or N) repeat its last row, which leaves min and
    // max alone and needs no test per row (their codes are not stored). A
    // 16-bit x off 4-byte alignment reads its elements one by one.
    const bool wide = sizeof(T) == 4 || vq_aligned(x, 4);
    const T* p = x + uint64_t(r0) * d + col * CPT;
    uint32_t raw[32];
    auto load = [&](uint32_t cnt) {
#pragma unroll
      for (uint32_t k = 0; k < 32; ++k) {
        const uint32_t row = k < cnt ? k : cnt - 1;
        if (wide) {
          // A row is `cols` 32-bit words.
          raw[k] = __ldg(reinterpret_cast<const uint32_t*>(p) + row * cols);
        } else {
          const uint16_t* h = reinterpret_cast<const uint16_t*>(p) + row * d;
          raw[k] = uint32_t(h[0]) | uint32_t(h[1]) << 16;
        }
      }
    };
    if (count == 32) {
      load(32);
    } else if (count > 0) {
      load(count);
    } else {
#pragma unroll
      for (uint32_t k = 0; k < 32; ++k) {
        raw[k] = 0;
      }
    }
    float lo[CPT];
    float hi[CPT];
    if constexpr (HALVES) {
      const uint32_t pinf = vq_inf2(static_cast<const T*>(nullptr));
      uint32_t mn = pinf;
      uint32_t mx = pinf | 0x80008000u;
#pragma unroll
      for (uint32_t k = 0; k < 32; ++k) {
        mn = vq_min2(static_cast<const T*>(nullptr), mn, raw[k]);
        mx = vq_max2(static_cast<const T*>(nullptr), mx, raw[k]);
      }
#pragma unroll
      for (uint32_t j = 0; j < CPT; ++j) {
        lo[j] = vq_word_elem(static_cast<const T*>(nullptr), mn, j);
        hi[j] = vq_word_elem(static_cast<const T*>(nullptr), mx, j);
      }
    } else {
      lo[0] = inf;
      hi[0] = -inf;
#pragma unroll
      for (uint32_t k = 0; k < 32; ++k) {
        lo[0] = fminf(lo[0], __uint_as_float(raw[k]));
        hi[0] = fmaxf(hi[0], __uint_as_float(raw[k]));
      }
    }
    Quant q[CPT];
    __align__(4) __half hs[CPT];
    __align__(4) __half hz[CPT];
    bool divide = false;
#pragma unroll
    for (uint32_t j = 0; j < CPT; ++j) {
      q[j] = quant_of(lo[j], hi[j], &hs[j], &hz[j], divide);
    }
    if (live) {
      vq_copy_n<CPT>(hs, scales + uint64_t(g) * d + col * CPT);
      vq_copy_n<CPT>(hz, zeros + uint64_t(g) * d + col * CPT);
    }
    // Word w: the codes of rows w L .. w L + L - 1, E bits a row.
    uint32_t words[WORDS];
    auto encode = [&](bool div) {
#pragma unroll
      for (uint32_t w = 0; w < WORDS; ++w) {
        uint32_t sum = 0;
#pragma unroll
        for (uint32_t i = 0; i < L; ++i) {
          const uint32_t k = w * L + i;
#pragma unroll
          for (uint32_t j = 0; j < CPT; ++j) {
            const float v = vq_word_elem(static_cast<const T*>(nullptr), raw[k], j);
            sum += __float_as_uint(code_big(v, q[j], div)) << (i * E + j * B_BITS);
          }
        }
        words[w] = sum - uint32_t(vq_big_sum32<B_BITS, L * CPT>());
      }
    };
    if (divide) {
      encode(true);
    } else {
      encode(false);
    }
    // Transpose within segments of L lanes: lane l ends with the words of
    // rows w L + l, element j (E bits) from lane j. At level h, lanes l and
    // l ^ h swap the halves of their words that the other's keeps.
    const uint32_t l = (threadIdx.x % 32) % L;
#pragma unroll
    for (uint32_t h = L / 2; h >= 1; h /= 2) {
      const uint32_t m = vq_transpose_mask<E>(h);
      const bool up = (l & h) != 0;
#pragma unroll
      for (uint32_t w = 0; w < WORDS; ++w) {
        const uint32_t send = up ? (words[w] & ~m) << (h * E) : (words[w] & m) >> (h * E);
        const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, h);
        words[w] = (words[w] & (up ? m : ~m)) | recv;
      }
    }
    // Lane l holds word `word` of rows w L + l.
    const uint32_t word = (col - l) / L;
    const uint32_t stride = nbytes + 4;
    const uint32_t groups = blockDim.x / cols;
    if (blockDim.x % cols == 0 && groups * gsize * stride <= KIVI_TILE_BYTES) {
      const uint32_t g0 = blockIdx.x * groups;
      if (live) {
#pragma unroll
        for (uint32_t w = 0; w < WORDS; ++w) {
          const uint32_t k = w * L + l;
          if (k < count) {
            *reinterpret_cast<uint32_t*>(tile + ((g - g0) * gsize + k) * stride + word * 4) = words[w];
          }
        }
      }
      __syncthreads();
      const uint32_t row0 = g0 * gsize;
      store_tile_words(packed + uint64_t(row0) * nbytes, min(groups * gsize, n > row0 ? n - row0 : 0u), stride);
      return;
    }
    if (live) {
#pragma unroll
      for (uint32_t w = 0; w < WORDS; ++w) {
        const uint32_t k = w * L + l;
        if (k < count) {
          reinterpret_cast<uint32_t*>(packed + uint64_t(r0 + k) * nbytes)[word] = words[w];
        }
      }
    }
    return;
  }
  if (!WORD_CODES && gsize <= 32 && d % 8 == 0) {
    // 8 lanes of 4 rows: 16 registers of 16-bit elements, 32 of float ones
    // (4 lanes of 8 rows held more registers than the lanes they saved).
    constexpr uint32_t KIVI_LANES = 8;
    constexpr uint32_t KIVI_ROWS = 32 / KIVI_LANES;
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
    uint4 raw[KIVI_ROWS][HALVES ? 1 : 2];
#pragma unroll
    for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
      const uint32_t r = r0 + sub * KIVI_ROWS + k;
      if (sub * KIVI_ROWS + k < gsize && r < r1) {
        vq_read_raw8(x + (uint64_t(r) * cgroups + c) * 8, raw[k], wide);
      }
    }
    float lo[8];
    float hi[8];
    vq_minmax8<T, KIVI_ROWS, KIVI_LANES>(
        raw, [&](uint32_t k) { return sub * KIVI_ROWS + k < gsize && r0 + sub * KIVI_ROWS + k < r1; }, lo, hi);
    // Each lane's 8 / KIVI_LANES channels' parameters, then every lane
    // takes all 8 from their owners.
    Quant mine[8 / KIVI_LANES];
    __half hs[8 / KIVI_LANES];
    __half hz[8 / KIVI_LANES];
    bool divide = false;
#pragma unroll
    for (uint32_t i = 0; i < 8 / KIVI_LANES; ++i) {
      const uint32_t j = i * KIVI_LANES + sub;
      float l = lo[0];
      float h = hi[0];
#pragma unroll
      for (uint32_t jj = 1; jj < 8; ++jj) {
        if (jj == j) {
          l = lo[jj];
          h = hi[jj];
        }
      }
      mine[i] = quant_of(l, h, &hs[i], &hz[i], divide);
    }
    const uint32_t base_lane = (threadIdx.x % 32) & ~(KIVI_LANES - 1);
    // Whether any channel of the team divides.
    const uint32_t team_mask = ((1u << KIVI_LANES) - 1u) << base_lane;
    divide = (__ballot_sync(0xffffffffu, divide) & team_mask) != 0;
#pragma unroll
    for (uint32_t i = 0; i < 8 / KIVI_LANES; ++i) {
      if (live) {
        const uint64_t p = uint64_t(g) * d + c * 8 + i * KIVI_LANES + sub;
        scales[p] = hs[i];
        zeros[p] = hz[i];
      }
    }
    // Channel by channel, its parameters taken from their owner just before
    // its codes, so that few of them are live at once; each row's codes
    // summed in place (rows past the group compute codes nobody stores).
    using Word = vq_word_t<B_BITS>;
    Word words[KIVI_ROWS];
    auto encode = [&](bool div) {
#pragma unroll
      for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
        words[k] = 0;
      }
#pragma unroll
      for (uint32_t j = 0; j < 8; ++j) {
        const Quant& m = mine[j / KIVI_LANES];
        const int src = int(base_lane + j % KIVI_LANES);
        Quant qj;
        qj.s = __shfl_sync(0xffffffffu, m.s, src);
        qj.rs = __shfl_sync(0xffffffffu, m.rs, src);
        qj.z = __shfl_sync(0xffffffffu, m.z, src);
#pragma unroll
        for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
          const float big = code_big(vq_raw_elem(static_cast<const T*>(nullptr), raw[k], j), qj, div);
          words[k] += Word(__float_as_uint(big)) << (j * B_BITS);
        }
      }
    };
    if (divide) {
      encode(true);
    } else {
      encode(false);
    }
    // A lane's codes are B_BITS bytes of each of its rows (at D = 128, a
    // few bytes per row and warp). When the block's teams
    // cover whole row groups, its codes are one run of whole rows: the block
    // gathers them in shared memory (rows padded, so that a warp's lanes,
    // which hold different rows, write different banks) and writes the run
    // in words.
    constexpr uint32_t PAD = vq_bytes_align<B_BITS>() > 4 ? vq_bytes_align<B_BITS>() : 4;
    const uint32_t teams = blockDim.x / KIVI_LANES;
    const uint32_t stride = nbytes + PAD;
    if (teams % cgroups == 0 && (teams / cgroups) * gsize * stride <= KIVI_TILE_BYTES) {
      const uint32_t row0 = vq_div(blockIdx.x * teams, cgroups) * gsize;
      if (live) {
#pragma unroll
        for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
          const uint32_t r = r0 + sub * KIVI_ROWS + k;
          if (sub * KIVI_ROWS + k < gsize && r < r1) {
            vq_store_bytes<B_BITS>(tile + (r - row0) * stride + c * B_BITS, words[k] - Word(vq_big_sum<B_BITS>()));
          }
        }
      }
      __syncthreads();
      const uint32_t rows = min((teams / cgroups) * gsize, n > row0 ? n - row0 : 0u);
      uint8_t* out = packed + uint64_t(row0) * nbytes;
      if (nbytes % 4 == 0 && vq_aligned(out, 4)) {
        store_tile_words(out, rows, stride);
      } else {
        for (uint32_t i = threadIdx.x; i < rows * nbytes; i += blockDim.x) {
          const uint32_t row = vq_div(i, nbytes);
          out[i] = tile[row * stride + (i - row * nbytes)];
        }
      }
      return;
    }
    if (!live) {
      return;
    }
#pragma unroll
    for (uint32_t k = 0; k < KIVI_ROWS; ++k) {
      const uint32_t r = r0 + sub * KIVI_ROWS + k;
      if (sub * KIVI_ROWS + k < gsize && r < r1) {
        vq_store_bytes<B_BITS>(packed + (uint64_t(r) * cgroups + c) * B_BITS, words[k] - Word(vq_big_sum<B_BITS>()));
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
  Quant q[8];
  bool divide = false;
  for (uint32_t j = 0; j < count; ++j) {
    q[j] = quant_of(lo[j], hi[j], &scales[uint64_t(g) * d + first + j], &zeros[uint64_t(g) * d + first + j], divide);
  }
  const uint32_t b0 = (first / 8) * B_BITS;
  const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
  for (uint32_t r = r0; r < r1; ++r) {
    float big[8];
    for (uint32_t j = 0; j < 8; ++j) {
      big[j] = j < count ? code_big(static_cast<float>(x[uint64_t(r) * d + first + j]), q[j], divide) : 8388608.0f;
    }
    const unsigned long long word = pack8(big);
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
    uint4 raw[4][HALVES ? 1 : 2];
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      if (k < chunks) {
        vq_read_raw8(x + base + k * 8, raw[k], wide);
      }
    }
    float lo8[8];
    float hi8[8];
    vq_minmax8<T, 4, 1>(raw, [&](uint32_t k) { return k < chunks; }, lo8, hi8);
    float lo = lo8[0];
    float hi = hi8[0];
#pragma unroll
    for (int j = 1; j < 8; ++j) {
      lo = fminf(lo, lo8[j]);
      hi = fmaxf(hi, hi8[j]);
    }
    bool divide = false;
    const Quant q = quant_of(lo, hi, &scales[t], &zeros[t], divide);
    uint64_t word[4];
    auto encode = [&](bool div) {
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k) {
        word[k] = 0;
        if (k < chunks) {
          float v[8];
          vq_load8(reinterpret_cast<const T*>(raw[k]), v);
          float big[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            big[j] = code_big(v[j], q, div);
          }
          word[k] = pack8(big);
        }
      }
    };
    if (divide) {
      encode(true);
    } else {
      encode(false);
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
  bool divide = false;
  const Quant q = quant_of(lo, hi, &scales[t], &zeros[t], divide);
  for (uint32_t k = 0; k < chunks; ++k) {
    float v[8];
    vq_read8(x + base + k * 8, v, wide);
    float big[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      big[j] = code_big(v[j], q, divide);
    }
    vq_store_bytes<B_BITS>(packed + dst + k * B_BITS, pack8(big));
  }
}
