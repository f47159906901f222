// Shared by the TurboQuant cache kernels.

// Code j of a densely packed row of `bits`-bit codes (crate::cpu::bit_pack's
// layout) starting at byte `base` of `buf`. A macro, so that it reads any
// address space (device, constant or threadgroup) without pointer arguments.
#define VQ_CODE_AT(buf, base, j, bits)                                                             \
  (((uint((buf)[(base) + (((j) * (bits)) >> 3)]) |                                                 \
     ((((j) * (bits)) & 7u) + (bits) > 8u ? uint((buf)[(base) + (((j) * (bits)) >> 3) + 1]) << 8   \
                                           : 0u)) >>                                               \
    (((j) * (bits)) & 7u)) &                                                                       \
   ((1u << (bits)) - 1u))
