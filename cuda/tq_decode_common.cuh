// The decode attention's helpers (tq_decode): codes read from words and
// shared memory, centroid tables, the lanes' reduce-scatter, the warp's max
// and sum, e^x. tq_common.cuh follows it where TurboQuant's codecs need it.

// Code b of BITS-bit codes packed from bit 0 of w (b a constant once
// unrolled, so w stays in registers; a code may cross a word boundary where
// BITS does not divide 32).
template <int BITS, int WORDS>
__device__ __forceinline__ unsigned tq_word_code(const unsigned (&w)[WORDS], int b) {
  const int bit = BITS * b;
  const int k = bit / 32;
  const unsigned v = (bit % 32) + BITS > 32 ? __funnelshift_r(w[k], w[k + 1 < WORDS ? k + 1 : k], bit % 32)
                                            : w[k] >> (bit % 32);
  return v & ((1u << BITS) - 1u);
}

// ---------------------------------------------------------------------------
// Reduce-scatter across the TPT lanes of a group (lanes li = 0..TPT-1 of
// aligned groups in a warp): each lane holds V partial sums; at each of the
// log2(TPT) butterfly stages a lane sends the half of its values it gives
// up and adds its partner's copy of the half it keeps, so that V sums cost
// V - 1 shuffles instead of V log2(TPT). After it, v[0 .. max(V / TPT, 1))
// hold the group's full sums of indices start, start + 1, ... (V < TPT:
// lanes differing only in the low bits hold the same sum).
template <int CUR, int O, int V>
__device__ __forceinline__ void tq_group_scatter(float (&v)[V], uint32_t li, uint32_t& start) {
  if constexpr (O > 0) {
    if constexpr (CUR > 1) {
      constexpr int H = CUR / 2;
      const bool up = (li & uint32_t(O)) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = up ? v[i] : v[H + i];
        const float keep = up ? v[H + i] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      if (up) start += H;
      tq_group_scatter<H, O / 2, V>(v, li, start);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      tq_group_scatter<1, O / 2, V>(v, li, start);
    }
  }
}

// The 8 values of chunk c of split token i on one side of tq_decode: its
// B-bit codes (ROW bytes a token, in shared memory) through `table`, or
// with !compressed the window row where it lies (`win` + i * stride), or
// zeros past the split's end (`have` false, window only: a code row past
// the end decodes to values no one reads) or the head size (`in_dim` false).
template <int B, int ROW, typename T>
__device__ __forceinline__ void tq_split_chunk(bool compressed, const uint8_t* codes, const float* table, const T* win,
                                               int64_t stride, uint32_t i, uint32_t c, bool have, bool in_dim,
                                               float* out) {
  if (compressed) {
    const vq_word_t<B> w = in_dim ? vq_word_t<B>(vq_load_bytes<B>(codes + i * ROW + c * B)) : 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = table[vq_code<B>(w, j)];
  } else if (have && in_dim) {
    vq_load8(win + int64_t(i) * stride + c * 8, out);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = 0.0f;
  }
}

// ---------------------------------------------------------------------------
// tq_decode on the tensor cores: codes become float16 fragment registers
// through a table in shared memory, one word per centroid (its float16 bits
// low), two lookups and a byte permute per register. A table of at most 32
// words lies in distinct banks, so a warp's lookups never conflict; a table
// of every pair of centroids (one lookup a register, but bank conflicts on a
// skewed code distribution) took the same time on the H200.

// The NW 32-bit words of a shared-memory bit stream from bit `bit` on, as
// code rows are packed (little-endian): with ALIGNED (bit a multiple of 32)
// NW loads, else NW (NW + 1 where a shift of up to MAXSH needs it) aligned
// loads and a funnel shift each (the stream holds a spare word past its end
// for that).
template <int NW, bool ALIGNED, int MAXSH = 31, int BITS = 32 * NW>
__device__ __forceinline__ void tq_shared_bits(const uint8_t* base, uint32_t bit, uint32_t (&w)[NW]) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(base) + (bit >> 5);
  if constexpr (ALIGNED) {
#pragma unroll
    for (int k = 0; k < NW; ++k) w[k] = p[k];
  } else {
    // The spare word only where a shift of up to MAXSH pushes the BITS
    // wanted past NW words.
    uint32_t x[NW + 1];
#pragma unroll
    for (int k = 0; k < NW; ++k) x[k] = p[k];
    x[NW] = MAXSH + BITS > 32 * NW ? p[NW] : 0u;
    const uint32_t sh = bit & 31u;
#pragma unroll
    for (int k = 0; k < NW; ++k) w[k] = __funnelshift_r(x[k], x[k + 1], sh);
  }
}

