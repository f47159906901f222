// tq_rvq_decode: inverse of tq_rvq_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (centroids1[a] + centroids2[b]); rotation [D, D], or [D] with
// HADAMARD (the signs, by butterflies). params = {N}. One threadgroup of D
// threads per vector; sums in order, no fma, as crate::cpu::turboquant.
#pragma clang fp contract(off)
threadgroup float yr[D];
const uint n = params[0];
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
const uint a = VQ_CODE_AT(codes1, ulong(v) * (D * B1_BITS / 8), uint(i), uint(B1_BITS));
const uint b = VQ_CODE_AT(codes2, ulong(v) * (D * B2_BITS / 8), uint(i), uint(B2_BITS));
const float yi = centroids1[a] + centroids2[b];
yr[i] = yi;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float o = ROTATE ? tq_unrotate_coord<D>(yr, i, rotation, HADAMARD) : yi;
y[ulong(v) * D + i] = T(o * float(norms[v]));
