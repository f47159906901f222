//! `window_append`: new tokens into a compressed layer's windows, each side
//! in its frame (see `cuda/window_append.cu`).

use super::Float;

/// The shapes of one `window_append`: windows `[batch, heads, slots, dim]`,
/// `tokens` new ones written from slot `at`.
#[derive(Clone, Copy, Debug)]
pub struct WindowShape {
    pub batch: usize,
    pub heads: usize,
    pub slots: usize,
    pub dim: usize,
    pub tokens: usize,
    pub at: usize,
}

/// One side's new tokens `x` `[batch, heads, tokens, dim]` through `frame`
/// `[dim, dim]` (`x·frame`, float32 sums, one rounding), plus `offset`
/// `[batch, heads, dim]` when given, or copied when `frame` is `None`,
/// into `out`, a copy of `window`, from slot `at`. Row-contiguous slices.
pub fn window_append<T: Float>(
    x: &[T],
    frame: Option<&[T]>,
    offset: Option<&[T]>,
    window: &[T],
    sh: &WindowShape,
    out: &mut [T],
) {
    let (d, w, t) = (sh.dim, sh.slots, sh.tokens);
    assert_eq!(out.len(), window.len(), "out length");
    assert_eq!(window.len(), sh.batch * sh.heads * w * d, "window length");
    assert_eq!(x.len(), sh.batch * sh.heads * t * d, "tokens length");
    assert!(sh.at + t <= w, "{} tokens from slot {} past {w} slots", t, sh.at);
    out.copy_from_slice(window);
    let mut acc = vec![0.0f32; d];
    // The frame in float32 once a call, not an element at a time per token.
    let frame = frame.map(|f| {
        let mut f32s = vec![0.0f32; f.len()];
        T::row_to_f32(f, &mut f32s);
        f32s
    });
    for bh in 0..sh.batch * sh.heads {
        for k in 0..t {
            let src = &x[(bh * t + k) * d..][..d];
            let dst = &mut out[(bh * w + sh.at + k) * d..][..d];
            let Some(frame) = &frame else {
                dst.copy_from_slice(src);
                continue;
            };
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (i, xi) in src.iter().enumerate() {
                let xi = xi.to_f32();
                for (a, f) in acc.iter_mut().zip(&frame[i * d..][..d]) {
                    *a += xi * f;
                }
            }
            match offset {
                Some(off) => {
                    for ((o, a), b) in dst.iter_mut().zip(&acc).zip(&off[bh * d..][..d]) {
                        *o = T::from_f32(a + b.to_f32());
                    }
                }
                None => dst.iter_mut().zip(&acc).for_each(|(o, a)| *o = T::from_f32(*a)),
            }
        }
    }
}
