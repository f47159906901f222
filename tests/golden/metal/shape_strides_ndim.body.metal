// y_ndim is read, y's shape and strides are not; z's names never appear.
uint i = thread_position_in_grid.x;
int max_shape = x_strides[0] > 0 ? x_ndim : y_ndim;  // `max_shape` adds x_shape
out[i] = T(x[i]) + T(max_shape) + T(z[0]);
