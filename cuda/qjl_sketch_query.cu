// qjl_sketch_query: q T [Q, D], sketch float [m, D] -> sq float [Q, m] = S q,
// a thread per (query, sketch row), its sum over the columns in order with
// no fused multiply-add (crate::cpu's order). sizes = {Q, D, m}; template T.
// It runs once per qjl_score call: that kernel's blocks copy these Q m
// floats instead of each reading the whole sketch.
const uint32_t nq = vq_size(params_shape, 0);
const uint32_t d = vq_size(params_shape, 1);
const uint32_t m = vq_size(params_shape, 2);
const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
if (t >= nq * m) {
  return;
}
const T* qi = q + uint64_t(t / m) * d;
const float* row = sketch + uint64_t(t % m) * d;
float acc = 0.0f;
#pragma unroll 8
for (uint32_t j = 0; j < d; ++j) {
  acc = __fadd_rn(acc, __fmul_rn(row[j], static_cast<float>(qi[j])));
}
sq[t] = acc;
