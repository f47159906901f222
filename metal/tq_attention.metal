// tq_attention: one split of the keys and values of one (batch, kv head) for a
// tile of QN query rows (G heads x QN/G queries) -> running max, sum and
// accumulator of the online softmax, in the rotated frame.
// Template: T, D, KB (key bits), VB (value bits), QN. Threadgroup: 128 threads.
// params = {B, Hq, Hkv, L, n_sink, n_comp, n_recent, CAP, WCAP, split_tokens,
//           num_splits, q_tiles, causal}.
// Tokens in position order: sinks (window slots 0..n_sink), compressed
// (store slots), recent (window slots n_sink..).
constexpr int TG = 128;
constexpr int DPT = (D + TG - 1) / TG;
constexpr int KROW = D * KB / 8;
constexpr int VROW = D * VB / 8;
threadgroup float qs[QN * D];
threadgroup float sc[QN * TG];
threadgroup float m_s[QN];
threadgroup float l_s[QN];
threadgroup float a_s[QN];
threadgroup float kc[1 << KB];
threadgroup float vc[1 << VB];
const uint Bn = params[0], Hq = params[1], Hkv = params[2], L = params[3];
const uint n_sink = params[4], n_comp = params[5], n_recent = params[6];
const uint CAP = params[7], WCAP = params[8], split_tokens = params[9];
const uint num_splits = params[10], q_tiles = params[11], causal = params[12];
const uint G = Hq / Hkv;
const uint QT = QN / G;
const uint total = n_sink + n_comp + n_recent;
const int tid = int(thread_position_in_threadgroup.x);
uint blk = threadgroup_position_in_grid.x;
const uint split = blk % num_splits;
blk /= num_splits;
const uint qt = blk % q_tiles;
blk /= q_tiles;
const uint hk = blk % Hkv;
const uint b = blk / Hkv;
if (b >= Bn) {
  return;
}
const ulong head = ulong(b) * Hkv + hk;
const float qscale = scale[0];
for (int k = tid; k < (1 << KB); k += TG) kc[k] = k_cent[k];
for (int k = tid; k < (1 << VB); k += TG) vc[k] = v_cent[k];
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint ql = qt * QT + uint(r) % QT;
  float y = 0.0f;
  if (ql < L) {
    const ulong qrow = ((ulong(b) * Hq + hk * G + uint(r) / QT) * L + ql) * D;
    for (int j = 0; j < D; ++j) {
      y += rot_k[i * D + j] * float(q[qrow + j]);
    }
  }
  qs[e] = y * qscale;
}
if (tid < QN) {
  m_s[tid] = -INFINITY;
  l_s[tid] = 0.0f;
}
float acc[QN][DPT];
for (int r = 0; r < QN; ++r) {
  for (int c = 0; c < DPT; ++c) acc[r][c] = 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint t_begin = split * split_tokens;
const uint t_end = min(t_begin + split_tokens, total);
for (uint tile = t_begin; tile < t_end; tile += TG) {
  const uint t = tile + uint(tid);
  float s[QN];
  for (int r = 0; r < QN; ++r) s[r] = 0.0f;
  if (t < t_end) {
    if (t >= n_sink && t < n_sink + n_comp) {
      const ulong slot = head * CAP + (t - n_sink);
      const device uint8_t* krow = k_codes + slot * KROW;
      for (int j = 0; j < D; ++j) {
        const float c = kc[vq_code_at(krow, uint(j), KB)];
        for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * c;
      }
      const float kn = float(k_norms[slot]);
      for (int r = 0; r < QN; ++r) s[r] *= kn;
    } else {
      const uint w = t < n_sink ? t : t - n_comp;
      const ulong kbase = (head * WCAP + w) * D;
      for (int j = 0; j < D; ++j) {
        const float kv = float(win_k[kbase + j]);
        for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kv;
      }
    }
  }
  for (int r = 0; r < QN; ++r) {
    const uint ql = qt * QT + uint(r) % QT;
    const bool visible = t < t_end && ql < L && !(causal != 0 && t > total - L + ql);
    sc[r * TG + tid] = visible ? s[r] : -INFINITY;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < QN) {
    const int r = tid;
    float mx = m_s[r];
    for (int k = 0; k < TG; ++k) mx = max(mx, sc[r * TG + k]);
    const float alpha = mx == -INFINITY ? 1.0f : exp(m_s[r] - mx);
    float sum = 0.0f;
    for (int k = 0; k < TG; ++k) {
      const float p = mx == -INFINITY ? 0.0f : exp(sc[r * TG + k] - mx);
      sc[r * TG + k] = p;
      sum += p;
    }
    l_s[r] = l_s[r] * alpha + sum;
    m_s[r] = mx;
    a_s[r] = alpha;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) {
      for (int r = 0; r < QN; ++r) acc[r][c] *= a_s[r];
      const uint count = min(uint(TG), t_end - tile);
      for (uint k = 0; k < count; ++k) {
        const uint tt = tile + k;
        float v;
        if (tt >= n_sink && tt < n_sink + n_comp) {
          const ulong slot = head * CAP + (tt - n_sink);
          v = vc[vq_code_at(v_codes + slot * VROW, uint(i), VB)] * float(v_norms[slot]);
        } else {
          const uint w = tt < n_sink ? tt : tt - n_comp;
          v = float(win_v[(head * WCAP + w) * D + i]);
        }
        for (int r = 0; r < QN; ++r) acc[r][c] += sc[r * TG + k] * v;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (int r = 0; r < QN; ++r) {
  const uint ql = qt * QT + uint(r) % QT;
  if (ql >= L) continue;
  const ulong row = (ulong(b) * Hq + hk * G + uint(r) / QT) * L + ql;
  if (tid == 0) {
    m_out[row * num_splits + split] = m_s[r];
    l_out[row * num_splits + split] = l_s[r];
  }
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) acc_out[(row * num_splits + split) * D + i] = acc[r][c];
  }
}
