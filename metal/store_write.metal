// store_write: one TurboQuant-MSE side's store grown to cap slots with m new
// tokens written from slot `first`: out_codes [R, cap, CB] and out_norms
// [R, cap] hold the old store's slots 0..first-1, then the new tokens (a
// norm at or past float16's largest, where the encoder saturates a token
// with a NaN or an infinity, stored as NaN), then zeros. One pass instead of
// zeros and a join per array, a slice update per array and the norms' mark.
// Inputs, row-contiguous: codes uint8 [R, cap0, CB]; norms half [R, cap0];
// new_codes uint8 [R, m, CB]; new_norms half [R, m];
// params = {R, cap0, first, m, cap, CB}.
// One thread per 4 code bytes of one output slot (the first also writes
// the slot's norm).
const uint rows = params[0], cap0 = params[1], first = params[2];
const uint m = params[3], cap = params[4], CB = params[5];
const uint words = (CB + 3) / 4;
const ulong e = ulong(thread_position_in_grid.x);
if (e >= ulong(rows) * cap * words) {
  return;
}
const uint w = uint(e % words);
const ulong slot = e / words;
const uint t = uint(slot % cap);
const ulong r = slot / cap;
const bool is_new = t >= first && t < first + m;
const ulong at = t < first ? r * cap0 + t : r * m + (t - first);
device uint8_t* dst = out_codes + slot * CB + 4 * w;
const uint n = min(4u, CB - 4 * w);
for (uint k = 0; k < n; ++k) {
  dst[k] = t < first ? codes[at * CB + 4 * w + k] : is_new ? new_codes[at * CB + 4 * w + k] : uint8_t(0);
}
if (w == 0) {
  half v = t < first ? norms[at] : is_new ? new_norms[at] : half(0.0f);
  if (is_new && !(float(v) < 65504.0f)) {
    v = as_type<half>(ushort(0x7E00));
  }
  out_norms[slot] = v;
}
