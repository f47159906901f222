template <typename T>
[[kernel]] void custom_kernel_scalar_input__float_float_floats_float(
  const device float* x [[buffer(0)]],
  const constant float& s [[buffer(1)]],
  device float* out [[buffer(2)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
// s_shape is never emitted: s is 0-d and passed by reference.
uint i = thread_position_in_grid.x;
out[i] = x[i] * s;

}

template [[host_name("custom_kernel_scalar_input__float_float_floats_float")]] [[kernel]] decltype(custom_kernel_scalar_input__float_float_floats_float<float>) custom_kernel_scalar_input__float_float_floats_float<float>;
