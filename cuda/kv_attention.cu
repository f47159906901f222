// kv_attention: one split of one (batch, kv head) for a tile of QN query rows
// (G heads x QN/G queries) -> running max, sum and accumulator of the online
// softmax, in the value frame; the CUDA twin of metal/kv_attention.metal
// (same template arguments, inputs, params and split plan; codecs in
// kv_common.cuh). Block: 128 threads (4 warps), tokens in tiles of 128.
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int DPT = (D + TG - 1) / TG;
__shared__ float qs[QN * D];
__shared__ float p_s[TG * QN];
__shared__ float red[QN * WARPS];
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
// Each row's prepared query (a row past L reads the last one; it is masked).
uint64_t qrow[QN];
#pragma unroll
for (int r = 0; r < QN; ++r) {
  const uint32_t ql = min(qt * QT + r % QT, L - 1);
  qrow[r] = ((uint64_t(b) * Hq + hk * G + r / QT) * L + ql) * QF;
}
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint32_t ql = qt * QT + r % QT;
  qs[e] = ql < L ? qf[qrow[r] + i] : 0.0f;
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
  if (compressed && tid < count && KM == KV_PRODUCT_QUANTIZED) {
    pos = n_sink + t;
    // Product quantization: one lookup per sub-vector in each row's table.
    constexpr int KROW = (D / KG * KB + 7) / 8;
    const uint8_t* krow = reinterpret_cast<const uint8_t*>(k_codes) + (head * CAP + t) * KROW;
    for (int p = 0; p < D / KG; ++p) {
      const unsigned c = kv_code_at(krow, unsigned(p), unsigned(KB));
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] += qf[qrow[r] + D + uint64_t(p) * (1u << KB) + c];
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
        const float f = qf[qrow[r] + D + i];
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
        const float f = qf[qrow[r] + D + j];
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
      for (uint32_t k = 0; k < count; ++k) {
        const float v = compressed
            ? kv_element<VM, VB, VG, D>(v_codes, v_scales, v_zeros, v_rows, head, tile + k, CAP, i)
            : kv_float(win_v[(head * WCAP + tile + k) * D + i]);
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
