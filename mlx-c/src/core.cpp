// Errors, strings, dtypes, devices, streams, arrays, vectors and memory.
#include <cstring>
#include <sstream>

#include "mlx/backend/cuda/cuda.h"
#include "mlx/backend/metal/metal.h"
#include "private.h"

namespace mlxc {

namespace {
thread_local std::string last_error;
}

void set_error(const std::string& msg) {
  last_error = msg;
}

mx::Dtype to_dtype(mlx_dtype d) {
  switch (d) {
    case MLX_BOOL: return mx::bool_;
    case MLX_UINT8: return mx::uint8;
    case MLX_UINT16: return mx::uint16;
    case MLX_UINT32: return mx::uint32;
    case MLX_UINT64: return mx::uint64;
    case MLX_INT8: return mx::int8;
    case MLX_INT16: return mx::int16;
    case MLX_INT32: return mx::int32;
    case MLX_INT64: return mx::int64;
    case MLX_FLOAT16: return mx::float16;
    case MLX_FLOAT32: return mx::float32;
    case MLX_FLOAT64: return mx::float64;
    case MLX_BFLOAT16: return mx::bfloat16;
    case MLX_COMPLEX64: return mx::complex64;
  }
  throw std::invalid_argument("unknown mlx_dtype " + std::to_string(static_cast<int>(d)));
}

mlx_dtype from_dtype(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return MLX_BOOL;
    case mx::Dtype::Val::uint8: return MLX_UINT8;
    case mx::Dtype::Val::uint16: return MLX_UINT16;
    case mx::Dtype::Val::uint32: return MLX_UINT32;
    case mx::Dtype::Val::uint64: return MLX_UINT64;
    case mx::Dtype::Val::int8: return MLX_INT8;
    case mx::Dtype::Val::int16: return MLX_INT16;
    case mx::Dtype::Val::int32: return MLX_INT32;
    case mx::Dtype::Val::int64: return MLX_INT64;
    case mx::Dtype::Val::float16: return MLX_FLOAT16;
    case mx::Dtype::Val::float32: return MLX_FLOAT32;
    case mx::Dtype::Val::float64: return MLX_FLOAT64;
    case mx::Dtype::Val::bfloat16: return MLX_BFLOAT16;
    case mx::Dtype::Val::complex64: return MLX_COMPLEX64;
  }
  return MLX_FLOAT32;
}

mx::Shape to_shape(const int* shape, size_t n) {
  if (n > 0 && !shape) throw std::invalid_argument("null shape pointer");
  return mx::Shape(shape, shape + n);
}

}  // namespace mlxc

using namespace mlxc;

