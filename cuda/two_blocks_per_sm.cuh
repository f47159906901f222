// Asks ptxas for two resident blocks of 256 threads per SM (at most 128
// registers a thread) for the kernel MLX declares after this header: MLX
// writes `__global__ void NAME(` itself, so the bound rides on the keyword.
// Without it ptxas gives tq_prod_decode's dense tensor-core path over 160
// registers, one block per SM, as it hoists fragment loads.
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__(256, 2)
