// Asks ptxas for three resident blocks of 256 threads per SM (at most 80
// registers a thread) for the kernel MLX declares after this header, as
// two_blocks_per_sm.cuh does for two: tq_decode's warps split by role hold
// either the queries' fragments or the accumulators, and 24 warps an SM
// hide more of their latency than 16.
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(256, 3)
