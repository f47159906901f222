// Shared by the TurboQuant cache kernels.
#pragma once

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's layout).
__device__ __forceinline__ unsigned vq_code_at(const uint8_t* row, unsigned j, unsigned bits) {
  const unsigned o = j * bits;
  const unsigned byte = o >> 3;
  const unsigned shift = o & 7u;
  unsigned v = row[byte];
  if (shift + bits > 8u) {
    v |= unsigned(row[byte + 1]) << 8;
  }
  return (v >> shift) & ((1u << bits) - 1u);
}
