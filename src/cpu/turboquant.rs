//! TurboQuant-MSE for the cache: encode (norm, rotate, nearest centroid,
//! pack) and attention that reads the packed codes directly.
//!
//! Arithmetic order is the GPU kernels' exact path's (float32, no fused
//! multiply-add, sequential sums), so the encoders agree bit for bit (CUDA's
//! tensor-core path for float16 and bfloat16 inputs up to near-ties);
//! attention sums in different orders on different back-ends and agrees to
//! rounding.
//!
//! A cached vector `x` is stored as `‖x‖` (float16) and the `b`-bit indices of
//! `y = Π x/‖x‖` in a sorted codebook `c`. Its reconstruction is
//! `‖x‖ Πᵀ c[idx]`, so `⟨q, x̂⟩ = ‖x‖ ⟨Π q, c[idx]⟩`: attention rotates the
//! query once, scores straight from the codes, accumulates values in the
//! rotated frame and rotates the output back once.

use half::f16;

use super::bitpack::get_group;
pub use super::split_attention::FromF32;
use super::split_attention::{self, dot};
use super::quant::OrderedDots;
use super::vq::VqElement;
use super::Float;

/// Code `j` of a densely packed row of `bits`-bit codes.
#[inline(always)]
pub fn code_at(row: &[u8], j: usize, bits: u32) -> usize {
    code_bits(row, j * bits as usize, bits)
}

