// kv_attention: one split of one (batch, kv head) for a tile of QN query rows
// (G heads x QN/G queries) -> running max, sum and accumulator of the online
// softmax, in the value frame; the CUDA twin of metal/kv_attention.metal
// (same template arguments, inputs, params and split plan; codecs in
// kv_common.cuh). Block: 128 threads (4 warps), tokens in tiles of 128.
// Every codec's score and value are hooks of one loop: a codec kv_staged
// names (TurboQuant, FP8) has, under STAGE, each tile's code rows, scales
// and table staged in shared memory with coalesced loads, key rows padded to
// an odd number of words so that threads reading their own row hit distinct
// banks; the others read device memory through kv_element.
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int DPT = (D + TG - 1) / TG;
constexpr bool KS = STAGE && kv_staged(KM);
constexpr bool VS = STAGE && kv_staged(VM);
constexpr int KSROW = D * KB / 8, VSROW = D * VB / 8;
constexpr int KSTRIDE = (((KSROW + 3) / 4) | 1) * 4;
constexpr int VSTRIDE = (VSROW + 3) / 4 * 4;
__shared__ float qs[QN * D];
// Aligned: a token's QN weights are read as 16-byte vectors.
__shared__ __align__(16) float p_s[TG * QN];
__shared__ float red[QN * WARPS];
__shared__ __align__(16) uint8_t kbuf[KS ? TG * KSTRIDE : 16];
__shared__ __align__(16) uint8_t vbuf[VS ? TG * VSTRIDE + 8 : 16];
__shared__ float kn_s[KS ? TG : 1];
__shared__ float vn_s[VS ? TG : 1];
__shared__ float kc[KS ? (1 << KB) : 1];
__shared__ float vc[VS ? (1 << VB) : 1];
// The sizes ride in the shapes [0, s0..s8] and [0, s9..] of two empty
// arrays (kernels::split_sizes): MLX passes an input's shape by value, where
// an array of values would be migrated to the GPU at every call.
const uint32_t Bn = params_shape[1], Hq = params_shape[2], Hkv = params_shape[3], L = params_shape[4];
const uint32_t n_sink = params_shape[5], n_comp = params_shape[6], n_recent = params_shape[7];
const uint32_t CAP = params_shape[8], WCAP = params_shape[9], split_tokens = params_hi_shape[1];
const uint32_t num_splits = params_hi_shape[2], q_tiles = params_hi_shape[3], causal = params_hi_shape[4];
const uint32_t comp_splits = params_hi_shape[5], mask_heads = params_hi_shape[6];
const uint32_t G = Hq / Hkv;
const uint32_t QT = QN / G;
const uint32_t total = n_sink + n_comp + n_recent;
const int tid = threadIdx.x;
const int lane = tid & 31, warp = tid >> 5;
uint32_t blk = blockIdx.x;
const uint32_t split = blk % num_splits;
blk /= num_splits;
const uint32_t qt = blk % q_tiles;
blk /= q_tiles;
const uint32_t hk = blk % Hkv;
const uint32_t b = blk / Hkv;
if (b >= Bn) {
  return;
}
const uint64_t head = uint64_t(b) * Hkv + hk;
const float* k_rows = kv_side_table<KM>(k_table, hk);
const float* v_rows = kv_side_table<VM>(v_table, hk);
const float ninf = -__int_as_float(0x7f800000);
if constexpr (KS) {
  for (int k = tid; k < (1 << KB); k += TG) kc[k] = k_rows[k];
}
if constexpr (VS) {
  for (int k = tid; k < (1 << VB); k += TG) vc[k] = v_rows[k];
}
// Row r's prepared query (a row past L reads the last one; it is masked).
// Computed where read, not held: only the codecs scored from the query's
// features read it past the first D, and an array of them would cost the
// other codecs' loops their registers.
const auto qrow = [&](int r) -> uint64_t {
  const uint32_t ql = min(qt * QT + r % QT, L - 1);
  return ((uint64_t(b) * Hq + hk * G + r / QT) * L + ql) * QF;
};
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint32_t ql = qt * QT + r % QT;
  qs[e] = ql < L ? qf[qrow(r) + i] : 0.0f;
}
float m_run[QN], l_run[QN];
#pragma unroll
for (int r = 0; r < QN; ++r) {
  m_run[r] = ninf;
  l_run[r] = 0.0f;
}
float acc[QN][DPT];
#pragma unroll
for (int r = 0; r < QN; ++r) {
#pragma unroll
  for (int c = 0; c < DPT; ++c) acc[r][c] = 0.0f;
}
const bool compressed = split < comp_splits;
uint32_t t_begin, t_end;  // compressed indices, or window slots
if (compressed) {
  t_begin = split * split_tokens;
  t_end = min(t_begin + split_tokens, n_comp);
} else {
  t_begin = (split - comp_splits) * TG;
  t_end = min(t_begin + TG, n_sink + n_recent);
}
__syncthreads();
for (uint32_t tile = t_begin; tile < t_end; tile += TG) {
  const uint32_t count = min(uint32_t(TG), t_end - tile);
  const uint32_t t = tile + tid;
  float s[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) s[r] = 0.0f;
  uint32_t pos = 0xffffffffu;
  if (compressed && (KS || VS)) {
    // Stage the tile (the split is the block's, so every thread is here).
    if constexpr (KS) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(k_codes) + (head * CAP + tile) * KSROW;
      for (uint32_t e = tid; e < count * KSROW; e += TG) kbuf[(e / KSROW) * KSTRIDE + e % KSROW] = src[e];
      if (tid < count) kn_s[tid] = kv_float(k_scales[head * CAP + t]);
    }
    if constexpr (VS) {
      const uint8_t* src = reinterpret_cast<const uint8_t*>(v_codes) + (head * CAP + tile) * VSROW;
      for (uint32_t e = tid; e < count * VSROW; e += TG) vbuf[(e / VSROW) * VSTRIDE + e % VSROW] = src[e];
      if (tid < count) vn_s[tid] = kv_float(v_scales[head * CAP + t]);
    }
    __syncthreads();
  }
  if (compressed && tid < count && KS) {
    pos = n_sink + t;
    // Codes from 32-bit words through a 64-bit bit buffer; fully unrolled,
    // so that the word and shift of every code are constants.
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(kbuf + tid * KSTRIDE);
    uint64_t bits = 0;
    int have = 0, w = 0;
#pragma unroll
    for (int j = 0; j < D; ++j) {
      if (have < KB) {
        bits |= uint64_t(kw[w++]) << have;
        have += 32;
      }
      const float c = kc[unsigned(bits) & ((1u << KB) - 1u)];
      bits >>= KB;
      have -= KB;
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * c;
    }
#pragma unroll
    for (int r = 0; r < QN; ++r) s[r] *= kn_s[tid];
  } else if (compressed && tid < count && KM == KV_PRODUCT_QUANTIZED) {
    pos = n_sink + t;
    // Product quantization: one lookup per sub-vector in each row's table.
    constexpr int KROW = (D / KG * KB + 7) / 8;
    const uint8_t* krow = reinterpret_cast<const uint8_t*>(k_codes) + (head * CAP + t) * KROW;
    for (int p = 0; p < D / KG; ++p) {
      const unsigned c = kv_code_at(krow, unsigned(p), unsigned(KB));
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] += qf[qrow(r) + D + uint64_t(p) * (1u << KB) + c];
    }
    const float n = kv_float(k_scales[head * CAP + t]);
