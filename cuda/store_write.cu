// store_write: a TurboQuant-MSE layer's two stores (keys, then values) grown
// to cap slots with m new tokens written from slot `first`: each side's
// out_codes [R, cap, CB] and out_norms [R, cap] hold the old store's slots
// 0..first-1, then the new tokens (a norm at or past float16's largest,
// where the encoder saturates a token with a NaN or an infinity, stored as
// NaN), then zeros. One pass for both sides instead of zeros and a join per
// array, a slice update per array and the norms' mark.
// Inputs, row-contiguous, a side each (k_, v_): codes uint8 [R, cap0, CB];
// norms half [R, cap0]; new_codes uint8 [R, m, CB]; new_norms half [R, m];
// params: the sizes {R, cap0, first, m, cap, CB of the keys, CB of the
// values} (`vq_size`).
// One thread per 4 code bytes of one output slot of one side (the first also
// writes the slot's norm), the keys' slots first: a warp writes consecutive words.
const uint32_t rows = vq_size(params_shape, 0), cap0 = vq_size(params_shape, 1);
const uint32_t first = vq_size(params_shape, 2), m = vq_size(params_shape, 3);
const uint32_t cap = vq_size(params_shape, 4);
const uint32_t kb = vq_size(params_shape, 5), vb = vq_size(params_shape, 6);
const uint64_t k_items = uint64_t(rows) * cap * ((kb + 3) / 4);
const uint64_t e0 = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
const bool is_v = e0 >= k_items;
const uint32_t CB = is_v ? vb : kb;
const uint32_t words = (CB + 3) / 4;
const uint64_t e = is_v ? e0 - k_items : e0;
if (e >= uint64_t(rows) * cap * words) {
  return;
}
const uint8_t* codes = is_v ? v_codes : k_codes;
const uint8_t* new_codes = is_v ? v_new_codes : k_new_codes;
const __half* norms = is_v ? v_norms : k_norms;
const __half* new_norms = is_v ? v_new_norms : k_new_norms;
const uint32_t w = uint32_t(e % words);
const uint64_t slot = e / words;
const uint32_t t = uint32_t(slot % cap);
const uint64_t r = slot / cap;
const bool is_new = t >= first && t < first + m;
const uint64_t at = t < first ? r * cap0 + t : r * m + (t - first);
const uint8_t* src = t < first ? codes + at * CB : is_new ? new_codes + at * CB : nullptr;
uint8_t* dst = (is_v ? v_out_codes : k_out_codes) + slot * CB + 4 * w;
const uint32_t n = min(4u, CB - 4 * w);
if (CB % 4 == 0) {
  *reinterpret_cast<uint32_t*>(dst) = src ? *reinterpret_cast<const uint32_t*>(src + 4 * w) : 0u;
} else {
  for (uint32_t k = 0; k < n; ++k) {
    dst[k] = src ? src[4 * w + k] : uint8_t(0);
  }
}
if (w == 0) {
  // Copied as half: through float, a kept NaN would come back as 0x7FFF.
  __half v = t < first ? norms[at] : is_new ? new_norms[at] : __float2half(0.0f);
  if (is_new && !(__half2float(v) < 65504.0f)) {
    v = __ushort_as_half(0x7E00);  // float16's NaN as the CPU and Metal write it
  }
  (is_v ? v_out_norms : k_out_norms)[slot] = v;
}
