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
// QN consecutive rows. The grid is B * Hkv * tiles * splits blocks; window
// slots take ceil(n_win / 128) splits of 128, compressed tokens the rest,
// each a whole number of 128-token tiles.
// Threads: groups of TPT lanes share a token, lane li holding chunks
// c = li + k * TPT (k < CPT) of 8 dimensions, its rows' rotated queries in
// registers and its group's own online-softmax state. No barrier in the token
// loop; groups combine at the end (warp shuffles, then shared memory).
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int NCH = D / 8;
constexpr int CPT = (NCH + TPT - 1) / TPT;
constexpr int GROUPS = TG / TPT;
constexpr unsigned FULL = 0xffffffffu;
__shared__ float qs[QN * D];
__shared__ float kc[1 << KB];
__shared__ float vc[1 << VB];
__shared__ float m_s[WARPS * QN];
__shared__ float l_s[WARPS * QN];
__shared__ float a_s[WARPS * QN * D];
const uint32_t Bn = q_shape[0], Hq = q_shape[1], L = q_shape[2];
const uint32_t Hkv = win_k_shape[1];
const uint32_t n_comp = k_norms_shape[2];
const uint32_t n_win = win_k_shape[2];
const uint32_t G = Hq / Hkv;
const uint32_t head_rows = G * L;
const uint32_t tiles = (head_rows + QN - 1) / QN;
const uint32_t total = n_comp + n_win;
const uint32_t win_splits = (n_win + TG - 1) / TG;
const uint32_t num_splits = gridDim.x / (Bn * Hkv * tiles);
const uint32_t comp_splits = num_splits - win_splits;
const uint32_t split_tokens = comp_splits == 0 ? 0u : ((n_comp + comp_splits - 1) / comp_splits + TG - 1) / TG * TG;
const uint32_t tid = threadIdx.x;
const uint32_t lane = tid & 31u, warp = tid >> 5;
uint32_t blk = blockIdx.x;
const uint32_t split = blk % num_splits;
blk /= num_splits;
const uint32_t tile = blk % tiles;
blk /= tiles;
const uint32_t hk = blk % Hkv;
const uint32_t b = blk / Hkv;
const float ninf = -__int_as_float(0x7f800000);
for (uint32_t k = tid; k < (1u << KB); k += TG) kc[k] = k_cent[k];
for (uint32_t k = tid; k < (1u << VB); k += TG) vc[k] = v_cent[k];
// The tile's queries, rotated and scaled: qs = SCALE * Π q. The raw rows
// are staged first (one load per thread, all in flight); each thread then
// owns output dimensions i and reads row i of Π once, as float4, for all
// QN rows.
for (uint32_t e = tid; e < uint32_t(QN * D); e += TG) {
  const uint32_t rr = tile * QN + e / D, j = e % D;
  float x = 0.0f;
  if (rr < head_rows) {
    const int64_t qo = int64_t(b) * q_strides[0] + int64_t(hk * G + rr / L) * q_strides[1] + int64_t(rr % L) * q_strides[2];
    x = static_cast<float>(q[qo + int64_t(j) * q_strides[3]]);
  }
  a_s[e] = x;
}
__syncthreads();
const float scale = __int_as_float(SCALE);
for (uint32_t i = tid; i < uint32_t(D); i += TG) {
  const float4* ri = reinterpret_cast<const float4*>(rot + uint64_t(i) * D);
  float y[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) y[r] = 0.0f;
#pragma unroll 8
  for (int j4 = 0; j4 < D / 4; ++j4) {
    const float4 w = ri[j4];
#pragma unroll
    for (int r = 0; r < QN; ++r) {
      const float* x = a_s + r * D + 4 * j4;
      y[r] += w.x * x[0] + w.y * x[1] + w.z * x[2] + w.w * x[3];
    }
  }
#pragma unroll
  for (int r = 0; r < QN; ++r) qs[r * D + i] = y[r] * scale;
}
__syncthreads();
const uint32_t li = tid % TPT, gi = tid / TPT;
float qv[QN][CPT * 8];
bool row_ok[QN];
uint32_t qpos[QN];
#pragma unroll
for (int r = 0; r < QN; ++r) {
  const uint32_t rr = tile * QN + r;
  row_ok[r] = rr < head_rows;
  qpos[r] = total - L + rr % L;
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const uint32_t c = li + k * TPT;
#pragma unroll
    for (int j = 0; j < 8; ++j) qv[r][k * 8 + j] = c < uint32_t(NCH) ? qs[r * D + c * 8 + j] : 0.0f;
  }
}
float m_run[QN], l_run[QN], acc[QN][CPT * 8];
#pragma unroll
for (int r = 0; r < QN; ++r) {
  m_run[r] = ninf;
  l_run[r] = 0.0f;
#pragma unroll
  for (int j = 0; j < CPT * 8; ++j) acc[r][j] = 0.0f;
}
const bool compressed = split < comp_splits;
uint32_t t_begin, t_end;
if (compressed) {
  t_begin = split * split_tokens;
  t_end = min(t_begin + split_tokens, n_comp);
} else {
  t_begin = (split - comp_splits) * TG;
  t_end = min(t_begin + uint32_t(TG), n_win);
}
// The raw codes and norms of the group's next compressed token, fetched one
// iteration ahead so that their loads overlap this token's arithmetic.
unsigned long long kraw[CPT], vraw[CPT];
float kn_next = 0.0f, vn_next = 0.0f;
auto fetch = [&](uint32_t t) {
  const uint8_t* kp = k_codes + int64_t(b) * k_codes_strides[0] + int64_t(hk) * k_codes_strides[1] + int64_t(t) * k_codes_strides[2];
  const uint8_t* vp = v_codes + int64_t(b) * v_codes_strides[0] + int64_t(hk) * v_codes_strides[1] + int64_t(t) * v_codes_strides[2];
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const uint32_t c = li + k * TPT;
    kraw[k] = c < uint32_t(NCH) ? vq_load_bytes<KB>(kp + c * KB) : 0ull;
    vraw[k] = c < uint32_t(NCH) ? vq_load_bytes<VB>(vp + c * VB) : 0ull;
  }
  kn_next = __half2float(k_norms[int64_t(b) * k_norms_strides[0] + int64_t(hk) * k_norms_strides[1] + int64_t(t) * k_norms_strides[2]]);
  vn_next = __half2float(v_norms[int64_t(b) * v_norms_strides[0] + int64_t(hk) * v_norms_strides[1] + int64_t(t) * v_norms_strides[2]]);
};
if (compressed && t_begin + gi < t_end) fetch(t_begin + gi);
// Every lane runs every iteration (the shuffles need the whole warp); a
// group past the end holds no token.
for (uint32_t base = t_begin; base < t_end; base += GROUPS) {
  const uint32_t t = base + gi;
  const bool have = t < t_end;
  float kx[CPT * 8], vx[CPT * 8];
  float kn = 0.0f, vn = 0.0f;
  uint32_t pos = 0;
  if (have && compressed) {
    pos = N_SINK + t;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kx[k * 8 + j] = kc[unsigned(kraw[k] >> (j * KB)) & ((1u << KB) - 1u)];
        vx[k * 8 + j] = vc[unsigned(vraw[k] >> (j * VB)) & ((1u << VB) - 1u)];
      }
    }
    kn = kn_next;
    vn = vn_next;
    if (t + GROUPS < t_end) fetch(t + GROUPS);
  } else if (have) {
    pos = t < uint32_t(N_SINK) ? t : n_comp + t;
    const T* wk = win_k + int64_t(b) * win_k_strides[0] + int64_t(hk) * win_k_strides[1] + int64_t(t) * win_k_strides[2];
    const T* wv = win_v + int64_t(b) * win_v_strides[0] + int64_t(hk) * win_v_strides[1] + int64_t(t) * win_v_strides[2];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const uint32_t c = li + k * TPT;
      if (c < uint32_t(NCH)) {
        vq_load8(wk + c * 8, kx + k * 8);
        vq_load8(wv + c * 8, vx + k * 8);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          kx[k * 8 + j] = 0.0f;
          vx[k * 8 + j] = 0.0f;
        }
      }
    }
    kn = 1.0f;
    vn = 1.0f;
  } else {
#pragma unroll
    for (int j = 0; j < CPT * 8; ++j) {
      kx[j] = 0.0f;
      vx[j] = 0.0f;
    }
  }
  float s[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < CPT * 8; ++j) v += qv[r][j] * kx[j];
    s[r] = v;
  }
