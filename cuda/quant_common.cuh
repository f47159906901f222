// Shared by the quantizer and TurboQuant CUDA kernels (placed before the
// kernel, in the global namespace, after MLX's device utilities, which bring
// the half and bfloat16 types, and after vq_access.cuh and quant_load.cuh).
//
// The packed layouts keep 8 codes of B bits in B consecutive bytes, so a
// thread that owns 8 elements moves B bytes one way and 8 elements the other;
// these helpers make each of those one or two wide memory operations.

// vq_load_bytes<NB> where `wide` (p aligned to NB), else NB byte loads.
template <int NB>
__device__ __forceinline__ unsigned long long vq_read_bytes(const uint8_t* p, bool wide) {
  if (wide) {
    return vq_load_bytes<NB>(p);
  }
  unsigned long long v = 0;
#pragma unroll
  for (int y = 0; y < NB; ++y) v |= static_cast<unsigned long long>(p[y]) << (8 * y);
  return v;
}

// Stores the low NB bytes of v at p, little-endian (offsets as for vq_load_bytes).
template <int NB>
__device__ __forceinline__ void vq_store_bytes(uint8_t* p, unsigned long long v) {
  if constexpr (NB == 1) {
    p[0] = uint8_t(v);
  } else if constexpr (NB == 2) {
    *reinterpret_cast<uint16_t*>(p) = uint16_t(v);
  } else if constexpr (NB == 4) {
    *reinterpret_cast<uint32_t*>(p) = uint32_t(v);
  } else if constexpr (NB == 8) {
    *reinterpret_cast<unsigned long long*>(p) = v;
  } else {
#pragma unroll
    for (int y = 0; y < NB; ++y) p[y] = uint8_t(v >> (8 * y));
  }
}

