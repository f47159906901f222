//! The online-softmax core of both CPU attention kernels
//! (`turboquant::tq_attention`, `kv_attention::kv_attention`).
//!
//! Each (batch, KV head) is a unit whose query rows share every token read.
//! Its tokens are cut into splits so that every core has work even at batch 1
//! (flash-decoding); a split reads its tokens in blocks (every row's scores,
//! then their weights, then the weighted values, the running state rescaled
//! once per block) and keeps its own softmax state. The splits of a row are
//! merged at the end and brought back from the value frame. The kernels
//! supply only how a token is scored and how its value is read.

use half::f16;

/// Tokens whose scores one pass computes before their softmax weights.
const BLOCK: usize = 32;
/// Fewest tokens a split takes.
const MIN_SPLIT_TOKENS: usize = 512;

/// One split's online-softmax state: per query row the running maximum and
/// sum, and the weighted values in the value frame.
pub(crate) struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

/// `Σ a·b` in 8 interleaved partial sums: independent chains the compiler
/// keeps in vector registers (one sequential sum is a chain of dependent
/// adds, bound by their latency).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Attention of `units` units of `rows` query rows each over `total` tokens,
/// into `out` `[units, rows, dim]`. `split(unit, t0, t1)` returns the
/// state of one unit's rows over tokens `t0..t1` ([`online_softmax`]);
/// `rot_back` is `Π` (`dim * dim`) when the value frame is rotated (the
/// output is `Πᵀ acc / l`), else empty. A row that sees no token comes out
/// as zeros.
pub(crate) fn attend<T, F>(units: usize, rows: usize, dim: usize, total: usize, rot_back: &[f32], out: &mut [T], split: F)
where
    T: FromF32 + Send,
    F: Fn(usize, usize, usize) -> Partial + Sync,
{
    if units == 0 || rows == 0 || dim == 0 {
        return;
    }
    let workers = super::parallel::worker_count();
    let splits = (2 * workers).div_ceil(units).clamp(1, total.div_ceil(MIN_SPLIT_TOKENS).max(1));
    let per_split = total.div_ceil(splits).max(1);
    // Every query row reads every token: a key and a value product of dim each.
    let pieces = units * splits;
    let work = super::parallel::min_rows_for_work(pieces, units * rows * total * 2 * dim);
    let partials = super::map_row_ranges(pieces, work, |first, count| {
        (first..first + count)
            .map(|piece| {
                let (unit, s) = (piece / splits, piece % splits);
                let t0 = (s * per_split).min(total);
                split(unit, t0, (t0 + per_split).min(total))
            })
            .collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect::<Vec<_>>();
    // The merge: each row's partials and its rotation back (dim²).
    let merge = super::parallel::min_rows_for_work(units, units * rows * dim * (dim + splits));
    super::for_each_chunk(out, rows * dim, merge, |unit0, chunk| {
        let (mut acc, mut back) = (vec![0.0f32; dim], vec![0.0f32; dim]);
        for (u, out_unit) in chunk.chunks_mut(rows * dim).enumerate() {
            let parts = &partials[(unit0 + u) * splits..][..splits];
            for r in 0..rows {
                let big_m = parts.iter().map(|p| p.m[r]).fold(f32::NEG_INFINITY, f32::max);
                acc.fill(0.0);
                let mut l = 0.0f32;
                if big_m != f32::NEG_INFINITY {
                    for p in parts {
                        if p.m[r] == f32::NEG_INFINITY {
                            continue;
                        }
                        let w = (p.m[r] - big_m).exp();
                        l += w * p.l[r];
                        for (a, x) in acc.iter_mut().zip(&p.acc[r * dim..(r + 1) * dim]) {
                            *a += w * x;
                        }
                    }
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                let y = if rot_back.is_empty() {
                    &acc
                } else {
                    times_transpose(rot_back, &acc, &mut back);
                    &back
                };
                for (o, y) in out_unit[r * dim..(r + 1) * dim].iter_mut().zip(y) {
                    *o = T::from_f32(y * inv);
                }
            }
        }
    });
}

/// The online-softmax state of `rows` query rows over tokens `t0..t1`:
/// `scores(t, s)` writes every row's scaled score of token `t` into `s`
/// (`-inf` hides the token from a row); `value(t, x)` writes token `t`'s
/// value, in the value frame, into `x` (`dim`). A token no row sees is not
/// read.
pub(crate) fn online_softmax(
    rows: usize,
    dim: usize,
    t0: usize,
    t1: usize,
    mut scores: impl FnMut(usize, &mut [f32]),
    mut value: impl FnMut(usize, &mut [f32]),
) -> Partial {
    let mut part = Partial { m: vec![f32::NEG_INFINITY; rows], l: vec![0.0; rows], acc: vec![0.0; rows * dim] };
    let mut p = vec![0.0f32; BLOCK * rows];
    let mut x = vec![0.0f32; dim];
    let mut start = t0;
    while start < t1 {
        let end = (start + BLOCK).min(t1);
        let n = end - start;
        for t in start..end {
            scores(t, &mut p[(t - start) * rows..][..rows]);
        }
        // Their weights, the running state rescaled once per block.
        for r in 0..rows {
            let block_max = (0..n).map(|i| p[i * rows + r]).fold(f32::NEG_INFINITY, f32::max);
            let m_new = part.m[r].max(block_max);
            if m_new == f32::NEG_INFINITY {
                // The row has seen no token yet: none of these weighs.
                (0..n).for_each(|i| p[i * rows + r] = 0.0);
                continue;
            }
            let alpha = (part.m[r] - m_new).exp();
            if alpha != 1.0 {
                part.l[r] *= alpha;
                part.acc[r * dim..(r + 1) * dim].iter_mut().for_each(|a| *a *= alpha);
            }
            part.m[r] = m_new;
            for i in 0..n {
                let w = &mut p[i * rows + r];
                *w = (*w - m_new).exp();
                part.l[r] += *w;
            }
        }
        // The values, weighted.
        for t in start..end {
            let w = &p[(t - start) * rows..][..rows];
            if w.iter().all(|&w| w == 0.0) {
                continue;
            }
            value(t, &mut x);
            for (r, &w) in w.iter().enumerate() {
                if w == 0.0 {
                    continue;
                }
                for (a, v) in part.acc[r * dim..(r + 1) * dim].iter_mut().zip(&x) {
                    *a += w * v;
                }
            }
        }
        start = end;
    }
    part
}

/// `y = Πᵀ a` for a row-major `Π` `[d, d]`: the rows of `Π` weighed by `a`
/// and added in turn (contiguous rows, so the additions vectorise; each `y_i`
/// sums over `j` in ascending order as the column-wise loop would).
pub(crate) fn times_transpose(rot: &[f32], a: &[f32], y: &mut [f32]) {
    let d = y.len();
    y.fill(0.0);
    for (row, &aj) in rot.chunks_exact(d).zip(a) {
        for (yi, &p) in y.iter_mut().zip(row) {
            *yi += p * aj;
        }
    }
}

/// Conversion back from float32 for the element types.
pub trait FromF32 {
    fn from_f32(v: f32) -> Self;
}
impl FromF32 for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl FromF32 for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl FromF32 for half::bf16 {
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}
