// Shared by the kv_attention bodies (after tq_common.h, which gives VQ_CODE_AT).

// Element j of compressed token `ct` of KV head `head`, decoded in its side's
// frame. M: codec (0 dense, 1 TurboQuant-MSE, 2 KIVI per channel over groups
// of G tokens, 3 KIVI per token over groups of G channels, 4 product
// quantization with sub-vectors of G channels, 7 TurboQuant-RVQ: B-1 bits then
// 1 residual bit, the first codebook then the second in `table`; 5 QJL and 6
// TurboQuant-Prod are keys only and scored in kv_attention.metal); B: bits; ROW:
// elements of a code row; CAP: token slots per head. A macro, so that it reads
// any address space. Every branch compiles for any codec; the constant
// template arguments leave one.
#define KV_ELEMENT(M, B, G, ROW, codes, scales, zeros, table, head, ct, CAP, j)                          \
  ((M) == 0 ? float((codes)[((head) * (CAP) + (ct)) * D + (j)])                                          \
   : (M) == 1                                                                                            \
       ? (table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B))] *                 \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
   : (M) == 4                                                                                            \
       ? (table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j) / uint(G), uint(B)) * (G) + \
                 uint(j) % uint(G)] *                                                                    \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
   : (M) == 7                                                                                            \
       ? ((table)[VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B) - 1u)] +          \
          (table)[(1u << (uint(B) - 1u)) +                                                               \
                  VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW) + (D * (B - 1) + 7) / 8, uint(j), 1u)]) * \
             float((scales)[(head) * (CAP) + (ct)])                                                      \
       : float((zeros)[KV_PARAM(M, G, head, ct, CAP, j)]) +                                              \
             float((scales)[KV_PARAM(M, G, head, ct, CAP, j)]) *                                         \
                 float(VQ_CODE_AT(codes, ((head) * (CAP) + (ct)) * (ROW), uint(j), uint(B))))

// Index of the (scale, zero) pair of element j for the KIVI codecs.
#define KV_PARAM(M, G, head, ct, CAP, j)                                                                 \
  ((M) == 2 ? ((head) * (((CAP) + (G) - 1) / (G)) + (ct) / (G)) * D + (j)                                \
            : ((head) * (CAP) + (ct)) * (D / (G)) + (j) / (G))
