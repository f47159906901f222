/* The project's C ABI over MLX's C++ API.
 *
 * Conventions follow upstream mlx-c: opaque handles `{ void* ctx }` passed by
 * value, `_new` / `_free` pairs, results through the first out-parameter, an
 * `int` status from every fallible call (0 = success). Unlike upstream there
 * is no process-wide error handler: a failed call stores MLX's message in a
 * thread-local slot that `mlx_last_error_message` returns, and nothing ever
 * exits or aborts the process. Exceptions never cross this boundary.
 *
 * Where upstream has a function, it has the same name and signature here.
 */
#ifndef MLXC_MLXC_H
#define MLXC_MLXC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ------------------------------------------------------------ */

/* The message of the last failed call on this thread ("" if none). */
const char* mlx_last_error_message(void);
void mlx_clear_last_error(void);

/* ---- strings and versions ------------------------------------------------ */

typedef struct mlx_string_ {
  void* ctx;
} mlx_string;
mlx_string mlx_string_new(void);
mlx_string mlx_string_new_data(const char* str);
const char* mlx_string_data(mlx_string str);
int mlx_string_free(mlx_string str);

/* The version of the libmlx that is loaded at run time. */
int mlx_version(mlx_string* str_);

typedef struct mlx_vector_string_ {
  void* ctx;
} mlx_vector_string;
mlx_vector_string mlx_vector_string_new(void);
int mlx_vector_string_free(mlx_vector_string vec);
int mlx_vector_string_append_value(mlx_vector_string vec, const char* val);
size_t mlx_vector_string_size(mlx_vector_string vec);
/* `*res` points into the vector's storage, valid until the vector changes. */
int mlx_vector_string_get(char** res, const mlx_vector_string vec, size_t idx);

/* ---- dtypes ------------------------------------------------------------ */

typedef enum mlx_dtype_ {
  MLX_BOOL,
  MLX_UINT8,
  MLX_UINT16,
  MLX_UINT32,
  MLX_UINT64,
  MLX_INT8,
  MLX_INT16,
  MLX_INT32,
  MLX_INT64,
  MLX_FLOAT16,
  MLX_FLOAT32,
  MLX_FLOAT64,
  MLX_BFLOAT16,
  MLX_COMPLEX64,
} mlx_dtype;
size_t mlx_dtype_size(mlx_dtype dtype);

/* ---- devices and streams ------------------------------------------------ */

typedef enum mlx_device_type_ { MLX_CPU, MLX_GPU } mlx_device_type;

typedef struct mlx_device_ {
  void* ctx;
} mlx_device;
mlx_device mlx_device_new(void);
mlx_device mlx_device_new_type(mlx_device_type type, int index);
int mlx_device_free(mlx_device dev);
int mlx_device_get_type(mlx_device_type* type, mlx_device dev);
int mlx_get_default_device(mlx_device* dev);
int mlx_device_is_available(bool* avail, mlx_device dev);

typedef struct mlx_stream_ {
  void* ctx;
} mlx_stream;
mlx_stream mlx_stream_new(void);
mlx_stream mlx_stream_new_device(mlx_device dev);
int mlx_stream_free(mlx_stream stream);
int mlx_stream_set(mlx_stream* stream, const mlx_stream src);
int mlx_stream_get_device(mlx_device* dev, mlx_stream stream);
int mlx_stream_get_index(int* index, mlx_stream stream);
int mlx_get_default_stream(mlx_stream* stream, mlx_device dev);
mlx_stream mlx_default_cpu_stream_new(void);
mlx_stream mlx_default_gpu_stream_new(void);
int mlx_synchronize(mlx_stream stream);

/* The GPU back-end compiled into the loaded libmlx: "metal", "cuda" or "none". */
const char* mlx_gpu_backend_name(void);

/* ---- arrays ------------------------------------------------------------- */

typedef struct mlx_array_ {
  void* ctx;
} mlx_array;
mlx_array mlx_array_new(void);
int mlx_array_free(mlx_array arr);
int mlx_array_set(mlx_array* arr, const mlx_array src);
/* Copies `data` (row-major, `dim` dimensions). NULL with a recorded error on failure. */
mlx_array mlx_array_new_data(const void* data, const int* shape, int dim, mlx_dtype dtype);
mlx_array mlx_array_new_float(float val);
mlx_array mlx_array_new_int(int val);

