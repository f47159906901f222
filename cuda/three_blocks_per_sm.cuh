// Asks ptxas for three resident blocks of 256 threads per SM (at most 80
// registers a thread) for the kernel MLX declares after this header; placed
// after two_blocks_per_sm.cuh, whose bound it replaces (tq_decode's VARIANT
// bit 4: more warps an SM to wait on its shared-memory reads and mma chains,
// for a few spilled registers).
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(256, 3)
