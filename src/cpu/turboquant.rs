//! TurboQuant-MSE for the cache: encode (norm, rotate, nearest centroid,
//! pack) and attention that reads the packed codes directly.
//!
//! Arithmetic order is the GPU kernels' (float32, no fused multiply-add,
//! sequential sums), so the encoders agree bit for bit; attention sums in
//! different orders on different back-ends and agrees to rounding.
//!
//! A cached vector `x` is stored as `‖x‖` (float16) and the `b`-bit indices of
//! `y = Π x/‖x‖` in a sorted codebook `c`. Its reconstruction is
//! `‖x‖ Πᵀ c[idx]`, so `⟨q, x̂⟩ = ‖x‖ ⟨Π q, c[idx]⟩`: attention rotates the
//! query once, scores straight from the codes, accumulates values in the
//! rotated frame and rotates the output back once.

use half::f16;

use super::vq::VqElement;

/// Code `j` of a densely packed row of `bits`-bit codes.
#[inline(always)]
pub fn code_at(row: &[u8], j: usize, bits: u32) -> usize {
    let o = j * bits as usize;
    let byte = o >> 3;
    let shift = o & 7;
    let mut v = u32::from(row[byte]);
    if shift + bits as usize > 8 {
        v |= u32::from(row[byte + 1]) << 8;
    }
    ((v >> shift) & ((1 << bits) - 1)) as usize
}

/// Index of the centroid nearest to `y` (ties to the lowest index).
#[inline(always)]
fn nearest(y: f32, centroids: &[f32]) -> u8 {
    let mut best = f32::INFINITY;
    let mut best_i = 0u8;
    for (k, &c) in centroids.iter().enumerate() {
        let diff = y - c;
        let dist = diff * diff;
        if dist < best {
            best = dist;
            best_i = k as u8;
        }
    }
    best_i
}

/// Largest finite float16: norms beyond it are stored saturated.
pub const MAX_NORM: f32 = 65504.0;

/// Encodes `n = x.len() / d` vectors: `codes` gets `d * bits / 8` bytes per
/// vector, `norms` one float16 each. `rotation` is `Π`, row-major `[d, d]`.
pub fn tq_encode<T: VqElement>(
    x: &[T],
    rotation: &[f32],
    centroids: &[f32],
    d: usize,
    bits: u32,
    codes: &mut [u8],
    norms: &mut [f16],
) {
    let n = norms.len();
    let row_bytes = d * bits as usize / 8;
    assert_eq!(x.len(), n * d, "x length");
    assert_eq!(codes.len(), n * row_bytes, "codes length");
    assert_eq!(rotation.len(), d * d, "rotation size");
    // Norms are cheap and sequential; the rows in parallel below.
    for (i, out) in norms.iter_mut().enumerate() {
        let mut s2 = 0.0f32;
        for v in &x[i * d..(i + 1) * d] {
            let f = v.to_f32();
            s2 += f * f;
        }
        *out = f16::from_f32(s2.sqrt().min(MAX_NORM));
    }
    super::for_each_chunk(codes, row_bytes, 64, |row0, chunk| {
        let mut u = vec![0.0f32; d];
        let mut idx = vec![0u8; d];
        for (r, dst) in chunk.chunks_mut(row_bytes).enumerate() {
            let src = &x[(row0 + r) * d..(row0 + r + 1) * d];
            let mut s2 = 0.0f32;
            for v in src {
                let f = v.to_f32();
                s2 += f * f;
            }
            let s = s2.sqrt();
            for (uj, v) in u.iter_mut().zip(src) {
                *uj = if s > 0.0 { v.to_f32() / s } else { 0.0 };
            }
            for (i, code) in idx.iter_mut().enumerate() {
                let mut y = 0.0f32;
                for (&p, &uj) in rotation[i * d..(i + 1) * d].iter().zip(&u) {
                    y += p * uj;
                }
                *code = nearest(y, centroids);
            }
            super::bit_pack(&idx, 1, d, bits, dst);
        }
    });
}

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Queries per head (1 when decoding).
    pub queries: usize,
    pub dim: usize,
    pub key_bits: u32,
    pub value_bits: u32,
    /// Tokens held: float16 sinks first, then compressed, then the recent window.
    pub sinks: usize,
    pub compressed: usize,
    pub recent: usize,
    /// Slots per head of the compressed store and of the window store.
    pub capacity: usize,
    pub window_capacity: usize,
    /// Query `l` sits at position `total - queries + l` and sees positions up to it.
    pub causal: bool,
}

impl AttentionShape {
    pub fn total(&self) -> usize {
        self.sinks + self.compressed + self.recent
    }
}

/// Read-only views of one layer's stored keys and values.
pub struct AttentionInputs<'a, T> {
    pub rot_k: &'a [f32],
    pub rot_v: &'a [f32],
    pub k_codes: &'a [u8],
    pub k_norms: &'a [f16],
    pub k_centroids: &'a [f32],
    pub v_codes: &'a [u8],
    pub v_norms: &'a [f16],
    pub v_centroids: &'a [f32],
    /// Rotated float16/bfloat16/float32 keys and values of the sinks and the
    /// recent window, `[batch, kv_heads, window_capacity, dim]`.
    pub win_k: &'a [T],
    pub win_v: &'a [T],
}

