// qjl_score: S q float [Q, m] (qjl_sketch_query's output), signs uint8
// [N, nbytes], norms half [N] -> scores float [Q, N] = (sqrt(pi/2)/m *
// norm) * sum_r +-(S q_i)_r, the sign from bit r of the key. sizes = {N, m,
// nbytes, Q}; template TC. Each block copies S q (Q m <= 4096 floats); its
// threads then
// stride over the keys. The host caps the grid at about one resident wave,
// so that few blocks repeat the tables' set-up.
//
// Fast path (m a multiple of 4, Q <= 8 and 4 m NQ <= 4096 for NQ = 4 or 8
// query slots): the block turns S q into nibble tables. For sketch rows
// 4g..4g+3 and the queries 2p and 2p + 1, entry c of row (g, p) holds the two
// sums over h < 4 of +-(S q_i)_{4g+h}, + where bit h of c is set: a key costs
// one 8-byte shared read per 4 sign bits and 2 queries, and one add per
// query. A row's 16 entries span the 32 banks once, so the lanes' reads never
// conflict (16-byte entries of 4 queries put c and c + 8 in the same banks:
// the kernel took 40% longer with them). Otherwise a key's bits are
// walked one by one. The sums run in another order than crate::cpu's byte
// tables: scores agree to float32 rounding.
//
// Tensor-core path (template TC, which the host sets where m is a multiple
// of 128 up to 512, Q <= 8 and Q m <= 1024; rows of signs aligned to their
// lanes' loads and blocks of whole warps, else the paths above): keys x
// sketch rows as an m16n8k16 product. A holds 16 keys' signs as +-1.0 in
// float16, each register built from two bits of a word by a shift and one
// logic op; B holds S q scaled by a power of two per query (its largest
// entry in [2^14, 2^15)) in two float16 parts, the high parts of 4 queries
// in columns 0-3 and the low parts in 4-7, so one product per k-step carries
// about 22 bits of S q for 4 queries. Which sketch row meets which A column
// is a free choice: lane 4 g + c reads words c m/128 .. (c + 1) m/128 - 1 of
// keys g and g + 8 (a warp's loads are whole rows), and at k-step 8 u + v
// its registers take bits (2v, 2v + 16) and (2v + 1, 2v + 17) of its word u;
// B's rows follow.
__shared__ __align__(16) float tab[4096];
__shared__ float sqs[1024];
const uint32_t n = vq_size(params_shape, 0);
const uint32_t m = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t nq = vq_size(params_shape, 3);
const uint32_t tid = threadIdx.x;
constexpr uint32_t QS_WORDS = 8;
const uint32_t slots = nq <= 4 ? 4u : 8u;
const bool tables = nq <= 8 && m % 4 == 0 && 4 * m * slots <= 4096 && nq * m <= 1024;
const uint32_t chunk_words = m / 128;
// The products run in whole warps: blocks of a multiple of 32 threads.
const bool tensor_cores = TC && nq <= 8 && m % 128 == 0 && m <= 512 && nq * m <= 1024 &&
                          vq_aligned(signs, 4 * chunk_words) && blockDim.x % 32 == 0;
