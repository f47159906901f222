// helpers shared by the kernel
template <typename T>
inline T twice(T v) {
  return v + v;
}
