// The tensor cores' m16n8k16 product with float32 accumulators, for
// float16 and bfloat16 operands (mma_common.cuh follows it where the
// fragment loaders are needed).

// c += a b for one m16n8k16 tile.
__device__ __forceinline__ void vq_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An 8 x 8 matrix of 16-bit entries, lane 4g + q holding row g's columns
// 2q, 2q + 1, transposed: the lane then holds row g of the transpose.
__device__ __forceinline__ uint32_t vq_transpose8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// c += a b for one m16n8k16 tile of bfloat16 operands.
__device__ __forceinline__ void vq_mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b with operands of the tag's type.
__device__ __forceinline__ void vq_mma(const __half*, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  vq_mma(c, a, b0, b1);
}
__device__ __forceinline__ void vq_mma(const __nv_bfloat16*, float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  vq_mma_bf16(c, a, b0, b1);
}
