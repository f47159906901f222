// Shared by the TurboQuant cache kernels.

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's
// layout) starting at byte `base` of `buf`. A macro, so that it reads any
// address space (device, constant or threadgroup) without pointer arguments.
#define VQ_CODE_AT(buf, base, j, bits)                                                             \
  (((uint((buf)[(base) + (((j) * (bits)) >> 3)]) |                                                 \
     ((((j) * (bits)) & 7u) + (bits) > 8u ? uint((buf)[(base) + (((j) * (bits)) >> 3) + 1]) << 8   \
                                           : 0u)) >>                                               \
    (((j) * (bits)) & 7u)) &                                                                       \
   ((1u << (bits)) - 1u))
template <typename T, int D, int KB, int VB, int QN>
[[kernel]] void custom_kernel_veloxquant_tq_attention__float16_t_128_4_3_16_float_uint8_t_float16_t_float_uint8_t_float16_t_float_float16_t_float16_t_uint32_t_float_float_float(
  const device float* qr [[buffer(0)]],
  const device uint8_t* k_codes [[buffer(1)]],
  const device float16_t* k_norms [[buffer(2)]],
  const device float* k_cent [[buffer(3)]],
  const device uint8_t* v_codes [[buffer(4)]],
  const device float16_t* v_norms [[buffer(5)]],
  const device float* v_cent [[buffer(6)]],
  const device float16_t* win_k [[buffer(7)]],
  const device float16_t* win_v [[buffer(8)]],
  const device uint32_t* params [[buffer(9)]],
  device float* m_out [[buffer(10)]],
  device float* l_out [[buffer(11)]],
  device float* acc_out [[buffer(12)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],
  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {
// tq_attention: one split of one (batch, kv head) for a tile of QN query rows
// (G heads x QN/G queries) -> running max, sum and accumulator of the online
// softmax, in the rotated frame. Template: T, D, KB (key bits), VB (value
// bits), QN. Threadgroup: 128 threads (4 simdgroups), tokens in tiles of 128.
// Inputs: qr float32 [B, Hq, L, D] (queries rotated and scaled once by the
// host), the compressed stores and the rotated float16 windows.
// params = {B, Hq, Hkv, L, n_sink, n_comp, n_recent, CAP, WCAP, split_tokens,
//           num_splits, q_tiles, causal, comp_splits}.
// Splits [0, comp_splits) cover compressed tokens (position n_sink + index),
// the rest cover window slots 128 at a time (sinks at positions 0.., recent
// at n_sink + n_comp..). A tile's codes and norms are staged in threadgroup
// memory; rows are padded to an odd number of words.
constexpr int TG = 128;
constexpr int WARPS = TG / 32;
constexpr int DPT = (D + TG - 1) / TG;
constexpr int KROW = D * KB / 8;
constexpr int VROW = D * VB / 8;
constexpr int KSTRIDE = (((KROW + 3) / 4) | 1) * 4;
threadgroup float qs[QN * D];
threadgroup uint8_t kbuf[TG * KSTRIDE];
threadgroup uint8_t vbuf[TG * VROW + 4];
threadgroup float kn_s[TG];
threadgroup float vn_s[TG];
threadgroup float p_s[QN * TG];
threadgroup float red[QN * WARPS];
threadgroup float kc[1 << KB];
threadgroup float vc[1 << VB];
const uint Bn = params[0], Hq = params[1], Hkv = params[2], L = params[3];
const uint n_sink = params[4], n_comp = params[5], n_recent = params[6];
const uint CAP = params[7], WCAP = params[8], split_tokens = params[9];
const uint num_splits = params[10], q_tiles = params[11], causal = params[12];
const uint comp_splits = params[13];
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
for (int k = tid; k < (1 << KB); k += TG) kc[k] = k_cent[k];
for (int k = tid; k < (1 << VB); k += TG) vc[k] = v_cent[k];
for (int e = tid; e < QN * D; e += TG) {
  const int r = e / D, i = e % D;
  const uint ql = qt * QT + uint(r) % QT;
  qs[e] = ql < L ? qr[((ulong(b) * Hq + hk * G + uint(r) / QT) * L + ql) * D + i] : 0.0f;
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
  if (compressed) {
    const ulong kbase = (head * CAP + tile) * KROW;
    for (uint e = uint(tid); e < count * KROW; e += TG) kbuf[(e / KROW) * KSTRIDE + e % KROW] = k_codes[kbase + e];
    const ulong vbase = (head * CAP + tile) * VROW;
    for (uint e = uint(tid); e < count * VROW; e += TG) vbuf[e] = v_codes[vbase + e];
    if (uint(tid) < count) {
      kn_s[tid] = float(k_norms[head * CAP + t]);
      vn_s[tid] = float(v_norms[head * CAP + t]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (uint(tid) < count) {
      pos = n_sink + t;
      for (int j = 0; j < D; ++j) {
        const float c = kc[VQ_CODE_AT(kbuf, uint(tid) * KSTRIDE, uint(j), uint(KB))];
        for (int r = 0; r < QN; ++r) s[r] += qs[r * D + j] * c;
      }
      for (int r = 0; r < QN; ++r) s[r] *= kn_s[tid];
    }
  } else if (uint(tid) < count) {
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
        float v;
        if (compressed) {
          v = vc[VQ_CODE_AT(vbuf, k * VROW, uint(i), uint(VB))] * vn_s[k];
        } else {
          v = float(win_v[(head * WCAP + tile + k) * D + i]);
        }
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

}

template [[host_name("custom_kernel_veloxquant_tq_attention__float16_t_128_4_3_16_float_uint8_t_float16_t_float_uint8_t_float16_t_float_float16_t_float16_t_uint32_t_float_float_float")]] [[kernel]] decltype(custom_kernel_veloxquant_tq_attention__float16_t_128_4_3_16_float_uint8_t_float16_t_float_uint8_t_float16_t_float_float16_t_float16_t_uint32_t_float_float_float<float16_t, 128, 4, 3, 16>) custom_kernel_veloxquant_tq_attention__float16_t_128_4_3_16_float_uint8_t_float16_t_float_uint8_t_float16_t_float_float16_t_float16_t_uint32_t_float_float_float<float16_t, 128, 4, 3, 16>;
