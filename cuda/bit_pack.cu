// bit_pack: codes uint8 [rows, n] -> packed uint8 [rows, nbytes].
// sizes = {rows, n, nbytes}; template B_BITS. One thread per (row, group of 8
// codes); eight codes fill exactly B_BITS bytes, so groups never share a byte.
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
const uint32_t first = g * 8;
const uint32_t count = min(8u, n - first);
const uint32_t mask = (1u << B_BITS) - 1u;
const uint64_t src = uint64_t(row) * n + first;
uint64_t word = 0;
for (uint32_t j = 0; j < count; ++j) {
  word |= uint64_t(uint32_t(codes[src + j]) & mask) << (j * B_BITS);
}
vq_store_group<B_BITS>(word, g, row, nbytes, packed);
