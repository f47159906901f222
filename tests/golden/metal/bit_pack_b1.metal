template <int B_BITS>
[[kernel]] void custom_kernel_bit_pack__1_uint8_t_uint32_tc_uint8_t(
  const device uint8_t* codes [[buffer(0)]],
  const constant uint32_t* params [[buffer(1)]],
  device uint8_t* packed [[buffer(2)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
// bit_pack: codes uint8 [rows, n] -> packed uint8 [rows, nbytes].
// params = {rows, n, nbytes}; template B_BITS. One thread per (row, group of 8
// codes); eight codes fill exactly B_BITS bytes, so groups never share a byte.
// Inputs are indexed directly rather than through local pointers because MLX
// places an input of fewer than 8 elements in `constant` memory, not `device`.
const uint rows = params[0];
const uint n = params[1];
const uint nbytes = params[2];
const uint groups = (n + 7) / 8;
const uint t = thread_position_in_grid.x;
if (t >= rows * groups) {
  return;
}
const uint row = t / groups;
const uint g = t % groups;
const uint first = g * 8;
const uint count = min(8u, n - first);
const uint mask = (1u << B_BITS) - 1u;
const ulong src = ulong(row) * n + first;
ulong word = 0;
for (uint j = 0; j < count; ++j) {
  word |= ulong(uint(codes[src + j]) & mask) << (j * B_BITS);
}
const uint b0 = g * B_BITS;
const uint b1 = min(b0 + uint(B_BITS), nbytes);
const ulong dst = ulong(row) * nbytes;
for (uint k = b0; k < b1; ++k) {
  packed[dst + k] = uint8_t(word >> (8 * (k - b0)));
}

}

template [[host_name("custom_kernel_bit_pack__1_uint8_t_uint32_tc_uint8_t")]] [[kernel]] decltype(custom_kernel_bit_pack__1_uint8_t_uint32_tc_uint8_t<1>) custom_kernel_bit_pack__1_uint8_t_uint32_tc_uint8_t<1>;