size_t mlx_array_itemsize(const mlx_array arr);
size_t mlx_array_size(const mlx_array arr);
size_t mlx_array_nbytes(const mlx_array arr);
size_t mlx_array_ndim(const mlx_array arr);
const int* mlx_array_shape(const mlx_array arr);
mlx_dtype mlx_array_dtype(const mlx_array arr);
int mlx_array_eval(mlx_array arr);
/* Pointer to the first element of an evaluated array (offset applied). */
const void* mlx_array_data_raw(const mlx_array arr);
/* Whether an evaluated array is row-contiguous. */
int mlx_array_is_row_contiguous(bool* res, const mlx_array arr);
int mlx_array_tostring(mlx_string* str, const mlx_array arr);

typedef struct mlx_vector_array_ {
  void* ctx;
} mlx_vector_array;
mlx_vector_array mlx_vector_array_new(void);
mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t size);
int mlx_vector_array_free(mlx_vector_array vec);
int mlx_vector_array_append_value(mlx_vector_array vec, const mlx_array val);
size_t mlx_vector_array_size(mlx_vector_array vec);
int mlx_vector_array_get(mlx_array* res, const mlx_vector_array vec, size_t idx);
int mlx_eval(const mlx_vector_array outputs);
int mlx_async_eval(const mlx_vector_array outputs);

/* ---- memory ------------------------------------------------------------- */

int mlx_get_active_memory(size_t* res);
int mlx_get_peak_memory(size_t* res);
int mlx_reset_peak_memory(void);
int mlx_clear_cache(void);

/* ---- operations (the subset the reference graphs use) ------------------- */

