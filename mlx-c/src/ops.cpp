// The MLX operations the reference graphs and the safe wrapper use.
#include "private.h"

using namespace mlxc;

extern "C" {

#define MLXC_BINARY(NAME, FN)                                                          \
  int NAME(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s) { \
    return guard([&] { set_array(res, mx::FN(arr(a), arr(b), stream(s))); });         \
  }
MLXC_BINARY(mlx_add, add)
MLXC_BINARY(mlx_subtract, subtract)
MLXC_BINARY(mlx_multiply, multiply)
MLXC_BINARY(mlx_divide, divide)
MLXC_BINARY(mlx_bitwise_and, bitwise_and)
MLXC_BINARY(mlx_bitwise_or, bitwise_or)
MLXC_BINARY(mlx_left_shift, left_shift)
MLXC_BINARY(mlx_right_shift, right_shift)
#undef MLXC_BINARY

int mlx_square(mlx_array* res, const mlx_array a, const mlx_stream s) {
  return guard([&] { set_array(res, mx::square(arr(a), stream(s))); });
}
int mlx_astype(mlx_array* res, const mlx_array a, mlx_dtype dtype, const mlx_stream s) {
  return guard([&] { set_array(res, mx::astype(arr(a), to_dtype(dtype), stream(s))); });
}
int mlx_reshape(mlx_array* res, const mlx_array a, const int* shape, size_t shape_num, const mlx_stream s) {
  return guard([&] { set_array(res, mx::reshape(arr(a), to_shape(shape, shape_num), stream(s))); });
}
int mlx_broadcast_to(mlx_array* res, const mlx_array a, const int* shape, size_t shape_num, const mlx_stream s) {
  return guard([&] { set_array(res, mx::broadcast_to(arr(a), to_shape(shape, shape_num), stream(s))); });
}
int mlx_expand_dims(mlx_array* res, const mlx_array a, int axis, const mlx_stream s) {
  return guard([&] { set_array(res, mx::expand_dims(arr(a), axis, stream(s))); });
}
int mlx_contiguous(mlx_array* res, const mlx_array a, bool allow_col_major, const mlx_stream s) {
  return guard([&] { set_array(res, mx::contiguous(arr(a), allow_col_major, stream(s))); });
}
int mlx_transpose(mlx_array* res, const mlx_array a, const int* axes, size_t axes_num, const mlx_stream s) {
  return guard([&] {
    std::vector<int> ax(axes, axes + axes_num);
    set_array(res, mx::transpose(arr(a), ax, stream(s)));
  });
}
int mlx_sum_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s) {
  return guard([&] { set_array(res, mx::sum(arr(a), std::vector<int>{axis}, keepdims, stream(s))); });
}
int mlx_argmin_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s) {
  return guard([&] { set_array(res, mx::argmin(arr(a), axis, keepdims, stream(s))); });
}
int mlx_arange(mlx_array* res, double start, double stop, double step, mlx_dtype dtype, const mlx_stream s) {
  return guard([&] { set_array(res, mx::arange(start, stop, step, to_dtype(dtype), stream(s))); });
}
int mlx_zeros(mlx_array* res, const int* shape, size_t shape_num, mlx_dtype dtype, const mlx_stream s) {
  return guard([&] { set_array(res, mx::zeros(to_shape(shape, shape_num), to_dtype(dtype), stream(s))); });
}
int mlx_concatenate_axis(mlx_array* res, const mlx_vector_array arrays, int axis, const mlx_stream s) {
  return guard([&] { set_array(res, mx::concatenate(vec(arrays), axis, stream(s))); });
}
int mlx_slice(mlx_array* res, const mlx_array a, const int* start, size_t start_num, const int* stop,
              size_t stop_num, const int* strides, size_t strides_num, const mlx_stream s) {
  return guard([&] {
    set_array(res, mx::slice(arr(a), to_shape(start, start_num), to_shape(stop, stop_num),
                             to_shape(strides, strides_num), stream(s)));
  });
}
int mlx_pad(mlx_array* res, const mlx_array a, const int* axes, size_t axes_num, const int* low_pad_size,
            size_t low_pad_size_num, const int* high_pad_size, size_t high_pad_size_num,
            const mlx_array pad_value, const char* mode, const mlx_stream s) {
  return guard([&] {
    std::vector<int> ax(axes, axes + axes_num);
    set_array(res, mx::pad(arr(a), ax, to_shape(low_pad_size, low_pad_size_num),
                           to_shape(high_pad_size, high_pad_size_num), arr(pad_value),
                           mode ? mode : "constant", stream(s)));
  });
}
int mlx_take_axis(mlx_array* res, const mlx_array a, const mlx_array indices, int axis, const mlx_stream s) {
  return guard([&] { set_array(res, mx::take(arr(a), arr(indices), axis, stream(s))); });
}
int mlx_softmax_axis(mlx_array* res, const mlx_array a, int axis, bool precise, const mlx_stream s) {
  return guard([&] { set_array(res, mx::softmax(arr(a), std::vector<int>{axis}, precise, stream(s))); });
}
int mlx_slice_update(mlx_array* res, const mlx_array src, const mlx_array update, const int* start, size_t start_num,
                     const int* stop, size_t stop_num, const int* strides, size_t strides_num, const mlx_stream s) {
  return guard([&] {
    set_array(res, mx::slice_update(arr(src), arr(update), to_shape(start, start_num), to_shape(stop, stop_num),
                                    to_shape(strides, strides_num), stream(s)));
  });
}
int mlx_fast_scaled_dot_product_attention(mlx_array* res, const mlx_array queries, const mlx_array keys,
                                          const mlx_array values, float scale, const char* mask_mode,
                                          const mlx_array mask_arr, const mlx_array sinks, const mlx_stream s) {
  return guard([&] {
    std::optional<mx::array> mask;
    if (mask_arr.ctx) mask = arr(mask_arr);
    std::optional<mx::array> sk;
    if (sinks.ctx) sk = arr(sinks);
    set_array(res, mx::fast::scaled_dot_product_attention(arr(queries), arr(keys), arr(values), scale,
                                                          mask_mode ? mask_mode : "", mask, sk, false, stream(s)));
  });
}
int mlx_array_equal(mlx_array* res, const mlx_array a, const mlx_array b, bool equal_nan, const mlx_stream s) {
  return guard([&] { set_array(res, mx::array_equal(arr(a), arr(b), equal_nan, stream(s))); });
}

