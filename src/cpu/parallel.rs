//! Splitting row-wise work over the available cores with scoped threads.

use std::num::NonZeroUsize;
use std::sync::OnceLock;

pub(crate) fn worker_count() -> usize {
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

/// Runs `f(first_row, row_count)` over `rows` split into contiguous ranges,
/// in parallel when there are at least `min_rows_per_thread` rows per worker,
/// and returns the results in row order. For kernels with several outputs:
/// each range fills its own buffers, which the caller copies into place.
pub fn map_row_ranges<R, F>(rows: usize, min_rows_per_thread: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize, usize) -> R + Sync,
{
    if rows == 0 {
        return Vec::new();
    }
    let threads = worker_count().min(rows / min_rows_per_thread.max(1)).max(1);
    let rows_per = rows.div_ceil(threads);
    if threads == 1 {
        return vec![f(0, rows)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..rows)
            .step_by(rows_per)
            .map(|first| {
                let f = &f;
                scope.spawn(move || f(first, rows_per.min(rows - first)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker panicked")).collect()
    })
}
