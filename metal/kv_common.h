// Shared by the kv_attention bodies (after tq_common.h, which gives VQ_CODE_AT).

// Codecs whose token is a row of D B-bit codes into a table, times one
// scale: kv_attention stages a tile of their rows in threadgroup memory
// (crate::codec::Codec::staged_in_attention says the same).
#define KV_STAGED(M) ((M) == KV_TURBOQUANT_MSE || (M) == KV_TURBOQUANT_UNIFORM || (M) == KV_FP8)

// Element j of compressed token `ct` of KV head `head`, decoded in its side's
// frame. M: codec id (the KV_* macros the crate defines from its `Codec`;
// KIVI per channel over groups of G tokens, KIVI per token over groups of G
// channels, product quantization with sub-vectors of G channels,
// TurboQuant-RVQ: B-1 bits then 1 residual bit, the first codebook then the
// second in `table`; FP8 reads its e4m3 grid as TurboQuant-MSE its
// centroids; QJL and TurboQuant-Prod are keys only and scored in
// kv_attention.metal); B: bits; ROW:
// elements of a code row; CAP: token slots per head. A macro, so that it reads
// any address space. Every branch compiles for any codec; the constant
// template arguments leave one.
#define KV_ELEMENT(M, B, G, ROW, codes, scales, zeros, table, head, ct, CAP, j)                          \
  ((M) == KV_DENSE ? float((codes)[((head) * (CAP) + (ct)) * D + (j)])                                          \
   : (M) == KV_TURBOQUANT_MSE || (M) == KV_TURBOQUANT_UNIFORM || (M) == KV_FP8                                           \
       ? (table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B))] *                 \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
   : (M) == KV_PRODUCT_QUANTIZED                                                                                            \
       ? (table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j) / uint(G), uint(B)) * (G) + \
                 uint(j) % uint(G)] *                                                                    \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
   : (M) == KV_TURBOQUANT_RVQ                                                                                            \
       ? ((table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B) - 1u)] +          \
          (table)[(1u << (uint(B) - 1u)) +                                                               \
                  VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW) + (D * (B - 1) + 7) / 8, uint(j), 1u)]) * \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
   : (M) == KV_KIVI_PER_CHANNEL                                                                          \
       ? float((zeros)[KV_PARAM(M, G, head, ct, CAP, j)]) +                                              \
             float((scales)[KV_PARAM(M, G, head, ct, CAP, j)]) *                                         \
                 float(KV_BITS_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint((table)[(j)]),                \
                                  uint((table)[(j) + 1]) - uint((table)[(j)])))                          \
       : float((zeros)[KV_PARAM(M, G, head, ct, CAP, j)]) +                                              \
             float((scales)[KV_PARAM(M, G, head, ct, CAP, j)]) *                                         \
                 float(VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B))))

// The `w`-bit code (1 to 8) starting at bit `o` of the row at `base`: KIVI
// keys' channel j spans bits [o[j], o[j+1]) of their row, `table` being the
// KV head's row of offsets (KV_SIDE_TABLE).
#define KV_BITS_AT(buf, base, o, w)                                                                       \
  (((uint((buf)[(base) + ((o) >> 3)]) | (((o) & 7u) + (w) > 8u ? uint((buf)[(base) + ((o) >> 3) + 1]) << 8 : 0u)) >> \
    ((o) & 7u)) &                                                                                        \
   ((1u << (w)) - 1u))

// The table KV_ELEMENT reads for KV head `hk`: for KIVI keys the head's row
// of bit offsets (crate::cpu::kv_attention::kivi_bit_offsets: a stride, then
// the rows), else the codec's table.
#define KV_SIDE_TABLE(M, table, hk) ((M) == KV_KIVI_PER_CHANNEL ? (table) + 1 + (hk) * uint((table)[0]) : (table))

// Index of the (scale, zero) pair of element j for the KIVI codecs.
#define KV_PARAM(M, G, head, ct, CAP, j)                                                                 \
  ((M) == KV_KIVI_PER_CHANNEL ? ((head) * (((CAP) + (G) - 1) / (G)) + (ct) / (G)) * D + (j)                                \
            : ((head) * (CAP) + (ct)) * (D / (G)) + (j) / (G))
