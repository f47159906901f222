// bit_unpack: packed uint8 [rows, nbytes] -> codes uint8 [rows, n].
// sizes = {rows, n, nbytes}; template B_BITS. One thread per (row, group of 8
// codes), reading the B_BITS bytes (fewer at the end of a row) that hold them.
const uint32_t rows = vq_size(params_shape, 0);
const uint32_t n = vq_size(params_shape, 1);
const uint32_t nbytes = vq_size(params_shape, 2);
const uint32_t groups = (n + 7) / 8;
const uint64_t t = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (t >= uint64_t(rows) * groups) {
  return;
}
const uint32_t row = uint32_t(t / groups);
const uint32_t g = uint32_t(t % groups);
const uint32_t b0 = g * B_BITS;
const uint32_t b1 = min(b0 + uint32_t(B_BITS), nbytes);
const uint64_t src = uint64_t(row) * nbytes;
uint64_t word = 0;
for (uint32_t k = b0; k < b1; ++k) {
  word |= uint64_t(packed[src + k]) << (8 * (k - b0));
}
const uint32_t first = g * 8;
const uint32_t count = min(8u, n - first);
const uint64_t mask = (uint64_t(1) << B_BITS) - 1;
const uint64_t dst = uint64_t(row) * n + first;
for (uint32_t j = 0; j < count; ++j) {
  codes[dst + j] = uint8_t((word >> (j * B_BITS)) & mask);
}
