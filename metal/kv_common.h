// Shared by the kv_attention bodies (after tq_common.h, which gives VQ_CODE_AT).

// Element j of compressed token `ct` of KV head `head`, decoded in its side's
// frame. M: codec id (the KV_* macros the crate defines from its `Codec`;
// KIVI per channel over groups of G tokens, KIVI per token over groups of G
// channels, product quantization with sub-vectors of G channels,
// TurboQuant-RVQ: B-1 bits then 1 residual bit, the first codebook then the
// second in `table`; QJL and TurboQuant-Prod are keys only and scored in
// kv_attention.metal); B: bits; ROW:
// elements of a code row; CAP: token slots per head. A macro, so that it reads
// any address space. Every branch compiles for any codec; the constant
// template arguments leave one.
#define KV_ELEMENT(M, B, G, ROW, codes, scales, zeros, table, head, ct, CAP, j)                          \
  ((M) == KV_DENSE ? float((codes)[((head) * (CAP) + (ct)) * D + (j)])                                          \
   : (M) == KV_TURBOQUANT_MSE                                                                                            \
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
       : float((zeros)[KV_PARAM(M, G, head, ct, CAP, j)]) +                                              \
             float((scales)[KV_PARAM(M, G, head, ct, CAP, j)]) *                                         \
                 float(VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B))))

// Index of the (scale, zero) pair of element j for the KIVI codecs.
#define KV_PARAM(M, G, head, ct, CAP, j)                                                                 \
  ((M) == KV_KIVI_PER_CHANNEL ? ((head) * (((CAP) + (G) - 1) / (G)) + (ct) / (G)) * D + (j)                                \
            : ((head) * (CAP) + (ct)) * (D / (G)) + (j) / (G))
