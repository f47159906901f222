template <typename T>
[[kernel]] void custom_kernel_atomic_outputs__uint32_t_uint32_t_uint32_t_float(
  const device uint32_t* x [[buffer(0)]],
  device atomic<uint32_t>* count [[buffer(1)]],
  device atomic<float>* total [[buffer(2)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
uint i = thread_position_in_grid.x;
atomic_fetch_add_explicit(count, x[i], memory_order_relaxed);
atomic_fetch_add_explicit(total, float(x[i]), memory_order_relaxed);

}

template [[host_name("custom_kernel_atomic_outputs__uint32_t_uint32_t_uint32_t_float")]] [[kernel]] decltype(custom_kernel_atomic_outputs__uint32_t_uint32_t_uint32_t_float<uint32_t>) custom_kernel_atomic_outputs__uint32_t_uint32_t_uint32_t_float<uint32_t>;