/// The `bits`-bit code (1 to 8) starting at bit `o` of a packed row.
#[inline(always)]
pub fn code_bits(row: &[u8], o: usize, bits: u32) -> usize {
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

/// The Euclidean norm of `a`, summed in float64 (the quantizers' and the
/// fused encoders' norm, bit for bit).
pub(crate) fn norm(a: &[f32]) -> f32 {
    a.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt() as f32
}

/// In-place unnormalized fast Walsh–Hadamard transform (Sylvester order).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// `Π` or `Πᵀ` as the CPU kernels apply it: a dense row-major `[d, d]`
/// matrix (sums in order), or the ±1 signs `[d]` of a Hadamard rotation, `d`
/// a power of two: `Π u = H (s ⊙ u) / √d` and `Πᵀ y = s ⊙ (H y / √d)` by
/// butterflies, in [`fwht`]'s order (`Rotation::forward`'s and
/// `inverse`'s arithmetic, so bit for bit the quantizer's).
pub(crate) enum KernelRotation<'a> {
    Dense(OrderedDots),
    Hadamard { signs: &'a [f32], scale: f32, inverse: bool },
}

impl<'a> KernelRotation<'a> {
    /// `Π` from a rotation input: `d * d` values are a dense `Π`, `d` values
    /// the signs of a Hadamard rotation (`d` a power of two).
    pub fn new(rotation: &'a [f32], d: usize) -> Self {
        Self::read(rotation, d, false)
    }

    /// `Πᵀ` from the same input.
    pub fn inverse(rotation: &'a [f32], d: usize) -> Self {
        Self::read(rotation, d, true)
    }

    /// How every CPU kernel reads its rotation input.
    fn read(rotation: &'a [f32], d: usize, inverse: bool) -> Self {
        if rotation.len() == d && d > 1 {
            assert!(d.is_power_of_two(), "a Hadamard rotation needs a power-of-two size, not {d}");
            return KernelRotation::Hadamard { signs: rotation, scale: 1.0 / (d as f32).sqrt(), inverse };
        }
        assert_eq!(rotation.len(), d * d, "rotation size");
        // Πᵀ's transpose is Π itself: `Σ_k Π_ki y_k` in order of k.
        KernelRotation::Dense(if inverse { OrderedDots::from_transpose(rotation, d, d) } else { OrderedDots::new(rotation, d, d) })
    }

    /// `out = Π x` (or `Πᵀ x`).
    pub fn apply(&self, x: &[f32], out: &mut [f32]) {
        match self {
            KernelRotation::Dense(dots) => dots.apply(x, out),
            KernelRotation::Hadamard { signs, scale, inverse: false } => {
                for ((o, &xj), &sj) in out.iter_mut().zip(x).zip(signs.iter()) {
                    *o = xj * sj;
                }
                fwht(out);
                out.iter_mut().for_each(|v| *v *= scale);
            }
            KernelRotation::Hadamard { signs, scale, inverse: true } => {
                out.copy_from_slice(x);
                fwht(out);
                for (o, &sj) in out.iter_mut().zip(signs.iter()) {
                    *o = *o * scale * sj;
                }
            }
        }
    }
}

/// Encodes `n = x.len() / d` vectors: `codes` gets `d * bits / 8` bytes per
/// vector, `norms` one float16 each. `rotation` is `Π` as `KernelRotation`
/// reads it (`[d, d]`, or Hadamard signs `[d]`); `None` for vectors that are
/// rotated already.
pub fn tq_encode<T: VqElement>(
    x: &[T],
    rotation: Option<&[f32]>,
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
    // Norms are cheap and sequential; the rows in parallel below.
    for (i, out) in norms.iter_mut().enumerate() {
        let mut s2 = 0.0f32;
        for v in &x[i * d..(i + 1) * d] {
            let f = v.to_f32();
            s2 += f * f;
        }
        *out = f16::from_f32(s2.sqrt().min(MAX_NORM));
    }
    let rotation = rotation.map(|r| KernelRotation::new(r, d));
    super::for_each_chunk(codes, row_bytes, 64, |row0, chunk| {
        let (mut u, mut y) = (vec![0.0f32; d], vec![0.0f32; d]);
        let mut idx = vec![0u8; d];
        for (r, dst) in chunk.chunks_mut(row_bytes).enumerate() {
            T::row_to_f32(&x[(row0 + r) * d..(row0 + r + 1) * d], &mut u);
            let s = u.iter().map(|f| f * f).fold(0.0f32, |s2, f2| s2 + f2).sqrt();
            for uj in u.iter_mut() {
                *uj = if s > 0.0 { *uj / s } else { 0.0 };
            }
            match &rotation {
                Some(rot) => rot.apply(&u, &mut y),
                None => y.copy_from_slice(&u),
            }
            for (code, &yi) in idx.iter_mut().zip(&y) {
                *code = nearest(yi, centroids);
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

/// A codebook padded to 256 entries, so that a `u8` code indexes it with no
/// bounds check.
pub(super) fn padded_table(centroids: &[f32]) -> [f32; 256] {
    let mut t = [0.0f32; 256];
    t[..centroids.len()].copy_from_slice(centroids);
    t
}

/// `out[j] = table[code j] · scale` for a densely packed row of `bits`-bit
/// codes (whole bytes for 2, 4 and 8 bits; 8 codes from `bits` bytes
/// otherwise).
#[inline(always)]
pub(super) fn decode_row(row: &[u8], bits: u32, table: &[f32; 256], scale: f32, out: &mut [f32]) {
    match bits {
        8 => out.iter_mut().zip(row).for_each(|(o, &c)| *o = table[c as usize] * scale),
        4 => {
            for (o, &byte) in out.chunks_exact_mut(2).zip(row) {
                o[0] = table[(byte & 15) as usize] * scale;
                o[1] = table[(byte >> 4) as usize] * scale;
            }
        }
        2 => {
            for (o, &byte) in out.chunks_exact_mut(4).zip(row) {
                for (k, v) in o.iter_mut().enumerate() {
                    *v = table[((byte >> (2 * k)) & 3) as usize] * scale;
                }
            }
        }
        3 => decode_groups::<3>(row, table, scale, out),
        5 => decode_groups::<5>(row, table, scale, out),
        6 => decode_groups::<6>(row, table, scale, out),
        7 => decode_groups::<7>(row, table, scale, out),
        _ => decode_groups::<1>(row, table, scale, out),
    }
}

/// [`decode_row`] for widths that do not divide a byte: 8 codes from each
/// `B` bytes, with constant shifts.
#[inline(always)]
fn decode_groups<const B: usize>(row: &[u8], table: &[f32; 256], scale: f32, out: &mut [f32]) {
    let mut codes = [0u8; 8];
    for (g, group) in out.chunks_mut(8).enumerate() {
        let codes = &mut codes[..group.len()];
        get_group(&row[g * B..(g * B + B).min(row.len())], B, codes);
        for (o, &c) in group.iter_mut().zip(codes.iter()) {
            *o = table[c as usize] * scale;
        }
    }
}

/// Attention of `q` `[batch, q_heads, queries, dim]` over the layer, into `out`
/// (same shape), with softmax scale `scale`: split over the cores and merged
/// by `split_attention`; each split rotates its rows' queries into the key
/// frame once, unpacks a key's codes once for all rows, and accumulates the
/// values in the rotated frame.
pub fn tq_attention<T: VqElement + FromF32>(
    q: &[T],
    inp: &AttentionInputs<'_, T>,
    sh: &AttentionShape,
    scale: f32,
    out: &mut [T],
) {
    let d = sh.dim;
    let g = sh.q_heads / sh.kv_heads;
    let rows = g * sh.queries;
    let total = sh.total();
    let (kb, vb) = (d * sh.key_bits as usize / 8, d * sh.value_bits as usize / 8);
    let (k_table, v_table) = (padded_table(inp.k_centroids), padded_table(inp.v_centroids));
    let compressed = |t: usize| t >= sh.sinks && t < sh.sinks + sh.compressed;
    split_attention::attend(sh.batch * sh.kv_heads, rows, d, total, inp.rot_v, out, |unit, t0, t1| {
        let (b, hk) = (unit / sh.kv_heads, unit % sh.kv_heads);
        let head = b * sh.kv_heads + hk;
        let window_slot = |t: usize| head * sh.window_capacity + if t < sh.sinks { t } else { t - sh.compressed };
        // The rows' queries in the key frame, scaled: qr = scale · Π q.
        let mut qr = vec![0.0f32; rows * d];
        let mut x: Vec<f32> = vec![0.0; d];
        for r in 0..rows {
            let (hq, ql) = (hk * g + r / sh.queries, r % sh.queries);
            let src = &q[((b * sh.q_heads + hq) * sh.queries + ql) * d..][..d];
            T::row_to_f32(src, &mut x);
            for (i, y) in qr[r * d..(r + 1) * d].iter_mut().enumerate() {
                *y = dot(&inp.rot_k[i * d..(i + 1) * d], &x) * scale;
            }
        }
        let scores = |t: usize, s: &mut [f32]| {
            let norm = if compressed(t) {
                let slot = head * sh.capacity + (t - sh.sinks);
                decode_row(&inp.k_codes[slot * kb..(slot + 1) * kb], sh.key_bits, &k_table, 1.0, &mut x);
                inp.k_norms[slot].to_f32()
            } else {
                let slot = window_slot(t);
                T::row_to_f32(&inp.win_k[slot * d..(slot + 1) * d], &mut x);
                1.0
            };
            for (r, sr) in s.iter_mut().enumerate() {
                let hidden = sh.causal && t > total - sh.queries + r % sh.queries;
                *sr = if hidden { f32::NEG_INFINITY } else { dot(&qr[r * d..(r + 1) * d], &x) * norm };
            }
        };
        let value = |t: usize, x: &mut [f32]| {
            if compressed(t) {
                let slot = head * sh.capacity + (t - sh.sinks);
                decode_row(&inp.v_codes[slot * vb..(slot + 1) * vb], sh.value_bits, &v_table, inp.v_norms[slot].to_f32(), x);
            } else {
                let slot = window_slot(t);
                T::row_to_f32(&inp.win_v[slot * d..(slot + 1) * d], x);
            }
        };
        split_attention::online_softmax(rows, d, t0, t1, scores, value)
    });
}

// ------------------------------------------------ TurboQuant-Prod and -RVQ
//
// Fused encoders and decoders of `crate::quant::{TurboQuantProd,
// TurboQuantRvq}`, bit for bit for float32 input and a dense rotation: the
// norm as `crate::quant` computes it (float64 squares summed in order), codes
// from the codebook's decision boundaries (`ScalarCodebook::quantize`), every
// float32 sum in order from 0, no fused multiply-add. The GPU bodies follow
// the same order.

/// `√(π/2) / d`, the QJL factor of TurboQuant-Prod's reconstruction, as the
/// quantizer computes it.
pub fn prod_scale(d: usize) -> f32 {
    std::f32::consts::FRAC_PI_2.sqrt() / d as f32
}

/// Loads one row into `u`, normalizes it and writes `y = Π u` (zeros for a
/// zero row). Returns the norm.
fn normalize_rotate_row<T: VqElement>(src: &[T], rotation: Option<&KernelRotation>, u: &mut [f32], y: &mut [f32]) -> f32 {
    T::row_to_f32(src, u);
    let s = norm(u);
    for uj in u.iter_mut() {
        *uj = if s > 0.0 { *uj / s } else { 0.0 };
    }
    match rotation {
        Some(rot) => rot.apply(u, y),
        None => y.copy_from_slice(u),
    }
    s
}

/// `out = norm · Πᵀ y`, `rotation` read by [`KernelRotation::inverse`], or
/// `norm · y` without a rotation. `acc` is scratch of `y.len()`.
fn unrotate_row<T: Float>(rotation: Option<&KernelRotation>, y: &[f32], norm: f32, acc: &mut [f32], out: &mut [T]) {
    match rotation {
        Some(rot) => rot.apply(y, acc),
        None => acc.copy_from_slice(y),
    }
    for (o, &v) in out.iter_mut().zip(acc.iter()) {
        *o = T::from_f32(v * norm);
    }
}

/// Copies the per-range buffers of `map_row_ranges` into one output.
fn gather<T: Copy>(parts: impl Iterator<Item = Vec<T>>, out: &mut [T]) {
    let mut at = 0;
    for p in parts {
        out[at..at + p.len()].copy_from_slice(&p);
        at += p.len();
    }
    assert_eq!(at, out.len(), "output length");
}

#[derive(Default)]
struct EncodedRows {
    codes: Vec<u8>,
    codes2: Vec<u8>,
    norms: Vec<f16>,
    norms2: Vec<f16>,
}

/// TurboQuant-Prod encoding of `n = norms.len()` rows of `x` (`n * d`):
/// `codes` the packed `mse_bits`-bit indices of `y = Π x/‖x‖` in the sorted
/// `centroids` (`2^mse_bits`; both empty when `mse_bits` is 0), `signs` the
/// packed bits `S r ≥ 0` of the residual `r = y − c[idx]` (`sketch` `d × d`),
/// `norms` `‖x‖` and `residual_norms` `‖r‖` (empty when `mse_bits` is 0) in
/// float16, saturated at 65504.
#[allow(clippy::too_many_arguments)]
pub fn tq_prod_encode<T: VqElement>(
    x: &[T],
    rotation: Option<&[f32]>,
    centroids: &[f32],
    sketch: &[f32],
    d: usize,
    mse_bits: u32,
    codes: &mut [u8],
    signs: &mut [u8],
    norms: &mut [f16],
    residual_norms: &mut [f16],
) {
    let n = norms.len();
    let code_bytes = if mse_bits > 0 { super::packed_len(d, mse_bits) } else { 0 };
    let sign_bytes = super::packed_len(d, 1);
    assert_eq!(x.len(), n * d, "x length");
    assert_eq!(sketch.len(), d * d, "sketch size");
    assert_eq!(codes.len(), n * code_bytes, "codes length");
    assert_eq!(signs.len(), n * sign_bytes, "signs length");
    assert_eq!(residual_norms.len(), if mse_bits > 0 { n } else { 0 }, "residual norms length");
    if mse_bits > 0 {
        assert_eq!(centroids.len(), 1 << mse_bits, "centroids length");
    }
    let bounds = if mse_bits > 0 { super::scalar_boundaries(centroids) } else { Vec::new() };
    let rot = rotation.map(|r| KernelRotation::new(r, d));
    let sketch_dots = OrderedDots::new(sketch, d, d);
    let parts = super::parallel::map_row_ranges(n, 32, |first, count| {
        let mut out = EncodedRows {
            codes: vec![0u8; count * code_bytes],
            codes2: vec![0u8; count * sign_bytes],
            norms: vec![f16::ZERO; count],
            norms2: vec![f16::ZERO; if mse_bits > 0 { count } else { 0 }],
        };
        let (mut u, mut y, mut idx, mut bits) = (vec![0.0f32; d], vec![0.0f32; d], vec![0u8; d], vec![0u8; d]);
        let mut proj = vec![0.0f32; d];
        for r in 0..count {
            let s = normalize_rotate_row(&x[(first + r) * d..(first + r + 1) * d], rot.as_ref(), &mut u, &mut y);
            out.norms[r] = f16::from_f32(s.min(MAX_NORM));
            if mse_bits > 0 {
                super::quant::scalar_codes(&bounds, &y, &mut idx);
                for (c, v) in idx.iter().zip(y.iter_mut()) {
                    *v -= centroids[*c as usize];
                }
                super::bit_pack(&idx, 1, d, mse_bits, &mut out.codes[r * code_bytes..(r + 1) * code_bytes]);
                out.norms2[r] = f16::from_f32(norm(&y).min(MAX_NORM));
            }
            sketch_dots.apply(&y, &mut proj);
            for (b, p) in bits.iter_mut().zip(&proj) {
                *b = u8::from(*p >= 0.0);
            }
            super::bit_pack(&bits, 1, d, 1, &mut out.codes2[r * sign_bytes..(r + 1) * sign_bytes]);
        }
        out
    });
    let mut parts: Vec<EncodedRows> = parts;
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.codes)), codes);
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.codes2)), signs);
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.norms)), norms);
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.norms2)), residual_norms);
}

