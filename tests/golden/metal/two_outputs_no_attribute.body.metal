a[0] = x[0] + float(x_shape[0]);
b[0] = x[1];
