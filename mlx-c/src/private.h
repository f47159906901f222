// Shared plumbing of the C ABI: handle conversion and the exception guard.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlxc/mlxc.h"

namespace mlxc {

namespace mx = mlx::core;

void set_error(const std::string& msg);

// Runs `f`, turning any C++ exception into a status 1 and a recorded message.
// Every entry point that can fail goes through here: no exception crosses the
// C boundary and no error ends the process.
template <typename F>
int guard(F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    set_error(e.what());
  } catch (...) {
    set_error("unknown C++ exception");
  }
  return 1;
}

// Handles own a heap object of the C++ type behind `ctx`.
inline mx::array& arr(mlx_array a) {
  if (!a.ctx) throw std::invalid_argument("null mlx_array handle");
  return *static_cast<mx::array*>(a.ctx);
}
inline mx::Stream& stream(mlx_stream s) {
  if (!s.ctx) throw std::invalid_argument("null mlx_stream handle");
  return *static_cast<mx::Stream*>(s.ctx);
}
inline mx::Device& device(mlx_device d) {
  if (!d.ctx) throw std::invalid_argument("null mlx_device handle");
  return *static_cast<mx::Device*>(d.ctx);
}
inline std::vector<mx::array>& vec(mlx_vector_array v) {
  if (!v.ctx) throw std::invalid_argument("null mlx_vector_array handle");
  return *static_cast<std::vector<mx::array>*>(v.ctx);
}
inline std::vector<std::string>& strings(mlx_vector_string v) {
  if (!v.ctx) throw std::invalid_argument("null mlx_vector_string handle");
  return *static_cast<std::vector<std::string>*>(v.ctx);
}

// Stores `value` in `*out`, reusing the handle's storage when it has one.
inline void set_array(mlx_array* out, mx::array value) {
  if (!out) throw std::invalid_argument("null result pointer");
  if (out->ctx) {
    *static_cast<mx::array*>(out->ctx) = std::move(value);
  } else {
    out->ctx = new mx::array(std::move(value));
  }
}
inline void set_vector(mlx_vector_array* out, std::vector<mx::array> value) {
  if (!out) throw std::invalid_argument("null result pointer");
  if (out->ctx) {
    *static_cast<std::vector<mx::array>*>(out->ctx) = std::move(value);
  } else {
    out->ctx = new std::vector<mx::array>(std::move(value));
  }
}

mx::Dtype to_dtype(mlx_dtype d);
mlx_dtype from_dtype(mx::Dtype d);
mx::Shape to_shape(const int* shape, size_t n);

}  // namespace mlxc
