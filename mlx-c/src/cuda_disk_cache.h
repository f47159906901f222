// Keeps the machine code of custom CUDA kernels on disk, where MLX looks.
#pragma once

#include <string>

#include "private.h"

namespace mlxc {

// The first time a process sees `key` (what decides a kernel's generated
// source: the kernel, its template arguments, its dtypes), compiles the
// custom kernel behind `output` into MLX's kernel cache unless it is there.
void keep_cuda_kernel_on_disk(const std::string& key, const mx::array& output);

}  // namespace mlxc
