// window_append: a compressed layer's new tokens into its float16 windows,
// each side in its frame: out_k = win_k with slots at..at+L-1 replaced by
// keys·key_frame (+ key_offset with OFFSET), out_v = win_v with the same
// slots replaced by values·value_frame (ROTATE_V) or the values. One launch
// instead of two matmuls and two slice updates: at decode MLX's host time per
// op is what a token costs.
// Template: T (every input's and output's element type), D, OFFSET, ROTATE_V.
// Inputs, read through their shapes and strides: keys, values [B, Hkv, L, D];
// key_frame, value_frame [D, D]; key_offset [B, Hkv, 1, D]; win_k, win_v
// [B, Hkv, W, D]; filled [B, Hkv, at, D], a view whose length is the slot
// of the first new token. Without OFFSET or ROTATE_V the unused input is a
// stand-in, its values never used. Outputs out_k, out_v [B, Hkv, W, D], contiguous.
// Threads: first the new slots' products, KS lanes (a whole warp where D is
// a multiple of 32, else an aligned group of 8) per 8 output dimensions of
// one new slot of one side, each summing a D / KS share of the inputs with
// every load issued before the first product, the shares then added by
// shuffles (the products' latency, on a few SMs, sets the kernel's time:
// with fewer lanes each waited on its loads in turn); padded to whole warps.
// Then one thread per 8 consecutive dimensions of every other slot of each
// side, copied. The host's cuda_window_lanes gives KS.
constexpr int NCH = D / 8;
constexpr int KS = D % 32 == 0 ? 32 : 8;
// 8 consecutive elements as 16-byte words where they lie back to back on a
// 16-byte boundary (the windows' and frames' layout), else one at a time.
constexpr int WORDS = 8 * int(sizeof(T)) / 16;
auto load8 = [](const T* p, bool words, int64_t stride, T out[8]) {
  if (words) {
#pragma unroll
    for (int w = 0; w < WORDS; ++w) reinterpret_cast<uint4*>(out)[w] = reinterpret_cast<const uint4*>(p)[w];
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = p[int64_t(j) * stride];
  }
};
constexpr int SHARE = D / KS;
const uint32_t Bn = win_k_shape[0], Hn = win_k_shape[1], W = win_k_shape[2];
const uint32_t L = keys_shape[2];
const uint32_t at = filled_shape[2];
const uint64_t new_items = 2ull * Bn * Hn * L * NCH * KS;
const uint64_t new_pad = (new_items + 31) / 32 * 32;
const uint64_t per_side = uint64_t(Bn) * Hn * W * NCH;
const uint64_t e = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (e < new_pad) {
  // Whole warps: every lane runs the shuffles; a padding lane redoes item 0
  // and writes nothing.
  const bool valid = e < new_items;
  uint32_t r = valid ? uint32_t(e) : 0u;
  const uint32_t sub = r % KS;
  r /= KS;
  const uint32_t c = r % NCH;
  r /= NCH;
  const uint32_t t = r % L;
  r /= L;
  const uint32_t h = r % Hn;
  r /= Hn;
  const uint32_t b = r % Bn;
  const bool is_v = r / Bn != 0;
  const T* x = is_v
      ? values + int64_t(b) * values_strides[0] + int64_t(h) * values_strides[1] + int64_t(t) * values_strides[2]
      : keys + int64_t(b) * keys_strides[0] + int64_t(h) * keys_strides[1] + int64_t(t) * keys_strides[2];
  const int64_t x3 = is_v ? values_strides[3] : keys_strides[3];
  // Without ROTATE_V the values' frame is a stand-in: its products are
  // computed (the warp stays together) and dropped.
  const T* frame = is_v ? value_frame : key_frame;
  const int64_t f0 = is_v ? value_frame_strides[0] : key_frame_strides[0];
  const int64_t f1 = is_v ? value_frame_strides[1] : key_frame_strides[1];
  // The share's frame rows as 16-byte words where the frame is row-major on
  // a 16-byte boundary (one test, outside the loads).
  const T* f = frame + int64_t(sub) * SHARE * f0 + int64_t(c * 8) * f1;
  const bool words = f1 == 1 && f0 % 8 == 0 && (reinterpret_cast<uintptr_t>(f) & 15u) == 0;
  T xs[SHARE];
  T fr[SHARE][8];
#pragma unroll
  for (int k = 0; k < SHARE; ++k) {
    xs[k] = x[int64_t(sub * SHARE + k) * x3];
    load8(f + int64_t(k) * f0, words, f1, fr[k]);
  }
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < SHARE; ++k) {
    const float xi = static_cast<float>(xs[k]);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += xi * static_cast<float>(fr[k][j]);
  }
#pragma unroll
  for (int o = KS / 2; o > 0; o >>= 1) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  }
  if (!valid || sub != 0) {
    return;
  }
  T* dst = (is_v ? out_v : out_k) + ((uint64_t(b) * Hn + h) * W + at + t) * D + c * 8;
  if (is_v && !ROTATE_V) {
#pragma unroll
    for (int j = 0; j < 8; ++j) dst[j] = x[int64_t(c * 8 + j) * x3];
    return;
  }
  if (!is_v && OFFSET) {
    const T* off = key_offset + int64_t(b) * key_offset_strides[0] + int64_t(h) * key_offset_strides[1];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<float>(off[int64_t(c * 8 + j) * key_offset_strides[3]]);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) dst[j] = static_cast<T>(acc[j]);
  return;
}
if (e - new_pad >= 2 * per_side) {
  return;
}
const bool is_v = e - new_pad >= per_side;
uint32_t r = uint32_t(is_v ? e - new_pad - per_side : e - new_pad);
const uint32_t c = r % NCH;
r /= NCH;
const uint32_t slot = r % W;
r /= W;
const uint32_t h = r % Hn;
const uint32_t b = r / Hn;
if (slot >= at && slot < at + L) {
  return;
}
T* dst = (is_v ? out_v : out_k) + ((uint64_t(b) * Hn + h) * W + slot) * D + c * 8;
const T* src = is_v
    ? win_v + int64_t(b) * win_v_strides[0] + int64_t(h) * win_v_strides[1] + int64_t(slot) * win_v_strides[2]
    : win_k + int64_t(b) * win_k_strides[0] + int64_t(h) * win_k_strides[1] + int64_t(slot) * win_k_strides[2];
const int64_t s3 = is_v ? win_v_strides[3] : win_k_strides[3];
if (s3 == 1 && ((reinterpret_cast<uintptr_t>(src + c * 8) | reinterpret_cast<uintptr_t>(dst)) & 15u) == 0) {
#pragma unroll
  for (int w = 0; w < WORDS; ++w) reinterpret_cast<uint4*>(dst)[w] = reinterpret_cast<const uint4*>(src + c * 8)[w];
  return;
}
#pragma unroll
for (int j = 0; j < 8; ++j) dst[j] = src[int64_t(c * 8 + j) * s3];
