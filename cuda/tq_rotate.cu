// tq_rotate: the decode queries in the keys' rotated frame, scaled once per
// call: out[b, h, l] = SCALE * Π q[b, h, l] in float32 (tq_decode then reads
// them as they are instead of every block rotating its own: at llama-8b 32K
// that was a fifth of tq_decode's warp time, 248 blocks each reading Π).
// Template T, D, QR (query rows a block serves), SCALE (float32 bits).
// q [B, Hq, L, D] is read through its strides, rot [D, D] float32 row-major,
// out [B, Hq, L, D] contiguous. Block k serves rows QR (k / (D / 32)) on and
// output dimensions 32 (k % (D / 32)) on, with 256 threads: 8 lanes an
// output dimension, each reading D / 8 consecutive entries of its row of Π
// (a warp reads four whole rows), their sums added by shuffles.
constexpr int PARTS = 8;
constexpr int SEG = D / PARTS;
__shared__ float xs[QR * D];
const uint32_t Hq = q_shape[1], L = q_shape[2];
const uint32_t rows = q_shape[0] * Hq * L;
const uint32_t col_blocks = D / 32;
const uint32_t r0 = (blockIdx.x / col_blocks) * QR;
const uint32_t i = (blockIdx.x % col_blocks) * 32 + threadIdx.x / PARTS;
const uint32_t part = threadIdx.x % PARTS;
// This thread's share of row i of Π, requested before the queries.
float w[SEG];
#pragma unroll
for (int j = 0; j < SEG; j += 4) {
  const float4 v = *reinterpret_cast<const float4*>(rot + uint64_t(i) * D + part * SEG + j);
  w[j] = v.x, w[j + 1] = v.y, w[j + 2] = v.z, w[j + 3] = v.w;
}
for (uint32_t e = threadIdx.x; e < uint32_t(QR * D); e += blockDim.x) {
  const uint32_t r = r0 + e / D, j = e % D;
  float x = 0.0f;
  if (r < rows) {
    const uint32_t b = r / (Hq * L), h = (r / L) % Hq, l = r % L;
    x = static_cast<float>(q[int64_t(b) * q_strides[0] + int64_t(h) * q_strides[1] + int64_t(l) * q_strides[2] +
                             int64_t(j) * q_strides[3]]);
  }
  xs[e] = x;
}
__syncthreads();
const float scale = __int_as_float(SCALE);
#pragma unroll
for (int r = 0; r < QR; ++r) {
  float y = 0.0f;
#pragma unroll
  for (int j = 0; j < SEG; ++j) y += w[j] * xs[r * D + part * SEG + j];
#pragma unroll
  for (int o = 1; o < PARTS; o <<= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  if (part == 0 && r0 + r < rows) out[uint64_t(r0 + r) * D + i] = y * scale;
}