// The largest bit offset within a word of segment g < 8 of a row, segments
// of SEG bits, rows of ROW bits (31 where rows do not start on a word).
__device__ __forceinline__ constexpr int tq_max_shift(int seg, int row) {
  int m = 0;
  for (int g = 0; g < 8; ++g) m = (g * seg) % 32 > m ? (g * seg) % 32 : m;
  return row % 32 != 0 ? 31 : m;
}
// 3-bit values: at a head of 128 a segment of 48 bits starts at bit 0 or 16
// of a word (two words hold it), at 64 one of 24 at 0, 8, 16 or 24 (a spare
// word needed); a row of 240 bits (head 80) starts anywhere.
static_assert(tq_max_shift(48, 384) == 16 && tq_max_shift(24, 192) == 24 && tq_max_shift(30, 240) == 31, "tq_max_shift");

// Table word e: centroid e's float16 bits.
__device__ __forceinline__ uint32_t tq_half_entry(const float* cent, uint32_t e) {
  return __half_as_ushort(__float2half_rn(cent[e]));
}

// Codes j and j + 1 of one row's words as a half2 word.
template <int B, int NW>
__device__ __forceinline__ uint32_t tq_pair_along(const uint32_t* table, const uint32_t (&w)[NW], int j) {
  return __byte_perm(table[tq_word_code<B, NW>(w, j)], table[tq_word_code<B, NW>(w, j + 1)], 0x5410);
}

// Code j of two rows' words (lo's in the low half) as a half2 word.
template <int B, int NW>
__device__ __forceinline__ uint32_t tq_pair_across(const uint32_t* table, const uint32_t (&lo)[NW],
                                                   const uint32_t (&hi)[NW], int j) {
  return __byte_perm(table[tq_word_code<B, NW>(lo, j)], table[tq_word_code<B, NW>(hi, j)], 0x5410);
}

// Up to eight centroids' float16 bits as byte tables: lo[0] holds the low
// bytes of entries 0-3, lo[1] of 4-7, hi the high bytes (entries past the
// table zero), for __byte_perm lookups of codes of at most 3 bits.
struct TqPermTable {
  uint32_t lo[2], hi[2];
};

template <int B>
__device__ __forceinline__ TqPermTable tq_perm_table(const uint32_t* table) {
  static_assert(B <= 3, "a byte permute selects among eight bytes");
  TqPermTable t{};
#pragma unroll
  for (int e = 0; e < (1 << B); ++e) {
    t.lo[e / 4] |= (table[e] & 0xffu) << (8 * (e % 4));
    t.hi[e / 4] |= ((table[e] >> 8) & 0xffu) << (8 * (e % 4));
  }
  return t;
}