int mlx_add(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_subtract(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_multiply(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_divide(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_square(mlx_array* res, const mlx_array a, const mlx_stream s);
int mlx_bitwise_and(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_bitwise_or(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_left_shift(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_right_shift(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_astype(mlx_array* res, const mlx_array a, mlx_dtype dtype, const mlx_stream s);
int mlx_reshape(mlx_array* res, const mlx_array a, const int* shape, size_t shape_num, const mlx_stream s);
int mlx_broadcast_to(mlx_array* res, const mlx_array a, const int* shape, size_t shape_num, const mlx_stream s);
int mlx_expand_dims(mlx_array* res, const mlx_array a, int axis, const mlx_stream s);
int mlx_contiguous(mlx_array* res, const mlx_array a, bool allow_col_major, const mlx_stream s);
int mlx_transpose(mlx_array* res, const mlx_array a, const int* axes, size_t axes_num, const mlx_stream s);
int mlx_sum_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s);
int mlx_argmin_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s);
int mlx_arange(mlx_array* res, double start, double stop, double step, mlx_dtype dtype, const mlx_stream s);
int mlx_zeros(mlx_array* res, const int* shape, size_t shape_num, mlx_dtype dtype, const mlx_stream s);
int mlx_concatenate_axis(mlx_array* res, const mlx_vector_array arrays, int axis, const mlx_stream s);
int mlx_slice(mlx_array* res, const mlx_array a, const int* start, size_t start_num, const int* stop,
              size_t stop_num, const int* strides, size_t strides_num, const mlx_stream s);
int mlx_pad(mlx_array* res, const mlx_array a, const int* axes, size_t axes_num, const int* low_pad_size,
            size_t low_pad_size_num, const int* high_pad_size, size_t high_pad_size_num,
            const mlx_array pad_value, const char* mode, const mlx_stream s);
int mlx_take_axis(mlx_array* res, const mlx_array a, const mlx_array indices, int axis, const mlx_stream s);
int mlx_softmax_axis(mlx_array* res, const mlx_array a, int axis, bool precise, const mlx_stream s);
int mlx_slice_update(mlx_array* res, const mlx_array src, const mlx_array update, const int* start, size_t start_num,
                     const int* stop, size_t stop_num, const int* strides, size_t strides_num, const mlx_stream s);
int mlx_array_equal(mlx_array* res, const mlx_array a, const mlx_array b, bool equal_nan, const mlx_stream s);
int mlx_greater(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_greater_equal(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_maximum(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_minimum(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_matmul(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_take(mlx_array* res, const mlx_array a, const mlx_array indices, const mlx_stream s);
/* c + a @ b in one matmul (c broadcast to the product's shape). */
int mlx_addmm(mlx_array* res, const mlx_array c, const mlx_array a, const mlx_array b, const mlx_stream s);
int mlx_min_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s);
int mlx_max_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s);
int mlx_round(mlx_array* res, const mlx_array a, int decimals, const mlx_stream s);
int mlx_sqrt(mlx_array* res, const mlx_array a, const mlx_stream s);
int mlx_where(mlx_array* res, const mlx_array condition, const mlx_array x, const mlx_array y, const mlx_stream s);

/* mask_mode: "" or "causal"; mask_arr may be an empty handle (ctx NULL). */
int mlx_fast_scaled_dot_product_attention(mlx_array* res, const mlx_array queries, const mlx_array keys,
                                          const mlx_array values, float scale, const char* mask_mode,
                                          const mlx_array mask_arr, const mlx_array sinks, const mlx_stream s);

/* ---- custom GPU kernels (MLX's fast::metal_kernel / fast::cuda_kernel) ---- */

typedef struct mlx_fast_metal_kernel_config_ {
  void* ctx;
} mlx_fast_metal_kernel_config;
mlx_fast_metal_kernel_config mlx_fast_metal_kernel_config_new(void);
void mlx_fast_metal_kernel_config_free(mlx_fast_metal_kernel_config cls);
int mlx_fast_metal_kernel_config_add_output_arg(mlx_fast_metal_kernel_config cls, const int* shape, size_t size,
                                                mlx_dtype dtype);
int mlx_fast_metal_kernel_config_set_grid(mlx_fast_metal_kernel_config cls, int grid1, int grid2, int grid3);
int mlx_fast_metal_kernel_config_set_thread_group(mlx_fast_metal_kernel_config cls, int thread1, int thread2,
                                                  int thread3);
int mlx_fast_metal_kernel_config_set_init_value(mlx_fast_metal_kernel_config cls, float value);
int mlx_fast_metal_kernel_config_set_verbose(mlx_fast_metal_kernel_config cls, bool verbose);
int mlx_fast_metal_kernel_config_add_template_arg_dtype(mlx_fast_metal_kernel_config cls, const char* name,
                                                        mlx_dtype dtype);
int mlx_fast_metal_kernel_config_add_template_arg_int(mlx_fast_metal_kernel_config cls, const char* name,
                                                      int value);
int mlx_fast_metal_kernel_config_add_template_arg_bool(mlx_fast_metal_kernel_config cls, const char* name,
                                                       bool value);

typedef struct mlx_fast_metal_kernel_ {
  void* ctx;
} mlx_fast_metal_kernel;
mlx_fast_metal_kernel mlx_fast_metal_kernel_new(const char* name, const mlx_vector_string input_names,
                                                const mlx_vector_string output_names, const char* source,
                                                const char* header, bool ensure_row_contiguous,
                                                bool atomic_outputs);
void mlx_fast_metal_kernel_free(mlx_fast_metal_kernel cls);
int mlx_fast_metal_kernel_apply(mlx_vector_array* outputs, mlx_fast_metal_kernel cls,
                                const mlx_vector_array inputs, const mlx_fast_metal_kernel_config config,
                                const mlx_stream stream);

typedef struct mlx_fast_cuda_kernel_config_ {
  void* ctx;
} mlx_fast_cuda_kernel_config;
mlx_fast_cuda_kernel_config mlx_fast_cuda_kernel_config_new(void);
void mlx_fast_cuda_kernel_config_free(mlx_fast_cuda_kernel_config cls);
int mlx_fast_cuda_kernel_config_add_output_arg(mlx_fast_cuda_kernel_config cls, const int* shape, size_t size,
                                               mlx_dtype dtype);
int mlx_fast_cuda_kernel_config_set_grid(mlx_fast_cuda_kernel_config cls, int grid1, int grid2, int grid3);
int mlx_fast_cuda_kernel_config_set_thread_group(mlx_fast_cuda_kernel_config cls, int thread1, int thread2,
                                                 int thread3);
int mlx_fast_cuda_kernel_config_set_init_value(mlx_fast_cuda_kernel_config cls, float value);
int mlx_fast_cuda_kernel_config_set_verbose(mlx_fast_cuda_kernel_config cls, bool verbose);
int mlx_fast_cuda_kernel_config_add_template_arg_dtype(mlx_fast_cuda_kernel_config cls, const char* name,
                                                       mlx_dtype dtype);
int mlx_fast_cuda_kernel_config_add_template_arg_int(mlx_fast_cuda_kernel_config cls, const char* name,
                                                     int value);
int mlx_fast_cuda_kernel_config_add_template_arg_bool(mlx_fast_cuda_kernel_config cls, const char* name,
                                                      bool value);

typedef struct mlx_fast_cuda_kernel_ {
  void* ctx;
} mlx_fast_cuda_kernel;
mlx_fast_cuda_kernel mlx_fast_cuda_kernel_new(const char* name, const mlx_vector_string input_names,
                                              const mlx_vector_string output_names, const char* source,
                                              const char* header, bool ensure_row_contiguous, int shared_memory);
void mlx_fast_cuda_kernel_free(mlx_fast_cuda_kernel cls);
int mlx_fast_cuda_kernel_apply(mlx_vector_array* outputs, mlx_fast_cuda_kernel cls,
                               const mlx_vector_array inputs, const mlx_fast_cuda_kernel_config config,
                               const mlx_stream stream);

#ifdef __cplusplus
}
#endif

#endif
