uint lid = thread_index_in_threadgroup;
uint gid = threadgroup_position_in_grid.x * threads_per_threadgroup.x + lid;
out[gid] = x[gid] + T(simdgroup_index_in_threadgroup);
