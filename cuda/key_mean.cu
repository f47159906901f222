// key_mean: a compressed layer's key mean over its first chunk and the offset
// that mean takes in the keys' frame, in one launch instead of nine ops.
// Template: T (the keys' and the offset's element type), D, ROTATE, FRAME
// (the frame's scale F, a power of two), TG (threads of a block).
// Inputs: keys [B, H, L, D], read through its shape and strides; rotation
// float32 [D, D] (F·Π, row-major), read only with ROTATE (else a stand-in).
// Outputs, contiguous: mean float32 [B, H, 1, D], the mean over the L tokens
// with a NaN or an infinity counted as 0 (so that a non-finite key shifts no
// other key); offset T [B, H, 1, D], −mean in the keys' frame:
// −Σ_d mean[d]·rotation[j, d] / F² with ROTATE, else −mean[j] / F.
// One block per (b, h): a thread per 8 consecutive dimensions of every
// LANES-th token (16-byte loads where the row lies so, several in flight),
// the lanes' sums added in shared memory, then a thread per output
// dimension forms the offset from the mean held there.
constexpr int NCH = D / 8;
constexpr int LANES = TG / NCH;
__shared__ float part[LANES * D];
__shared__ float mean_s[D];
const uint32_t Hn = keys_shape[1], L = keys_shape[2];
const uint32_t bh = blockIdx.x;
const int tid = threadIdx.x;
const int c = tid % NCH, lane = tid / NCH;
if (lane < LANES) {
  const T* p = keys + int64_t(bh / Hn) * keys_strides[0] + int64_t(bh % Hn) * keys_strides[1] +
               int64_t(c * 8) * keys_strides[3];
  const int64_t st = keys_strides[2], s3 = keys_strides[3];
  const bool words = s3 == 1 && st % 8 == 0 && vq_aligned(p, 16);
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll 4
  for (uint32_t t = lane; t < L; t += LANES) {
    const T* row = p + int64_t(t) * st;
    float x[8];
    if (words) {
      vq_load8(row, x);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = static_cast<float>(row[int64_t(j) * s3]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j] += isfinite(x[j]) ? x[j] : 0.0f;
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) part[lane * D + c * 8 + j] = acc[j];
}
__syncthreads();
for (int d = tid; d < D; d += TG) {
  float s = 0.0f;
#pragma unroll 8
  for (int l = 0; l < LANES; ++l) {
    s += part[l * D + d];
  }
  s /= float(L);
  mean_s[d] = s;
  mean[uint64_t(bh) * D + d] = s;
}
__syncthreads();
for (int j = tid; j < D; j += TG) {
  float o;
  if constexpr (ROTATE) {
    o = 0.0f;
    const float* row = rotation + int64_t(j) * D;
    // Not unrolled whole: a 1024-thread block may hold 64 registers a thread.
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      o += mean_s[d] * row[d];
    }
    o *= -1.0f / float(FRAME * FRAME);
  } else {
    o = mean_s[j] * (-1.0f / float(FRAME));
  }
  offset[uint64_t(bh) * D + j] = static_cast<T>(o);
}
