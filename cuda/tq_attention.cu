// tq_attention: one split of the keys and values of one (batch, kv head) for a
// tile of QN query rows (G heads x QN/G queries) -> running max, sum and
// accumulator of the online softmax, in the rotated frame.
// Template: T, D, KB (key bits), VB (value bits), QN. Block: 128 threads.
// params = {B, Hq, Hkv, L, n_sink, n_comp, n_recent, CAP, WCAP, split_tokens,
//           num_splits, q_tiles, causal}.
// Tokens in position order: sinks (window slots 0..n_sink), compressed
// (store slots), recent (window slots n_sink..).
constexpr int TG = 128;
constexpr int DPT = (D + TG - 1) / TG;
constexpr int KROW = D * KB / 8;
constexpr int VROW = D * VB / 8;
__shared__ float qs[QN * D];
__shared__ float sc[QN * TG];
__shared__ float m_s[QN];
__shared__ float l_s[QN];
__shared__ float a_s[QN];
__shared__ float kc[1 << KB];
__shared__ float vc[1 << VB];
const uint32_t Bn = params[0], Hq = params[1], Hkv = params[2], L = params[3];
const uint32_t n_sink = params[4], n_comp = params[5], n_recent = params[6];
const uint32_t CAP = params[7], WCAP = params[8], split_tokens = params[9];
const uint32_t num_splits = params[10], q_tiles = params[11], causal = params[12];
const uint32_t G = Hq / Hkv;
const uint32_t QT = QN / G;
const uint32_t total = n_sink + n_comp + n_recent;
const int tid = threadIdx.x;
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
const float qscale = scale[0];
// Row r: head hk*G + r / QT, query qt*QT + r % QT.
for (int k = tid; k < (1 << KB); k += TG) kc[k] = k_cent[k];
for (int k = tid; k < (1 << VB); k += TG) vc[k] = v_cent[k];
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint32_t ql = qt * QT + r % QT;
  float y = 0.0f;
  if (ql < L) {
    const uint64_t qrow = ((uint64_t(b) * Hq + hk * G + r / QT) * L + ql) * D;
    for (int j = 0; j < D; ++j) {
      y += rot_k[i * D + j] * static_cast<float>(q[qrow + j]);
    }
  }
  qs[e] = y * qscale;
}
if (tid < QN) {
  m_s[tid] = -__int_as_float(0x7f800000);
  l_s[tid] = 0.0f;
}
float acc[QN][DPT];
#pragma unroll
for (int r = 0; r < QN; ++r) {
#pragma unroll
  for (int c = 0; c < DPT; ++c) acc[r][c] = 0.0f;
}
__syncthreads();
const uint32_t t_begin = split * split_tokens;
const uint32_t t_end = min(t_begin + split_tokens, total);
for (uint32_t tile = t_begin; tile < t_end; tile += TG) {
  const uint32_t t = tile + tid;
  float s[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) s[r] = 0.0f;
  if (t < t_end) {
    if (t >= n_sink && t < n_sink + n_comp) {
      const uint64_t slot = head * CAP + (t - n_sink);
      const uint8_t* krow = k_codes + slot * KROW;
      for (int j = 0; j < D; ++j) {
        const float c = kc[vq_code_at(krow, j, KB)];
#pragma unroll
        for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * c;
      }
      const float kn = __half2float(k_norms[slot]);
#pragma unroll
      for (int r = 0; r < QN; ++r) s[r] *= kn;
    } else {
      const uint32_t w = t < n_sink ? t : t - n_comp;
      const T* krow = win_k + (head * WCAP + w) * D;
      for (int j = 0; j < D; ++j) {
        const float kv = static_cast<float>(krow[j]);
#pragma unroll
        for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kv;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    const uint32_t ql = qt * QT + r % QT;
    const bool visible = t < t_end && ql < L && !(causal && t > total - L + ql);
    sc[r * TG + tid] = visible ? s[r] : -__int_as_float(0x7f800000);
  }
  __syncthreads();
  if (tid < QN) {
    const int r = tid;
    float mx = m_s[r];
    for (int k = 0; k < TG; ++k) mx = fmaxf(mx, sc[r * TG + k]);
    const float alpha = mx == -__int_as_float(0x7f800000) ? 1.0f : expf(m_s[r] - mx);
    float sum = 0.0f;
    for (int k = 0; k < TG; ++k) {
      const float p = mx == -__int_as_float(0x7f800000) ? 0.0f : expf(sc[r * TG + k] - mx);
      sc[r * TG + k] = p;
      sum += p;
    }
    l_s[r] = l_s[r] * alpha + sum;
    m_s[r] = mx;
    a_s[r] = alpha;
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) {
#pragma unroll
      for (int r = 0; r < QN; ++r) acc[r][c] *= a_s[r];
      const uint32_t count = min(uint32_t(TG), t_end - tile);
      for (uint32_t k = 0; k < count; ++k) {
        const uint32_t tt = tile + k;
        float v;
        if (tt >= n_sink && tt < n_sink + n_comp) {
          const uint64_t slot = head * CAP + (tt - n_sink);
          v = vc[vq_code_at(v_codes + slot * VROW, i, VB)] * __half2float(v_norms[slot]);
        } else {
          const uint32_t w = tt < n_sink ? tt : tt - n_comp;
          v = static_cast<float>(win_v[(head * WCAP + w) * D + i]);
        }
#pragma unroll
        for (int r = 0; r < QN; ++r) acc[r][c] += sc[r * TG + k] * v;
      }
    }
  }
  __syncthreads();
}
// Outputs per row: m, l [R, S] and acc [R, S, D], R = B * Hq * L.
for (int r = 0; r < QN; ++r) {
  const uint32_t ql = qt * QT + r % QT;
  if (ql >= L) continue;
  const uint64_t row = (uint64_t(b) * Hq + hk * G + r / QT) * L + ql;
  if (tid == 0) {
    m_out[row * num_splits + split] = m_s[r];
    l_out[row * num_splits + split] = l_s[r];
  }
#pragma unroll
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) acc_out[(row * num_splits + split) * D + i] = acc[r][c];
  }
}
