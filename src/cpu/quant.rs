//! The quantizer kernels on slices: scalar codebook, KIVI, QJL and product
//! quantization, each fused with `bit_pack`'s layout.
//!
//! The arithmetic is the GPU bodies' (float32, no fused multiply-add, the
//! same order of operations), so the Metal emulator and the CUDA tests can
//! compare with these functions, and for float32 input the codes equal those
//! of `crate::quant`.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::bitpack::{get_group, packed_len};
use super::vq::VqElement;

/// Element types the kernels read and write.
pub trait Float: VqElement + Default {
    fn from_f32(v: f32) -> Self;
}

impl Float for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Float for f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Float for bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Writes the low `b` bits of each of up to 8 `codes` into `dst`
/// (`bit_pack`'s layout for one group of 8 codes).
#[inline(always)]
fn put_group(codes: &[u8], b: usize, dst: &mut [u8]) {
    let mut word = 0u64;
    for (j, &c) in codes.iter().enumerate() {
        word |= u64::from(c) << (j * b);
    }
    for (k, byte) in dst.iter_mut().enumerate() {
        *byte = (word >> (8 * k)) as u8;
    }
}

/// Expands `$body` once per width up to 8 with `$b` that width as a
/// constant (so that the packing loops unroll: with the width known at run
/// time only they cost more than the quantization), else with `$b` 0 (read
/// `bits` at run time).
macro_rules! by_width {
    ($bits:expr, $b:ident => $body:expr) => {
        match $bits {
            1 => { const $b: usize = 1; $body }
            2 => { const $b: usize = 2; $body }
            3 => { const $b: usize = 3; $body }
            4 => { const $b: usize = 4; $body }
            5 => { const $b: usize = 5; $body }
            6 => { const $b: usize = 6; $body }
            7 => { const $b: usize = 7; $body }
            8 => { const $b: usize = 8; $body }
            _ => { const $b: usize = 0; $body }
        }
    };
}

/// Runs `f(row, codes_of_row)` for every row and packs the codes of each row
/// into `out` (`rows` × `packed_len(n, bits)`).
fn pack_rows(out: &mut [u8], rows: usize, n: usize, bits: u32, f: impl Fn(usize, &mut [u8]) + Sync) {
    let nbytes = packed_len(n, bits);
    assert_eq!(out.len(), rows * nbytes, "packed length");
    let full = n / 8;
    by_width!(bits, B => {
        let b = if B == 0 { bits as usize } else { B };
        super::for_each_chunk(out, nbytes, 256, |row0, chunk| {
            let mut codes = vec![0u8; n];
            for (r, dst) in chunk.chunks_mut(nbytes).enumerate() {
                f(row0 + r, &mut codes);
                let (head, tail) = codes.split_at(full * 8);
                for (group, d) in head.chunks_exact(8).zip(dst.chunks_exact_mut(b)) {
                    put_group(group, b, d);
                }
                if !tail.is_empty() {
                    put_group(tail, b, &mut dst[full * b..]);
                }
            }
        })
    })
}

/// Runs `f(row, codes_of_row, out_row)` for every row of `packed`.
fn unpack_rows<T: Send>(
    packed: &[u8],
    rows: usize,
    n: usize,
    bits: u32,
    out: &mut [T],
    f: impl Fn(usize, &[u8], &mut [T]) + Sync,
) {
    let nbytes = packed_len(n, bits);
    assert_eq!(packed.len(), rows * nbytes, "packed length");
    let row_len = out.len() / rows.max(1);
    let full = n / 8;
    by_width!(bits, B => {
        let b = if B == 0 { bits as usize } else { B };
        super::for_each_chunk(out, row_len, 256, |row0, chunk| {
            let mut codes = vec![0u8; n];
            for (r, dst) in chunk.chunks_mut(row_len).enumerate() {
                let src = &packed[(row0 + r) * nbytes..(row0 + r + 1) * nbytes];
                let (head, tail) = codes.split_at_mut(full * 8);
                for (group, s) in head.chunks_exact_mut(8).zip(src.chunks_exact(b)) {
                    get_group(s, b, group);
                }
                if !tail.is_empty() {
                    get_group(&src[full * b..], b, tail);
                }
                f(row0 + r, &codes, dst);
            }
        })
    })
}

