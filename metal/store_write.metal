// store_write: a TurboQuant-MSE layer's two stores (keys, then values) grown
// to cap slots with m new tokens written from slot `first`: each side's
// out_codes [R, cap, CB] and out_norms [R, cap] hold the old store's slots
// 0..first-1, then the new tokens (a norm at or past float16's largest,
// where the encoder saturates a token with a NaN or an infinity, stored as
// NaN), then zeros. One pass for both sides instead of zeros and a join per
// array, a slice update per array and the norms' mark.
// Inputs, row-contiguous, a side each (k_, v_): codes uint8 [R, cap0, CB];
// norms half [R, cap0]; new_codes uint8 [R, m, CB]; new_norms half [R, m];
// params = {R, cap0, first, m, cap, CB of the keys, CB of the values}.
// One thread per 4 code bytes of one output slot of one side (the first also
// writes the slot's norm), the keys' slots first.
const uint rows = params[0], cap0 = params[1], first = params[2];
const uint m = params[3], cap = params[4], kb = params[5], vb = params[6];
const ulong k_items = ulong(rows) * cap * ((kb + 3) / 4);
const ulong e0 = ulong(thread_position_in_grid.x);
const bool is_v = e0 >= k_items;
const uint CB = is_v ? vb : kb;
const uint words = (CB + 3) / 4;
const ulong e = is_v ? e0 - k_items : e0;
if (e >= ulong(rows) * cap * words) {
  return;
}
device const uint8_t* codes = is_v ? v_codes : k_codes;
device const uint8_t* new_codes = is_v ? v_new_codes : k_new_codes;
device const half* norms = is_v ? v_norms : k_norms;
device const half* new_norms = is_v ? v_new_norms : k_new_norms;
const uint w = uint(e % words);
const ulong slot = e / words;
const uint t = uint(slot % cap);
const ulong r = slot / cap;
const bool is_new = t >= first && t < first + m;
const ulong at = t < first ? r * cap0 + t : r * m + (t - first);
device uint8_t* dst = (is_v ? v_out_codes : k_out_codes) + slot * CB + 4 * w;
const uint n = min(4u, CB - 4 * w);
for (uint k = 0; k < n; ++k) {
  dst[k] = t < first ? codes[at * CB + 4 * w + k] : is_new ? new_codes[at * CB + 4 * w + k] : uint8_t(0);
}
if (w == 0) {
  half v = t < first ? norms[at] : is_new ? new_norms[at] : half(0.0f);
  if (is_new && !(float(v) < 65504.0f)) {
    v = as_type<half>(ushort(0x7E00));
  }
  (is_v ? v_out_norms : k_out_norms)[slot] = v;
}