/// Inverse of [`tq_prod_encode`]: `‖x‖ Πᵀ (c[idx] + scale · ‖r‖ · Sᵀ z)`, `z`
/// the ±1 signs, `‖r‖ = 1` when `mse_bits` is 0, `scale` = [`prod_scale`].
#[allow(clippy::too_many_arguments)]
pub fn tq_prod_decode<T: Float>(
    codes: &[u8],
    signs: &[u8],
    norms: &[f16],
    residual_norms: &[f16],
    rotation: Option<&[f32]>,
    centroids: &[f32],
    sketch: &[f32],
    d: usize,
    mse_bits: u32,
    scale: f32,
    out: &mut [T],
) {
    let n = norms.len();
    let code_bytes = if mse_bits > 0 { super::packed_len(d, mse_bits) } else { 0 };
    let sign_bytes = super::packed_len(d, 1);
    assert_eq!(out.len(), n * d, "out length");
    assert_eq!(codes.len(), n * code_bytes, "codes length");
    assert_eq!(signs.len(), n * sign_bytes, "signs length");
    assert_eq!(sketch.len(), d * d, "sketch size");
    let unrotation = rotation.map(|r| KernelRotation::inverse(r, d));
    super::for_each_chunk(out, d, 32, |row0, chunk| {
        let (mut y, mut acc) = (vec![0.0f32; d], vec![0.0f32; d]);
        for (r, o) in chunk.chunks_mut(d).enumerate() {
            let row = row0 + r;
            let rn = if mse_bits > 0 {
                let crow = &codes[row * code_bytes..(row + 1) * code_bytes];
                for (j, v) in y.iter_mut().enumerate() {
                    *v = centroids[code_at(crow, j, mse_bits)];
                }
                residual_norms[row].to_f32()
            } else {
                y.iter_mut().for_each(|v| *v = 0.0);
                1.0
            };
            let a = scale * rn;
            let srow = &signs[row * sign_bytes..(row + 1) * sign_bytes];
            for (k, sk) in sketch.chunks_exact(d).enumerate() {
                let z = if code_at(srow, k, 1) != 0 { a } else { -a };
                for (v, &s) in y.iter_mut().zip(sk) {
                    *v += z * s;
                }
            }
            unrotate_row(unrotation.as_ref(), &y, norms[row].to_f32(), &mut acc, o);
        }
    });
}

