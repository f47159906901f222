uint i = thread_position_in_grid.x;
out[i] = a[i % 7] + b[i] + T(c[0]);
