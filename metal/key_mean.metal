// key_mean: a compressed layer's key mean over its first chunk and the offset
// that mean takes in the keys' frame, in one launch instead of nine ops.
// Template: T (the keys' and the offset's element type), D, ROTATE, FRAME
// (the frame's scale F, a power of two), TG (threads of a threadgroup).
// Inputs: keys [B, H, L, D], read through its shape and strides; rotation
// float32 [D, D] (F·Π, row-major), read only with ROTATE (else a stand-in).
// Outputs, contiguous: mean float32 [B, H, 1, D], the mean over the L tokens
// with a NaN or an infinity counted as 0; offset T [B, H, 1, D], −mean in the
// keys' frame: −Σ_d mean[d]·rotation[j, d] / F² with ROTATE, else −mean[j] / F.
// One threadgroup per (b, h): a thread per 8 consecutive dimensions of every
// LANES-th token, the lanes' sums added in threadgroup memory, then a thread
// per output dimension forms the offset from the mean held there.
constexpr uint NCH = D / 8;
constexpr uint LANES = TG / NCH;
threadgroup float part[LANES * D];
threadgroup float mean_s[D];
const uint Hn = uint(keys_shape[1]), L = uint(keys_shape[2]);
const uint bh = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint c = tid % NCH, lane = tid / NCH;
if (lane < LANES) {
  device const T* p = keys + long(bh / Hn) * keys_strides[0] + long(bh % Hn) * keys_strides[1] +
                      long(c * 8) * keys_strides[3];
  const long st = keys_strides[2], s3 = keys_strides[3];
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (uint t = lane; t < L; t += LANES) {
    for (uint j = 0; j < 8; ++j) {
      const float v = float(p[long(t) * st + long(j) * s3]);
      acc[j] += isfinite(v) ? v : 0.0f;
    }
  }
  for (uint j = 0; j < 8; ++j) {
    part[lane * D + c * 8 + j] = acc[j];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint d = tid; d < D; d += TG) {
  float s = 0.0f;
  for (uint l = 0; l < LANES; ++l) {
    s += part[l * D + d];
  }
  s /= float(L);
  mean_s[d] = s;
  mean[ulong(bh) * D + d] = s;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint j = tid; j < D; j += TG) {
  float o;
  if (ROTATE) {
    o = 0.0f;
    for (uint d = 0; d < D; ++d) {
      o += mean_s[d] * float(rotation[ulong(j) * D + d]);
    }
    o *= -1.0f / float(FRAME * FRAME);
  } else {
    o = mean_s[j] * (-1.0f / float(FRAME));
  }
  offset[ulong(bh) * D + j] = T(o);
}