// ------------------------------------------------------------ scalar codebook

/// The decision boundaries of a sorted scalar codebook: `0.5 * (c[i] + c[i+1])`
/// in float32, as `crate::quant::ScalarCodebook` computes them.
pub fn scalar_boundaries(codebook: &[f32]) -> Vec<f32> {
    codebook.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect()
}

/// For each of `v`, the number of boundaries strictly below it: the index of
/// the nearest centroid, a value on a boundary going down (NaN gives 0). One
/// pass over `v` per boundary, which vectorizes.
pub(crate) fn scalar_codes(bounds: &[f32], v: &[f32], out: &mut [u8]) {
    out.fill(0);
    for &t in bounds {
        for (c, &x) in out.iter_mut().zip(v) {
            *c += u8::from(t < x);
        }
    }
}

/// Quantizes `x` (`n * d`) against the sorted `codebook` (`2^bits` entries)
/// and packs the codes of each row into `out` (`n * packed_len(d, bits)`).
pub fn scalar_quantize<T: Float>(x: &[T], n: usize, d: usize, codebook: &[f32], bits: u32, out: &mut [u8]) {
    assert_eq!(x.len(), n * d, "x length");
    assert_eq!(codebook.len(), 1 << bits, "codebook length");
    let bounds = scalar_boundaries(codebook);
    pack_rows(out, n, d, bits, |r, codes| {
        let row: Vec<f32> = x[r * d..(r + 1) * d].iter().map(|v| v.to_f32()).collect();
        scalar_codes(&bounds, &row, codes);
    });
}

/// `codebook[code]` for every packed code, as `T`.
pub fn scalar_dequantize<T: Float>(packed: &[u8], n: usize, d: usize, codebook: &[f32], bits: u32, out: &mut [T]) {
    assert_eq!(out.len(), n * d, "out length");
    assert_eq!(codebook.len(), 1 << bits, "codebook length");
    unpack_rows(packed, n, d, bits, out, |_, codes, o| {
        for (v, &c) in o.iter_mut().zip(codes) {
            *v = T::from_f32(codebook[c as usize]);
        }
    });
}

// ------------------------------------------------------------------- KIVI

/// KIVI's code of `v` for a group with float16-rounded `scale` and `zero`:
/// `round((v - zero) / scale)` clamped to the levels, 0 for a constant group.
#[inline(always)]
pub fn kivi_code(v: f32, scale: f32, zero: f32, bits: u32) -> u8 {
    let x = (v - zero) / scale;
    // round-half-away-from-zero as trunc(x ± pred(0.5)) (exact for every
    // float; `f32::round` is a library call on baseline x86-64, this
    // vectorizes). Clamped to the levels before the conversion (the same
    // code: the bounds are integers), so that the conversion needs no
    // saturation and vectorizes too; NaN gives 0. Branch-free.
    let r = (x + HALF_DOWN.copysign(x)).max(0.0).min(((1u32 << bits) - 1) as f32) as u8;
    if scale > 0.0 { r } else { 0 }
}

/// The largest float below 0.5.
const HALF_DOWN: f32 = 0.499_999_97;

/// `(scale, zero)` in float16 for a group spanning `[lo, hi]`. A value beyond
/// the float16 range becomes infinity (the kernels cannot fail mid-graph).
#[inline(always)]
pub fn kivi_params(lo: f32, hi: f32, bits: u32) -> (f16, f16) {
    let levels = ((1u32 << bits) - 1) as f32;
    (f16::from_f32((hi - lo) / levels), f16::from_f32(lo))
}

