//! `key_mean` on the CPU: a layer's key mean over its first chunk and the
//! offset that mean takes in the keys' frame, in one pass over the keys.

use super::{for_each_chunk, min_rows_for_work, Float};

/// The keys read and the frame the offset is expressed in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KeyMeanShape {
    /// Batch times KV heads.
    pub rows: usize,
    pub tokens: usize,
    pub dim: usize,
    /// The frame's scale `F` (`frame_scale`, a power of two).
    pub frame: f32,
}

/// `mean[r, d]`: the mean over the tokens of row `r`'s keys `[rows, tokens,
/// dim]` in dimension `d`, summed in float32 with a NaN or an infinity
/// counted as 0 (so that a non-finite key shifts no other key), divided by
/// all the tokens. `offset[r, j]`: `−mean` in the keys' frame, `−Σ_d
/// mean[d]·rotation[j, d] / F²` with `rotation` (`F·Π`, row-major), else
/// `−mean[j] / F`.
pub fn key_mean<T: Float, O: Float>(keys: &[T], rotation: Option<&[f32]>, sh: &KeyMeanShape, mean: &mut [f32], offset: &mut [O]) {
    let (n, d) = (sh.tokens, sh.dim);
    assert_eq!(keys.len(), sh.rows * n * d, "keys length");
    assert_eq!(mean.len(), sh.rows * d, "mean length");
    assert_eq!(offset.len(), sh.rows * d, "offset length");
    if let Some(r) = rotation {
        assert_eq!(r.len(), d * d, "rotation length");
    }
    for_each_chunk(mean, d, min_rows_for_work(sh.rows, n * d), |row0, part| {
        for (i, m) in part.chunks_exact_mut(d).enumerate() {
            m.fill(0.0);
            for token in keys[(row0 + i) * n * d..][..n * d].chunks_exact(d) {
                for (acc, x) in m.iter_mut().zip(token) {
                    let x = x.to_f32();
                    if x.is_finite() {
                        *acc += x;
                    }
                }
            }
            m.iter_mut().for_each(|v| *v /= n as f32);
        }
    });
    let (into_rotated, into_plain) = (-1.0 / (sh.frame * sh.frame), -1.0 / sh.frame);
    for (m, o) in mean.chunks_exact(d).zip(offset.chunks_exact_mut(d)) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = O::from_f32(match rotation {
                Some(r) => r[j * d..][..d].iter().zip(m).map(|(a, b)| a * b).sum::<f32>() * into_rotated,
                None => m[j] * into_plain,
            });
        }
    }
}