/// TurboQuant-RVQ encoding of `n = norms.len()` rows of `x` (`n * d`): the
/// `bits1`-bit index `a` of `y = Π x/‖x‖` in `first`, the `bits2`-bit index
/// of `y − first[a]` in `second` (both sorted), packed, and `‖x‖` in float16.
#[allow(clippy::too_many_arguments)]
pub fn tq_rvq_encode<T: VqElement>(
    x: &[T],
    rotation: Option<&[f32]>,
    first: &[f32],
    second: &[f32],
    d: usize,
    bits: (u32, u32),
    codes1: &mut [u8],
    codes2: &mut [u8],
    norms: &mut [f16],
) {
    let n = norms.len();
    let (b1, b2) = (super::packed_len(d, bits.0), super::packed_len(d, bits.1));
    assert_eq!(x.len(), n * d, "x length");
    assert_eq!((codes1.len(), codes2.len()), (n * b1, n * b2), "codes length");
    assert_eq!((first.len(), second.len()), (1 << bits.0, 1 << bits.1), "codebook lengths");
    let (bounds1, bounds2) = (super::scalar_boundaries(first), super::scalar_boundaries(second));
    let rot = rotation.map(|r| KernelRotation::new(r, d));
    let mut parts = super::parallel::map_row_ranges(n, 32, |row0, count| {
        let mut out = EncodedRows {
            codes: vec![0u8; count * b1],
            codes2: vec![0u8; count * b2],
            norms: vec![f16::ZERO; count],
            norms2: Vec::new(),
        };
        let (mut u, mut y, mut i1, mut i2) = (vec![0.0f32; d], vec![0.0f32; d], vec![0u8; d], vec![0u8; d]);
        let mut residual = vec![0.0f32; d];
        for r in 0..count {
            let s = normalize_rotate_row(&x[(row0 + r) * d..(row0 + r + 1) * d], rot.as_ref(), &mut u, &mut y);
            out.norms[r] = f16::from_f32(s.min(MAX_NORM));
            super::quant::scalar_codes(&bounds1, &y, &mut i1);
            for ((e, &v), &a) in residual.iter_mut().zip(&y).zip(&i1) {
                *e = v - first[a as usize];
            }
            super::quant::scalar_codes(&bounds2, &residual, &mut i2);
            super::bit_pack(&i1, 1, d, bits.0, &mut out.codes[r * b1..(r + 1) * b1]);
            super::bit_pack(&i2, 1, d, bits.1, &mut out.codes2[r * b2..(r + 1) * b2]);
        }
        out
    });
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.codes)), codes1);
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.codes2)), codes2);
    gather(parts.iter_mut().map(|p| std::mem::take(&mut p.norms)), norms);
}