/// KIVI group quantization of `x` (`n * d`). `per_channel` (keys): one
/// (scale, zero) per group of `group` consecutive rows and channel, `scales`
/// and `zeros` hold `ceil(n / group) * d`. Otherwise (values): one per row and
/// group of `group` consecutive channels (`group` divides `d`), `n * d / group`.
/// Codes are packed along each row into `codes` (`n * packed_len(d, bits)`).
#[allow(clippy::too_many_arguments)]
pub fn kivi_quantize<T: Float>(
    x: &[T],
    n: usize,
    d: usize,
    bits: u32,
    group: usize,
    per_channel: bool,
    codes: &mut [u8],
    scales: &mut [f16],
    zeros: &mut [f16],
) {
    assert_eq!(x.len(), n * d, "x length");
    assert!(group > 0 && (per_channel || d % group == 0), "group");
    let params = if per_channel { n.div_ceil(group) * d } else { n * d / group };
    assert!(scales.len() == params && zeros.len() == params, "scales/zeros length");
    // (scale, zero) per group, rows of parameters in parallel: per channel
    // (keys) a row is a group of `group` tokens (read token by token, so that
    // the reads are contiguous; min and max are exact whatever the order),
    // per token (values) a row is one token's `d / group` groups.
    let cols = if per_channel { d } else { d / group };
    let mut pairs = vec![(f16::ZERO, f16::ZERO); params];
    super::for_each_chunk(&mut pairs, cols, 16, |first, chunk| {
        let (mut lo, mut hi) = (vec![f32::INFINITY; cols], vec![f32::NEG_INFINITY; cols]);
        for (g, out) in (first..).zip(chunk.chunks_exact_mut(cols)) {
            lo.fill(f32::INFINITY);
            hi.fill(f32::NEG_INFINITY);
            if per_channel {
                for row in x[g * group * d..((g + 1) * group).min(n) * d].chunks_exact(d) {
                    for ((l, h), v) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
                        let v = v.to_f32();
                        *l = l.min(v);
                        *h = h.max(v);
                    }
                }
            } else {
                for ((l, h), grp) in lo.iter_mut().zip(hi.iter_mut()).zip(x[g * d..(g + 1) * d].chunks_exact(group)) {
                    (*l, *h) = min_max(grp);
                }
            }
            for ((o, &l), &h) in out.iter_mut().zip(&lo).zip(&hi) {
                *o = kivi_params(l, h, bits);
            }
        }
    });
    for ((s, z), &(ps, pz)) in scales.iter_mut().zip(zeros.iter_mut()).zip(&pairs) {
        *s = ps;
        *z = pz;
    }
    let (sf, zf) = (to_f32s(scales), to_f32s(zeros));
    pack_rows(codes, n, d, bits, |r, c| {
        let row = &x[r * d..(r + 1) * d];
        if per_channel {
            let p = (r / group) * d..(r / group + 1) * d;
            for ((code, v), (&s, &z)) in c.iter_mut().zip(row).zip(sf[p.clone()].iter().zip(&zf[p])) {
                *code = kivi_code(v.to_f32(), s, z, bits);
            }
        } else {
            for (k, (cg, xg)) in c.chunks_mut(group).zip(row.chunks(group)).enumerate() {
                // The group's parameters read once: indexed inside the loop,
                // the bounds checks kept it from vectorizing (1.7x slower).
                let p = r * d / group + k;
                let (s, z) = (sf[p], zf[p]);
                for (code, v) in cg.iter_mut().zip(xg) {
                    *code = kivi_code(v.to_f32(), s, z, bits);
                }
            }
        }
    });
}

