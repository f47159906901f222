// tq_decode: attention of QN query rows of one (batch, KV head) over one
// split of the layer's tokens -> the split's max, sum and accumulator of the
// softmax, in the rotated frame; tq_reduce finishes, or with REDUCE the
// last block of each tile (out [B, Hq, L, D], T).
// Template: T, D, KB/VB (key/value bits), QN (rows per tile, at most 4),
// TPT (lanes per token: a power of two up to 32), N_SINK (sink tokens held),
// CAUSAL, SCALE (the score scale's float32 bits), ROTATED, REDUCE, VARIANT
// (bits that choose how the tensor-core path reads its operands: see KPAIR,
// QA2 and KA below), EACH (0: one cache; n > 0: row b of q attends over
// sequence b's own cache, batch 1, among n sequences' inputs: the host's
// `each_prelude` binds the names below to sequence b's inputs first, so
// that every store is read at batch index 0 and each sequence's lengths
// are its own).
// Inputs, read through their shapes and strides (no parameter buffer, no
// copies): q [B, Hq, L, D] as the model gives it, or with ROTATED already
// rotated and scaled by tq_rotate (float32); rot [D, D] float32, the keys'
// and values' rotation Π (row-major); counters, with REDUCE, one uint32 a
// tile, zero (and left zero); the output counters_out, as many words, is
// zeroed for the layer's next decode, which takes it as its counters: MLX
// then orders two decodes of a layer, whose blocks would otherwise count
// into each other's tiles when they overlap on the GPU; the stores k_codes/v_codes [B, Hkv, CAP, D*bits/8] and
// v_norms [B, Hkv, CAP]; k_norms [B, Hkv, n_comp], a view whose length is the
// compressed count; the codebooks; the rotated windows (sinks first) win_v
// [B, Hkv, WCAP, D] and win_k [B, Hkv, n_win, D], a view whose length is the
// count of window tokens.
// Rows of a KV head are r = h * L + l (its G heads, L queries); a tile holds
// QN consecutive rows. The grid is B * Hkv * tiles * splits blocks; window
// slots take ceil(n_win / WT) splits of WT = 128, compressed tokens the rest,
// each a whole number of WT-token tiles. Blocks of the tensor-core path have
// 256 threads (eight warps: twice the warps an SM holds at two blocks of
// 128 registers a thread, the occupancy its chained mma and shared-memory
// reads wait on), every other block 128 (the host's decode_threads).
// Compressed splits on the tensor cores (D a multiple of 16, 16-bit types)
// read their tokens in chunks of TT, copied into shared memory (cp.async,
// 16 bytes a request, the next chunk in flight while one is read) with their
// norms. Each warp takes steps of 16 tokens and keeps its own online softmax
// in registers:
//   scores: S = Q K^T for two 8-token tiles: in a tile lane 4g + q decodes
//     token g's dimensions [q D/4, (q + 1) D/4) into B fragments through a
//     float16 table (the k index of the mma maps to those dimensions, the
//     queries' A fragments the same way); each score is scaled by its
//     token's norm and masked;
//     (with KA, S^T = K Q^T: lane 4g + q decodes the same dimensions of
//     tokens g and g + 8 into one A fragment of the 16-token tile, the
//     queries are B fragments held in registers);
//   weights: e^(s - m) with m the warp's running max of the row, taken over
//     the quad that holds it; the C fragments of the two tiles are then the
//     B fragments of the values' product as they lie (with KA, the max of a
//     column over the eight lanes that hold it, and the C fragments
//     transposed by movmatrix);
//   values: O^T = V^T P^T: lane 4g + q decodes dimensions [g D/8,
//     (g + 1) D/8) of tokens 2q, 2q + 1, 2q + 8, 2q + 9 of the step, two
//     tokens' codes of one dimension to an A register (the mma's k index
//     runs over tokens); the weights, times each token's value norm, are
//     the B fragments.
// The warps' maxima, sums and accumulators merge at the end.
// Other splits hold at most TT tokens, copied into shared memory at once.
// Window splits, and every split of a float32 cache or where D is not a
// multiple of 16, take the scalar path instead (float32 throughout): groups
// of TPT lanes share U tokens (lane li holds chunks c = li + k * TPT,
// k < CPT, of 8 dimensions), a group's U * QN partial dot products summed by
// one reduce-scatter; window rows are read where they lie. Groups and warps
// share the split's max, so the last combine is a plain sum. Products on the
// tensor cores take float16 operands (the centroids, the queries, the weights
// times the norms) and add in float32.
// Dynamic shared memory: TT * (KROW + VROW) + 16 bytes (the host's
// cuda_dynamic_shared_bytes), the split's key then value codes and a spare
// word for unaligned reads.
// The tensor-core path's shapes (see above).
constexpr bool MMA = D % 16 == 0 && sizeof(T) == 2;
constexpr int TG = MMA ? 256 : 128;
constexpr int WT = 128;
constexpr int WARPS = TG / 32;
constexpr int NCH = D / 8;
constexpr int CPT = (NCH + TPT - 1) / TPT;
constexpr int GROUPS = TG / TPT;
constexpr int QNP = QN <= 1 ? 1 : (QN <= 2 ? 2 : 4);
constexpr int U = TPT / QNP >= 8 ? 8 : (TPT / QNP >= 1 ? TPT / QNP : 1);
constexpr int V = U * QNP;
constexpr int VL = V >= TPT ? V / TPT : 1;
constexpr int REP = V >= TPT ? 1 : TPT / V;
constexpr int STEP = GROUPS * U;
constexpr int TT = 256;
constexpr int KROW = D * KB / 8;
constexpr int VROW = D * VB / 8;
constexpr unsigned FULL = 0xffffffffu;
constexpr int KSEG = D / 4;
constexpr int KS = D / 16;
constexpr int KNW = (KSEG * KB + 31) / 32;
constexpr bool KALIGNED = (KSEG * KB) % 32 == 0 && KROW % 4 == 0;
constexpr int VSEG = D / 8;
constexpr int VNW = (VSEG * VB + 31) / 32;
constexpr bool VALIGNED = (VSEG * VB) % 32 == 0 && VROW % 4 == 0;
static_assert(QN <= WARPS, "one warp per row weighs the scores");
// With 4-bit keys a byte of two codes indexes a table of their two
// centroids as a half2 word: one lookup a B register instead of two and a
// PRMT (a fifth of the loop's instructions; 43.1 -> 41.2 us a call at
// llama-8b 32K on the H200). Its 256 words share 32 banks, so a warp's
// lookups conflict: several shared-memory cycles each; VARIANT
// bit 0 takes the 16-word table (two conflict-free lookups and a PRMT).
// VARIANT bit 1: values of at most 3 bits decode through byte permutes of
// four registers holding their centroids' low and high bytes instead of a
// shared table (four PRMTs for four codes, no shared-memory reads).
constexpr bool KPAIR = KB == 4 && (VARIANT & 1) == 0;
constexpr bool VPERM = VB <= 3 && (VARIANT & 2) != 0;
// VARIANT bit 5 (with KA and KPAIR): the pair table once per bank, entry e
// of lane l at word 32 e + l, so that a warp's 32 lookups are one
// shared-memory cycle whatever its codes (32 KB).
constexpr bool KREP = KPAIR && (VARIANT & 8) != 0 && D <= 128 && (VARIANT & 32) != 0;
// Aligned to the 256-word table's size, so that an entry's address is the
// table's base OR its byte offset: one LOP3 masks a code byte into place
// and adds the base (KREP's 32 KB table adds its base instead).
__shared__ __align__(1024) uint32_t kt[KREP ? 256 * 32 : (KPAIR ? 256 : 1 << KB)];
__shared__ float qs[QN * D];
__shared__ float kc[1 << KB];
__shared__ float vc[1 << VB];
// The queries' A fragments, alike in every warp, with their zero rows: one
// 16-byte load a k-step instead of 16 registers held and two moves (with
// tq_exp: 45.8 -> 43.1 us a call at llama-8b 32K on the H200).
// VARIANT bit 2 keeps only their nonzero words; ptxas then holds them in
// registers across the loop (127 a thread in variant 6) and builds each
// fragment with moves.
// VARIANT bit 3 swaps the scores' operands: a 16-token tile of keys is the
// A fragment and the queries the B fragment (two words a k-step, held in
// registers for the whole loop, no zero words): one mma a k-step for 16
// tokens instead of two, no fragment moves; the scores' C fragments (token
// rows, query columns) become the values' B fragments through two
// movmatrix transposes a step.
// (Heads of at most 128: the queries of a longer head would not fit the
// registers beside the accumulators.)
constexpr bool KA = (VARIANT & 8) != 0 && D <= 128;
// VARIANT bit 4 (with KA, 3-bit values, the value table a uniform grid
// c0 + c step): a value code c becomes the float16 subnormal c 2^(p - 24)
// by one AND (its three bits left where a byte permute of the code words
// puts them, at mantissa bits p..p+2, p = 0..7 by its place in a 24-bit
// group), no table. The mma then sums weight times code; one more mma a
// step, over ones, sums the weights, and the end takes
// c0 sum(w) + step 2^(24 - p) sum(w c) for each dimension.
constexpr bool VLIN = KA && VB == 3 && VSEG % 8 == 0 && (VARIANT & 16) != 0;
constexpr bool QA2 = (VARIANT & 4) != 0;
__shared__ uint4 qa_s[MMA && !QA2 && !KA ? (D / 16) * 32 : 1];
__shared__ uint2 qa2_s[MMA && QA2 && !KA ? (D / 16) * 32 : 1];
__shared__ uint32_t vt[1 << VB];
// 16-byte aligned: the queries' rotation reads the raw rows here as float4.
__shared__ __align__(16) float sc[QN * TT];
__shared__ float m_s[QN];
__shared__ float l_s[QN];
// The tensor-core path's per-warp row maxima and sums.
__shared__ float mw_s[WARPS * QN];
__shared__ float lw_s[WARPS * QN];
__shared__ float kn_s[TT];
__shared__ float vn_s[TT];
extern __shared__ __align__(16) uint8_t codes_s[];
// Codes of TT tokens; the tensor-core path's two chunk buffers and their
// float16 norms follow each other.
constexpr int CBYTES = TT * (KROW + VROW);
// The dynamic shared memory of the launch, less the spare word.
constexpr int RDYN = MMA ? 2 * CBYTES + 8 * TT : CBYTES;
uint8_t* const ksm = codes_s;
uint8_t* const vsm = codes_s + TT * KROW;
__half* const kn_h = reinterpret_cast<__half*>(codes_s + 2 * CBYTES);
__half* const vn_h = kn_h + 2 * TT;
// The epilogue's per-warp sums reuse the codes' space (4 WARPS QN D bytes:
// 64 D at most without MMA, 128 D with it, never more than the one or two
// buffers of TT * (KROW + VROW) >= 64 D bytes).
float* const a_s = reinterpret_cast<float*>(codes_s);
const uint32_t Bn = q_shape[0], Hq = q_shape[1], L = q_shape[2];
const uint32_t Hkv = win_k_shape[1];
const uint32_t n_comp = k_norms_shape[2];
const uint32_t n_win = win_k_shape[2];
const uint32_t G = Hq / Hkv;
const uint32_t head_rows = G * L;
const uint32_t tiles = (head_rows + QN - 1) / QN;
const uint32_t total = n_comp + n_win;
const uint32_t win_splits = (n_win + WT - 1) / WT;
const uint32_t num_splits = gridDim.x / (Bn * Hkv * tiles);
const uint32_t comp_splits = num_splits - win_splits;
const uint32_t split_tokens = comp_splits == 0 ? 0u : ((n_comp + comp_splits - 1) / comp_splits + WT - 1) / WT * WT;
const uint32_t tid = threadIdx.x;
const uint32_t lane = tid & 31u, warp = tid >> 5;
uint32_t blk = blockIdx.x;
const uint32_t split = blk % num_splits;
blk /= num_splits;
const uint32_t tile = blk % tiles;
blk /= tiles;
const uint32_t hk = blk % Hkv;
const uint32_t b = blk / Hkv;
// The stores' batch index: sequence b's own cache holds one row.
const uint32_t bs = EACH ? 0u : b;
const float ninf = -__int_as_float(0x7f800000);
if (blockIdx.x % (EACH ? gridDim.x / Bn : gridDim.x) == 0) {
  for (uint32_t i = tid; i < uint32_t(counters_shape[0]); i += TG) counters_out[i] = 0u;
}
// Row rr of this tile's KV head (its G heads times L queries) among q's rows.
auto row_of = [&](uint32_t rr) -> uint64_t { return (uint64_t(b) * Hq + hk * G + rr / L) * L + rr % L; };
const uint32_t li = tid % TPT, gi = tid / TPT;
const bool compressed = split < comp_splits;
uint32_t t_begin, t_end;
if (compressed) {
  t_begin = split * split_tokens;
  t_end = min(t_begin + split_tokens, n_comp);
} else {
  t_begin = (split - comp_splits) * WT;
  t_end = min(t_begin + uint32_t(WT), n_win);
}
// The split's tokens are [t_begin, t_end), at most TT of them.
const uint32_t tn = t_end > t_begin ? t_end - t_begin : 0u;
// This (batch, KV head)'s rows of every input; a token adds its index times
// the token stride.
const uint8_t* kp0 = k_codes + int64_t(bs) * k_codes_strides[0] + int64_t(hk) * k_codes_strides[1];
const uint8_t* vp0 = v_codes + int64_t(bs) * v_codes_strides[0] + int64_t(hk) * v_codes_strides[1];
const __half* kn0 = k_norms + int64_t(bs) * k_norms_strides[0] + int64_t(hk) * k_norms_strides[1];
const __half* vn0 = v_norms + int64_t(bs) * v_norms_strides[0] + int64_t(hk) * v_norms_strides[1];
const int64_t ks = k_codes_strides[2], vs = v_codes_strides[2], kns = k_norms_strides[2], vns = v_norms_strides[2];
const int64_t wks = win_k_strides[2], wvs = win_v_strides[2];
// A window split's first rows (its tokens are indexed from there).
const T* wk = win_k + int64_t(bs) * win_k_strides[0] + int64_t(hk) * win_k_strides[1] + int64_t(t_begin) * wks;
const T* wv = win_v + int64_t(bs) * win_v_strides[0] + int64_t(hk) * win_v_strides[1] + int64_t(t_begin) * wvs;
// Tokens [t0, t1) of the split's codes into shared memory: rows back to
// back in the stores (the cache's layout) go as one block copy, else byte by
// byte; with MMA their norms too (float16, as stored).
auto stage = [&](uint8_t* dst, const uint8_t* base, int64_t stride, int row, uint32_t t0, uint32_t t1) {
  const uint64_t offset = uint64_t(t0) * row;
  if (stride == row) {
    const bool aligned = ((reinterpret_cast<uintptr_t>(base) + offset) & 15u) == 0;
    vq_copy_to_shared(dst, base, offset, uint64_t(t1) * row, int(((t1 - t0) * row + 15u) / 16u * 16u), aligned);
  } else {
    for (uint32_t y = tid; y < (t1 - t0) * uint32_t(row); y += TG) dst[y] = base[int64_t(t0 + y / row) * stride + y % row];
  }
};
auto stage_norms = [&](__half* dst, const __half* base, int64_t stride, uint32_t t0, uint32_t t1) {
  if (stride == 1) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(base);
    const uint64_t offset = uint64_t(t0) * 2;
    const bool aligned = ((reinterpret_cast<uintptr_t>(src) + offset) & 15u) == 0;
    vq_copy_to_shared(reinterpret_cast<uint8_t*>(dst), src, offset, uint64_t(t1) * 2, int(((t1 - t0) * 2 + 15u) / 16u * 16u), aligned);
  } else {
    for (uint32_t y = tid; y < t1 - t0; y += TG) dst[y] = base[int64_t(t0 + y) * stride];
  }
};
// Chunk c of a MMA split into buffer c % 2, as one cp.async group.
auto stage_chunk = [&](uint32_t c) {
  const uint32_t t0 = t_begin + c * TT, t1 = min(t0 + uint32_t(TT), t_end);
  uint8_t* buf = codes_s + (c & 1u) * CBYTES;
  stage(buf, kp0, ks, KROW, t0, t1);
  stage(buf + TT * KROW, vp0, vs, VROW, t0, t1);
  stage_norms(kn_h + (c & 1u) * TT, kn0, kns, t0, t1);
  stage_norms(vn_h + (c & 1u) * TT, vn0, vns, t0, t1);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
};
if (MMA && compressed) {
  stage_chunk(0);
} else if (compressed) {
  stage(ksm, kp0, ks, KROW, t_begin, t_end);
  stage(vsm, vp0, vs, VROW, t_begin, t_end);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Norms, codebooks and raw queries: every load issued before any store.
{
  constexpr int PER = TT / TG;
  float kn[PER], vn[PER];
#pragma unroll
  for (int y = 0; y < PER; ++y) {
    const uint32_t i = tid + y * TG;
    const bool have = !MMA && compressed && i < tn;
    kn[y] = have ? __half2float(kn0[int64_t(t_begin + i) * kns]) : 0.0f;
    vn[y] = have ? __half2float(vn0[int64_t(t_begin + i) * vns]) : 0.0f;
  }
  constexpr int QPER = (QN * D + TG - 1) / TG;
  float x[QPER];
#pragma unroll
  for (int y = 0; y < QPER; ++y) {
    const uint32_t e = tid + y * TG;
    const uint32_t rr = tile * QN + e / D, j = e % D;
    x[y] = 0.0f;
    if (e < uint32_t(QN * D) && rr < head_rows) {
      const int64_t qo = int64_t(b) * q_strides[0] + int64_t(hk * G + rr / L) * q_strides[1] + int64_t(rr % L) * q_strides[2];
      x[y] = static_cast<float>(q[qo + int64_t(j) * q_strides[3]]);
    }
  }
  for (uint32_t k = tid; k < (1u << KB); k += TG) kc[k] = k_cent[k];
  for (uint32_t k = tid; k < (1u << VB); k += TG) vc[k] = v_cent[k];
  if (MMA && compressed) {
    if (KREP) {
      // Round c writes copies 4 ((c + e) % 8) .. + 3 of entry e, 16 bytes:
      // the eight lanes of a quarter warp store to distinct banks.
      for (uint32_t e = tid; e < 256u; e += TG) {
        const uint32_t v = tq_half_entry(k_cent, e & 15u) | (tq_half_entry(k_cent, e >> 4) << 16);
        for (uint32_t c = 0; c < 8u; ++c) reinterpret_cast<uint4*>(kt)[e * 8u + ((c + e) & 7u)] = make_uint4(v, v, v, v);
      }
    } else if (KPAIR) {
      for (uint32_t e = tid; e < 256u; e += TG) kt[e] = tq_half_entry(k_cent, e & 15u) | (tq_half_entry(k_cent, e >> 4) << 16);
    } else {
      for (uint32_t e = tid; e < (1u << KB); e += TG) kt[e] = tq_half_entry(k_cent, e);
    }
    for (uint32_t e = tid; e < (1u << VB); e += TG) vt[e] = tq_half_entry(v_cent, e);
  }
#pragma unroll
  for (int y = 0; y < PER; ++y) {
    kn_s[tid + y * TG] = kn[y];
    vn_s[tid + y * TG] = vn[y];
  }
  // The raw rows wait in the scores' space (QN * D <= QN * TT floats);
  // rows tq_rotate rotated and scaled are the queries.
#pragma unroll
  for (int y = 0; y < QPER; ++y) {
    if (tid + y * TG < uint32_t(QN * D)) (ROTATED ? qs : sc)[tid + y * TG] = x[y];
  }
}
__syncthreads();
// The tile's queries, rotated and scaled: qs = SCALE * Π q; RP neighbouring
// lanes own output dimension i, each reading a 1/RP share of row i of Π (as
// float4) for all QN rows, their sums added by shuffles. Every thread runs
// every round, so that the shuffles see whole warps.
const float scale = __int_as_float(SCALE);
constexpr int RP = (TG >= 4 * D && (D / 4) % 4 == 0) ? 4 : ((TG >= 2 * D && (D / 4) % 2 == 0) ? 2 : 1);
for (uint32_t base = 0; !ROTATED && base < uint32_t(D * RP); base += TG) {
  const uint32_t e = base + tid;
  const bool on = e < uint32_t(D * RP);
  const uint32_t i = on ? e / RP : 0u, part = e % RP;
  const float4* ri = reinterpret_cast<const float4*>(rot + uint64_t(i) * D) + part * (D / 4 / RP);
  const float* xs = sc + part * (D / RP);
  float y[QN];
#pragma unroll
  for (int r = 0; r < QN; ++r) y[r] = 0.0f;
#pragma unroll 8
  for (int j4 = 0; j4 < D / 4 / RP; ++j4) {
    const float4 w = ri[j4];
#pragma unroll
    for (int r = 0; r < QN; ++r) {
      const float4 x = reinterpret_cast<const float4*>(xs + r * D)[j4];
      y[r] += w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
    }
  }
#pragma unroll
  for (int o = 1; o < RP; o <<= 1) {
#pragma unroll
    for (int r = 0; r < QN; ++r) y[r] += __shfl_xor_sync(FULL, y[r], o);
  }
  if (on && part == 0) {
#pragma unroll
    for (int r = 0; r < QN; ++r) qs[r * D + i] = y[r] * scale;
  }
}
// A chunked split waits for each chunk in the loop below.
if (!(MMA && compressed)) vq_copy_wait();
__syncthreads();
const uint32_t g = lane >> 2, tg = lane & 3u;
if (MMA && compressed) {
  // The tensor-core path: each warp takes steps of 16 tokens of a chunk and
  // keeps its own online softmax in registers, so that scores never leave
  // them: the scores' C fragments (row g, tokens 2tg, 2tg + 1 of two 8-token
  // tiles) are, once weighed, the values' B fragments as they stand. While
  // a chunk is read, the next one's codes are on their way (cp.async, two
  // buffers); one barrier a chunk. The warps' states merge at the end.
  // Scores: the A fragments hold rows g (rows g + 8 and past QN are zero);
  // with KA each lane's B fragments, column g, in registers.
  uint32_t qb[KA ? KS : 1][2];
  if (KA || warp == 0) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const bool on = g < uint32_t(QN);
      const float* x = qs + (on ? g : 0u) * D + tg * KSEG + 4 * ks;
      const uint32_t lo = on ? tq_half2_bits(x[0], x[1]) : 0u, hi = on ? tq_half2_bits(x[2], x[3]) : 0u;
      if constexpr (KA) {
        qb[ks][0] = lo;
        qb[ks][1] = hi;
      } else if constexpr (QA2) {
        qa2_s[ks * 32 + lane] = make_uint2(lo, hi);
      } else {
        qa_s[ks * 32 + lane] = make_uint4(lo, 0u, hi, 0u);
      }
    }
  }
  const uint32_t kt_base = static_cast<uint32_t>(__cvta_generic_to_shared(kt));
  // With KREP, this lane's copy (its bank).
  const uint32_t kt_lane = kt_base + (lane << 2);
  // Codes j, j + 1 of a key row's words as a half2 B register.
  auto key_pair = [&](const uint32_t(&w)[KNW], int j) -> uint32_t {
    if constexpr (KPAIR && !KA) {
      return kt[(w[j / 8] >> (4 * (j % 8))) & 0xffu];
    } else if constexpr (KREP) {
      const int sh = 4 * (j % 8);
      // Byte sh / 8 of the word (one PRMT) times 128 added to the lane's
      // copy (one LEA): the table's base is not 32 KB aligned in the shared
      // window (its first 1 KB is reserved), so no OR can place the byte.
      const uint32_t byte = __byte_perm(w[j / 8], 0u, 0x4440u | uint32_t(sh / 8));
      uint32_t r;
      asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(kt_lane + (byte << 7)));
      return r;
    } else if constexpr (KPAIR) {
      const int sh = 4 * (j % 8);
      const uint32_t x = w[j / 8], off = (sh >= 2 ? x >> (sh - 2) : x << 2) & 0x3fcu;
      uint32_t r;
      asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(kt_base | off));
      return r;
    } else {
      return tq_pair_along<KB, KNW>(kt, w, j);
    }
  };
  // The values' centroids as byte tables for tq_perm_pairs.
  TqPermTable vperm{};
  if constexpr (VPERM && !VLIN) vperm = tq_perm_table<VB>(vt);
  // With VLIN, each column's sum of the weights (rows alike).
  float s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // Values: C holds dimensions g VSEG + 2j (rows g) and g VSEG + 2j + 1
  // (rows g + 8) of query rows 2tg, 2tg + 1 (columns).
  constexpr int MT = D / 16;
  float o[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  // Row g's running max (alike in the four lanes of a quad) and this lane's
  // share of its sum.
  float m_run = ninf, l_run = 0.0f;
  const uint32_t rr = tile * QN + g;
  const bool row_on = g < uint32_t(QN) && rr < head_rows;
  const uint32_t last = total - L + rr % L;
  // With KA, columns 2tg + e: their running maxima (alike in the eight
  // lanes of a tg), this lane's shares of their sums, whether each is a
  // row of the tile, its last visible position.
  float mc_run[2] = {ninf, ninf}, lc_run[2] = {0.0f, 0.0f};
  bool col_on[2];
  uint32_t col_last[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const uint32_t r = 2 * tg + e, rc = tile * QN + r;
    col_on[e] = r < uint32_t(QN) && rc < head_rows;
    col_last[e] = total - L + rc % L;
  }
  const uint32_t chunks = (tn + TT - 1) / TT;
  for (uint32_t ch = 0; ch < chunks; ++ch) {
    vq_copy_wait();
    // Every warp is done with the chunk before last: its buffer is free.
    __syncthreads();
    if (ch + 1 < chunks) stage_chunk(ch + 1);
    const uint8_t* kcodes = codes_s + (ch & 1u) * CBYTES;
    const uint8_t* vcodes = kcodes + TT * KROW;
    const __half* kn = kn_h + (ch & 1u) * TT;
    const __half* vn = vn_h + (ch & 1u) * TT;
    const uint32_t c0 = ch * TT, n = min(uint32_t(TT), tn - c0);
    for (uint32_t t0 = warp * 16; t0 < n; t0 += WARPS * 16) {
      // Key words of tokens t0 + g and t0 + 8 + g: dimensions [tg KSEG, (tg + 1) KSEG).
      uint32_t w0[KNW], w1[KNW];
      tq_shared_bits<KNW, KALIGNED>(kcodes, (t0 + g) * (KROW * 8) + tg * (KSEG * KB), w0);
      tq_shared_bits<KNW, KALIGNED>(kcodes, (t0 + 8 + g) * (KROW * 8) + tg * (KSEG * KB), w1);
      // The values' B fragments: weights times value norms of tokens 2tg,
      // 2tg + 1 (b0) and 2tg + 8, 2tg + 9 (b1) of the step for query row g.
      uint32_t b0, b1;
      if constexpr (KA) {
        // S^T = K Q^T: C holds tokens g, g + 8 (rows) of query rows 2tg,
        // 2tg + 1 (columns); two chains of four mma.
        float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const uint32_t a[4] = {key_pair(w0, 4 * ks), key_pair(w1, 4 * ks), key_pair(w0, 4 * ks + 2),
                                 key_pair(w1, 4 * ks + 2)};
          if (ks % 2 == 0) {
            vq_mma(sa, a, qb[ks][0], qb[ks][1]);
          } else {
            vq_mma(sb, a, qb[ks][0], qb[ks][1]);
          }
        }
        const uint32_t tk[2] = {t0 + g, t0 + 8 + g};
        float sv[4], knv[2], vnv[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          knv[h] = __half2float(kn[tk[h] < n ? tk[h] : 0u]);
          vnv[h] = __half2float(vn[tk[h] < n ? tk[h] : 0u]);
        }
        float mx[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          mx[e] = ninf;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // A token past the end, masked, or a column past the tile's rows: -inf.
            const uint32_t pos = N_SINK + t_begin + c0 + tk[h];
            const bool in = col_on[e] && tk[h] < n && (!CAUSAL || pos <= col_last[e]);
            const float x = in ? (sa[2 * h + e] + sb[2 * h + e]) * knv[h] : ninf;
            sv[2 * h + e] = x;
            mx[e] = fmaxf(mx[e], x);
          }
        }
        // Each column's max over the step's 16 tokens: the eight lanes of a tg.
#pragma unroll
        for (int lm = 4; lm < 32; lm <<= 1) {
          mx[0] = fmaxf(mx[0], __shfl_xor_sync(FULL, mx[0], lm));
          mx[1] = fmaxf(mx[1], __shfl_xor_sync(FULL, mx[1], lm));
        }
        float al[2], p[4];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float m_new = fmaxf(mc_run[e], mx[e]);
          // Nothing is accumulated while the max is -inf: no factor then.
          al[e] = mc_run[e] == ninf ? 1.0f : tq_exp(mc_run[e] - m_new);
#pragma unroll
          for (int h = 0; h < 2; ++h) p[2 * h + e] = m_new == ninf ? 0.0f : tq_exp(sv[2 * h + e] - m_new);
          lc_run[e] = lc_run[e] * al[e] + (p[e] + p[2 + e]);
          mc_run[e] = m_new;
        }
        // Columns 2tg + e of the accumulators are this lane's own columns.
        if (__any_sync(FULL, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            o[j][0] *= al[0];
            o[j][2] *= al[0];
            o[j][1] *= al[1];
            o[j][3] *= al[1];
          }
          if constexpr (VLIN) {
            s1[0] *= al[0];
            s1[2] *= al[0];
            s1[1] *= al[1];
            s1[3] *= al[1];
          }
        }
        // Rows token g (g + 8), columns queries 2tg, 2tg + 1: transposed,
        // row query g, columns tokens 2tg, 2tg + 1 (2tg + 8, 2tg + 9).
        b0 = vq_transpose8(tq_half2_bits(p[0] * vnv[0], p[1] * vnv[0]));
        b1 = vq_transpose8(tq_half2_bits(p[2] * vnv[1], p[3] * vnv[1]));
      } else {
        // Scores of tokens t0 + 8h + (2tg, 2tg + 1), h = 0, 1: two tiles, two
        // independent mma chains.
        float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint4 qa;
          if constexpr (QA2) {
            const uint2 q2 = qa2_s[ks * 32 + lane];
            qa = make_uint4(q2.x, 0u, q2.y, 0u);
          } else {
            qa = qa_s[ks * 32 + lane];
          }
          const uint32_t a[4] = {qa.x, qa.y, qa.z, qa.w};
          vq_mma(s0, a, key_pair(w0, 4 * ks), key_pair(w0, 4 * ks + 2));
          vq_mma(s1, a, key_pair(w1, 4 * ks), key_pair(w1, 4 * ks + 2));
        }
        const uint32_t ts[4] = {t0 + 2 * tg, t0 + 2 * tg + 1, t0 + 2 * tg + 8, t0 + 2 * tg + 9};
        float sv[4] = {s0[0], s0[1], s1[0], s1[1]};
        float mx = ninf;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // A token past the end, masked, or of a row past the tile's scores -inf.
          const uint32_t pos = N_SINK + t_begin + c0 + ts[e];
          const bool in = row_on && ts[e] < n && (!CAUSAL || pos <= last);
          sv[e] = in ? sv[e] * __half2float(kn[in ? ts[e] : 0u]) : ninf;
          mx = fmaxf(mx, sv[e]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
        const float m_new = fmaxf(m_run, mx);
        const float alpha = m_run == ninf ? 0.0f : tq_exp(m_run - m_new);
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = m_new == ninf ? 0.0f : tq_exp(sv[e] - m_new);
        l_run = l_run * alpha + (p[0] + p[1]) + (p[2] + p[3]);
        m_run = m_new;
        // Columns 2tg + e of the accumulators take their row's factor, from
        // that row's quad; most steps leave every max as it was.
        const float a0 = __shfl_sync(FULL, alpha, 8 * tg), a1 = __shfl_sync(FULL, alpha, 8 * tg + 4);
        if (__any_sync(FULL, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            o[j][0] *= a0;
            o[j][2] *= a0;
            o[j][1] *= a1;
            o[j][3] *= a1;
          }
        }
        // The weights times the value norms as the B fragments: row g, tokens
        // ts (a token past the end weighs nothing).
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] *= __half2float(vn[ts[e] < n ? ts[e] : 0u]);
        b0 = tq_half2_bits(p[0], p[1]);
        b1 = tq_half2_bits(p[2], p[3]);
      }
      // Value codes of tokens 2tg, 2tg + 1, 2tg + 8, 2tg + 9: dimensions [g VSEG, (g + 1) VSEG).
      uint32_t w[4][VNW];
