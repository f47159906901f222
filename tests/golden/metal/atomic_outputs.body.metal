uint i = thread_position_in_grid.x;
atomic_fetch_add_explicit(count, x[i], memory_order_relaxed);
atomic_fetch_add_explicit(total, float(x[i]), memory_order_relaxed);