// S q goes to sqs ([Q][m]) for the tables and the tensor cores, else
// straight to tab (Q m <= 4096).
float* own_sq = tables || tensor_cores ? sqs : tab;
const float base = __fdiv_rn(__fsqrt_rn(1.57079632679489662f), float(m));
for (uint32_t e = tid; e < nq * m; e += blockDim.x) {
  own_sq[e] = sq[e];
}
__syncthreads();
if (tensor_cores) {
  // Each query's scale: 2^shift puts its largest |S q| in [2^14, 2^15).
  __shared__ int shift[8];
  const uint32_t lane = tid % 32;
  const uint32_t warp = tid / 32;
  const uint32_t warps = blockDim.x / 32;
  for (uint32_t i = warp; i < nq; i += warps) {
    float amax = 0.0f;
    for (uint32_t r = lane; r < m; r += 32) {
      amax = fmaxf(amax, fabsf(sqs[i * m + r]));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    if (lane == 0) {
      shift[i] = amax > 0.0f && isfinite(amax) ? max(-126, min(126, 14 - ilogbf(amax))) : 0;
    }
  }
  __syncthreads();
  // B fragments, entry (t zt + z) 32 + lane of k-step t and n-tile z
  // (queries 4z .. 4z + 3): rows 2c, 2c + 1 and 2c + 8, 2c + 9 of column g.
  const uint32_t zt = (nq + 3) / 4;
  const uint32_t ksteps = m / 16;
  uint2* frags = reinterpret_cast<uint2*>(tab);
  for (uint32_t e = tid; e < ksteps * zt * 32; e += blockDim.x) {
    const uint32_t fl = e % 32;
    const uint32_t z = (e / 32) % zt;
    const uint32_t t = e / (32 * zt);
    const uint32_t g = fl / 4;
    const uint32_t c = fl % 4;
    const uint32_t i = 4 * z + g % 4;
    const uint32_t row = 32 * (chunk_words * c + t / 8) + 2 * (t % 8);
    // Rows row + {0, 16} (B rows 2c, 2c + 1) and row + {1, 17} (2c + 8, 2c + 9).
    uint32_t part[2][2] = {{0u, 0u}, {0u, 0u}};
    if (i < nq) {
      const float scale = vq_pow2(shift[i]);
      const float* p = sqs + i * m + row;
      vq_split_pair(p[0] * scale, p[16] * scale, part[0][0], part[0][1]);
      vq_split_pair(p[1] * scale, p[17] * scale, part[1][0], part[1][1]);
    }
    const uint32_t lo = g / 4;
    frags[e] = make_uint2(part[0][lo], part[1][lo]);
  }
  __syncthreads();
  const uint32_t g = lane / 4;
  const uint32_t c = lane % 4;
  const uint32_t tiles = (n + 15) / 16;
  // A key's words of this lane: chunk_words (1, 2 or 4) from word
  // chunk_words c, one load.
  auto load = [&](uint32_t key, uint32_t (&w)[4]) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      w[u] = 0;
    }
    if (key >= n) {
      return;
    }
    const uint32_t* src = reinterpret_cast<const uint32_t*>(signs + uint64_t(key) * nbytes) + chunk_words * c;
    if (chunk_words == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(src);
      w[0] = v.x;
      w[1] = v.y;
      w[2] = v.z;
      w[3] = v.w;
    } else if (chunk_words == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      w[0] = v.x;
      w[1] = v.y;
    } else {
      w[0] = src[0];
    }
  };
  const uint32_t stride = gridDim.x * warps;
  uint32_t tile = blockIdx.x * warps + warp;
  uint32_t w0[4];
  uint32_t w1[4];
  load(tile * 16 + g, w0);
  load(tile * 16 + g + 8, w1);
  for (; tile < tiles; tile += stride) {
    const uint32_t k0 = tile * 16 + g;
    const uint32_t k1 = k0 + 8;
    uint32_t a_words[2][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a_words[0][u] = w0[u];
      a_words[1][u] = w1[u];
    }
    // The next tile's words, in flight during this tile's products.
    load(k0 + stride * 16, w0);
    load(k1 + stride * 16, w1);
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (uint32_t u = 0; u < 4; ++u) {
      if (u < chunk_words) {
#pragma unroll
        for (uint32_t v = 0; v < 8; ++v) {
          // Bits (2v, 2v + 16) to the sign bits 15 and 31 of -1.0, -1.0.
          auto pair = [&](uint32_t word, uint32_t bit) { return ((word << (15 - bit)) & 0x80008000u) ^ 0xBC00BC00u; };
          const uint32_t a[4] = {pair(a_words[0][u], 2 * v), pair(a_words[1][u], 2 * v), pair(a_words[0][u], 2 * v + 1),
                                 pair(a_words[1][u], 2 * v + 1)};
          const uint32_t t = 8 * u + v;
#pragma unroll
          for (uint32_t z = 0; z < 2; ++z) {
            if (z < zt) {
              const uint2 b = frags[(t * zt + z) * 32 + lane];
              vq_mma(acc[z], a, b.x, b.y);
            }
          }
        }
      }
    }
    // Lanes c < 2 hold the high parts of queries 4z + 2c, + 1 (columns 2c,
    // 2c + 1), lanes c + 2 their low parts.
    const float s0 = k0 < n ? __fmul_rn(base, __half2float(norms[k0])) : 0.0f;
    const float s1 = k1 < n ? __fmul_rn(base, __half2float(norms[k1])) : 0.0f;
#pragma unroll
    for (uint32_t z = 0; z < 2; ++z) {
      if (z < zt) {
        float o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          o[j] = acc[z][j] + __shfl_xor_sync(0xffffffffu, acc[z][j], 2);
        }
#pragma unroll
        for (uint32_t e = 0; e < 2; ++e) {
          const uint32_t i = 4 * z + 2 * c + e;
          if (c < 2 && i < nq) {
            const float unscale = vq_pow2(-shift[i]);
            if (k0 < n) {
              scores[uint64_t(i) * n + k0] = __fmul_rn(s0, __fmul_rn(o[e], unscale));
            }
            if (k1 < n) {
              scores[uint64_t(i) * n + k1] = __fmul_rn(s1, __fmul_rn(o[2 + e], unscale));
            }
          }
        }
      }
    }
  }
  return;
}
if (tables) {
  // Entry e = ((g * slots / 2 + p) * 16 + c) * 2 + i % 2 for query i = 2 p +
  // i % 2; slots past nq hold 0.
  for (uint32_t e = tid; e < 4 * m * slots; e += blockDim.x) {
    const uint32_t i = 2 * ((e / 32) % (slots / 2)) + e % 2;
    const uint32_t c = (e / 2) % 16;
    const uint32_t g = e / (slots * 16);
    float v = 0.0f;
    if (i < nq) {
#pragma unroll
      for (uint32_t h = 0; h < 4; ++h) {
        const float s = sqs[i * m + 4 * g + h];
        v = __fadd_rn(v, (c >> h) & 1u ? s : -s);
      }
    }
    tab[e] = v;
  }
  __syncthreads();
}
const uint32_t stride = gridDim.x * blockDim.x;
const uint32_t tab_base = static_cast<uint32_t>(__cvta_generic_to_shared(tab));
const bool wide = tables && nbytes % 16 == 0 && vq_aligned(signs, 16);
const bool words = tables && nbytes % 4 == 0 && vq_aligned(signs, 4);
for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride) {
  const float scale = __fmul_rn(base, __half2float(norms[t]));
  const uint8_t* key = signs + uint64_t(t) * nbytes;
  if (tables) {
    uint32_t bits[QS_WORDS];
#pragma unroll
    for (uint32_t w = 0; w < QS_WORDS; w += 4) {
      if (w * 4 < nbytes) {
        if (wide) {
          const uint4 u = *reinterpret_cast<const uint4*>(key + w * 4);
          bits[w] = u.x;
          bits[w + 1] = u.y;
          bits[w + 2] = u.z;
          bits[w + 3] = u.w;
        } else {
#pragma unroll
          for (uint32_t h = 0; h < 4; ++h) {
            uint32_t word = 0;
            if ((w + h) * 4 < nbytes && words) {
              word = reinterpret_cast<const uint32_t*>(key)[w + h];
            } else {
              for (uint32_t y = 0; y < 4 && (w + h) * 4 + y < nbytes; ++y) {
                word |= uint32_t(key[(w + h) * 4 + y]) << (8 * y);
              }
            }
            bits[w + h] = word;
          }
        }
      }
    }
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] = 0.0f;
    }
    if (slots == 4) {
      qjl_table_sums<4, QS_WORDS>(acc, bits, m, tab_base);
    } else {
      qjl_table_sums<8, QS_WORDS>(acc, bits, m, tab_base);
    }
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) {
      if (i < nq) {
        scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc[i]);
      }
    }
    continue;
  }
  for (uint32_t i = 0; i < nq; ++i) {
    float acc = 0.0f;
    for (uint32_t r = 0; r < m; ++r) {
      const float v = tab[i * m + r];
      acc = __fadd_rn(acc, (key[r / 8] >> (r % 8)) & 1u ? v : -v);
    }
    scores[uint64_t(i) * n + t] = __fmul_rn(scale, acc);
  }
}
