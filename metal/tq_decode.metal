// tq_decode: attention of QN query rows of one (batch, KV head) over one
// split of the layer's tokens -> the split's running max, sum and accumulator
// of the online softmax, in the rotated frame (tq_reduce finishes).
// Template: T, D, KB/VB (key/value bits), QN (rows per tile, at most 4),
// TPT (lanes per token: a power of two up to 32), N_SINK (sink tokens held),
// CAUSAL, SCALE (the score scale's float32 bits).
// Inputs, read through their shapes and strides (no parameter buffer, no
// copies): q [B, Hq, L, D] as the model gives it; rot [D, D] float32, the
// keys' rotation Π; the stores k_codes/v_codes [B, Hkv, CAP, D*bits/8] and
// v_norms [B, Hkv, CAP]; k_norms [B, Hkv, n_comp], a view whose length is the
// compressed count; the codebooks; the rotated windows (sinks first) win_v
// [B, Hkv, WCAP, D] and win_k [B, Hkv, n_win, D], a view whose length is the
// count of window tokens.
// Rows of a KV head are r = h * L + l (its G heads, L queries); a tile holds
// QN consecutive rows. The grid is B * Hkv * tiles * splits threadgroups;
// window slots take ceil(n_win / 128) splits of 128, compressed tokens the
// rest, each a whole number of 128-token tiles.
// Threads: groups of TPT lanes share a token, lane li holding chunks
// c = li + k * TPT (k < CPT) of 8 dimensions, its rows' rotated queries in
// registers and its group's own online-softmax state. No barrier in the token
// loop; groups combine at the end (simdgroup shuffles, then threadgroup
// memory).
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int NCH = D / 8;
constexpr int CPT = (NCH + TPT - 1) / TPT;
constexpr int GROUPS = TG / TPT;
constexpr int KROW = D * KB / 8;
constexpr int VROW = D * VB / 8;
threadgroup float qs[QN * D];
threadgroup float kc[1 << KB];
threadgroup float vc[1 << VB];
threadgroup float m_s[WARPS * QN];
threadgroup float l_s[WARPS * QN];
threadgroup float a_s[WARPS * QN * D];
const uint Bn = uint(q_shape[0]), Hq = uint(q_shape[1]), L = uint(q_shape[2]);
const uint Hkv = uint(win_k_shape[1]);
const uint n_comp = uint(k_norms_shape[2]);
const uint n_win = uint(win_k_shape[2]);
const uint G = Hq / Hkv;
const uint head_rows = G * L;
const uint tiles = (head_rows + QN - 1) / QN;
const uint total = n_comp + n_win;
const uint win_splits = (n_win + TG - 1) / TG;
const uint num_splits = threadgroups_per_grid.x / (Bn * Hkv * tiles);
const uint comp_splits = num_splits - win_splits;
const uint split_tokens = comp_splits == 0 ? 0u : ((n_comp + comp_splits - 1) / comp_splits + TG - 1) / TG * TG;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
uint blk = threadgroup_position_in_grid.x;
const uint split = blk % num_splits;
blk /= num_splits;
const uint tile = blk % tiles;
blk /= tiles;
const uint hk = blk % Hkv;
const uint b = blk / Hkv;
for (uint k = tid; k < (1u << KB); k += TG) kc[k] = k_cent[k];
for (uint k = tid; k < (1u << VB); k += TG) vc[k] = v_cent[k];
// The tile's queries, rotated and scaled: qs = SCALE * Π q. The raw rows
// are staged first (one load per thread, all in flight); each thread then
// owns output dimensions i and reads row i of Π once, as float4, for all
// QN rows.
for (uint e = tid; e < uint(QN * D); e += TG) {
  const uint rr = tile * QN + e / D, j = e % D;
  float x = 0.0f;
  if (rr < head_rows) {
    const long qo = long(b) * q_strides[0] + long(hk * G + rr / L) * q_strides[1] + long(rr % L) * q_strides[2];
    x = float(q[qo + long(j) * q_strides[3]]);
  }
  a_s[e] = x;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float scale = as_type<float>(SCALE);
for (uint i = tid; i < uint(D); i += TG) {
  float y[QN];
  for (int r = 0; r < QN; ++r) y[r] = 0.0f;
  for (int j4 = 0; j4 < D / 4; ++j4) {
    const float4 w = float4(rot[i * D + 4 * j4], rot[i * D + 4 * j4 + 1], rot[i * D + 4 * j4 + 2], rot[i * D + 4 * j4 + 3]);
    for (int r = 0; r < QN; ++r) {
      const uint x = r * D + 4 * j4;
      y[r] += w.x * a_s[x] + w.y * a_s[x + 1] + w.z * a_s[x + 2] + w.w * a_s[x + 3];
    }
  }
  for (int r = 0; r < QN; ++r) qs[r * D + i] = y[r] * scale;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint li = tid % TPT, gi = tid / TPT;
float qv[QN][CPT * 8];
bool row_ok[QN];
uint qpos[QN];
for (int r = 0; r < QN; ++r) {
  const uint rr = tile * QN + r;
  row_ok[r] = rr < head_rows;
  qpos[r] = total - L + rr % L;
  for (int k = 0; k < CPT; ++k) {
    const uint c = li + k * TPT;
    for (int j = 0; j < 8; ++j) qv[r][k * 8 + j] = c < uint(NCH) ? qs[r * D + c * 8 + j] : 0.0f;
  }
}
float m_run[QN], l_run[QN], acc[QN][CPT * 8];
for (int r = 0; r < QN; ++r) {
  m_run[r] = -INFINITY;
  l_run[r] = 0.0f;
  for (int j = 0; j < CPT * 8; ++j) acc[r][j] = 0.0f;
}
const bool compressed = split < comp_splits;
uint t_begin, t_end;
if (compressed) {
  t_begin = split * split_tokens;
  t_end = min(t_begin + split_tokens, n_comp);
} else {
  t_begin = (split - comp_splits) * TG;
  t_end = min(t_begin + uint(TG), n_win);
}
// Every lane runs every iteration (the shuffles need the whole simdgroup);
// a group past the end holds no token.
for (uint base = t_begin; base < t_end; base += GROUPS) {
  const uint t = base + gi;
  const bool have = t < t_end;
  float kx[CPT * 8], vx[CPT * 8];
  float kn = 0.0f, vn = 0.0f;
  uint pos = 0;
  if (have && compressed) {
    pos = N_SINK + t;
    const long kb = long(b) * k_codes_strides[0] + long(hk) * k_codes_strides[1] + long(t) * k_codes_strides[2];
    const long vb = long(b) * v_codes_strides[0] + long(hk) * v_codes_strides[1] + long(t) * v_codes_strides[2];
    for (int k = 0; k < CPT; ++k) {
      const uint c = li + k * TPT;
      ulong kbits = 0, vbits = 0;
      if (c < uint(NCH)) {
        for (int y = 0; y < KB; ++y) kbits |= ulong(k_codes[kb + c * KB + y]) << (8 * y);
        for (int y = 0; y < VB; ++y) vbits |= ulong(v_codes[vb + c * VB + y]) << (8 * y);
      }
      for (int j = 0; j < 8; ++j) {
        kx[k * 8 + j] = kc[uint(kbits >> (j * KB)) & ((1u << KB) - 1u)];
        vx[k * 8 + j] = vc[uint(vbits >> (j * VB)) & ((1u << VB) - 1u)];
      }
    }
    kn = float(k_norms[long(b) * k_norms_strides[0] + long(hk) * k_norms_strides[1] + long(t) * k_norms_strides[2]]);
    vn = float(v_norms[long(b) * v_norms_strides[0] + long(hk) * v_norms_strides[1] + long(t) * v_norms_strides[2]]);
  } else if (have) {
    pos = t < uint(N_SINK) ? t : n_comp + t;
    const long wk = long(b) * win_k_strides[0] + long(hk) * win_k_strides[1] + long(t) * win_k_strides[2];
    const long wv = long(b) * win_v_strides[0] + long(hk) * win_v_strides[1] + long(t) * win_v_strides[2];
    for (int k = 0; k < CPT; ++k) {
      const uint c = li + k * TPT;
      for (int j = 0; j < 8; ++j) {
        kx[k * 8 + j] = c < uint(NCH) ? float(win_k[wk + c * 8 + j]) : 0.0f;
        vx[k * 8 + j] = c < uint(NCH) ? float(win_v[wv + c * 8 + j]) : 0.0f;
      }
    }
    kn = 1.0f;
    vn = 1.0f;
  } else {
    for (int j = 0; j < CPT * 8; ++j) {
      kx[j] = 0.0f;
      vx[j] = 0.0f;
    }
  }
  float s[QN];
  for (int r = 0; r < QN; ++r) {
    float v = 0.0f;
    for (int j = 0; j < CPT * 8; ++j) v += qv[r][j] * kx[j];
    s[r] = v;
  }
  for (uint o = TPT / 2; o > 0; o >>= 1) {
    for (int r = 0; r < QN; ++r) s[r] += simd_shuffle_xor(s[r], ushort(o));
  }
  for (int r = 0; r < QN; ++r) {
    // Uniform across a group: every lane holds the same score.
    if (!have || !row_ok[r] || (CAUSAL && pos > qpos[r])) continue;
    const float sc = s[r] * kn;
    if (sc > m_run[r]) {
      const float alpha = exp(m_run[r] - sc);
      l_run[r] *= alpha;
      for (int j = 0; j < CPT * 8; ++j) acc[r][j] *= alpha;
      m_run[r] = sc;
    }
    const float p = exp(sc - m_run[r]);
    l_run[r] += p;
    const float pv = p * vn;
    for (int j = 0; j < CPT * 8; ++j) acc[r][j] += pv * vx[j];
  }
}
// Groups of one simdgroup: lanes li, li + TPT, ... hold the same dimensions.
for (uint o = TPT; o < 32; o <<= 1) {
  for (int r = 0; r < QN; ++r) {
    const float mo = simd_shuffle_xor(m_run[r], ushort(o));
    const float lo = simd_shuffle_xor(l_run[r], ushort(o));
    const float mn = max(m_run[r], mo);
    const float wa = mn == -INFINITY ? 0.0f : exp(m_run[r] - mn);
    const float wb = mn == -INFINITY ? 0.0f : exp(mo - mn);
    l_run[r] = l_run[r] * wa + lo * wb;
    for (int j = 0; j < CPT * 8; ++j) {
      const float x = simd_shuffle_xor(acc[r][j], ushort(o));
      acc[r][j] = acc[r][j] * wa + x * wb;
    }
    m_run[r] = mn;
  }
}
if (lane < uint(TPT)) {
  for (int r = 0; r < QN; ++r) {
    if (lane == 0) {
      m_s[warp * QN + r] = m_run[r];
      l_s[warp * QN + r] = l_run[r];
    }
    for (int k = 0; k < CPT; ++k) {
      const uint c = lane + k * TPT;
      if (c < uint(NCH)) {
        for (int j = 0; j < 8; ++j) a_s[(warp * QN + r) * D + c * 8 + j] = acc[r][k * 8 + j];
      }
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint e = tid; e < uint(QN * D); e += TG) {
  const uint r = e / D, i = e % D;
  const uint rr = tile * QN + r;
  if (rr >= head_rows) continue;
  float M = -INFINITY;
  for (int w = 0; w < WARPS; ++w) M = max(M, m_s[w * QN + r]);
  float lsum = 0.0f, a = 0.0f;
  if (M != -INFINITY) {
    for (int w = 0; w < WARPS; ++w) {
      const float wt = exp(m_s[w * QN + r] - M);
      lsum += wt * l_s[w * QN + r];
      a += wt * a_s[(w * QN + r) * D + i];
    }
  }
  const ulong row = (ulong(b) * Hq + hk * G + rr / L) * L + rr % L;
  acc_out[(row * num_splits + split) * D + i] = a;
  if (i == 0) {
    m_out[row * num_splits + split] = M;
    l_out[row * num_splits + split] = lsum;
  }
}