// N (a power of two up to 8) floats to N consecutive elements at p, aligned
// to N elements: one store.
template <int N>
__device__ __forceinline__ void vq_store_n(float* p, const float* v) {
  if constexpr (N == 8) {
    vq_store8(p, v);
  } else if constexpr (N == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (N == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = v[k];
  }
}

// Two floats as one pair of 16-bit elements, rounded to nearest.
__device__ __forceinline__ __half2 vq_pair(const __half*, float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ __nv_bfloat162 vq_pair(const __nv_bfloat16*, float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

template <int N, typename H>
__device__ __forceinline__ void vq_store_n(H* p, const float* v) {
  using H2 = decltype(vq_pair(p, 0.0f, 0.0f));
  if constexpr (N == 8) {
    vq_store8(p, v);
  } else if constexpr (N == 4) {
    uint2 raw;
    H2* h = reinterpret_cast<H2*>(&raw);
    h[0] = vq_pair(p, v[0], v[1]);
    h[1] = vq_pair(p, v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = raw;
  } else if constexpr (N == 2) {
    *reinterpret_cast<H2*>(p) = vq_pair(p, v[0], v[1]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = static_cast<H>(v[k]);
  }
}

// The alignment vq_load_bytes<NB> / vq_store_bytes<NB> need.
template <int NB>
__device__ constexpr unsigned vq_bytes_align() {
  return (NB == 2 || NB == 4 || NB == 8) ? NB : 1;
}

// vq_load8 where `wide`, else eight scalar loads.
template <typename T>
__device__ __forceinline__ void vq_read8(const T* p, float* out, bool wide) {
  if (wide) {
    vq_load8(p, out);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = static_cast<float>(p[j]);
  }
}

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's
// layout), from the one or two bytes that hold it.
__device__ __forceinline__ unsigned vq_code_at(const uint8_t* row, unsigned j, unsigned bits) {
  const unsigned o = j * bits;
  unsigned w = row[o >> 3];
  if ((o & 7u) + bits > 8u) {
    w |= unsigned(row[(o >> 3) + 1]) << 8;
  }
  return (w >> (o & 7u)) & ((1u << bits) - 1u);
}

// x / d for the sizes the bodies divide by (row lengths, group sizes): a
// shift where d is a power of two, as head dimensions and groups usually
// are, since a 32-bit division costs some twenty instructions.
__device__ __forceinline__ uint32_t vq_div(uint32_t x, uint32_t d) {
  return (d & (d - 1u)) == 0u ? x >> (__ffs(d) - 1) : x / d;
}

// float(c) for a code c < 2^23, exact: the code in the mantissa of 2^23,
// less 2^23 (a logic op and an add, where a conversion instruction runs at
// a quarter of the rate).
__device__ __forceinline__ float vq_code_float(uint32_t c) {
  return __fsub_rn(__uint_as_float(0x4B000000u | c), 8388608.0f);
}

// The bits of the smallest 16-bit T value strictly above b: for a T value
// v, b < v exactly when v >= that value (for a NaN b, a NaN, which no v
// meets, as no v is above a NaN).
__device__ __forceinline__ uint32_t vq_next_up16(uint32_t u) {
  if ((u & 0x7FFFu) == 0u) {
    return 1u;
  }
  return (u & 0x8000u) ? u - 1u : u + 1u;
}

__device__ __forceinline__ uint32_t vq_bits_above(const float*, float) { return 0u; }

__device__ __forceinline__ uint32_t vq_bits_above(const __half*, float b) {
  if (b != b) {
    return 0x7E00u;
  }
  const __half r = __float2half_ru(b);
  return __half2float(r) > b ? uint32_t(__half_as_ushort(r)) : vq_next_up16(__half_as_ushort(r));
}

__device__ __forceinline__ uint32_t vq_bits_above(const __nv_bfloat16*, float b) {
  if (b != b) {
    return 0x7FC0u;
  }
  const __nv_bfloat16 r = __float2bfloat16_ru(b);
  return __bfloat162float(r) > b ? uint32_t(__bfloat16_as_ushort(r)) : vq_next_up16(__bfloat16_as_ushort(r));
}

// Per half of a pair of 16-bit T values: 0xFFFF where a >= b, else 0.
// (The float overloads let bodies that also take float name the 16-bit
// paths in code float never runs.)
__device__ __forceinline__ uint32_t vq_ge_mask(const float*, uint32_t, uint32_t) { return 0u; }
__device__ __forceinline__ uint32_t vq_ge_mask(const __half*, uint32_t a, uint32_t b) {
  return __hge2_mask(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
}

__device__ __forceinline__ uint32_t vq_ge_mask(const __nv_bfloat16*, uint32_t a, uint32_t b) {
  return __hge2_mask(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
}

// Binary search of a pair of 16-bit T values over sorted boundaries, both
// halves at once: thr[i] holds vq_bits_above(boundary i) in both halves,
// m[l] the mask (0xFFFF per half) of step l's outcome. Step L compares the
// pair with the threshold its earlier steps chose, picked from thr by logic
// ops on their masks (one op per candidate pair, the newest mask at the
// root, so the rest of the choice is made while that mask is computed).
//
// vq_pair_pick: step L's threshold among the prefixes whose J last outcomes
// are S (prefix bit d_i weighs 1 << (L - 1 - i)).
template <int B, int L, int J, int S>
__device__ __forceinline__ uint32_t vq_pair_pick(const uint32_t (&thr)[(1 << B) - 1], const uint32_t (&m)[B]) {
  if constexpr (J == L) {
    return thr[(S << (B - L)) + (1 << (B - L - 1)) - 1];
  } else {
    const uint32_t above = vq_pair_pick<B, L, J + 1, S + (1 << J)>(thr, m);
    const uint32_t below = vq_pair_pick<B, L, J + 1, S>(thr, m);
    return (m[L - 1 - J] & above) | (~m[L - 1 - J] & below);
  }
}

template <int B, int L, typename T>
__device__ __forceinline__ void vq_pair_steps(const T* tag, uint32_t v, const uint32_t (&thr)[(1 << B) - 1],
                                              uint32_t (&m)[B]) {
  if constexpr (L < B) {
    m[L] = vq_ge_mask(tag, v, vq_pair_pick<B, L, 0, 0>(thr, m));
    vq_pair_steps<B, L + 1>(tag, v, thr, m);
  }
}

// The B-bit codes of the pair v (low half first) as low | high << B: each
// the number of boundaries strictly below its value.
template <int B, typename T>
__device__ __forceinline__ uint32_t vq_pair_code(const T* tag, uint32_t v, const uint32_t (&thr)[(1 << B) - 1]) {
  uint32_t m[B];
  vq_pair_steps<B, 0>(tag, v, thr, m);
  uint32_t acc = 0;
#pragma unroll
  for (int l = 0; l < B; ++l) {
    acc |= m[l] & ((1u << (B - 1 - l)) | (1u << (16 + B - 1 - l)));
  }
  return (acc & 0xFFFFu) | ((acc >> 16) << B);
}

// Fills table[bits] (65536 bytes of shared memory) with the B-bit code of
// each 16-bit pattern, pair_code(v) giving the codes of the two patterns in
// v as low | high << B. Within a run of 64 patterns of one sign the value is
// monotone in the bits, so a run whose two ends have one code has it
// throughout (a run of NaNs codes 0 at both ends; the run from +inf ends in
// a NaN, so its ends differ unless +inf's code is 0 too). Each warp codes
// 32 runs at once by their ends, splats the uniform ones and codes the
// others (one per boundary at most, and +inf's) a pair of patterns per lane.
// Every thread of the block calls it (blockDim a multiple of 32); a barrier
// must follow before the table is read.
template <int B, typename PairCode>
__device__ __forceinline__ void vq_build_pair_code_table(uint8_t* table, PairCode pair_code) {
  constexpr uint32_t RUNS = 1024;
  constexpr uint32_t MASK = (1u << B) - 1u;
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t run0 = threadIdx.x - lane; run0 < RUNS; run0 += blockDim.x) {
    const uint32_t run = run0 + lane;
    const uint32_t ends = pair_code((run * 64) | ((run * 64 + 63) << 16));
    const uint32_t code = ends & MASK;
    const bool uniform = code == (ends >> B);
    if (uniform) {
      const uint32_t w = code * 0x01010101u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        reinterpret_cast<uint4*>(table + run * 64)[i] = make_uint4(w, w, w, w);
      }
    }
    for (uint32_t mixed = __ballot_sync(0xffffffffu, !uniform); mixed != 0; mixed &= mixed - 1) {
      const uint32_t bits = (run0 + __ffs(mixed) - 1) * 64 + 2 * lane;
      const uint32_t codes = pair_code(bits | ((bits + 1) << 16));
      *reinterpret_cast<uint16_t*>(table + bits) = uint16_t((codes & MASK) | ((codes >> B) << 8));
    }
  }
}

// Codes and stores a thread's ITEMS groups of 8 16-bit elements held raw
// (vq_read_raw8; WORDS is 1 for them, 2 in the float bodies that name this
// but never run it), groups start, start + blockDim.x, ... below total, two
// elements at a time: pair(v) gives the codes of the pair v as
// low | high << B. Each group's 8 codes gather in a Word (32 bits hold them
// up to 4 bits) and leave as B bytes of packed.
template <int B, typename Word, int ITEMS, int WORDS, typename PairCode>
__device__ __forceinline__ void vq_store_pair_codes(uint8_t* packed, const uint4 (&raw)[ITEMS][WORDS], uint64_t start,
                                                    uint64_t total, PairCode pair) {
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const uint64_t item = start + uint64_t(k) * blockDim.x;
    if (item < total) {
      const uint32_t v[4] = {raw[k][0].x, raw[k][0].y, raw[k][0].z, raw[k][0].w};
      Word word = 0;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        word |= Word(pair(v[p])) << (2 * B * p);
      }
      vq_store_bytes<B>(packed + item * B, word);
    }
  }
}

// Codes and stores a thread's ITEMS groups of x [n, d] (a group: 8
// consecutive elements of a row, fewer at its end), groups start,
// start + blockDim.x, ... below n ceil(d / 8), one element at a time:
// code(i) gives the code of element i of x; each group's B bytes of the
// packed rows (nbytes each) are stored byte by byte, the last cut at the
// row's end.
template <int B, int ITEMS, typename Code>
__device__ __forceinline__ void vq_store_codes_by_element(uint8_t* packed, uint64_t start, uint64_t total, uint32_t d,
                                                          uint32_t nbytes, Code code) {
  const uint32_t groups = (d + 7) / 8;
  for (int k = 0; k < ITEMS; ++k) {
    const uint64_t item = start + uint64_t(k) * blockDim.x;
    if (item >= total) {
      return;
    }
    const uint32_t row = uint32_t(item / groups);
    const uint32_t g = uint32_t(item % groups);
    const uint32_t lead = g * 8;
    const uint32_t count = min(8u, d - lead);
    const uint64_t src = uint64_t(row) * d + lead;
    uint64_t word = 0;
    for (uint32_t j = 0; j < count; ++j) {
      word |= uint64_t(code(src + j)) << (j * B);
    }
    const uint32_t b0 = g * B;
    const uint32_t b1 = min(b0 + uint32_t(B), nbytes);
    const uint64_t dst = uint64_t(row) * nbytes;
    for (uint32_t b = b0; b < b1; ++b) {
      packed[dst + b] = uint8_t(word >> (8 * (b - b0)));
    }
  }
}

// Code j of a word of 8 packed B-bit codes times 2^vq_code_pos<B>(j), as a
// float, exactly: the code keeps its place in the word (less a byte-multiple
// shift where it would pass float32's 23 mantissa bits), its bits or'ed into
// 2^23's, less 2^23: one logic op and one add. vq_code_unscale<B>(j) is
// 2^-pos, the factor that undoes the place in a product with it.
template <int B>
__device__ constexpr int vq_code_base(int j) {
  return j * B + B <= 23 ? 0 : ((j * B + B - 23 + 7) / 8) * 8;
}

template <int B>
__device__ constexpr int vq_code_pos(int j) {
  return j * B - vq_code_base<B>(j);
}

template <int B>
__device__ __forceinline__ float vq_code_scaled(unsigned long long word, int j) {
  // The same for every code at one base (the compiler shares it): then one
  // logic op per code keeps that code's bits and 2^23's.
  // (In assembly: the compiler would otherwise split it into a mask and an
  // or again.)
  const uint32_t w = (uint32_t(word >> vq_code_base<B>(j)) & 0x007FFFFFu) | 0x4B000000u;
  uint32_t bits;
  asm("and.b32 %0, %1, %2;" : "=r"(bits) : "r"(w), "r"(0xFF800000u | (((1u << B) - 1u) << vq_code_pos<B>(j))));
  return __fsub_rn(__uint_as_float(bits), 8388608.0f);
}

template <int B>
__device__ __forceinline__ float vq_code_unscale(int j) {
  return __uint_as_float(uint32_t(127 - vq_code_pos<B>(j)) << 23);
}

// S consecutive T at src to dst, with the widest accesses S * sizeof(T)
// bytes allow (both aligned to that, or to 16 bytes beyond it).
template <int S, typename T>
__device__ __forceinline__ void vq_copy_n(const T* src, T* dst) {
  constexpr int BYTES = S * int(sizeof(T));
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if constexpr (BYTES == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else if constexpr (BYTES == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else {
#pragma unroll
    for (int h = 0; h < S; ++h) {
      dst[h] = src[h];
    }
  }
}

// Eight consecutive T at p as raw 16-byte words (one for 16-bit T, two for
// float), read wide where `wide` (p 16-byte aligned), else element by
// element.
template <typename T>
__device__ __forceinline__ void vq_read_raw8(const T* p, uint4 (&out)[sizeof(T) / 2], bool wide) {
  if (wide) {
#pragma unroll
    for (int w = 0; w < int(sizeof(T) / 2); ++w) {
      out[w] = reinterpret_cast<const uint4*>(p)[w];
    }
  } else {
    T v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = p[j];
    }
    memcpy(out, v, sizeof(v));
  }
}

// Pairwise minimum and maximum of two pairs of 16-bit T values, and +inf in
// both halves (the float overloads, as vq_ge_mask's, are never run).
__device__ __forceinline__ uint32_t vq_min2(const __half*, uint32_t a, uint32_t b) {
  const __half2 r = __hmin2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t vq_max2(const __half*, uint32_t a, uint32_t b) {
  const __half2 r = __hmax2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t vq_min2(const __nv_bfloat16*, uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmin2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t vq_max2(const __nv_bfloat16*, uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t vq_min2(const float*, uint32_t, uint32_t) { return 0u; }
__device__ __forceinline__ uint32_t vq_max2(const float*, uint32_t, uint32_t) { return 0u; }
__device__ __forceinline__ uint32_t vq_inf2(const __half*) { return 0x7C007C00u; }
__device__ __forceinline__ uint32_t vq_inf2(const __nv_bfloat16*) { return 0x7F807F80u; }
__device__ __forceinline__ uint32_t vq_inf2(const float*) { return 0u; }

// Per channel j < 8 of ROWS rows of 8 T held as raw words (vq_read_raw8),
// the minimum and maximum over the rows k with keep(k), across LANES
// adjacent lanes (each with its own rows; every lane of the warp calls it),
// as fminf and fmaxf fold them from +inf and -inf (NaN left out). 16-bit
// elements fold in pairs, two channels per instruction.
template <typename T, int ROWS, int LANES, typename Keep>
__device__ __forceinline__ void vq_minmax8(const uint4 (&raw)[ROWS][sizeof(T) / 2], Keep keep, float (&lo)[8],
                                           float (&hi)[8]) {
  if constexpr (sizeof(T) == 2) {
    // +inf and -inf in both halves of the type.
    const uint32_t pinf = vq_inf2(static_cast<const T*>(nullptr));
    uint32_t mn[4] = {pinf, pinf, pinf, pinf};
    uint32_t mx[4] = {pinf | 0x80008000u, pinf | 0x80008000u, pinf | 0x80008000u, pinf | 0x80008000u};
#pragma unroll
    for (int k = 0; k < ROWS; ++k) {
      if (keep(k)) {
        const uint32_t w[4] = {raw[k][0].x, raw[k][0].y, raw[k][0].z, raw[k][0].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          mn[i] = vq_min2(static_cast<const T*>(nullptr), mn[i], w[i]);
          mx[i] = vq_max2(static_cast<const T*>(nullptr), mx[i], w[i]);
        }
      }
    }
#pragma unroll
    for (int o = 1; o < LANES; o *= 2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        mn[i] = vq_min2(static_cast<const T*>(nullptr), mn[i], __shfl_xor_sync(0xffffffffu, mn[i], o));
        mx[i] = vq_max2(static_cast<const T*>(nullptr), mx[i], __shfl_xor_sync(0xffffffffu, mx[i], o));
      }
    }
    const uint4 m0 = make_uint4(mn[0], mn[1], mn[2], mn[3]);
    const uint4 m1 = make_uint4(mx[0], mx[1], mx[2], mx[3]);
    vq_load8(reinterpret_cast<const T*>(&m0), lo);
    vq_load8(reinterpret_cast<const T*>(&m1), hi);
  } else {
    const float inf = __int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      lo[j] = inf;
      hi[j] = -inf;
    }
#pragma unroll
    for (int k = 0; k < ROWS; ++k) {
      if (keep(k)) {
        float v[8];
        vq_load8(reinterpret_cast<const T*>(raw[k]), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          lo[j] = fminf(lo[j], v[j]);
          hi[j] = fmaxf(hi[j], v[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int o = 1; o < LANES; o *= 2) {
        lo[j] = fminf(lo[j], __shfl_xor_sync(0xffffffffu, lo[j], o));
        hi[j] = fmaxf(hi[j], __shfl_xor_sync(0xffffffffu, hi[j], o));
      }
    }
  }
}

// Element j of the T values a 32-bit word holds (two 16-bit ones, or one
// float), as float.
__device__ __forceinline__ float vq_word_elem(const float*, uint32_t u, uint32_t) { return __uint_as_float(u); }
__device__ __forceinline__ float vq_word_elem(const __half*, uint32_t u, uint32_t j) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(j ? u >> 16 : u & 0xFFFFu)));
}
__device__ __forceinline__ float vq_word_elem(const __nv_bfloat16*, uint32_t u, uint32_t j) {
  // A bfloat16 is the high half of the float it stands for.
  return __uint_as_float(j ? u & 0xFFFF0000u : u << 16);
}

// Element j (0..7) of 8 T held as raw words (vq_read_raw8), as float.
__device__ __forceinline__ float vq_raw_elem(const float*, const uint4 (&r)[2], uint32_t j) {
  const uint4 w = r[j / 4];
  const uint32_t u = (j % 4 == 0) ? w.x : (j % 4 == 1) ? w.y : (j % 4 == 2) ? w.z : w.w;
  return __uint_as_float(u);
}
template <typename T>
__device__ __forceinline__ float vq_raw_elem(const T* t, const uint4 (&r)[1], uint32_t j) {
  const uint32_t u = (j / 2 == 0) ? r[0].x : (j / 2 == 1) ? r[0].y : (j / 2 == 2) ? r[0].z : r[0].w;
  return vq_word_elem(t, u, j % 2);
}

// The bits of the float 2^23 + c_j summed at the places of 8 B-bit codes
// c_j, less this, is the packed word of the codes (modulo the word's width,
// which holds them): one shift-add per code.
template <int B>
__device__ constexpr unsigned long long vq_big_sum() {
  unsigned long long s = 0;
  for (int j = 0; j < 8; ++j) {
    s += 0x4B000000ull << (j * B);
  }
  return s;
}

// vq_big_sum for COUNT B-bit codes in a 32-bit word.
template <int B, int COUNT>
__device__ constexpr uint32_t vq_big_sum32() {
  uint32_t s = 0;
  for (int j = 0; j < COUNT; ++j) {
    s += j * B < 32 ? 0x4B000000u << (j * B) : 0u;
  }
  return s;
}

// In a word of E-bit elements, the elements j with j & h set.
template <int E>
__device__ __forceinline__ uint32_t vq_transpose_mask(uint32_t h) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 32 / E; ++j) {
    m |= (uint32_t(j) & h) ? ((E == 32 ? 0xFFFFFFFFu : (1u << E) - 1u) << (j * E)) : 0u;
  }
  return m;
}

template <int B>
__device__ __forceinline__ unsigned long long vq_pack_big8(const float (&big)[8]) {
  if constexpr (8 * B <= 32) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      word += __float_as_uint(big[j]) << (j * B);
    }
    return word - uint32_t(vq_big_sum<B>());
  } else {
    unsigned long long word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      word += static_cast<unsigned long long>(__float_as_uint(big[j])) << (j * B);
    }
    return word - vq_big_sum<B>();
  }
}

// Two floats from shared memory at an 8-byte aligned shared-window address
// (from __cvta_generic_to_shared), so that a hot loop keeps one base
// register rather than rebuilding the address of a __shared__ array.
__device__ __forceinline__ float2 vq_lds2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

// qjl_score's sums for one key over nibble tables: acc[i] += the table
// entry of group g, query i and the key's nibble c_g = bits 4g..4g+3, for
// g < m/4 in order and NQ query slots (4 or 8). The table at tab_base holds
// the pair of queries 2p, 2p + 1 at float offset ((g * NQ/2 + p) * 16 + c) * 2.
// The loops unroll fully, so each nibble is a shift, a mask, an address and
// one 8-byte read per 2 slots at a constant offset.
template <uint32_t NQ, uint32_t WORDS>
__device__ __forceinline__ void qjl_table_sums(float (&acc)[8], const uint32_t (&bits)[WORDS], uint32_t m,
                                               uint32_t tab_base) {
#pragma unroll
  for (uint32_t w = 0; w < WORDS; ++w) {
#pragma unroll
    for (uint32_t k = 0; k < 8; ++k) {
      const uint32_t g = w * 8 + k;
      if (g * 4 >= m) {
        return;
      }
      const uint32_t c = (bits[w] >> (4 * k)) & 15u;
#pragma unroll
      for (uint32_t p = 0; p < NQ / 2; ++p) {
        const float2 v = vq_lds2(tab_base + (((g * (NQ / 2) + p) * 16 + c) * 2) * 4);
        acc[2 * p] = __fadd_rn(acc[2 * p], v.x);
        acc[2 * p + 1] = __fadd_rn(acc[2 * p + 1], v.y);
      }
    }
  }
}

// The nearest of kk codebook entries to the D values at v (crate::cpu's
// arithmetic: float32, acc += diff * diff per coordinate in order with
// round-to-nearest intrinsics, which NVRTC never contracts into an fma; a
// strictly smaller distance wins, so ties go to the lowest index and NaN or
// infinite distances leave entry 0). entry(c, j) is coordinate j of entry c.
template <int D, typename T, typename Entry>
__device__ __forceinline__ uint32_t vq_nearest_exact(const T* v, uint32_t kk, Entry entry) {
  float e[D];
#pragma unroll
  for (int j = 0; j < D; ++j) {
    e[j] = static_cast<float>(v[j]);
  }
  float best = __int_as_float(0x7f800000);
  uint32_t best_i = 0;
  for (uint32_t c = 0; c < kk; ++c) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const float diff = __fsub_rn(e[j], entry(c, j));
      acc = __fadd_rn(acc, __fmul_rn(diff, diff));
    }
    if (acc < best) {
      best = acc;
      best_i = c;
    }
  }
  return best_i;
}

// Stores the BITS bytes that a group of 8 BITS-bit codes fills (word, low
// bits first) as bytes g * BITS.. of `row` of out [rows, nbytes], bit_pack's
// layout; the last group of a row stops at nbytes.
template <int BITS>
__device__ __forceinline__ void vq_store_group(uint64_t word, uint32_t g, uint32_t row, uint32_t nbytes, uint8_t* out) {
  const uint32_t b0 = g * BITS;
  const uint32_t b1 = min(b0 + uint32_t(BITS), nbytes);
  const uint64_t dst = uint64_t(row) * nbytes;
  for (uint32_t k = b0; k < b1; ++k) {
    out[dst + k] = uint8_t(word >> (8 * (k - b0)));
  }
}
