// qjl_score: S q float [Q, m] (qjl_sketch_query's output), signs uint8
// [N, nbytes], norms float16 [N] -> scores float [Q, N] = (sqrt(pi/2)/m *
// norm) * sum_r +-(S q)_r, the sign from bit r of the key. params = {N, m,
// nbytes, Q}. Each threadgroup copies S q (Q * m <= 4096 floats) into
// threadgroup memory, then one thread per key reads its signs once for all
// Q queries.
#pragma clang fp contract(off)
threadgroup float sqs[4096];
const uint n = params[0];
const uint m = params[1];
const uint nbytes = params[2];
const uint nq = params[3];
for (uint i = thread_index_in_threadgroup; i < nq * m; i += threads_per_threadgroup.x) {
  sqs[i] = sq[i];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint t = thread_position_in_grid.x;
if (t >= n) {
  return;
}
const float scale = sqrt(M_PI_2_F) / float(m) * float(norms[t]);
const ulong sb = ulong(t) * nbytes;
for (uint i = 0; i < nq; ++i) {
  float acc = 0.0f;
  for (uint r = 0; r < m; ++r) {
    const float v = sqs[i * m + r];
    acc += (signs[sb + r / 8] >> (r % 8)) & 1u ? v : -v;
  }
  scores[ulong(i) * n + t] = scale * acc;
}
