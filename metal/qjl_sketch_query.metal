// qjl_sketch_query: q T [Q, D], sketch float [m, D] -> sq float [Q, m] = S q,
// a thread per (query, sketch row), its sum over the columns in order.
// params = {Q, D, m}; template T. It runs once per qjl_score call: that
// kernel's threadgroups copy these Q m floats instead of each reading the
// whole sketch.
#pragma clang fp contract(off)
const uint nq = params[0];
const uint d = params[1];
const uint m = params[2];
const uint t = thread_position_in_grid.x;
if (t >= nq * m) {
  return;
}
const ulong qb = ulong(t / m) * d;
const ulong sb = ulong(t % m) * d;
float acc = 0.0f;
for (uint j = 0; j < d; ++j) {
  acc += sketch[sb + j] * float(q[qb + j]);
}
sq[t] = acc;