#pragma unroll
    for (int r = 0; r < QN; ++r) s[r] *= n;
  } else if (compressed && tid < count && KM == KV_QJL) {
    pos = n_sink + t;
    // QJL: ±(c S q)_r by the sign bit r of the key, times its norm.
    const uint8_t* krow = reinterpret_cast<const uint8_t*>(k_codes) + (head * CAP + t) * ((D * KB + 7) / 8);
    for (int i = 0; i < KB * D; ++i) {
      const bool up = kv_code_at(krow, unsigned(i), 1u) != 0u;
#pragma unroll
      for (int r = 0; r < QN; ++r) {
        const float f = qf[qrow(r) + D + i];
        s[r] += up ? f : -f;
      }
    }
    const float n = kv_float(k_scales[head * CAP + t]);
#pragma unroll
    for (int r = 0; r < QN; ++r) s[r] *= n;
  } else if (compressed && tid < count && KM == KV_TURBOQUANT_PROD) {
    pos = n_sink + t;
    // TurboQuant-Prod: norm * (<Πq, c[code]> + residual norm * Σ ±(c S Πq)_j).
    constexpr int KROW = (D * KB + 7) / 8, MSE_ROW = (D * (KB - 1) + 7) / 8;
    const uint8_t* krow = reinterpret_cast<const uint8_t*>(k_codes) + (head * CAP + t) * KROW;
    float z[QN];
#pragma unroll
    for (int r = 0; r < QN; ++r) z[r] = 0.0f;
    for (int j = 0; j < D; ++j) {
      const float kj = k_table[kv_code_at(krow, unsigned(j), unsigned(KB - 1))];
      const bool up = kv_code_at(krow + MSE_ROW, unsigned(j), 1u) != 0u;
#pragma unroll
      for (int r = 0; r < QN; ++r) {
        s[r] += qs[r * D + j] * kj;
        const float f = qf[qrow(r) + D + j];
        z[r] += up ? f : -f;
      }
    }
    const float n = kv_float(k_scales[(head * CAP + t) * 2]), rn = kv_float(k_scales[(head * CAP + t) * 2 + 1]);
#pragma unroll
    for (int r = 0; r < QN; ++r) s[r] = n * (s[r] + rn * z[r]);
  } else if (compressed && tid < count) {
    pos = n_sink + t;
    for (int j = 0; j < D; ++j) {
      const float kj = kv_element<KM, KB, KG, D>(k_codes, k_scales, k_zeros, k_rows, head, t, CAP, j);
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kj;
    }
  } else if (!compressed && tid < count) {
    pos = t < n_sink ? t : n_comp + t;
    const T* krow = win_k + (head * WCAP + t) * D;
    for (int j = 0; j < D; ++j) {
      const float kv = kv_float(krow[j]);
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kv;
    }
  }
  float mx[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    const uint32_t ql = qt * QT + r % QT;
    const bool visible = pos != 0xffffffffu && ql < L && !(causal && pos > total - L + ql);
    if (visible && mask_heads != 0) {
      const uint32_t hm = mask_heads == 1 ? 0u : hk * G + r / QT;
      s[r] += mask[((uint64_t(b) * mask_heads + hm) * L + ql) * total + pos];
    }
    s[r] = visible ? s[r] : ninf;
    float v = s[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[r * WARPS + warp] = v;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    float v = red[r * WARPS];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) v = fmaxf(v, red[r * WARPS + w]);
    mx[r] = fmaxf(m_run[r], v);
  }
  __syncthreads();
  float alpha[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    const float p = mx[r] == ninf ? 0.0f : __expf(s[r] - mx[r]);
    p_s[tid * QN + r] = p;
    float v = p;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[r * WARPS + warp] = v;
    alpha[r] = mx[r] == ninf ? 1.0f : __expf(m_run[r] - mx[r]);
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += red[r * WARPS + w];
    l_run[r] = l_run[r] * alpha[r] + sum;
    m_run[r] = mx[r];
  }
  // Values: each thread owns DPT dimensions and walks the tile's tokens.