extern "C" {

const char* mlx_last_error_message(void) {
  return last_error.c_str();
}
void mlx_clear_last_error(void) {
  last_error.clear();
}

mlx_string mlx_string_new(void) {
  return {nullptr};
}
mlx_string mlx_string_new_data(const char* str) {
  mlx_string s{nullptr};
  guard([&] { s.ctx = new std::string(str ? str : ""); });
  return s;
}
const char* mlx_string_data(mlx_string str) {
  return str.ctx ? static_cast<std::string*>(str.ctx)->c_str() : "";
}
int mlx_string_free(mlx_string str) {
  delete static_cast<std::string*>(str.ctx);
  return 0;
}
int mlx_version(mlx_string* str_) {
  return guard([&] {
    if (!str_) throw std::invalid_argument("null result pointer");
    delete static_cast<std::string*>(str_->ctx);
    str_->ctx = new std::string(mx::version());
  });
}

mlx_vector_string mlx_vector_string_new(void) {
  mlx_vector_string v{nullptr};
  guard([&] { v.ctx = new std::vector<std::string>(); });
  return v;
}
int mlx_vector_string_free(mlx_vector_string v) {
  delete static_cast<std::vector<std::string>*>(v.ctx);
  return 0;
}
int mlx_vector_string_append_value(mlx_vector_string v, const char* val) {
  return guard([&] { strings(v).emplace_back(val ? val : ""); });
}
size_t mlx_vector_string_size(mlx_vector_string v) {
  return v.ctx ? strings(v).size() : 0;
}
int mlx_vector_string_get(char** res, const mlx_vector_string v, size_t idx) {
  return guard([&] {
    if (!res) throw std::invalid_argument("null result pointer");
    *res = strings(v).at(idx).data();
  });
}

size_t mlx_dtype_size(mlx_dtype dtype) {
  size_t n = 0;
  guard([&] { n = to_dtype(dtype).size(); });
  return n;
}

mlx_device mlx_device_new(void) {
  return {nullptr};
}
mlx_device mlx_device_new_type(mlx_device_type type, int index) {
  mlx_device d{nullptr};
  guard([&] {
    d.ctx = new mx::Device(type == MLX_CPU ? mx::Device::cpu : mx::Device::gpu, index);
  });
  return d;
}
int mlx_device_free(mlx_device dev) {
  delete static_cast<mx::Device*>(dev.ctx);
  return 0;
}
int mlx_device_get_type(mlx_device_type* type, mlx_device dev) {
  return guard([&] { *type = device(dev).type == mx::Device::cpu ? MLX_CPU : MLX_GPU; });
}
int mlx_get_default_device(mlx_device* dev) {
  return guard([&] {
    delete static_cast<mx::Device*>(dev->ctx);
    dev->ctx = new mx::Device(mx::default_device());
  });
}
int mlx_device_is_available(bool* avail, mlx_device dev) {
  return guard([&] { *avail = mx::is_available(device(dev)); });
}

mlx_stream mlx_stream_new(void) {
  return {nullptr};
}
mlx_stream mlx_stream_new_device(mlx_device dev) {
  mlx_stream s{nullptr};
  guard([&] { s.ctx = new mx::Stream(mx::new_stream(device(dev))); });
  return s;
}
int mlx_stream_free(mlx_stream s) {
  delete static_cast<mx::Stream*>(s.ctx);
  return 0;
}
int mlx_stream_set(mlx_stream* out, const mlx_stream src) {
  return guard([&] {
    auto st = stream(src);
    delete static_cast<mx::Stream*>(out->ctx);
    out->ctx = new mx::Stream(st);
  });
}
int mlx_stream_get_device(mlx_device* dev, mlx_stream s) {
  return guard([&] {
    auto d = stream(s).device;
    delete static_cast<mx::Device*>(dev->ctx);
    dev->ctx = new mx::Device(d);
  });
}
int mlx_stream_get_index(int* index, mlx_stream s) {
  return guard([&] { *index = stream(s).index; });
}
int mlx_get_default_stream(mlx_stream* out, mlx_device dev) {
  return guard([&] {
    auto st = mx::default_stream(device(dev));
    delete static_cast<mx::Stream*>(out->ctx);
    out->ctx = new mx::Stream(st);
  });
}
mlx_stream mlx_default_cpu_stream_new(void) {
  mlx_stream s{nullptr};
  guard([&] { s.ctx = new mx::Stream(mx::default_stream(mx::Device::cpu)); });
  return s;
}
mlx_stream mlx_default_gpu_stream_new(void) {
  mlx_stream s{nullptr};
  guard([&] { s.ctx = new mx::Stream(mx::default_stream(mx::Device::gpu)); });
  return s;
}
int mlx_synchronize(mlx_stream s) {
  return guard([&] { mx::synchronize(stream(s)); });
}
const char* mlx_gpu_backend_name(void) {
  if (mx::metal::is_available()) return "metal";
  if (mx::cu::is_available()) return "cuda";
  return "none";
}

mlx_array mlx_array_new(void) {
  return {nullptr};
}
int mlx_array_free(mlx_array a) {
  delete static_cast<mx::array*>(a.ctx);
  return 0;
}
int mlx_array_set(mlx_array* a, const mlx_array src) {
  return guard([&] { set_array(a, arr(src)); });
}
mlx_array mlx_array_new_data(const void* data, const int* shape, int dim, mlx_dtype dtype) {
  mlx_array a{nullptr};
  guard([&] {
    if (dim < 0) throw std::invalid_argument("negative number of dimensions");
    auto s = to_shape(shape, static_cast<size_t>(dim));
    auto dt = to_dtype(dtype);
    size_t count = 1;
    for (auto v : s) {
      if (v < 0) throw std::invalid_argument("negative dimension in shape");
      count *= static_cast<size_t>(v);
    }
    // Allocate through MLX and copy, so the array owns its buffer.
    mx::array out(mx::allocator::malloc(count * dt.size()), s, dt);
    if (count > 0) {
      if (!data) throw std::invalid_argument("null data pointer");
      std::memcpy(out.data<uint8_t>(), data, count * dt.size());
    }
    a.ctx = new mx::array(std::move(out));
  });
  return a;
}
mlx_array mlx_array_new_float(float val) {
  mlx_array a{nullptr};
  guard([&] { a.ctx = new mx::array(val); });
  return a;
}
mlx_array mlx_array_new_int(int val) {
  mlx_array a{nullptr};
  guard([&] { a.ctx = new mx::array(val); });
  return a;
}
size_t mlx_array_itemsize(const mlx_array a) {
  return a.ctx ? arr(a).itemsize() : 0;
}
size_t mlx_array_size(const mlx_array a) {
  return a.ctx ? arr(a).size() : 0;
}
size_t mlx_array_nbytes(const mlx_array a) {
  return a.ctx ? arr(a).nbytes() : 0;
}
size_t mlx_array_ndim(const mlx_array a) {
  return a.ctx ? arr(a).ndim() : 0;
}
const int* mlx_array_shape(const mlx_array a) {
  return a.ctx ? arr(a).shape().data() : nullptr;
}
mlx_dtype mlx_array_dtype(const mlx_array a) {
  return a.ctx ? from_dtype(arr(a).dtype()) : MLX_FLOAT32;
}
int mlx_array_eval(mlx_array a) {
  return guard([&] { arr(a).eval(); });
}
const void* mlx_array_data_raw(const mlx_array a) {
  const void* p = nullptr;
  guard([&] {
    auto& x = arr(a);
    if (!x.is_available()) throw std::runtime_error("array is not evaluated");
    p = x.data<uint8_t>();
  });
  return p;
}
int mlx_array_is_row_contiguous(bool* res, const mlx_array a) {
  return guard([&] { *res = arr(a).flags().row_contiguous; });
}
int mlx_array_tostring(mlx_string* str, const mlx_array a) {
  return guard([&] {
    std::ostringstream os;
    os << arr(a);
    delete static_cast<std::string*>(str->ctx);
    str->ctx = new std::string(os.str());
  });
}

mlx_vector_array mlx_vector_array_new(void) {
  mlx_vector_array v{nullptr};
  guard([&] { v.ctx = new std::vector<mx::array>(); });
  return v;
}
mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t size) {
  mlx_vector_array v{nullptr};
  guard([&] {
    auto out = std::make_unique<std::vector<mx::array>>();
    for (size_t i = 0; i < size; ++i) out->push_back(arr(data[i]));
    v.ctx = out.release();
  });
  return v;
}
int mlx_vector_array_free(mlx_vector_array v) {
  delete static_cast<std::vector<mx::array>*>(v.ctx);
  return 0;
}
int mlx_vector_array_append_value(mlx_vector_array v, const mlx_array val) {
  return guard([&] { vec(v).push_back(arr(val)); });
}
size_t mlx_vector_array_size(mlx_vector_array v) {
  return v.ctx ? vec(v).size() : 0;
}
int mlx_vector_array_get(mlx_array* res, const mlx_vector_array v, size_t idx) {
  return guard([&] { set_array(res, vec(v).at(idx)); });
}
int mlx_eval(const mlx_vector_array outputs) {
  return guard([&] { mx::eval(vec(outputs)); });
}
int mlx_async_eval(const mlx_vector_array outputs) {
  return guard([&] { mx::async_eval(vec(outputs)); });
}

int mlx_get_active_memory(size_t* res) {
  return guard([&] { *res = mx::get_active_memory(); });
}
int mlx_get_peak_memory(size_t* res) {
  return guard([&] { *res = mx::get_peak_memory(); });
}
int mlx_reset_peak_memory(void) {
  return guard([&] { mx::reset_peak_memory(); });
}
int mlx_clear_cache(void) {
  return guard([&] { mx::clear_cache(); });
}

}  // extern "C"
