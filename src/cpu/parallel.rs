//! Splitting row-wise work over the available cores with scoped threads.

use std::num::NonZeroUsize;
use std::sync::OnceLock;

fn worker_count() -> usize {
    static WORKERS: OnceLock<usize> = OnceLock::new();
    *WORKERS.get_or_init(|| {
        std::env::var("VELOXQUANT_CPU_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get))
    })
}

/// Runs `f(first_row, out_chunk)` over `out` split into chunks of whole rows
/// (`row_len` elements each), in parallel when the work is large enough to
/// pay for the threads (`min_rows_per_thread`).
pub fn for_each_chunk<T, F>(out: &mut [T], row_len: usize, min_rows_per_thread: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    if row_len == 0 || out.is_empty() {
        return;
    }
    let rows = out.len() / row_len;
    let threads = worker_count().min(rows / min_rows_per_thread.max(1)).max(1);
    if threads == 1 {
        f(0, out);
        return;
    }
    let rows_per = rows.div_ceil(threads);
    std::thread::scope(|scope| {
        for (i, chunk) in out.chunks_mut(rows_per * row_len).enumerate() {
            let f = &f;
            scope.spawn(move || f(i * rows_per, chunk));
        }
    });
}
