// qjl_score: q T [Q, D], sketch float [m, D], signs uint8 [N, nbytes], norms
// float16 [N] -> scores float [Q, N] = (sqrt(pi/2)/m * norm) * sum_r +-(S q)_r,
// the sign from bit r of the key. params = {N, D, m, nbytes, Q}; template T.
// Each threadgroup first computes S q (Q * m <= 4096 floats) into threadgroup
// memory, then one thread per key reads its signs once for all Q queries.
#pragma clang fp contract(off)
threadgroup float sq[4096];
const uint n = params[0];
const uint d = params[1];
const uint m = params[2];
const uint nbytes = params[3];
const uint nq = params[4];
for (uint i = thread_index_in_threadgroup; i < nq * m; i += threads_per_threadgroup.x) {
  const ulong qb = ulong(i / m) * d;
  const ulong sb = ulong(i % m) * d;
  float acc = 0.0f;
  for (uint j = 0; j < d; ++j) {
    acc += sketch[sb + j] * float(q[qb + j]);
  }
  sq[i] = acc;
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
    const float v = sq[i * m + r];
    acc += (signs[sb + r / 8] >> (r % 8)) & 1u ? v : -v;
  }
  scores[ulong(i) * n + t] = scale * acc;
}