#pragma unroll
      for (int e = 0; e < 4; ++e) tq_shared_bits<VNW, VALIGNED, tq_max_shift(VSEG * VB, VROW * 8), VSEG * VB>(vcodes, (t0 + 2 * tg + (e & 1) + 8 * (e >> 1)) * (VROW * 8) + g * (VSEG * VB), w[e]);
      // 3-bit codes: every selector of the step's value permutes at once.
      constexpr bool VSEL = KA && VPERM && VB == 3 && VSEG % 8 == 0 && !VLIN;
      uint32_t sx[VSEL ? MT : 1], sy[VSEL ? MT : 1];
      if constexpr (VSEL) {
        tq_perm_sels3<VNW, VSEG>(w[0], w[1], sx);
        tq_perm_sels3<VNW, VSEG>(w[2], w[3], sy);
      }
      // With VLIN: code i of token pair (2tg, 2tg + 1) (x) and (2tg + 8,
      // 2tg + 9) (y) as a subnormal half2 register.
      uint32_t vx[VLIN ? VSEG : 1], vy[VLIN ? VSEG : 1];
      if constexpr (VLIN) {
        tq_lin_codes3<VNW, VSEG>(w[0], w[1], vx);
        tq_lin_codes3<VNW, VSEG>(w[2], w[3], vy);
        const uint32_t ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
        vq_mma(s1, ones, b0, b1);
      }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        if constexpr (VLIN) {
          const uint32_t a[4] = {vx[2 * j], vx[2 * j + 1], vy[2 * j], vy[2 * j + 1]};
          vq_mma(o[j], a, b0, b1);
        } else if constexpr (VSEL) {
          const uint2 x = tq_perm_lookup(vperm, sx[j]);
          const uint2 y = tq_perm_lookup(vperm, sy[j]);
          const uint32_t a[4] = {x.x, x.y, y.x, y.y};
          vq_mma(o[j], a, b0, b1);
        } else if constexpr (VPERM) {
          const uint2 x = tq_perm_pairs<VB, VNW>(vperm, w[0], w[1], 2 * j);
          const uint2 y = tq_perm_pairs<VB, VNW>(vperm, w[2], w[3], 2 * j);
          const uint32_t a[4] = {x.x, x.y, y.x, y.y};
          vq_mma(o[j], a, b0, b1);
        } else {
          const uint32_t a[4] = {tq_pair_across<VB, VNW>(vt, w[0], w[1], 2 * j), tq_pair_across<VB, VNW>(vt, w[0], w[1], 2 * j + 1),
                                 tq_pair_across<VB, VNW>(vt, w[2], w[3], 2 * j), tq_pair_across<VB, VNW>(vt, w[2], w[3], 2 * j + 1)};
          vq_mma(o[j], a, b0, b1);
        }
      }
    }
  }
  if constexpr (VLIN) {
    // Dimension g VSEG + i holds sum(w c) 2^(p_i - 24): the values are
    // c0 + c step.
    const float c0 = vc[0], step = (vc[(1 << VB) - 1] - vc[0]) * (1.0f / float((1 << VB) - 1));
#pragma unroll
    for (int j = 0; j < MT; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float f = step * tq_lin_scale3(2 * j + h);
#pragma unroll
        for (int e = 0; e < 2; ++e) o[j][2 * h + e] = c0 * s1[e] + f * o[j][2 * h + e];
      }
    }
  }
  // The warps' states: each warp's row max and sum, then its accumulators
  // scaled to the block's max into the codes' space (free once every warp
  // is past this barrier).
  if constexpr (KA) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int lm = 4; lm < 32; lm <<= 1) lc_run[e] += __shfl_xor_sync(FULL, lc_run[e], lm);
      if (g == 0 && 2 * tg + e < uint32_t(QN)) {
        mw_s[warp * QN + 2 * tg + e] = mc_run[e];
        lw_s[warp * QN + 2 * tg + e] = lc_run[e];
      }
    }
  } else {
    l_run += __shfl_xor_sync(FULL, l_run, 1);
    l_run += __shfl_xor_sync(FULL, l_run, 2);
    if (tg == 0 && g < uint32_t(QN)) {
      mw_s[warp * QN + g] = m_run;
      lw_s[warp * QN + g] = l_run;
    }
  }
  __syncthreads();
  auto block_max = [&](uint32_t r) {
    float m = ninf;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, mw_s[w * QN + r]);
    return m;
  };
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const uint32_t r = 2 * tg + e;
    if (r < uint32_t(QN)) {
      const float mw = mw_s[warp * QN + r];
      const float f = mw == ninf ? 0.0f : __expf(mw - block_max(r));
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        float* out = a_s + (warp * QN + r) * D + g * VSEG + 2 * j;
        out[0] = o[j][e] * f;
        out[1] = o[j][2 + e] * f;
      }
    }
  }
  if (tid < uint32_t(QN)) {
    const float m = block_max(tid);
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float mw = mw_s[w * QN + tid];
      l += mw == ninf ? 0.0f : lw_s[w * QN + tid] * __expf(mw - m);
    }
    m_s[tid] = m;
    l_s[tid] = l;
  }
} else {
  // Scores, in steps of STEP tokens: a group's tokens in a step are
  // st + u * GROUPS + gi, so that neighbouring groups read neighbouring rows.
  float qv[QN][CPT * 8];
#pragma unroll
  for (int r = 0; r < QN; ++r) {
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const uint32_t c = li + k * TPT;
#pragma unroll
      for (int j = 0; j < 8; ++j) qv[r][k * 8 + j] = c < uint32_t(NCH) ? qs[r * D + c * 8 + j] : 0.0f;
    }
  }
  for (uint32_t st = 0; st < tn; st += STEP) {
    float part[V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t i = st + u * GROUPS + gi;
      float kx[CPT * 8];
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const uint32_t c = li + k * TPT;
        tq_split_chunk<KB, KROW>(compressed, ksm, kc, wk, wks, i, c, i < tn, c < uint32_t(NCH), kx + k * 8);
      }
#pragma unroll
      for (int r = 0; r < QNP; ++r) {
        float v = 0.0f;
        if (r < QN) {
#pragma unroll
          for (int j = 0; j < CPT * 8; ++j) v += qv[r][j] * kx[j];
        }
        part[u * QNP + r] = v;
      }
    }
    uint32_t start = 0;
    tq_group_scatter<V, TPT / 2, V>(part, li, start);
    if (li % REP == 0) {
#pragma unroll
      for (int k = 0; k < VL; ++k) {
        const uint32_t idx = start + k;
        const uint32_t u = idx / QNP, r = idx % QNP;
        const uint32_t i = st + u * GROUPS + gi;
        const uint32_t rr = tile * QN + r;
        if (r < uint32_t(QN) && i < tn) {
          const uint32_t t = t_begin + i;
          float s = part[k];
          uint32_t pos;
          if (compressed) {
            s *= kn_s[i];
            pos = N_SINK + t;
          } else {
            pos = t < uint32_t(N_SINK) ? t : n_comp + t;
          }
          if (rr >= head_rows || (CAUSAL && pos > total - L + rr % L)) s = ninf;
          sc[r * TT + i] = s;
        }
      }
    }
  }
  __syncthreads();
  // Weights: warp r turns row r's scores into e^(s - m), m_s and l_s the
  // split's max and sum.
  if (warp < uint32_t(QN)) {
    float* row = sc + warp * TT;
    float mx = ninf;
    for (uint32_t i = lane; i < tn; i += 32) mx = fmaxf(mx, row[i]);
    mx = tq_warp_max(mx);
    float sum = 0.0f;
    for (uint32_t i = lane; i < tn; i += 32) {
      const float p = mx == ninf ? 0.0f : __expf(row[i] - mx);
      row[i] = p;
      sum += p;
    }
    sum = tq_warp_sum(sum);
    if (lane == 0) {
      m_s[warp] = mx;
      l_s[warp] = sum;
    }
  }
  __syncthreads();
  // Values, in the scores' steps.
  float acc[QN][CPT * 8];