#pragma unroll
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) {
#pragma unroll
      for (int r = 0; r < QN; ++r) acc[r][c] *= alpha[r];
      // A staged code sits at the same word and shift in every row.
      const unsigned o = unsigned(i) * VB;
      const unsigned word = o >> 5, shift = o & 31u;
      for (uint32_t k = 0; k < count; ++k) {
        float v;
        if (!compressed) {
          v = kv_float(win_v[(head * WCAP + tile + k) * D + i]);
        } else if constexpr (VS) {
          const uint32_t* vw = reinterpret_cast<const uint32_t*>(vbuf + k * VSTRIDE) + word;
          uint64_t x = vw[0];
          if (shift + VB > 32u) x |= uint64_t(vw[1]) << 32;
          v = vc[unsigned(x >> shift) & ((1u << VB) - 1u)] * vn_s[k];
        } else {
          v = kv_element<VM, VB, VG, D>(v_codes, v_scales, v_zeros, v_rows, head, tile + k, CAP, i);
        }
        const float* pk = p_s + k * QN;
#pragma unroll
        for (int r = 0; r < QN; ++r) acc[r][c] += pk[r] * v;
      }
    }
  }
  __syncthreads();
}
for (int r = 0; r < QN; ++r) {
  const uint32_t ql = qt * QT + r % QT;
  if (ql >= L) continue;
  const uint64_t row = (uint64_t(b) * Hq + hk * G + r / QT) * L + ql;
  if (tid == 0) {
    m_out[row * num_splits + split] = m_run[r];
    l_out[row * num_splits + split] = l_run[r];
  }
#pragma unroll
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) acc_out[(row * num_splits + split) * D + i] = acc[r][c];
  }
}