/// Smallest and largest of `v` (NaN ignored; infinities for none), in eight
/// lanes that vectorize: min and max are exact in any order.
fn min_max<T: Float>(v: &[T]) -> (f32, f32) {
    let (mut lo, mut hi) = ([f32::INFINITY; 8], [f32::NEG_INFINITY; 8]);
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for ((l, h), x) in lo.iter_mut().zip(hi.iter_mut()).zip(c) {
            let x = x.to_f32();
            *l = l.min(x);
            *h = h.max(x);
        }
    }
    for x in tail {
        lo[0] = lo[0].min(x.to_f32());
        hi[0] = hi[0].max(x.to_f32());
    }
    (lo.iter().fold(f32::INFINITY, |a, &b| a.min(b)), hi.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)))
}

/// Float16 parameters as float32, converted once rather than per element.
fn to_f32s(v: &[f16]) -> Vec<f32> {
    // `half`'s slice conversion uses the CPU's F16C instructions when present.
    let mut out = vec![0.0f32; v.len()];
    v.convert_to_f32_slice(&mut out);
    out
}

/// `zero + scale * code` (float32, no fused multiply-add), as `T`.
#[allow(clippy::too_many_arguments)]
pub fn kivi_dequantize<T: Float>(
    codes: &[u8],
    scales: &[f16],
    zeros: &[f16],
    n: usize,
    d: usize,
    bits: u32,
    group: usize,
    per_channel: bool,
    out: &mut [T],
) {
    assert_eq!(out.len(), n * d, "out length");
    let (sf, zf) = (to_f32s(scales), to_f32s(zeros));
    unpack_rows(codes, n, d, bits, out, |r, c, o| {
        if per_channel {
            let p = (r / group) * d..(r / group + 1) * d;
            for ((v, &code), (&s, &z)) in o.iter_mut().zip(c).zip(sf[p.clone()].iter().zip(&zf[p])) {
                *v = T::from_f32(z + s * f32::from(code));
            }
        } else {
            for (k, (og, cg)) in o.chunks_mut(group).zip(c.chunks(group)).enumerate() {
                let (s, z) = (sf[r * d / group + k], zf[r * d / group + k]);
                for (v, &code) in og.iter_mut().zip(cg) {
                    *v = T::from_f32(z + s * f32::from(code));
                }
            }
        }
    });
}

// -------------------------------------------------------------------- QJL

/// A row-major `[m, d]` matrix held transposed, for `out[i] = Σ_j rows[i][j] *
/// x[j]`: float32, every sum in order of `j` from 0, no fused multiply-add
/// (the GPU bodies sum the same way). Walking the transpose keeps each sum's
/// order while the `m` sums advance together, contiguous in memory, which
/// vectorizes (one ordered sum alone is bound by the add's latency).
pub(crate) struct OrderedDots {
    t: Vec<f32>,
    m: usize,
    d: usize,
}

impl OrderedDots {
    pub(crate) fn new(rows: &[f32], m: usize, d: usize) -> Self {
        assert_eq!(rows.len(), m * d, "rows length");
        let mut t = vec![0.0f32; m * d];
        for (i, row) in rows.chunks_exact(d.max(1)).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                t[j * m + i] = v;
            }
        }
        OrderedDots { t, m, d }
    }

    /// The matrix `[m, d]` given by its transpose `[d, m]` (row-major), held
    /// as is: `out[i] = Σ_j t[j][i] * x[j]`.
    pub(crate) fn from_transpose(t: &[f32], m: usize, d: usize) -> Self {
        assert_eq!(t.len(), m * d, "transpose length");
        OrderedDots { t: t.to_vec(), m, d }
    }

    pub(crate) fn apply<T: VqElement>(&self, x: &[T], out: &mut [f32]) {
        assert_eq!((x.len(), out.len()), (self.d, self.m), "x / out length");
        out.fill(0.0);
        for (col, xj) in self.t.chunks_exact(self.m.max(1)).zip(x) {
            let xj = xj.to_f32();
            for (o, &v) in out.iter_mut().zip(col) {
                *o += v * xj;
            }
        }
    }
}

