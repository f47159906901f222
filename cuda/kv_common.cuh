// Shared by the kv_attention bodies: decoding one element of a compressed
// token for each codec, named by the KV_* ids the crate defines from its
// `Codec` (KIVI per channel over groups of G tokens, KIVI per token over
// groups of G channels, product quantization with sub-vectors of G channels,
// TurboQuant-RVQ: B-1 bits then 1 residual bit, the first codebook then the
// second in `table`; FP8 reads its e4m3 grid as TurboQuant-MSE its centroids; QJL and TurboQuant-Prod are keys only and scored in
// kv_attention.cu).

// Codecs whose token is a row of D B-bit codes into a table, times one
// scale: kv_attention stages a tile of their rows in shared memory
// (crate::codec::Codec::staged_in_attention says the same).
__device__ constexpr bool kv_staged(int m) {
  return m == KV_TURBOQUANT_MSE || m == KV_TURBOQUANT_UNIFORM || m == KV_FP8;
}

template <typename X>
__device__ inline float kv_float(X x) {
  return static_cast<float>(x);
}
template <>
__device__ inline float kv_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ inline float kv_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// The `bits`-bit code (1 to 8) starting at bit `o` of a packed row.
__device__ inline unsigned kv_bits_at(const uint8_t* row, unsigned o, unsigned bits) {
  const unsigned byte = o >> 3, shift = o & 7u;
  unsigned v = row[byte];
  if (shift + bits > 8u) v |= unsigned(row[byte + 1]) << 8;
  return (v >> shift) & ((1u << bits) - 1u);
}

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's layout).
__device__ inline unsigned kv_code_at(const uint8_t* row, unsigned j, unsigned bits) {
  return kv_bits_at(row, j * bits, bits);
}

// The table kv_element reads for KV head `hk`: for KIVI keys the head's row of
// bit offsets (crate::cpu::kv_attention::kivi_bit_offsets: a stride, then the
// rows), else the codec's table.
template <int M>
__device__ inline const float* kv_side_table(const float* table, uint32_t hk) {
  if constexpr (M == KV_KIVI_PER_CHANNEL) {
    return table + 1 + hk * unsigned(table[0]);
  } else {
    return table;
  }
}

// Element j of compressed token `ct` of KV head `head`, in its side's frame.
template <int M, int B, int G, int D, typename C, typename S>
__device__ inline float kv_element(const C* codes, const S* scales, const S* zeros, const float* table,
                                   uint64_t head, uint64_t ct, uint64_t cap, int j) {
  const uint64_t slot = head * cap + ct;
  if constexpr (M == KV_DENSE) {
    return kv_float(codes[slot * D + j]);
  } else if constexpr (M == KV_PRODUCT_QUANTIZED) {
    constexpr int ROW = (D / G * B + 7) / 8;
    const unsigned c = kv_code_at(reinterpret_cast<const uint8_t*>(codes) + slot * ROW, unsigned(j) / G, unsigned(B));
    return table[c * G + j % G] * kv_float(scales[slot]);
  } else if constexpr (M == KV_TURBOQUANT_RVQ) {
    constexpr int ROW = (D * B + 7) / 8, FIRST = (D * (B - 1) + 7) / 8;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(codes) + slot * ROW;
    const unsigned c1 = kv_code_at(row, unsigned(j), unsigned(B - 1));
    const unsigned c2 = kv_code_at(row + FIRST, unsigned(j), 1u);
    return (table[c1] + table[(1u << (B - 1)) + c2]) * kv_float(scales[slot]);
  } else if constexpr (M == KV_KIVI_PER_CHANNEL) {
    // Channel j spans bits [o[j], o[j+1]) of the row; `table` is the KV
    // head's row of offsets (kv_side_table).
    constexpr int ROW = (D * B + 7) / 8;
    const unsigned o = unsigned(table[j]);
    const unsigned c = kv_bits_at(reinterpret_cast<const uint8_t*>(codes) + slot * ROW, o, unsigned(table[j + 1]) - o);
    const uint64_t p = (head * ((cap + G - 1) / G) + ct / G) * D + j;
    return kv_float(zeros[p]) + kv_float(scales[p]) * float(c);
  } else {
    constexpr int ROW = (D * B + 7) / 8;
    const unsigned c = kv_code_at(reinterpret_cast<const uint8_t*>(codes) + slot * ROW, unsigned(j), unsigned(B));
    if constexpr (M == KV_TURBOQUANT_MSE || M == KV_TURBOQUANT_UNIFORM || M == KV_FP8) {
      return table[c] * kv_float(scales[slot]);
    } else {
      const uint64_t p = slot * (D / G) + j / G;
      return kv_float(zeros[p]) + kv_float(scales[p]) * float(c);
    }
  }
}