// PRMT as PTX defines it: a selector nibble's top bit replicates the sign
// (__byte_perm clears those bits first, one LOP3 a call, where the
// selectors here have them clear already).
__device__ __forceinline__ uint32_t tq_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Codes (lo_j, hi_j, lo_j+1, hi_j+1) in the low four nibbles of sel (top
// bits clear) as two half2 words, (c[lo_j], c[hi_j]) and (c[lo_j+1], c[hi_j+1]).
__device__ __forceinline__ uint2 tq_perm_lookup(const TqPermTable& t, uint32_t sel) {
  const uint32_t l = tq_prmt(t.lo[0], t.lo[1], sel);
  const uint32_t h = tq_prmt(t.hi[0], t.hi[1], sel);
  return make_uint2(__byte_perm(l, h, 0x5140), __byte_perm(l, h, 0x7362));
}

// Codes j and j + 1 of two rows' words (lo's in the low halves) as two
// half2 words, tq_pair_across(.., j) and (.., j + 1), through byte
// permutes: the four codes select their entries' low bytes, then their
// high bytes, and two more permutes interleave them.
template <int B, int NW>
__device__ __forceinline__ uint2 tq_perm_pairs(const TqPermTable& t, const uint32_t (&lo)[NW], const uint32_t (&hi)[NW],
                                               int j) {
  const uint32_t sel = tq_word_code<B, NW>(lo, j) | (tq_word_code<B, NW>(hi, j) << 4) |
                       (tq_word_code<B, NW>(lo, j + 1) << 8) | (tq_word_code<B, NW>(hi, j + 1) << 12);
  return tq_perm_lookup(t, sel);
}

// Eight 3-bit codes (bits 0-23 of x; higher bits ignored) one a nibble,
// top bits clear. The first two steps keep what their complementary masks
// let through (one LOP3 each, after the shift): the bits between codes are
// cleared by the last.
__device__ __forceinline__ uint32_t tq_nibbles3(uint32_t x) {
  x = (x & 0x0000ffffu) | ((x << 4) & 0xffff0000u);
  x = (x & 0x00ff00ffu) | ((x << 2) & 0xff00ff00u);
  return (x & 0x07070707u) | ((x << 1) & 0x70707070u);
}

// tq_perm_pairs' selectors for every pair of 3-bit codes (2m, 2m + 1) of
// two rows of N codes (N a multiple of 8): eight codes of each row spread to
// nibbles at once, then interleaved a byte at a time (about a third of the
// instructions of building each selector from its four codes).
// (M, the selectors' room, is N / 2 where the caller uses them: the body is
// compiled in every instantiation of the kernel, used or not.)
template <int NW, int N, int M>
__device__ __forceinline__ void tq_perm_sels3(const uint32_t (&lo)[NW], const uint32_t (&hi)[NW], uint32_t (&sel)[M]) {
  static_assert(N % 8 == 0 || M < N / 2, "rows of whole 24-bit groups");
#pragma unroll
  for (int q = 0; q < (M < N / 2 ? 0 : N / 8); ++q) {
    const int bit = 24 * q, k = bit / 32, sh = bit % 32;
    const uint32_t xl = sh + 24 > 32 ? __funnelshift_r(lo[k], lo[k + 1], sh) : lo[k] >> sh;
    const uint32_t xh = sh + 24 > 32 ? __funnelshift_r(hi[k], hi[k + 1], sh) : hi[k] >> sh;
    const uint32_t l = tq_nibbles3(xl), h = tq_nibbles3(xh);
    // Byte b: codes 2b of lo and hi (e), then codes 2b + 1 (o).
    const uint32_t e = (l & 0x0f0f0f0fu) | ((h << 4) & 0xf0f0f0f0u);
    const uint32_t o = ((l >> 4) & 0x0f0f0f0fu) | (h & 0xf0f0f0f0u);
#pragma unroll
    for (int b = 0; b < 4; ++b) sel[4 * q + b] = tq_prmt(e, o, b | ((b + 4) << 4));
  }
}

// Code i of two rows of N 3-bit codes (lo's in the low half) as a half2
// word of float16 subnormals: bits p..p+2 of each half hold the code, the
// rest zero, so that the half is c 2^(p - 24) (tq_lin_scale3(i) =
// 2^(24 - p)). Each 24-bit group of eight codes is read through three byte
// permutes (bytes 0-1, 1-2 and 2-3 of both rows), which leave its codes at
// p = 0, 3, 6, 1, 4, 7, 2, 5; one AND a word then keeps a code.
// (M, the output's room, is N where the caller uses it, as in tq_perm_sels3.)
// Mantissa bit p of code c (0..7) of a 24-bit group in tq_lin_codes3.
__device__ __forceinline__ constexpr int tq_lin_pos3(int c) {
  return 3 * c - 8 * (c / 3);
}

template <int NW, int N, int M>
__device__ __forceinline__ void tq_lin_codes3(const uint32_t (&lo)[NW], const uint32_t (&hi)[NW], uint32_t (&out)[M]) {
  static_assert(N % 8 == 0 || M < N, "rows of whole 24-bit groups");
#pragma unroll
  for (int q = 0; q < (M < N ? 0 : N / 8); ++q) {
    const int bit = 24 * q, k = bit / 32, sh = bit % 32;
    const uint32_t xl = sh + 24 > 32 ? __funnelshift_r(lo[k], lo[k + 1], sh) : lo[k] >> sh;
    const uint32_t xh = sh + 24 > 32 ? __funnelshift_r(hi[k], hi[k + 1], sh) : hi[k] >> sh;
    const uint32_t u[3] = {__byte_perm(xl, xh, 0x5410), __byte_perm(xl, xh, 0x6521), __byte_perm(xl, xh, 0x7632)};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int p = tq_lin_pos3(c);
      out[8 * q + c] = u[c / 3] & ((7u << p) | (7u << (p + 16)));
    }
  }
}

// 2^(24 - p) of code i's half in tq_lin_codes3.
__device__ __forceinline__ float tq_lin_scale3(int i) {
  return float(1 << (24 - tq_lin_pos3(i % 8)));
}

// The max and the sum of x over a warp's 32 lanes, in every lane.
__device__ __forceinline__ float tq_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float tq_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// e^x of x <= 0 by the SFU's 2^x, subnormal results flushed to zero (a
// weight below 2^-126 of the row's largest is nothing to a float32 sum;
// __expf would spend six instructions keeping them).
__device__ __forceinline__ float tq_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// Two floats as a half2 word (lo in the low half).
__device__ __forceinline__ uint32_t tq_half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