/* Used by the quantizer kernels' reference graphs. */
#define MLXC_BINARY(NAME, FN)                                                          \
  int NAME(mlx_array* res, const mlx_array a, const mlx_array b, const mlx_stream s) { \
    return guard([&] { set_array(res, mx::FN(arr(a), arr(b), stream(s))); });         \
  }
MLXC_BINARY(mlx_greater, greater)
MLXC_BINARY(mlx_greater_equal, greater_equal)
MLXC_BINARY(mlx_maximum, maximum)
MLXC_BINARY(mlx_minimum, minimum)
MLXC_BINARY(mlx_matmul, matmul)
MLXC_BINARY(mlx_take, take)
#undef MLXC_BINARY
int mlx_addmm(mlx_array* res, const mlx_array c, const mlx_array a, const mlx_array b, const mlx_stream s) {
  return guard([&] { set_array(res, mx::addmm(arr(c), arr(a), arr(b), 1.0f, 1.0f, stream(s))); });
}
int mlx_min_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s) {
  return guard([&] { set_array(res, mx::min(arr(a), std::vector<int>{axis}, keepdims, stream(s))); });
}
int mlx_max_axis(mlx_array* res, const mlx_array a, int axis, bool keepdims, const mlx_stream s) {
  return guard([&] { set_array(res, mx::max(arr(a), std::vector<int>{axis}, keepdims, stream(s))); });
}
int mlx_round(mlx_array* res, const mlx_array a, int decimals, const mlx_stream s) {
  return guard([&] { set_array(res, mx::round(arr(a), decimals, stream(s))); });
}
int mlx_sqrt(mlx_array* res, const mlx_array a, const mlx_stream s) {
  return guard([&] { set_array(res, mx::sqrt(arr(a), stream(s))); });
}
int mlx_where(mlx_array* res, const mlx_array condition, const mlx_array x, const mlx_array y, const mlx_stream s) {
  return guard([&] { set_array(res, mx::where(arr(condition), arr(x), arr(y), stream(s))); });
}

}  // extern "C"