/// QJL encoding of keys `k` (`n * d`) with the sketch `s` (`m * d`, row
/// major): `signs` gets the packed bits `S k ≥ 0` (`n * ceil(m / 8)`),
/// `norms` the float16 `‖k‖` (float32 sum of squares in order).
pub fn qjl_encode<T: Float>(k: &[T], n: usize, d: usize, sketch: &[f32], m: usize, signs: &mut [u8], norms: &mut [f16]) {
    assert_eq!(k.len(), n * d, "k length");
    assert_eq!(sketch.len(), m * d, "sketch length");
    assert_eq!(norms.len(), n, "norms length");
    let dots = OrderedDots::new(sketch, m, d);
    pack_rows(signs, n, m, 1, |r, bits| {
        let mut proj = vec![0.0f32; m];
        dots.apply(&k[r * d..(r + 1) * d], &mut proj);
        for (b, p) in bits.iter_mut().zip(&proj) {
            *b = u8::from(*p >= 0.0);
        }
    });
    for (o, key) in norms.iter_mut().zip(k.chunks_exact(d.max(1))) {
        let mut acc = 0.0f32;
        for v in key {
            acc += v.to_f32() * v.to_f32();
        }
        *o = f16::from_f32(acc.sqrt());
    }
}

/// QJL scores of `nq` queries `q` (`nq * d`) against `n` encoded keys:
/// `out[i * n + t] = (√(π/2)/m · ‖k_t‖) · Σ_r ±(S q_i)_r`, the sign from bit
/// `r` of key `t`. Each query's signed sums over 8 sketch rows are tabled for
/// all 256 bytes, so that a key costs one lookup per sign byte; the sum's
/// order differs from a sequential one by float32 rounding.
#[allow(clippy::too_many_arguments)]
pub fn qjl_score<T: Float>(
    q: &[T],
    nq: usize,
    d: usize,
    sketch: &[f32],
    m: usize,
    signs: &[u8],
    norms: &[f16],
    n: usize,
    out: &mut [f32],
) {
    assert_eq!(q.len(), nq * d, "q length");
    assert_eq!(out.len(), nq * n, "scores length");
    let nbytes = packed_len(m, 1);
    assert_eq!(signs.len(), n * nbytes, "signs length");
    let mut sq = vec![0.0f32; nq * m];
    let dots = OrderedDots::new(sketch, m, d);
    for (i, out) in sq.chunks_exact_mut(m.max(1)).enumerate() {
        dots.apply(&q[i * d..(i + 1) * d], out);
    }
    // tables[(i * nbytes + p) * 256 + b] = Σ_j ±sq[i][8p + j], + where bit j
    // of b is set, over the rows that exist (the last byte may be partial).
    let mut tables = vec![0.0f32; nq * nbytes * 256];
    for (ip, table) in tables.chunks_exact_mut(256).enumerate() {
        let (i, p) = (ip / nbytes, ip % nbytes);
        let rows = &sq[i * m + 8 * p..i * m + (8 * p + 8).min(m)];
        table[0] = -rows.iter().sum::<f32>();
        for b in 1..256usize {
            let low = b.trailing_zeros() as usize;
            let add = rows.get(low).map_or(0.0, |v| 2.0 * v);
            table[b] = table[b & (b - 1)] + add;
        }
    }
    let scale = std::f32::consts::FRAC_PI_2.sqrt() / m as f32;
    super::for_each_chunk(out, 1, 4096, |first, chunk| {
        for (o, idx) in chunk.iter_mut().zip(first..) {
            let (i, t) = (idx / n, idx % n);
            let key = &signs[t * nbytes..(t + 1) * nbytes];
            let tab = &tables[i * nbytes * 256..(i + 1) * nbytes * 256];
            let mut acc = [0.0f32; 4];
            for (p, &byte) in key.iter().enumerate() {
                acc[p % 4] += tab[p * 256 + byte as usize];
            }
            *o = scale * norms[t].to_f32() * ((acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
    });
}

// --------------------------------------------------------------------- PQ

/// Index of the entry of `codebook` (`k * s`) nearest to `v`, with
/// `vq_quantize`'s arithmetic (ties to the lowest index).
#[inline(always)]
fn nearest<T: VqElement>(v: &[T], codebook: &[f32], s: usize) -> u16 {
    let mut best = f32::INFINITY;
    let mut best_i = 0u16;
    for (c, entry) in codebook.chunks_exact(s).enumerate() {
        let mut acc = 0.0f32;
        for (a, &b) in v.iter().zip(entry) {
            let diff = a.to_f32() - b;
            acc += diff * diff;
        }
        if acc < best {
            best = acc;
            best_i = c as u16;
        }
    }
    best_i
}

/// Bit widths of the product-quantization codes (as `crate::quant::pq`).
pub const PQ_BITS: std::ops::RangeInclusive<u32> = 1..=12;

/// Product quantization of `x` (`n * d`): each of the `d / s` sub-vectors of
/// `s` elements is replaced by the index of its nearest entry of `codebook`
/// (`k * s`, `k ≤ 2^bits`, `bits` in 1..=12). Codes are packed along the row in
/// `code_planes`: the low `lo` bits in `out`
/// (`n * packed_len(d / s, lo)`), the high `hi` bits in `out_hi` (empty when
/// `hi` is 0), `(lo, hi) = super::bitpack::code_planes(bits)`.
#[allow(clippy::too_many_arguments)]
pub fn pq_encode<T: Float>(
    x: &[T],
    n: usize,
    d: usize,
    codebook: &[f32],
    s: usize,
    bits: u32,
    out: &mut [u8],
    out_hi: &mut [u8],
) {
    assert_eq!(x.len(), n * d, "x length");
    assert!(s > 0 && d % s == 0 && codebook.len() % s == 0, "sub-vector size");
    assert!(PQ_BITS.contains(&bits), "bits");
    assert!(codebook.len() / s <= 1 << bits && !codebook.is_empty(), "codebook size");
    let per = d / s;
    let (lo, hi) = super::bitpack::code_planes(bits);
    let mut idx = vec![0u16; n * per];
    super::for_each_chunk(&mut idx, per, 256, |row0, chunk| {
        for (r, codes) in chunk.chunks_mut(per.max(1)).enumerate() {
            let row = &x[(row0 + r) * d..(row0 + r + 1) * d];
            for (p, c) in codes.iter_mut().enumerate() {
                *c = nearest(&row[p * s..(p + 1) * s], codebook, s);
            }
        }
    });
    let low_mask = (1u16 << lo) - 1;
    pack_rows(out, n, per, lo, |r, codes| {
        for (c, &i) in codes.iter_mut().zip(&idx[r * per..(r + 1) * per]) {
            *c = (i & low_mask) as u8;
        }
    });
    if hi > 0 {
        pack_rows(out_hi, n, per, hi, |r, codes| {
            for (c, &i) in codes.iter_mut().zip(&idx[r * per..(r + 1) * per]) {
                *c = (i >> lo) as u8;
            }
        });
    } else {
        assert!(out_hi.is_empty(), "no high plane at {bits} bits");
    }
}

/// Unpacks one row of `codes.len()` codes of `b` bits.
fn unpack_row(src: &[u8], b: usize, codes: &mut [u8]) {
    let nbytes = src.len();
    for (g, group) in codes.chunks_mut(8).enumerate() {
        get_group(&src[g * b..(g * b + b).min(nbytes)], b, group);
    }
}

/// The codebook entries of packed PQ codes (both planes, as [`pq_encode`]
/// writes them), as `T` (`n * d`).
#[allow(clippy::too_many_arguments)]
pub fn pq_decode<T: Float>(
    packed: &[u8],
    packed_hi: &[u8],
    n: usize,
    d: usize,
    codebook: &[f32],
    s: usize,
    bits: u32,
    out: &mut [T],
) {
    assert_eq!(out.len(), n * d, "out length");
    let k = codebook.len() / s;
    let per = d / s;
    let (lo, hi) = super::bitpack::code_planes(bits);
    let (nb_lo, nb_hi) = (packed_len(per, lo), if hi > 0 { packed_len(per, hi) } else { 0 });
    assert_eq!(packed.len(), n * nb_lo, "packed length");
    assert_eq!(packed_hi.len(), n * nb_hi, "high plane length");
    super::for_each_chunk(out, d, 256, |row0, chunk| {
        let (mut low, mut high) = (vec![0u8; per], vec![0u8; per]);
        for (r, o) in chunk.chunks_mut(d).enumerate() {
            let row = row0 + r;
            unpack_row(&packed[row * nb_lo..(row + 1) * nb_lo], lo as usize, &mut low);
            if hi > 0 {
                unpack_row(&packed_hi[row * nb_hi..(row + 1) * nb_hi], hi as usize, &mut high);
            }
            for p in 0..per {
                let c = usize::from(low[p]) | usize::from(high[p]) << lo;
                // A code past the codebook (corrupt input) reads entry 0, as the GPU bodies do.
                let c = if c < k { c } else { 0 };
                for (v, &e) in o[p * s..(p + 1) * s].iter_mut().zip(&codebook[c * s..(c + 1) * s]) {
                    *v = T::from_f32(e);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn kivi_rounding_equals_round_half_away_from_zero() {
        // The 4000 floats around every half and every integer from -3 to 300
        // (where rounding can go wrong), tiny values, and the specials.
        let mut xs = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, f32::MIN_POSITIVE, -0.0, 0.0];
        for k in -6..=600 {
            let c = k as f32 / 2.0;
            for i in 0..2000u32 {
                xs.push(f32::from_bits(c.to_bits().wrapping_add(i)));
                xs.push(f32::from_bits(c.to_bits().wrapping_sub(i)));
            }
        }
        for x in xs {
            for bits in [1u32, 8] {
                let want = x.round().clamp(0.0, ((1u32 << bits) - 1) as f32) as u8;
                assert_eq!(super::kivi_code(x, 1.0, 0.0, bits), want, "x = {x:e}, bits = {bits}");
            }
        }
    }

    #[test]
    fn scalar_round_trip_and_boundaries_go_down() {
        let cb = [-1.0f32, 0.0, 0.5, 2.0];
        let x = [-5.0f32, -0.5, -0.4, 0.25, 1.2, 1.25, 9.0];
        let mut p = vec![0u8; packed_len(7, 2)];
        scalar_quantize(&x, 1, 7, &cb, 2, &mut p);
        let mut back = vec![0.0f32; 7];
        scalar_dequantize(&p, 1, 7, &cb, 2, &mut back);
        assert_eq!(back, [-1.0, -1.0, 0.0, 0.0, 0.5, 0.5, 2.0]);
    }

    #[test]
    fn qjl_signs_and_score() {
        // S = I (m = d = 2): signs of k, score = √(π/2)/2 · ‖k‖ · (±q0 ± q1).
        let s = [1.0f32, 0.0, 0.0, 1.0];
        let k = [3.0f32, -4.0];
        let (mut signs, mut norms) = (vec![0u8; 1], vec![f16::ZERO; 1]);
        qjl_encode(&k, 1, 2, &s, 2, &mut signs, &mut norms);
        assert_eq!((signs[0], norms[0].to_f32()), (1, 5.0));
        let mut out = [0.0f32];
        qjl_score(&[1.0f32, -1.0], 1, 2, &s, 2, &signs, &norms, 1, &mut out);
        let want = std::f32::consts::FRAC_PI_2.sqrt() / 2.0 * 5.0 * 2.0;
        assert!((out[0] - want).abs() < 1e-5, "{}", out[0]);
    }
}