/// Inverse of [`tq_rvq_encode`]: `‖x‖ Πᵀ (first[a] + second[b])`.
#[allow(clippy::too_many_arguments)]
pub fn tq_rvq_decode<T: Float>(
    codes1: &[u8],
    codes2: &[u8],
    norms: &[f16],
    rotation: Option<&[f32]>,
    first: &[f32],
    second: &[f32],
    d: usize,
    bits: (u32, u32),
    out: &mut [T],
) {
    let n = norms.len();
    let (b1, b2) = (super::packed_len(d, bits.0), super::packed_len(d, bits.1));
    assert_eq!(out.len(), n * d, "out length");
    assert_eq!((codes1.len(), codes2.len()), (n * b1, n * b2), "codes length");
    let unrotation = rotation.map(|r| KernelRotation::inverse(r, d));
    super::for_each_chunk(out, d, 32, |row0, chunk| {
        let (mut y, mut acc) = (vec![0.0f32; d], vec![0.0f32; d]);
        for (r, o) in chunk.chunks_mut(d).enumerate() {
            let row = row0 + r;
            let (c1, c2) = (&codes1[row * b1..(row + 1) * b1], &codes2[row * b2..(row + 1) * b2]);
            for (j, v) in y.iter_mut().enumerate() {
                *v = first[code_at(c1, j, bits.0)] + second[code_at(c2, j, bits.1)];
            }
            unrotate_row(unrotation.as_ref(), &y, norms[row].to_f32(), &mut acc, o);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_row_reads_every_width_as_code_at_does() {
        let table: Vec<f32> = (0..256).map(|i| i as f32 * 0.5 - 3.0).collect();
        let padded = padded_table(&table);
        for bits in 1..=8u32 {
            for d in [8usize, 16, 24, 64, 96] {
                let row: Vec<u8> = (0..d * bits as usize / 8).map(|i| (i * 37 + bits as usize * 11) as u8).collect();
                let mut got = vec![0.0f32; d];
                decode_row(&row, bits, &padded, 2.0, &mut got);
                let want: Vec<f32> = (0..d).map(|j| table[code_at(&row, j, bits)] * 2.0).collect();
                assert_eq!(got, want, "bits {bits} d {d}");
            }
        }
    }
}
