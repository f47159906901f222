//! `store_write` on the CPU: one TurboQuant-MSE side's store grown and
//! written in one pass.

use super::turboquant::MAX_NORM;
use half::f16;

/// The slots of a side's store before and after, and where the new tokens go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreShape {
    /// Batch times KV heads.
    pub rows: usize,
    /// Slots per row of the store read, and of the store written.
    pub capacity: usize,
    pub new_capacity: usize,
    /// The first slot the new tokens take, and how many there are.
    pub first: usize,
    pub tokens: usize,
    /// Bytes of one token's codes.
    pub row_bytes: usize,
}

/// A new norm as the store keeps it: a NaN where the encoder saturated it at
/// float16's largest (a token with a NaN or an infinity, or a norm past that
/// range), so that the token decodes to NaN.
#[inline]
pub fn stored_norm(n: f16) -> f16 {
    if n.is_nan() || n.to_f32() >= MAX_NORM {
        f16::NAN
    } else {
        n
    }
}

/// `out_*[r, t]`: slot `t` of the old store for `t < first`, new token
/// `t − first` for `t < first + tokens` (its norm through [`stored_norm`]),
/// zero past them.
pub fn store_write(
    codes: &[u8],
    norms: &[f16],
    new_codes: &[u8],
    new_norms: &[f16],
    sh: &StoreShape,
    out_codes: &mut [u8],
    out_norms: &mut [f16],
) {
    let (nb, cap) = (sh.row_bytes, sh.new_capacity);
    assert!(sh.first <= sh.capacity && sh.first + sh.tokens <= cap, "store slots");
    assert_eq!(codes.len(), sh.rows * sh.capacity * nb, "codes length");
    assert_eq!(norms.len(), sh.rows * sh.capacity, "norms length");
    assert_eq!(new_codes.len(), sh.rows * sh.tokens * nb, "new_codes length");
    assert_eq!(new_norms.len(), sh.rows * sh.tokens, "new_norms length");
    assert_eq!(out_codes.len(), sh.rows * cap * nb, "out_codes length");
    assert_eq!(out_norms.len(), sh.rows * cap, "out_norms length");
    let end = sh.first + sh.tokens;
    // Which slot of which array slot `t` of row `r` takes.
    let source = |r: usize, t: usize| -> Option<(bool, usize)> {
        if t < sh.first {
            Some((false, r * sh.capacity + t))
        } else if t < end {
            Some((true, r * sh.tokens + t - sh.first))
        } else {
            None
        }
    };
    super::for_each_chunk(out_codes, nb, 4096, |slot0, part| {
        for (i, o) in part.chunks_exact_mut(nb).enumerate() {
            let g = slot0 + i;
            match source(g / cap, g % cap) {
                Some((false, at)) => o.copy_from_slice(&codes[at * nb..][..nb]),
                Some((true, at)) => o.copy_from_slice(&new_codes[at * nb..][..nb]),
                None => o.fill(0),
            }
        }
    });
    super::for_each_chunk(out_norms, 1, 1 << 16, |slot0, part| {
        for (i, o) in part.iter_mut().enumerate() {
            let g = slot0 + i;
            *o = match source(g / cap, g % cap) {
                Some((false, at)) => norms[at],
                Some((true, at)) => stored_norm(new_norms[at]),
                None => f16::ZERO,
            };
        }
    });
}
