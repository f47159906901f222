// Keeps custom CUDA kernels' sources and machine code on disk.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "private.h"

namespace mlxc {

// A custom kernel's header and body as MLX's cuda_kernel is handed them.
// MLX copies a kernel's whole source into the code it generates, and hashes
// that code, at every launch (about 0.25 us of host time per KB). Written once
// into the kernel cache directory, under a name made from their text, header
// and body reach MLX as one `#include` line each, so that a launch's host cost
// no longer grows with the kernel. Where the files cannot be written (or the
// disk cache is off), `header` and `body` are the texts themselves.
struct CudaSource {
  std::string header;
  std::string body;
  // Each file an #include line names, with its text.
  std::vector<std::pair<std::string, std::string>> files;
};
CudaSource cuda_source(const std::string& name, const std::string& header, const std::string& body,
                       const std::vector<std::string>& input_names);

// The first time a process sees `key` (what decides a kernel's generated
// source: the kernel, its template arguments, its dtypes), compiles the
// custom kernel behind `output` into MLX's kernel cache unless it is there,
// after writing again any of `source`'s files that has gone.
void keep_cuda_kernel_on_disk(const std::string& key, const mx::array& output, const CudaSource& source);

}  // namespace mlxc
