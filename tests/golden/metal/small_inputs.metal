template <typename T>
[[kernel]] void custom_kernel_small_inputs__float_floatc_float_int32_tc_uint8_tc_float(
  const constant float* a [[buffer(0)]],
  const device float* b [[buffer(1)]],
  const constant int32_t* c [[buffer(2)]],
  const constant uint8_t* d [[buffer(3)]],
  device float* out [[buffer(4)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
uint i = thread_position_in_grid.x;
out[i] = a[i % 7] + b[i] + T(c[0]);

}

template [[host_name("custom_kernel_small_inputs__float_floatc_float_int32_tc_uint8_tc_float")]] [[kernel]] decltype(custom_kernel_small_inputs__float_floatc_float_int32_tc_uint8_tc_float<float>) custom_kernel_small_inputs__float_floatc_float_int32_tc_uint8_tc_float<float>;
