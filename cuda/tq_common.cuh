// Shared by the TurboQuant CUDA kernels (placed before the kernel, in the
// global namespace, after MLX's device utilities, which bring the half and
// bfloat16 types).

// ‖v‖ of n floats as crate::quant computes it: float64 squares summed in
// order, the root rounded to float32.
__device__ inline float tq_norm(const float* v, int n) {
  double s2 = 0.0;
  for (int j = 0; j < n; ++j) {
    const double f = static_cast<double>(v[j]);
    s2 = __dadd_rn(s2, __dmul_rn(f, f));
  }
  return __double2float_rn(__dsqrt_rn(s2));
}

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's layout).
__device__ inline unsigned tq_code_at(const uint8_t* row, unsigned j, unsigned bits) {
  const unsigned o = j * bits;
  unsigned w = row[o >> 3];
  if ((o & 7u) + bits > 8u) {
    w |= unsigned(row[(o >> 3) + 1]) << 8;
  }
  return (w >> (o & 7u)) & ((1u << bits) - 1u);
}

