// MLX's generated kernel source includes <cooperative_groups.h> and names
// its namespace; veloxquant's kernels use none of it, and the real header
// costs about a second of each kernel's compile.
#pragma once
namespace cooperative_groups {}
