// kv_attention: one split of one (batch, kv head) for a tile of QN query rows
// (G heads x QN/G queries) -> running max, sum and accumulator of the online
// softmax, in the value frame. Keys and values each have their own codec.
// Template: T; D; KM, KB, KG (key codec, bits, group) and VM, VB, VG (value
// codec, bits, group), codecs as in kv_common.h; QN rows per tile; QF floats
// per prepared query row. Threadgroup: 128 threads (4 simdgroups), tokens in
// tiles of 128, one token per thread for the scores, channels across threads
// for the values.
// Inputs: qf float32 [B, Hq, L, QF] (queries in the key frame, scaled, from
// the host; for product-quantized keys followed by the lookup table of every
// sub-vector, for QJL and TurboQuant-Prod keys by the sketched query c S q,
// read from device memory); per side codes (uint8, or T for the dense codec), scales and
// zeros (float16), table (float32 codebook); the float16 windows in each
// side's frame; mask float32 [B, MH, L, total] added to the scaled scores
// (-inf hides a token), read only when MH > 0; params = {B, Hq, Hkv, L,
// n_sink, n_comp, n_recent, CAP, WCAP, split_tokens, num_splits, q_tiles,
// causal, comp_splits, MH} (MH: mask heads, 0 without a mask, 1 when every
// head shares it, else Hq).
// Splits [0, comp_splits) cover compressed tokens (position n_sink + index),
// the rest cover window slots 128 at a time (sinks at positions 0.., recent
// at n_sink + n_comp..).
// Every codec's score and value are hooks of one loop: a codec KV_STAGED
// names (TurboQuant, FP8) has, under STAGE, each tile's code rows, scales
// and table staged in threadgroup memory, key rows padded to an odd number
// of words so that threads reading their own row hit distinct banks; the
// others read device memory through KV_ELEMENT.
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int DPT = (D + TG - 1) / TG;
// Prod and RVQ rows (B-1 bits then 1 bit per channel) and QJL rows (KB * D
// sign bits) are (D * B + 7) / 8 bytes too.
constexpr int KROW = KM == KV_DENSE ? D : KM == KV_PRODUCT_QUANTIZED ? (D / KG * KB + 7) / 8 : (D * KB + 7) / 8;
constexpr int VROW = VM == KV_DENSE ? D : VM == KV_PRODUCT_QUANTIZED ? (D / VG * VB + 7) / 8 : (D * VB + 7) / 8;
constexpr bool KS = STAGE && KV_STAGED(KM);
constexpr bool VS = STAGE && KV_STAGED(VM);
constexpr int KSROW = D * KB / 8, VSROW = D * VB / 8;
constexpr int KSTRIDE = (((KSROW + 3) / 4) | 1) * 4;
constexpr int VSTRIDE = (VSROW + 3) / 4 * 4;
threadgroup float qs[QN * D];
threadgroup float p_s[QN * TG];
threadgroup float red[QN * WARPS];
threadgroup uint8_t kbuf[KS ? TG * KSTRIDE : 16];
threadgroup uint8_t vbuf[VS ? TG * VSTRIDE + 8 : 16];
threadgroup float kn_s[KS ? TG : 1];
threadgroup float vn_s[VS ? TG : 1];
threadgroup float kc[KS ? (1 << KB) : 1];
threadgroup float vc[VS ? (1 << VB) : 1];
const uint Bn = params[0], Hq = params[1], Hkv = params[2], L = params[3];
const uint n_sink = params[4], n_comp = params[5], n_recent = params[6];
const uint CAP = params[7], WCAP = params[8], split_tokens = params[9];
const uint num_splits = params[10], q_tiles = params[11], causal = params[12];
const uint comp_splits = params[13], mask_heads = params[14];
const uint G = Hq / Hkv;
const uint QT = QN / G;
const uint total = n_sink + n_comp + n_recent;
const int tid = int(thread_position_in_threadgroup.x);
const uint lane = thread_index_in_simdgroup;
const uint warp = simdgroup_index_in_threadgroup;
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
const device float* k_rows = KV_SIDE_TABLE(KM, k_table, hk);
const device float* v_rows = KV_SIDE_TABLE(VM, v_table, hk);
if (KS) {
  for (int k = tid; k < (1 << KB); k += TG) kc[k] = k_rows[k];
}
if (VS) {
  for (int k = tid; k < (1 << VB); k += TG) vc[k] = v_rows[k];
}
// Row r's prepared query (a row past L reads the last one; it is masked).
// Computed where read, not held: only the codecs scored from the query's
// features read it past the first D, and an array of them would cost the
// other codecs' loops their registers.
#define KV_QROW(r) (((ulong(b) * Hq + hk * G + uint(r) / QT) * L + min(qt * QT + uint(r) % QT, L - 1)) * QF)
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint ql = qt * QT + uint(r) % QT;
  qs[e] = ql < L ? qf[KV_QROW(r) + i] : 0.0f;
}
float m_run[QN], l_run[QN];
for (int r = 0; r < QN; ++r) {
  m_run[r] = -INFINITY;
  l_run[r] = 0.0f;
}
float acc[QN][DPT];
for (int r = 0; r < QN; ++r) {
  for (int c = 0; c < DPT; ++c) acc[r][c] = 0.0f;
}
const bool compressed = split < comp_splits;
uint t_begin, t_end;
if (compressed) {
  t_begin = split * split_tokens;
  t_end = min(t_begin + split_tokens, n_comp);
} else {
  t_begin = (split - comp_splits) * TG;
  t_end = min(t_begin + uint(TG), n_sink + n_recent);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint tile = t_begin; tile < t_end; tile += TG) {
  const uint count = min(uint(TG), t_end - tile);
  const uint t = tile + uint(tid);
  float s[QN];
  for (int r = 0; r < QN; ++r) s[r] = 0.0f;
  uint pos = 0xffffffffu;
  if (compressed && (KS || VS)) {
    // Stage the tile (the split is the threadgroup's, so every thread is here).
    if (KS) {
      const ulong kbase = (head * CAP + tile) * KSROW;
      for (uint e = uint(tid); e < count * KSROW; e += TG) kbuf[(e / KSROW) * KSTRIDE + e % KSROW] = uint8_t(k_codes[kbase + e]);
      if (uint(tid) < count) kn_s[tid] = float(k_scales[head * CAP + t]);
    }
    if (VS) {
      const ulong vbase = (head * CAP + tile) * VSROW;
      for (uint e = uint(tid); e < count * VSROW; e += TG) vbuf[(e / VSROW) * VSTRIDE + e % VSROW] = uint8_t(v_codes[vbase + e]);
      if (uint(tid) < count) vn_s[tid] = float(v_scales[head * CAP + t]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (compressed && uint(tid) < count && KS) {
    pos = n_sink + t;
    for (int j = 0; j < D; ++j) {
      const float c = kc[VQ_CODE_AT(kbuf, uint(tid) * KSTRIDE, uint(j), uint(KB))];
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * c;
    }
    for (int r = 0; r < QN; ++r) s[r] *= kn_s[tid];
  } else if (compressed && uint(tid) < count && KM == KV_PRODUCT_QUANTIZED) {
    pos = n_sink + t;
    // Product quantization: one lookup per sub-vector in each row's table.
    for (int p = 0; p < D / KG; ++p) {
      const uint c = VQ_CODE_AT(k_codes, (head * CAP + t) * KROW, uint(p), uint(KB));
      for (int r = 0; r < QN; ++r) s[r] += qf[KV_QROW(r) + D + uint(p) * (1u << KB) + c];
    }
    for (int r = 0; r < QN; ++r) s[r] *= float(k_scales[head * CAP + t]);
  } else if (compressed && uint(tid) < count && KM == KV_QJL) {
    pos = n_sink + t;
    // QJL: ±(c S q)_r by the sign bit r of the key, times its norm.
    for (int i = 0; i < KB * D; ++i) {
      const bool up = VQ_CODE_AT(k_codes, (head * CAP + t) * KROW, uint(i), 1u) != 0u;
      for (int r = 0; r < QN; ++r) {
        const float f = qf[KV_QROW(r) + D + uint(i)];
        s[r] += up ? f : -f;
      }
    }
    for (int r = 0; r < QN; ++r) s[r] *= float(k_scales[head * CAP + t]);
  } else if (compressed && uint(tid) < count && KM == KV_TURBOQUANT_PROD) {
    pos = n_sink + t;
    // TurboQuant-Prod: norm * (<Πq, c[code]> + residual norm * Σ ±(c S Πq)_j).
    constexpr int MSE_ROW = (D * (KB - 1) + 7) / 8;
    const ulong base = (head * CAP + t) * KROW;
    float z[QN];
    for (int r = 0; r < QN; ++r) z[r] = 0.0f;
    for (int j = 0; j < D; ++j) {
      const float kj = k_table[VQ_CODE_AT(k_codes, base, uint(j), uint(KB) - 1u)];
      const bool up = VQ_CODE_AT(k_codes, base + MSE_ROW, uint(j), 1u) != 0u;
      for (int r = 0; r < QN; ++r) {
        s[r] += qs[r * D + j] * kj;
        const float f = qf[KV_QROW(r) + D + uint(j)];
        z[r] += up ? f : -f;
      }
    }
    const float n = float(k_scales[(head * CAP + t) * 2]), rn = float(k_scales[(head * CAP + t) * 2 + 1]);
    for (int r = 0; r < QN; ++r) s[r] = n * (s[r] + rn * z[r]);
  } else if (compressed && uint(tid) < count) {
    pos = n_sink + t;
    for (int j = 0; j < D; ++j) {
      const float kj = KV_ELEMENT(KM, KB, KG, KROW, k_codes, k_scales, k_zeros, k_rows, head, t, CAP, j);
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kj;
    }
  } else if (!compressed && uint(tid) < count) {
    pos = t < n_sink ? t : n_comp + t;
    const ulong kbase = (head * WCAP + t) * D;
    for (int j = 0; j < D; ++j) {
      const float kv = float(win_k[kbase + j]);
      for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * kv;
    }
  }
  float mx[QN];
  for (int r = 0; r < QN; ++r) {
    const uint ql = qt * QT + uint(r) % QT;
    const bool visible = pos != 0xffffffffu && ql < L && !(causal != 0 && pos > total - L + ql);
    if (visible && mask_heads != 0) {
      const uint hm = mask_heads == 1 ? 0u : hk * G + uint(r) / QT;
      s[r] += mask[((ulong(b) * mask_heads + hm) * L + ql) * total + pos];
    }
    s[r] = visible ? s[r] : -INFINITY;
    const float v = simd_max(s[r]);
    if (lane == 0) red[r * WARPS + warp] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int r = 0; r < QN; ++r) {
    float v = red[r * WARPS];
    for (int w = 1; w < WARPS; ++w) v = max(v, red[r * WARPS + w]);
    mx[r] = max(m_run[r], v);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float alpha[QN];
  for (int r = 0; r < QN; ++r) {
    const float p = mx[r] == -INFINITY ? 0.0f : exp(s[r] - mx[r]);
    p_s[r * TG + tid] = p;
    const float v = simd_sum(p);
    if (lane == 0) red[r * WARPS + warp] = v;
    alpha[r] = mx[r] == -INFINITY ? 1.0f : exp(m_run[r] - mx[r]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int r = 0; r < QN; ++r) {
    float sum = 0.0f;
    for (int w = 0; w < WARPS; ++w) sum += red[r * WARPS + w];
    l_run[r] = l_run[r] * alpha[r] + sum;
    m_run[r] = mx[r];
  }
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) {
      for (int r = 0; r < QN; ++r) acc[r][c] *= alpha[r];
      for (uint k = 0; k < count; ++k) {
        const float v = !compressed ? float(win_v[(head * WCAP + tile + k) * D + i])
            : VS ? vc[VQ_CODE_AT(vbuf, k * VSTRIDE, uint(i), uint(VB))] * vn_s[k]
            : KV_ELEMENT(VM, VB, VG, VROW, v_codes, v_scales, v_zeros, v_rows, head, tile + k, CAP, i);
        for (int r = 0; r < QN; ++r) acc[r][c] += p_s[r * TG + k] * v;
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
    m_out[row * num_splits + split] = m_run[r];
    l_out[row * num_splits + split] = l_run[r];
  }
  for (int c = 0; c < DPT; ++c) {
    const int i = tid + c * TG;
    if (i < D) acc_out[(row * num_splits + split) * D + i] = acc[r][c];
  }
}
#undef KV_QROW