#pragma unroll
  for (int o = TPT / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int r = 0; r < QN; ++r) s[r] += __shfl_xor_sync(FULL, s[r], o);
  }
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    // Uniform across a group: every lane holds the same score.
    if (!have || !row_ok[r] || (CAUSAL && pos > qpos[r])) continue;
    const float sc = s[r] * kn;
    if (sc > m_run[r]) {
      const float alpha = __expf(m_run[r] - sc);
      l_run[r] *= alpha;
#pragma unroll
      for (int j = 0; j < CPT * 8; ++j) acc[r][j] *= alpha;
      m_run[r] = sc;
    }
    const float p = __expf(sc - m_run[r]);
    l_run[r] += p;
    const float pv = p * vn;
#pragma unroll
    for (int j = 0; j < CPT * 8; ++j) acc[r][j] += pv * vx[j];
  }
}
// Groups of one warp: lanes li, li + TPT, ... hold the same dimensions.
#pragma unroll
for (int o = TPT; o < 32; o <<= 1) {
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    const float mo = __shfl_xor_sync(FULL, m_run[r], o);
    const float lo = __shfl_xor_sync(FULL, l_run[r], o);
    const float mn = fmaxf(m_run[r], mo);
    const float wa = mn == ninf ? 0.0f : __expf(m_run[r] - mn);
    const float wb = mn == ninf ? 0.0f : __expf(mo - mn);
    l_run[r] = l_run[r] * wa + lo * wb;
#pragma unroll
    for (int j = 0; j < CPT * 8; ++j) {
      const float x = __shfl_xor_sync(FULL, acc[r][j], o);
      acc[r][j] = acc[r][j] * wa + x * wb;
    }
    m_run[r] = mn;
  }
}
if (lane < uint32_t(TPT)) {
#pragma unroll
  for (int r = 0; r < QN; ++r) {
    if (lane == 0) {
      m_s[warp * QN + r] = m_run[r];
      l_s[warp * QN + r] = l_run[r];
    }
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const uint32_t c = lane + k * TPT;
      if (c < uint32_t(NCH)) {
#pragma unroll
        for (int j = 0; j < 8; ++j) a_s[(warp * QN + r) * D + c * 8 + j] = acc[r][k * 8 + j];
      }
    }
  }
}
__syncthreads();
for (uint32_t e = tid; e < uint32_t(QN * D); e += TG) {
  const uint32_t r = e / D, i = e % D;
  const uint32_t rr = tile * QN + r;
  if (rr >= head_rows) continue;
  float M = ninf;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) M = fmaxf(M, m_s[w * QN + r]);
  float lsum = 0.0f, a = 0.0f;
  if (M != ninf) {
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = __expf(m_s[w * QN + r] - M);
      lsum += wt * l_s[w * QN + r];
      a += wt * a_s[(w * QN + r) * D + i];
    }
  }
  const uint64_t row = (uint64_t(b) * Hq + hk * G + rr / L) * L + rr % L;
  acc_out[(row * num_splits + split) * D + i] = a;
  if (i == 0) {
    m_out[row * num_splits + split] = M;
    l_out[row * num_splits + split] = lsum;
  }
}