#pragma unroll
  for (int r = 0; r < QN; ++r) {
#pragma unroll
    for (int j = 0; j < CPT * 8; ++j) acc[r][j] = 0.0f;
  }
  for (uint32_t st = 0; st < tn; st += STEP) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t i = st + u * GROUPS + gi;
      // A token past the end weighs nothing (its weight slot was never written).
      const bool have = i < tn;
      float vx[CPT * 8];
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const uint32_t c = li + k * TPT;
        tq_split_chunk<VB, VROW>(compressed, vsm, vc, wv, wvs, i, c, have, c < uint32_t(NCH), vx + k * 8);
      }
      const float vn = compressed ? vn_s[have ? i : 0u] : 1.0f;
#pragma unroll
      for (int r = 0; r < QN; ++r) {
        const float pv = have ? sc[r * TT + i] * vn : 0.0f;
#pragma unroll
        for (int j = 0; j < CPT * 8; ++j) acc[r][j] += pv * vx[j];
      }
    }
  }
  // The codes' space becomes the per-warp sums.
  __syncthreads();
  // Groups of one warp: lanes li, li + TPT, ... hold the same dimensions.
#pragma unroll
  for (int o = TPT; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < QN; ++r) {
#pragma unroll
      for (int j = 0; j < CPT * 8; ++j) acc[r][j] += __shfl_xor_sync(FULL, acc[r][j], o);
    }
  }
  if (lane < uint32_t(TPT)) {
#pragma unroll
    for (int r = 0; r < QN; ++r) {
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
}
__syncthreads();
for (uint32_t e = tid; e < uint32_t(QN * D); e += TG) {
  const uint32_t r = e / D, i = e % D;
  const uint32_t rr = tile * QN + r;
  if (rr >= head_rows) continue;
  float a = 0.0f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) a += a_s[(w * QN + r) * D + i];
  const uint64_t row = row_of(rr);
  acc_out[(row * num_splits + split) * D + i] = a;
  if (i == 0) {
    m_out[row * num_splits + split] = m_s[r];
    l_out[row * num_splits + split] = l_s[r];
  }
}
if (!REDUCE) {
  return;
}
// The last block of a tile to finish merges the tile's splits and rotates
// them back (tq_reduce's work, one launch less a layer). counters holds one
// word a tile, zero between calls: each block adds one after its partials
// are visible, and the block that makes it num_splits resets it.
__shared__ bool last_s;
__threadfence();
__syncthreads();
if (tid == 0) {
  uint32_t* const counter = const_cast<uint32_t*>(counters) + (uint64_t(bs) * Hkv + hk) * tiles + tile;
  last_s = atomicAdd(counter, 1u) + 1u == num_splits;
  if (last_s) atomicExch(counter, 0u);
}
__syncthreads();
if (!last_s) {
  return;
}
__threadfence();
// Per row: the splits' max M (warp r) and the softmax's sum, then
// a_i = sum_s e^(m_s - M) acc_s,i into a_s, and out_i = sum_j a_j Π[j][i]
// divided by the sum.
float* const ma_s = mw_s;
float* const den_s = lw_s;
if (warp < uint32_t(QN)) {
  const uint32_t rr = tile * QN + warp;
  float M = ninf, den = 0.0f;
  if (rr < head_rows) {
    const uint64_t row = row_of(rr);
    for (uint32_t t = lane; t < num_splits; t += 32) M = fmaxf(M, __ldcg(m_out + row * num_splits + t));
    M = tq_warp_max(M);
    if (M != ninf) {
      for (uint32_t t = lane; t < num_splits; t += 32) {
        den += __expf(__ldcg(m_out + row * num_splits + t) - M) * __ldcg(l_out + row * num_splits + t);
      }
    }
    den = tq_warp_sum(den);
  }
  if (lane == 0) {
    ma_s[warp] = M;
    den_s[warp] = den;
  }
}
__syncthreads();
// Four dimensions a thread, the splits shared by P threads, MS splits'
// loads in flight at once (the tail runs alone after the other blocks: its
// time is latency); the parts meet in the codes' space past a_s.
{
  constexpr int E4 = QN * D / 4;
  constexpr int P = TG >= 2 * E4 ? TG / E4 : 1;
  constexpr int MS = 8;
  static_assert(QN * D * 4 * P <= RDYN, "the parts fit in the codes' space");
  float4* const a4 = reinterpret_cast<float4*>(a_s);
  float4* const part_s = a4 + E4;
  for (uint32_t e = tid; e < uint32_t(E4 * P); e += TG) {
    const uint32_t e4 = e % E4, p = e / E4;
    const uint32_t r = e4 / (D / 4), i = e4 % (D / 4) * 4;
    const uint32_t rr = tile * QN + r;
    const float M = ma_s[r];
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (rr < head_rows && M != ninf) {
      const uint64_t row = row_of(rr);
      for (uint32_t t0 = p * MS; t0 < num_splits; t0 += MS * P) {
        float m[MS];
        float4 v[MS];
#pragma unroll
        for (int k = 0; k < MS; ++k) {
          const uint32_t t = t0 + k;
          const bool on = t < num_splits;
          m[k] = on ? __ldcg(m_out + row * num_splits + t) : ninf;
          v[k] = on ? __ldcg(reinterpret_cast<const float4*>(acc_out + (row * num_splits + t) * D + i))
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < MS; ++k) {
          const float f = __expf(m[k] - M);
          a.x += f * v[k].x;
          a.y += f * v[k].y;
          a.z += f * v[k].z;
          a.w += f * v[k].w;
        }
      }
    }
    (p == 0 ? a4[e4] : part_s[(p - 1) * E4 + e4]) = a;
  }
  __syncthreads();
  if constexpr (P > 1) {
    for (uint32_t e4 = tid; e4 < uint32_t(E4); e4 += TG) {
      float4 a = a4[e4];
#pragma unroll
      for (int p = 1; p < P; ++p) {
        const float4 b = part_s[(p - 1) * E4 + e4];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
      }
      a4[e4] = a;
    }
    __syncthreads();
  }
}
// The values' frame back to the model's: JR rows of Π at a time copied into
// the codes' space past a_s (cp.async: every thread's share in flight at
// once, no registers), each thread's outputs summed over them.
{
  constexpr int JR = (RDYN - QN * D * 4) / (4 * D) < D ? (RDYN - QN * D * 4) / (4 * D) : D;
  static_assert(JR >= 1, "a row of the rotation fits past the sums");
  constexpr int OPT = (QN * D + TG - 1) / TG;
  float* const rot_s = a_s + QN * D;
  const bool rot_aligned = (reinterpret_cast<uintptr_t>(rot) & 15u) == 0;
  float y[OPT];
#pragma unroll
  for (int k = 0; k < OPT; ++k) y[k] = 0.0f;
  for (uint32_t j0 = 0; j0 < uint32_t(D); j0 += JR) {
    const uint32_t jn = min(uint32_t(JR), uint32_t(D) - j0);
    vq_copy_to_shared(reinterpret_cast<uint8_t*>(rot_s), reinterpret_cast<const uint8_t*>(rot), uint64_t(j0) * D * 4,
                      uint64_t(D) * D * 4, int(jn * D * 4), rot_aligned);
    vq_copy_wait();
    __syncthreads();
#pragma unroll
    for (int k = 0; k < OPT; ++k) {
      const uint32_t e = tid + k * TG;
      if (e < uint32_t(QN * D)) {
        const float* ar = a_s + e / D * D + j0;
        const float* rc = rot_s + e % D;
#pragma unroll 8
        for (uint32_t j = 0; j < jn; ++j) y[k] += ar[j] * rc[j * D];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < OPT; ++k) {
    const uint32_t e = tid + k * TG;
    const uint32_t r = e / D, i = e % D;
    const uint32_t rr = tile * QN + r;
    if (e >= uint32_t(QN * D) || rr >= head_rows) continue;
    const float M = ma_s[r], den = den_s[r];
    out[row_of(rr) * D + i] = static_cast<T>(M != ninf && den > 0.0f ? y[k] / den : 0.0f);
  }
}
