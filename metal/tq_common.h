// Shared by the TurboQuant cache kernels.

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's layout).
inline uint vq_code_at(const device uint8_t* row, uint j, uint bits) {
  const uint o = j * bits;
  const uint byte = o >> 3;
  const uint shift = o & 7u;
  uint v = row[byte];
  if (shift + bits > 8u) {
    v |= uint(row[byte + 1]) << 8;
  }
  return (v >> shift) & ((1u << bits) - 1u);
}
