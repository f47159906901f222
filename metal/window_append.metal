// window_append: a compressed layer's new tokens into its float16 windows,
// each side in its frame: out_k = win_k with slots at..at+L-1 replaced by
// keys·key_frame (+ key_offset with OFFSET), out_v = win_v with the same
// slots replaced by values·value_frame (ROTATE_V) or the values. One launch
// instead of two matmuls and two slice updates.
// Template: T (every input's and output's element type), D, OFFSET, ROTATE_V.
// Inputs, read through their shapes and strides: keys, values [B, Hkv, L, D];
// key_frame, value_frame [D, D]; key_offset [B, Hkv, 1, D]; win_k, win_v
// [B, Hkv, W, D]; filled [B, Hkv, at, D], a view whose length is the slot
// of the first new token. Without OFFSET or ROTATE_V the unused input is a
// stand-in, never read. Outputs out_k, out_v [B, Hkv, W, D], contiguous.
// One thread per 8 consecutive dimensions of one slot of one side.
constexpr uint NCH = D / 8;
const uint Hn = uint(win_k_shape[1]), W = uint(win_k_shape[2]);
const uint L = uint(keys_shape[2]);
const uint at = uint(filled_shape[2]);
const ulong per_side = ulong(win_k_shape[0]) * Hn * W * NCH;
const ulong e = ulong(thread_position_in_grid.x);
if (e >= 2 * per_side) {
  return;
}
const bool is_v = e >= per_side;
ulong r = is_v ? e - per_side : e;
const uint c = uint(r % NCH);
r /= NCH;
const uint slot = uint(r % W);
r /= W;
const uint h = uint(r % Hn);
const uint b = uint(r / Hn);
device T* dst = (is_v ? out_v : out_k) + ((ulong(b) * Hn + h) * W + slot) * D + c * 8;
if (slot < at || slot >= at + L) {
  const device T* src = is_v
      ? win_v + long(b) * win_v_strides[0] + long(h) * win_v_strides[1] + long(slot) * win_v_strides[2]
      : win_k + long(b) * win_k_strides[0] + long(h) * win_k_strides[1] + long(slot) * win_k_strides[2];
  const long s3 = is_v ? long(win_v_strides[3]) : long(win_k_strides[3]);
  for (uint j = 0; j < 8; ++j) dst[j] = src[long(c * 8 + j) * s3];
  return;
}
const uint t = slot - at;
const device T* x = is_v
    ? values + long(b) * values_strides[0] + long(h) * values_strides[1] + long(t) * values_strides[2]
    : keys + long(b) * keys_strides[0] + long(h) * keys_strides[1] + long(t) * keys_strides[2];
const long x3 = is_v ? long(values_strides[3]) : long(keys_strides[3]);
if (is_v && !ROTATE_V) {
  for (uint j = 0; j < 8; ++j) dst[j] = x[long(c * 8 + j) * x3];
  return;
}
const device T* frame = is_v ? value_frame : key_frame;
const long f0 = is_v ? long(value_frame_strides[0]) : long(key_frame_strides[0]);
const long f1 = is_v ? long(value_frame_strides[1]) : long(key_frame_strides[1]);
float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
for (uint i = 0; i < uint(D); ++i) {
  const float xi = float(x[long(i) * x3]);
  for (uint j = 0; j < 8; ++j) acc[j] += xi * float(frame[long(i) * f0 + long(c * 8 + j) * f1]);
}
if (!is_v && OFFSET) {
  const device T* off = key_offset + long(b) * key_offset_strides[0] + long(h) * key_offset_strides[1];
  for (uint j = 0; j < 8; ++j) acc[j] += float(off[long(c * 8 + j) * key_offset_strides[3]]);
}
for (uint j = 0; j < 8; ++j) dst[j] = T(acc[j]);