/// Attention of `q` `[batch, q_heads, queries, dim]` over the layer, into `out`
/// (same shape), with softmax scale `scale`.
pub fn tq_attention<T: VqElement + FromF32>(
    q: &[T],
    inp: &AttentionInputs<'_, T>,
    sh: &AttentionShape,
    scale: f32,
    out: &mut [T],
) {
    let d = sh.dim;
    let g = sh.q_heads / sh.kv_heads;
    let rows_per_kv = g * sh.queries;
    let kb = d * sh.key_bits as usize / 8;
    let vb = d * sh.value_bits as usize / 8;
    let total = sh.total();
    // Work unit: one (batch, kv head): its g query heads share every key read.
    super::for_each_chunk(out, rows_per_kv * d, 1, |unit0, chunk| {
        let mut qr = vec![0.0f32; rows_per_kv * d];
        let mut acc = vec![0.0f32; rows_per_kv * d];
        let mut m = vec![f32::NEG_INFINITY; rows_per_kv];
        let mut l = vec![0.0f32; rows_per_kv];
        let mut vals = vec![0.0f32; d];
        let mut scores = vec![0.0f32; rows_per_kv];
        for (u, out_unit) in chunk.chunks_mut(rows_per_kv * d).enumerate() {
            let unit = unit0 + u;
            let (b, hk) = (unit / sh.kv_heads, unit % sh.kv_heads);
            // Rows of this unit: heads hk*g .. hk*g+g, each with `queries` queries.
            for r in 0..rows_per_kv {
                let (hq, ql) = (hk * g + r / sh.queries, r % sh.queries);
                let src = &q[((b * sh.q_heads + hq) * sh.queries + ql) * d..][..d];
                for i in 0..d {
                    let mut y = 0.0f32;
                    for j in 0..d {
                        y += inp.rot_k[i * d + j] * src[j].to_f32();
                    }
                    qr[r * d + i] = y * scale;
                }
            }
            m.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            l.iter_mut().for_each(|v| *v = 0.0);
            acc.iter_mut().for_each(|v| *v = 0.0);
            let head = b * sh.kv_heads + hk;
            for t in 0..total {
                // Scores of every row for token t, and its value in the rotated frame.
                if t >= sh.sinks && t < sh.sinks + sh.compressed {
                    let slot = head * sh.capacity + (t - sh.sinks);
                    let krow = &inp.k_codes[slot * kb..(slot + 1) * kb];
                    let kn = inp.k_norms[slot].to_f32();
                    for (r, s) in scores.iter_mut().enumerate() {
                        let qrow = &qr[r * d..(r + 1) * d];
                        let mut dot = 0.0f32;
                        for j in 0..d {
                            dot += qrow[j] * inp.k_centroids[code_at(krow, j, sh.key_bits)];
                        }
                        *s = dot * kn;
                    }
                    let vrow = &inp.v_codes[slot * vb..(slot + 1) * vb];
                    let vn = inp.v_norms[slot].to_f32();
                    for (j, v) in vals.iter_mut().enumerate() {
                        *v = inp.v_centroids[code_at(vrow, j, sh.value_bits)] * vn;
                    }
                } else {
                    let w = if t < sh.sinks { t } else { t - sh.compressed };
                    let slot = head * sh.window_capacity + w;
                    let krow = &inp.win_k[slot * d..(slot + 1) * d];
                    for (r, s) in scores.iter_mut().enumerate() {
                        let qrow = &qr[r * d..(r + 1) * d];
                        let mut dot = 0.0f32;
                        for j in 0..d {
                            dot += qrow[j] * krow[j].to_f32();
                        }
                        *s = dot;
                    }
                    for (v, x) in vals.iter_mut().zip(&inp.win_v[slot * d..(slot + 1) * d]) {
                        *v = x.to_f32();
                    }
                }
                for r in 0..rows_per_kv {
                    if sh.causal && t > total - sh.queries + r % sh.queries {
                        continue;
                    }
                    let s = scores[r];
                    let m_new = m[r].max(s);
                    let alpha = (m[r] - m_new).exp();
                    let p = (s - m_new).exp();
                    l[r] = l[r] * alpha + p;
                    let a = &mut acc[r * d..(r + 1) * d];
                    for (av, &v) in a.iter_mut().zip(&vals) {
                        *av = *av * alpha + p * v;
                    }
                    m[r] = m_new;
                }
            }
            // Back from the rotated frame: out = Πᵀ acc / l.
            for r in 0..rows_per_kv {
                let (hq_local, ql) = (r / sh.queries, r % sh.queries);
                let dst_row = hq_local * sh.queries + ql;
                let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
                let a = &acc[r * d..(r + 1) * d];
                for i in 0..d {
                    let mut y = 0.0f32;
                    for j in 0..d {
                        y += inp.rot_v[j * d + i] * a[j];
                    }
                    out_unit[dst_row * d + i] = T::from_f32(y * inv);
                }
            }
        }
    });
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
