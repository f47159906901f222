[[kernel]] void custom_kernel_two_outputs_no_attribute_float_float_float(
  const device float* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  device float* a [[buffer(2)]]) {
  device float* b [[buffer(3)]]) {
a[0] = x[0] + float(x_shape[0]);
b[0] = x[1];

}
