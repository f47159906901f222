// MLX's custom GPU kernels: fast::metal_kernel and fast::cuda_kernel.
//
// A kernel object holds MLX's CustomKernelFunction; a config collects what one
// call needs (output shapes and dtypes, grid, threadgroup, template
// arguments). Template arguments go through MLX's own TemplateArg variant, so
// MLX writes them into the source; nothing here splices strings.
#include "cuda_disk_cache.h"
#include "private.h"

namespace {

using namespace mlxc;

struct KernelConfig {
  std::vector<mx::Shape> output_shapes;
  std::vector<mx::Dtype> output_dtypes;
  std::tuple<int, int, int> grid{1, 1, 1};
  std::tuple<int, int, int> thread_group{1, 1, 1};
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> template_args;
  std::optional<float> init_value;
  bool verbose = false;
};

KernelConfig& config(void* ctx) {
  if (!ctx) throw std::invalid_argument("null kernel config handle");
  return *static_cast<KernelConfig*>(ctx);
}

mx::fast::CustomKernelFunction& kernel(void* ctx) {
  if (!ctx) throw std::invalid_argument("null kernel handle");
  return *static_cast<mx::fast::CustomKernelFunction*>(ctx);
}

// What MLX's generated source depends on besides the kernel: template
// arguments, input and output dtypes, which inputs are scalars.
std::string source_key(const void* k, const KernelConfig& c, const std::vector<mx::array>& inputs) {
  std::string key = std::to_string(reinterpret_cast<uintptr_t>(k));
  for (const auto& [name, arg] : c.template_args) {
    key += '|' + name + '=';
    if (auto* i = std::get_if<int>(&arg)) key += std::to_string(*i);
    else if (auto* b = std::get_if<bool>(&arg)) key += *b ? 't' : 'f';
    else key += std::to_string(static_cast<int>(std::get<mx::Dtype>(arg).val()));
  }
  for (const auto& a : inputs) key += ",i" + std::to_string(static_cast<int>(a.dtype().val())) + (a.ndim() ? "" : "s");
  for (const auto& d : c.output_dtypes) key += ",o" + std::to_string(static_cast<int>(d.val()));
  return key;
}

int apply(mlx_vector_array* outputs, void* k, mlx_vector_array inputs, void* cfg, mlx_stream s, bool cuda) {
  return guard([&] {
    auto& c = config(cfg);
    auto outs = kernel(k)(vec(inputs), c.output_shapes, c.output_dtypes, c.grid, c.thread_group,
                          c.template_args, c.init_value, c.verbose, stream(s));
    if (cuda) keep_cuda_kernel_on_disk(source_key(k, c, vec(inputs)), outs[0]);
    set_vector(outputs, std::move(outs));
  });
}

}  // namespace

extern "C" {

// The two back-ends share one config layout; the functions differ only by name.
#define MLXC_KERNEL_CONFIG(PREFIX, TYPE)                                                               \
  TYPE PREFIX##_new(void) {                                                                            \
    TYPE c{nullptr};                                                                                   \
    guard([&] { c.ctx = new KernelConfig(); });                                                        \
    return c;                                                                                          \
  }                                                                                                    \
  void PREFIX##_free(TYPE cls) {                                                                       \
    delete static_cast<KernelConfig*>(cls.ctx);                                                        \
  }                                                                                                    \
  int PREFIX##_add_output_arg(TYPE cls, const int* shape, size_t size, mlx_dtype dtype) {              \
    return guard([&] {                                                                                 \
      config(cls.ctx).output_shapes.push_back(to_shape(shape, size));                                  \
      config(cls.ctx).output_dtypes.push_back(to_dtype(dtype));                                        \
    });                                                                                                \
  }                                                                                                    \
  int PREFIX##_set_grid(TYPE cls, int g1, int g2, int g3) {                                            \
    return guard([&] { config(cls.ctx).grid = {g1, g2, g3}; });                                        \
  }                                                                                                    \
  int PREFIX##_set_thread_group(TYPE cls, int t1, int t2, int t3) {                                    \
    return guard([&] { config(cls.ctx).thread_group = {t1, t2, t3}; });                                \
  }                                                                                                    \
  int PREFIX##_set_init_value(TYPE cls, float value) {                                                 \
    return guard([&] { config(cls.ctx).init_value = value; });                                         \
  }                                                                                                    \
  int PREFIX##_set_verbose(TYPE cls, bool verbose) {                                                   \
    return guard([&] { config(cls.ctx).verbose = verbose; });                                          \
  }                                                                                                    \
  int PREFIX##_add_template_arg_dtype(TYPE cls, const char* name, mlx_dtype dtype) {                   \
    return guard([&] { config(cls.ctx).template_args.emplace_back(name, to_dtype(dtype)); });          \
  }                                                                                                    \
  int PREFIX##_add_template_arg_int(TYPE cls, const char* name, int value) {                           \
    return guard([&] { config(cls.ctx).template_args.emplace_back(name, value); });                    \
  }                                                                                                    \
  int PREFIX##_add_template_arg_bool(TYPE cls, const char* name, bool value) {                         \
    return guard([&] { config(cls.ctx).template_args.emplace_back(name, value); });                    \
  }

MLXC_KERNEL_CONFIG(mlx_fast_metal_kernel_config, mlx_fast_metal_kernel_config)
MLXC_KERNEL_CONFIG(mlx_fast_cuda_kernel_config, mlx_fast_cuda_kernel_config)
#undef MLXC_KERNEL_CONFIG

mlx_fast_metal_kernel mlx_fast_metal_kernel_new(const char* name, const mlx_vector_string input_names,
                                                const mlx_vector_string output_names, const char* source,
                                                const char* header, bool ensure_row_contiguous,
                                                bool atomic_outputs) {
  mlx_fast_metal_kernel k{nullptr};
  guard([&] {
    k.ctx = new mx::fast::CustomKernelFunction(mx::fast::metal_kernel(
        name, strings(input_names), strings(output_names), source, header ? header : "",
        ensure_row_contiguous, atomic_outputs));
  });
  return k;
}
void mlx_fast_metal_kernel_free(mlx_fast_metal_kernel cls) {
  delete static_cast<mx::fast::CustomKernelFunction*>(cls.ctx);
}
int mlx_fast_metal_kernel_apply(mlx_vector_array* outputs, mlx_fast_metal_kernel cls,
                                const mlx_vector_array inputs, const mlx_fast_metal_kernel_config config,
                                const mlx_stream stream) {
  return apply(outputs, cls.ctx, inputs, config.ctx, stream, false);
}

mlx_fast_cuda_kernel mlx_fast_cuda_kernel_new(const char* name, const mlx_vector_string input_names,
                                              const mlx_vector_string output_names, const char* source,
                                              const char* header, bool ensure_row_contiguous, int shared_memory) {
  mlx_fast_cuda_kernel k{nullptr};
  guard([&] {
    k.ctx = new mx::fast::CustomKernelFunction(mx::fast::cuda_kernel(
        name, strings(input_names), strings(output_names), source, header ? header : "",
        ensure_row_contiguous, shared_memory));
  });
  return k;
}
void mlx_fast_cuda_kernel_free(mlx_fast_cuda_kernel cls) {
  delete static_cast<mx::fast::CustomKernelFunction*>(cls.ctx);
}
int mlx_fast_cuda_kernel_apply(mlx_vector_array* outputs, mlx_fast_cuda_kernel cls,
                               const mlx_vector_array inputs, const mlx_fast_cuda_kernel_config config,
                               const mlx_stream stream) {
  return apply(outputs, cls.ctx, inputs, config.ctx, stream, true);
}

}  // extern "C"
