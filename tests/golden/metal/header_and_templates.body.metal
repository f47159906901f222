uint i = thread_position_in_grid.x;
out[i] = twice(x[i]) + T(float(N) * float(w[i]));
flag[i] = FLAG;
