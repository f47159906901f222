template <typename T>
[[kernel]] void custom_kernel_some_attributes__float16_t_float16_t_float16_t(
  const device float16_t* x [[buffer(0)]],
  device float16_t* out [[buffer(1)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint thread_index_in_threadgroup [[thread_index_in_threadgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]],
  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {
uint lid = thread_index_in_threadgroup;
uint gid = threadgroup_position_in_grid.x * threads_per_threadgroup.x + lid;
out[gid] = x[gid] + T(simdgroup_index_in_threadgroup);

}

template [[host_name("custom_kernel_some_attributes__float16_t_float16_t_float16_t")]] [[kernel]] decltype(custom_kernel_some_attributes__float16_t_float16_t_float16_t<float16_t>) custom_kernel_some_attributes__float16_t_float16_t_float16_t<float16_t>;
