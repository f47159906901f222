[[kernel]] void custom_kernel_no_template_args_float_float_float(
  const device float* x [[buffer(0)]],
  const device float* y [[buffer(1)]],
  device float* out [[buffer(2)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
uint i = thread_position_in_grid.x;
out[i] = x[i] + y[i];
}
