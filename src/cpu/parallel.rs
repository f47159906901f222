//! Splitting row-wise work over the available cores: one rayon pool of
//! `worker_count()` threads, kept between calls (a kernel call that started
//! its own threads paid tens of microseconds for them, a decode step's
//! attention many times over).

use std::num::NonZeroUsize;
use std::sync::OnceLock;

use rayon::prelude::*;

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

/// The pool the CPU kernels share; None where it could not start (the
/// kernels then run on the calling thread).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(worker_count())
            .thread_name(|i| format!("veloxquant-cpu-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Multiply-adds below which a kernel's call stays on the calling thread:
/// waking the pool's threads and waiting for the last of them costs
/// microseconds, far more while MLX's or the BLAS's threads hold the cores,
/// which a decode step's attention over a short context pays many times over.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// `min_rows_per_thread` for [`for_each_chunk`] or [`map_row_ranges`] over
/// `rows` rows that together cost about `work` multiply-adds: one thread
/// below [`PARALLEL_MIN_WORK`], else a row per thread at least.
pub fn min_rows_for_work(rows: usize, work: usize) -> usize {
    if work < PARALLEL_MIN_WORK {
        rows.max(1)
    } else {
        1
    }
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
    match pool() {
        Some(p) => p.install(|| out.par_chunks_mut(rows_per * row_len).enumerate().for_each(|(i, chunk)| f(i * rows_per, chunk))),
        None => f(0, out),
    }
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
    let ranges: Vec<usize> = (0..rows).step_by(rows_per).collect();
    match pool() {
        Some(p) => p.install(|| ranges.into_par_iter().map(|first| f(first, rows_per.min(rows - first))).collect()),
        None => vec![f(0, rows)],
    }
}
