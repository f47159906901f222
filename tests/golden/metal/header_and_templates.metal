// helpers shared by the kernel
template <typename T>
inline T twice(T v) {
  return v + v;
}
template <typename T, int N, bool FLAG, typename U>
[[kernel]] void custom_kernel_header_and_templates__bfloat16_t__7_1_int64_t_bfloat16_t_int64_t_bfloat16_t_bool(
  const device bfloat16_t* x [[buffer(0)]],
  const device int64_t* w [[buffer(1)]],
  device bfloat16_t* out [[buffer(2)]],
  device bool* flag [[buffer(3)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
uint i = thread_position_in_grid.x;
out[i] = twice(x[i]) + T(float(N) * float(w[i]));
flag[i] = FLAG;

}

template [[host_name("custom_kernel_header_and_templates__bfloat16_t__7_1_int64_t_bfloat16_t_int64_t_bfloat16_t_bool")]] [[kernel]] decltype(custom_kernel_header_and_templates__bfloat16_t__7_1_int64_t_bfloat16_t_int64_t_bfloat16_t_bool<bfloat16_t, -7, 1, int64_t>) custom_kernel_header_and_templates__bfloat16_t__7_1_int64_t_bfloat16_t_int64_t_bfloat16_t_bool<bfloat16_t, -7, 1, int64_t>;
