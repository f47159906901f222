// tq_prod_decode: inverse of tq_prod_encode, -> y T [N, D] =
// ‖x‖ Πᵀ (c[code] + scale · ‖r‖ · Sᵀ z), z the ±1 signs (‖r‖ = 1 and no
// codes when B_BITS = 1: codes, residual_norms and centroids are placeholders).
// params = {N, float bits of scale = √(π/2)/D}. One threadgroup of D threads
// per vector; thread i builds coordinate i of the rotated reconstruction,
// then of its inverse rotation. Sums in order, no fma, as crate::cpu::turboquant.
#pragma clang fp contract(off)
constexpr int MSE_BITS = B_BITS - 1;
constexpr int CODE_BYTES = D * MSE_BITS / 8;
threadgroup float z[D];
threadgroup float yr[D];
const uint n = params[0];
const float scale = as_type<float>(params[1]);
const uint v = threadgroup_position_in_grid.x;
const int i = int(thread_position_in_threadgroup.x);
if (v >= n) {
  return;
}
float yi = 0.0f;
float rn = 1.0f;
if (MSE_BITS > 0) {
  yi = centroids[VQ_CODE_AT(codes, ulong(v) * CODE_BYTES, uint(i), uint(MSE_BITS))];
  rn = float(residual_norms[v]);
}
const float a = scale * rn;
z[i] = ((signs[ulong(v) * (D / 8) + i / 8] >> (i % 8)) & 1) != 0 ? a : -a;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int k = 0; k < D; ++k) {
  yi += z[k] * sketch[k * D + i];
}
yr[i] = yi;
threadgroup_barrier(mem_flags::mem_threadgroup);
const float o = ROTATE ? tq_unrotate_coord<D>(yr, i, rotation, HADAMARD) : yi;
y[ulong(v) * D + i] = T(o * float(norms[v]));
