//! Every codec's definition, one block each, and the registry that finds
//! them. A new codec is a variant of [`Codec`] (with its GPU name, in
//! `layout.rs`), a block here, its entry in [`DEFS`], and its arms in the
//! attention bodies (CPU, Metal, CUDA).

use super::tables::{centroids, e4m3_grid, kivi_bit_offsets, pq_codebook, qjl_sketch, uniform_grid, E4M3_MAX};
use super::{Codec, CodecDef, Encoded, SideCodec, SideLayout};
use crate::array::Array;
use crate::cpu::kv_attention::{sketch_scale, KvShape};
use crate::cpu::packed_len;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::kernels::kv_attention::KvSideArrays;
use crate::kernels::turboquant::tq_encode;
use crate::kernels::{self, times_transpose, KiviMode, Options, Policy};
use crate::ops;
use crate::quant::ScalarCodebook;
use crate::stream::Stream;

/// The definitions, in the order of [`Codec::ALL`] (the ids).
pub(super) static DEFS: [&dyn CodecDef; 10] = [
    &Dense,
    &TurboQuantMse(false),
    &KiviPerChannel,
    &KiviPerToken,
    &ProductQuantized,
    &Qjl,
    &TurboQuantProd,
    &TurboQuantRvq,
    &Fp8,
    &TurboQuantMse(true),
];

/// A two-stage code row (TurboQuant-Prod, -RVQ): the first stage's `bits −
/// 1`-bit codes, then one bit per channel (the residual's sign or code).
fn two_stage_row_len(sc: &SideCodec, dim: usize) -> usize {
    sc.first_len(dim) + packed_len(dim, 1)
}

/// NaN where a token of `x` `[B, Hkv, m, D]` holds a NaN or an infinity or
/// its norm exceeds float16's range, 0 elsewhere, float32 `[B, Hkv, m]`
/// (`[B, Hkv, m, 1]` with `keep`): the norm as float16, times 0.
pub(super) fn norm_non_finite(x: &Array, keep: bool, s: &Stream) -> Result<Array> {
    let xf = ops::astype(x, Dtype::F32, s)?;
    let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, s)?, -1, keep, s)?, s)?;
    ops::multiply(&ops::astype(&ops::astype(&norm, Dtype::F16, s)?, Dtype::F32, s)?, &Array::scalar_f32(0.0)?, s)
}

/// `x` * 0 (NaN exactly where `x` is NaN or infinite), float32. KIVI's
/// float16 scales and zeros overflow to infinities, which decode non-finite.
fn times_zero(x: &Array, s: &Stream) -> Result<Array> {
    ops::multiply(&ops::astype(x, Dtype::F32, s)?, &Array::scalar_f32(0.0)?, s)
}

/// The norm of each token of `x`, float16 `[B, Hkv, m]` (saturated at
/// float16's largest, as `tq_encode` stores it), and its unit vector, float32.
fn norm_unit(x: &Array, s: &Stream) -> Result<(Array, Array)> {
    let sh = x.shape();
    let xf = ops::astype(x, Dtype::F32, s)?;
    let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, s)?, -1, true, s)?, s)?;
    let unit = ops::divide(&xf, &ops::maximum(&norm, &Array::scalar_f32(f32::MIN_POSITIVE)?, s)?, s)?;
    let norm = ops::minimum(&norm, &Array::scalar_f32(crate::cpu::turboquant::MAX_NORM)?, s)?;
    Ok((ops::reshape(&ops::astype(&norm, Dtype::F16, s)?, &sh[..3], s)?, unit))
}

fn missing(l: &SideLayout, what: &str) -> Error {
    Error::invalid("layer", format!("{:?} needs {what}", l.codec))
}

/// The compressed tokens' code bytes `[lo, hi)` of each row, `[B, Hkv, n, hi − lo]`.
fn code_bytes(side: &KvSideArrays<'_>, sh: &KvShape, lo: usize, hi: usize, s: &Stream) -> Result<Array> {
    let (b, h, n) = (sh.batch as i32, sh.kv_heads as i32, sh.compressed as i32);
    ops::slice(side.codes, &[0, 0, 0, lo as i32], &[b, h, n, hi as i32], s)
}

/// `count` codes of `bits` bits from bytes `[lo, hi)` of each row, uint32.
fn unpacked(side: &KvSideArrays<'_>, sh: &KvShape, lo: usize, hi: usize, bits: u32, count: usize, s: &Stream) -> Result<Array> {
    let off = Options::on(s.clone(), Policy::Off);
    ops::astype(&kernels::bit_unpack(&code_bytes(side, sh, lo, hi, s)?, bits, count, &off)?, Dtype::U32, s)
}

/// The compressed tokens' norms `[B, Hkv, n, 1]`, float32, from norms stored
/// `[B, Hkv, slots]`.
fn token_norms(l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (b, h, n) = (sh.batch as i32, sh.kv_heads as i32, sh.compressed as i32);
    let norms = ops::slice(side.scales.ok_or_else(|| missing(l, "norms"))?, &[0, 0, 0], &[b, h, n], s)?;
    ops::expand_dims(&ops::astype(&norms, Dtype::F32, s)?, -1, s)
}

/// `table[code] · norm` for every element of the compressed tokens (one
/// `bits`-bit code an element, a norm or scale a token), float32.
fn table_times_norm(l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, table_name: &str, s: &Stream) -> Result<Array> {
    let idx = unpacked(side, sh, 0, l.row_len, l.bits, sh.dim, s)?;
    let vals = ops::take_axis(side.table.ok_or_else(|| missing(l, table_name))?, &idx, 0, s)?;
    ops::multiply(&vals, &token_norms(l, side, sh, s)?, s)
}

/// The compressed tokens' rows of a `[B, Hkv, rows, cols]` parameter array, float32.
fn params_of(l: &SideLayout, a: Option<&Array>, what: &str, sh: &KvShape, s: &Stream) -> Result<Array> {
    let a = a.ok_or_else(|| missing(l, what))?;
    let (b, h) = (sh.batch as i32, sh.kv_heads as i32);
    let rows = l.param_rows(sh.compressed) as i32;
    ops::astype(&ops::slice(a, &[0, 0, 0, 0], &[b, h, rows, l.param_cols as i32], s)?, Dtype::F32, s)
}

/// ±1 from sign bits.
fn signs(bits: &Array, s: &Stream) -> Result<Array> {
    let z = ops::astype(bits, Dtype::F32, s)?;
    ops::subtract(&ops::multiply(&z, &Array::scalar_f32(2.0)?, s)?, &Array::scalar_f32(1.0)?, s)
}

/// `Σ_r z_r S[r, :]`, exactly where small (see `times_transpose`).
fn sketch_t(z: &Array, sketch: &Array, s: &Stream) -> Result<Array> {
    times_transpose(z, &ops::transpose(sketch, &[1, 0], s)?, s)
}

/// The sketched query `c · S q'` for a sketch of `m` rows.
fn sketched_query(framed: &Array, sketch: &Array, m: usize, s: &Stream) -> Result<Array> {
    ops::multiply(&times_transpose(framed, sketch, s)?, &Array::scalar_f32(sketch_scale(m))?, s)
}

/// `x` in a buffer of its own. The sketch starts a few floats into the
/// table, and a matrix at such an offset makes cuBLASLt refuse the matmul
/// (NOT_SUPPORTED: its kernels assume aligned operands).
fn aligned(x: &Array, s: &Stream) -> Result<Array> {
    ops::add(x, &Array::scalar_f32(0.0)?, s)
}

/// KIVI's (scales, zeros) spread over the compressed tokens' elements,
/// `[B, Hkv, n, D]` each: rows along `axis` repeat `group` times.
fn kivi_params(l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, axis: i32, len: usize, s: &Stream) -> Result<(Array, Array)> {
    let idx: Vec<u32> = (0..len).map(|i| (i / l.group) as u32).collect();
    let idx = Array::from_slice(&idx, &[len as i32])?;
    let scales = ops::take_axis(&params_of(l, side.scales, "scales", sh, s)?, &idx, axis, s)?;
    let zeros = ops::take_axis(&params_of(l, side.zeros, "zeros", sh, s)?, &idx, axis, s)?;
    Ok((scales, zeros))
}

/// KIVI's encoder over `x` `[B, Hkv, m, D]`, per head.
fn kivi_encode(l: &SideLayout, x: &Array, mode: KiviMode, opts: &Options) -> Result<Encoded> {
    let s = opts.resolve_stream()?;
    let sh = x.shape();
    let (b, h, m, d) = (sh[0], sh[1], sh[2], sh[3]);
    // Per channel, groups of rows never cross heads: m is a whole number of groups.
    let (codes, scales, zeros) = kernels::kivi_quantize(&ops::reshape(x, &[b * h * m, d], &s)?, l.bits, l.group, mode, opts)?;
    let per_head = |a: Array, rows: usize, cols: usize| ops::reshape(&a, &[b, h, rows as i32, cols as i32], &s);
    let (rows, cols) = (l.param_rows(m as usize), l.param_cols);
    Ok(Encoded {
        codes: per_head(codes, m as usize, l.row_len)?,
        scales: Some(per_head(scales, rows, cols)?),
        zeros: Some(per_head(zeros, rows, cols)?),
    })
}

/// KIVI keys' codes `[B, Hkv, n, row]` read at the bit offsets of `layout`
/// (`kivi_bit_offsets`: a stride, then the heads' rows), float32 `[B, Hkv,
/// n, D]`. A code of at most 8 bits spans at most two bytes: `((byte[o/8] |
/// byte[o/8 + 1] << 8) >> o%8) & (2^width − 1)`, gathered head by head
/// (each may have its own offsets).
fn kivi_codes_at(codes: &Array, layout: &Array, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (h, d) = (sh.kv_heads as i32, sh.dim as i32);
    let cs = codes.shape();
    let (b, n, row) = (cs[0], cs[2], cs[3]);
    // Row h of the table starts at 1 + h * stride (the stride is on the device).
    let stride = ops::slice(layout, &[0], &[1], s)?;
    let heads = Array::from_slice(&(0..h).map(|i| i as f32).collect::<Vec<_>>(), &[h, 1])?;
    let cols = Array::from_slice(&(0..=d).map(|c| (c + 1) as f32).collect::<Vec<_>>(), &[1, d + 1])?;
    let at = ops::astype(&ops::add(&ops::multiply(&heads, &stride, s)?, &cols, s)?, Dtype::U32, s)?;
    let offsets = ops::astype(&ops::take(layout, &at, s)?, Dtype::U32, s)?;
    let start = ops::slice(&offsets, &[0, 0], &[h, d], s)?;
    let end = ops::slice(&offsets, &[0, 1], &[h, d + 1], s)?;
    let u32s = |v: u32| Array::from_slice(&[v], &[1]);
    let byte = ops::right_shift(&start, &u32s(3)?, s)?;
    let next = ops::minimum(&ops::add(&byte, &u32s(1)?, s)?, &u32s(row as u32 - 1)?, s)?;
    let shift = ops::bitwise_and(&start, &u32s(7)?, s)?;
    let mask = ops::subtract(&ops::left_shift(&u32s(1)?, &ops::subtract(&end, &start, s)?, s)?, &u32s(1)?, s)?;
    let wide = ops::astype(codes, Dtype::U32, s)?;
    let heads = (0..h)
        .map(|i| -> Result<Array> {
            let of = |a: &Array| -> Result<Array> { ops::reshape(&ops::slice(a, &[i, 0], &[i + 1, d], s)?, &[d], s) };
            let x = ops::slice(&wide, &[0, i, 0, 0], &[b, i + 1, n, row], s)?;
            let lo = ops::take_axis(&x, &of(&byte)?, 3, s)?;
            let hi = ops::left_shift(&ops::take_axis(&x, &of(&next)?, 3, s)?, &u32s(8)?, s)?;
            let v = ops::right_shift(&ops::bitwise_or(&lo, &hi, s)?, &of(&shift)?, s)?;
            ops::bitwise_and(&v, &of(&mask)?, s)
        })
        .collect::<Result<Vec<_>>>()?;
    ops::astype(&ops::concatenate(&heads, 1, s)?, Dtype::F32, s)
}

/// A two-stage codec's first stage: the `bits − 1`-bit codes of `unit`
/// into the `first` codebook, and the residual they leave, float32.
fn first_stage(l: &SideLayout, unit: &Array, first: &Array, opts: &Options) -> Result<(Array, Array)> {
    let d = unit.shape()[3] as usize;
    let codes = kernels::scalar_quantize(unit, first, l.bits - 1, opts)?;
    let approx = kernels::scalar_dequantize(&codes, first, l.bits - 1, d, Dtype::F32, opts)?;
    Ok((codes, ops::subtract(unit, &approx, &opts.resolve_stream()?)?))
}

struct Dense;

impl CodecDef for Dense {
    fn codec(&self) -> Codec {
        Codec::Dense
    }
    fn rotated(&self) -> bool {
        false
    }
    fn row_len(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        0
    }
    fn encode(&self, _l: &SideLayout, x: &Array, _table: Option<&Array>, _widths: Option<&[u8]>, dtype: Dtype, opts: &Options) -> Result<Encoded> {
        Ok(Encoded { codes: ops::astype(x, dtype, &opts.resolve_stream()?)?, scales: None, zeros: None })
    }
    fn decode(&self, _l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        ops::astype(&code_bytes(side, sh, 0, sh.dim, s)?, Dtype::F32, s)
    }
}

/// TurboQuant-MSE, on the Lloyd–Max centroids (`TurboQuantMse(false)`) or
/// on a uniform grid (`TurboQuantMse(true)`, `Codec::TurboQuantUniform`):
/// one encoder, non-finite marks and decode, two tables.
struct TurboQuantMse(bool);

impl CodecDef for TurboQuantMse {
    fn codec(&self) -> Codec {
        if self.0 {
            Codec::TurboQuantUniform
        } else {
            Codec::TurboQuantMse
        }
    }
    fn rotated(&self) -> bool {
        true
    }
    fn flat_norms(&self) -> bool {
        true
    }
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(if self.0 { uniform_grid(dim, sc.bits)? } else { centroids(dim, sc.bits)? }))
    }
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let table = table.ok_or_else(|| missing(l, "its centroids"))?;
        let (codes, norms) = tq_encode(x, None, table, l.bits, opts)?;
        Ok(Encoded { codes, scales: Some(norms), zeros: None })
    }
    /// `tq_encode` holds a norm at float16's largest (65504) for a token
    /// with a NaN or an infinity or a norm past that range (NaN where a
    /// back-end's min keeps NaN): one pass over the norms instead of
    /// computing them again from `x`, the rule `store_write` applies.
    fn mark_non_finite(&self, _l: &SideLayout, _x: &Array, scales: &Array, s: &Stream) -> Result<Array> {
        crate::kernels::stored_norms(scales, s)
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        table_times_norm(l, side, sh, "centroids", s)
    }
}

struct KiviPerChannel;

impl CodecDef for KiviPerChannel {
    fn codec(&self) -> Codec {
        Codec::KiviPerChannel
    }
    fn rotated(&self) -> bool {
        false
    }
    fn tokens_per_param_row(&self, sc: &SideCodec) -> usize {
        sc.group
    }
    fn param_cols(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    fn has_zeros(&self) -> bool {
        true
    }
    fn scales_name(&self) -> &'static str {
        "scales"
    }
    /// The uniform bit offsets (one row every head reads); a layer with
    /// unequal widths holds its own.
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(kivi_bit_offsets(None, dim, sc.bits)))
    }
    fn encode(&self, l: &SideLayout, x: &Array, _table: Option<&Array>, widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        match widths {
            Some(widths) => {
                let (codes, scales, zeros) = kernels::kivi_quantize_widths(x, widths, l.bits, l.group, &opts.resolve_stream()?)?;
                Ok(Encoded { codes, scales: Some(scales), zeros: Some(zeros) })
            }
            None => kivi_encode(l, x, KiviMode::Keys, opts),
        }
    }
    /// Per token group and channel: the group's tokens share their scales
    /// in that channel, so they decode to NaN together.
    fn non_finite(&self, l: &SideLayout, x: &Array, s: &Stream) -> Result<Array> {
        let sh = x.shape();
        let (b, h, m, d) = (sh[0], sh[1], sh[2], sh[3]);
        let g = l.group as i32;
        ops::sum_axis(&ops::reshape(&times_zero(x, s)?, &[b, h, m / g, g, d], s)?, 3, false, s)
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let (scales, zeros) = kivi_params(l, side, sh, 2, sh.compressed, s)?;
        let codes = match side.table {
            Some(layout) => kivi_codes_at(&code_bytes(side, sh, 0, l.row_len, s)?, layout, sh, s)?,
            None => ops::astype(&unpacked(side, sh, 0, l.row_len, l.bits, sh.dim, s)?, Dtype::F32, s)?,
        };
        ops::add(&zeros, &ops::multiply(&scales, &codes, s)?, s)
    }
}

struct KiviPerToken;

impl CodecDef for KiviPerToken {
    fn codec(&self) -> Codec {
        Codec::KiviPerToken
    }
    fn rotated(&self) -> bool {
        false
    }
    fn param_cols(&self, sc: &SideCodec, dim: usize) -> usize {
        dim / sc.group
    }
    fn has_zeros(&self) -> bool {
        true
    }
    fn scales_name(&self) -> &'static str {
        "scales"
    }
    fn encode(&self, l: &SideLayout, x: &Array, _table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        kivi_encode(l, x, KiviMode::Values, opts)
    }
    /// Per token `[B, Hkv, m, 1]`, for every channel group.
    fn non_finite(&self, _l: &SideLayout, x: &Array, s: &Stream) -> Result<Array> {
        ops::sum_axis(&times_zero(x, s)?, -1, true, s)
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let (scales, zeros) = kivi_params(l, side, sh, 3, sh.dim, s)?;
        let codes = ops::astype(&unpacked(side, sh, 0, l.row_len, l.bits, sh.dim, s)?, Dtype::F32, s)?;
        ops::add(&zeros, &ops::multiply(&scales, &codes, s)?, s)
    }
}

struct ProductQuantized;

impl CodecDef for ProductQuantized {
    fn codec(&self) -> Codec {
        Codec::ProductQuantized
    }
    fn rotated(&self) -> bool {
        true
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    fn flat_norms(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        packed_len(dim / sc.group, sc.bits)
    }
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(pq_codebook(dim, sc.group)?))
    }
    /// The query, then its lookup table: one row of `2^bits` entries per sub-vector.
    fn query_features(&self, sc: &SideCodec, dim: usize) -> usize {
        dim + dim / sc.group * (1 << sc.bits)
    }
    /// The unit vector's sub-vectors into the codebook (8-bit codes: one
    /// plane, no high bits).
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let (norm, unit) = norm_unit(x, &s)?;
        let table = table.ok_or_else(|| missing(l, "its codebook"))?;
        let codebook = ops::reshape(table, &[1 << l.bits, l.group as i32], &s)?;
        let codes = kernels::pq_encode(&unit, &codebook, l.bits, opts)?.codes;
        Ok(Encoded { codes, scales: Some(norm), zeros: None })
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let idx = unpacked(side, sh, 0, l.row_len, l.bits, sh.dim / l.group, s)?;
        let table = side.table.ok_or_else(|| missing(l, "its codebook"))?;
        let entries = ops::reshape(table, &[1 << l.bits, l.group as i32], s)?;
        let shape = [sh.batch as i32, sh.kv_heads as i32, sh.compressed as i32, sh.dim as i32];
        let vals = ops::reshape(&ops::take_axis(&entries, &idx, 0, s)?, &shape, s)?;
        ops::multiply(&vals, &token_norms(l, side, sh, s)?, s)
    }
    /// The lookup table ⟨q_p, codebook[c]⟩: [..., D/s, s] x [s, K].
    fn query_extras(&self, l: &SideLayout, framed: &Array, table: Option<&Array>, sh: &KvShape, s: &Stream) -> Result<Option<Array>> {
        let table = table.ok_or_else(|| missing(l, "its codebook"))?;
        let (sub, entries) = (l.group as i32, 1i32 << l.bits);
        let lead = [sh.batch as i32, sh.q_heads as i32, sh.queries as i32];
        let parts = ops::reshape(framed, &[lead[0], lead[1], lead[2], sh.dim as i32 / sub, sub], s)?;
        let codebook_t = ops::transpose(&ops::reshape(table, &[entries, sub], s)?, &[1, 0], s)?;
        let lut = ops::sum_axis(&ops::multiply(&ops::expand_dims(&parts, -1, s)?, &codebook_t, s)?, -2, false, s)?;
        Ok(Some(ops::reshape(&lut, &[lead[0], lead[1], lead[2], sh.dim as i32 / sub * entries], s)?))
    }
}

struct Qjl;

impl Qjl {
    /// The table is the sketch `[m, D]`, whole.
    fn sketch(l: &SideLayout, table: Option<&Array>, dim: usize, s: &Stream) -> Result<Array> {
        ops::reshape(table.ok_or_else(|| missing(l, "its sketch"))?, &[l.sketch_rows as i32, dim as i32], s)
    }
}

impl CodecDef for Qjl {
    fn codec(&self) -> Codec {
        Codec::Qjl
    }
    fn rotated(&self) -> bool {
        false
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    fn flat_norms(&self) -> bool {
        true
    }
    /// `bits` sketch rows per channel (`m = bits * dim`), one sign bit each.
    fn sketch_rows(&self, sc: &SideCodec, dim: usize) -> usize {
        sc.bits as usize * dim
    }
    fn table(&self, sc: &SideCodec, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(qjl_sketch(self.sketch_rows(sc, dim), dim, seed)))
    }
    /// The query, then the sketched query (one float per sketch row).
    fn query_features(&self, sc: &SideCodec, dim: usize) -> usize {
        dim + self.sketch_rows(sc, dim)
    }
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let (norm, _) = norm_unit(x, &s)?;
        let sketch = Self::sketch(l, table, x.shape()[3] as usize, &s)?;
        let (signs, _) = kernels::qjl_encode(x, &sketch, opts)?;
        Ok(Encoded { codes: signs, scales: Some(norm), zeros: None })
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let sketch = Self::sketch(l, side.table, sh.dim, s)?;
        let z = signs(&unpacked(side, sh, 0, l.row_len, 1, l.sketch_rows, s)?, s)?;
        let unit = ops::multiply(&sketch_t(&z, &sketch, s)?, &Array::scalar_f32(sketch_scale(l.sketch_rows))?, s)?;
        ops::multiply(&unit, &token_norms(l, side, sh, s)?, s)
    }
    fn query_extras(&self, l: &SideLayout, framed: &Array, table: Option<&Array>, sh: &KvShape, s: &Stream) -> Result<Option<Array>> {
        let sketch = Self::sketch(l, table, sh.dim, s)?;
        Ok(Some(sketched_query(framed, &sketch, l.sketch_rows, s)?))
    }
}

struct TurboQuantProd;

/// A two-stage codec's table split after the first stage's `2^(bits − 1)`
/// centroids: those, and the second stage's part as it follows them.
fn first_stage_split(l: &SideLayout, table: Option<&Array>, s: &Stream) -> Result<(Array, Array)> {
    let table = table.ok_or_else(|| missing(l, "its table"))?;
    let (first, len) = (1i32 << (l.bits - 1), table.shape()[0]);
    Ok((ops::slice(table, &[0], &[first], s)?, ops::slice(table, &[first], &[len], s)?))
}

impl TurboQuantProd {
    /// The table's two parts: the first stage's centroids and the residual's
    /// sketch `[D, D]`.
    fn parts(l: &SideLayout, table: Option<&Array>, dim: usize, s: &Stream) -> Result<(Array, Array)> {
        let (first, rest) = first_stage_split(l, table, s)?;
        Ok((first, aligned(&ops::reshape(&rest, &[dim as i32, dim as i32], s)?, s)?))
    }
}

impl CodecDef for TurboQuantProd {
    fn codec(&self) -> Codec {
        Codec::TurboQuantProd
    }
    fn rotated(&self) -> bool {
        true
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        two_stage_row_len(sc, dim)
    }
    fn first_len(&self, sc: &SideCodec, dim: usize) -> usize {
        packed_len(dim, sc.bits - 1)
    }
    /// Norm and residual norm.
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        2
    }
    /// First-stage centroids, then the residual's `dim x dim` sketch.
    fn table(&self, sc: &SideCodec, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
        let mut t = centroids(dim, sc.bits - 1)?;
        t.extend(qjl_sketch(dim, dim, seed));
        Ok(Some(t))
    }
    /// The query, then the sketched query.
    fn query_features(&self, sc: &SideCodec, dim: usize) -> usize {
        dim + self.sketch_rows(sc, dim)
    }
    /// First stage: `bits − 1`-bit codes of the unit vector; then the
    /// residual's QJL signs and norm.
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let d = x.shape()[3] as usize;
        let (norm, unit) = norm_unit(x, &s)?;
        let (first, sketch) = Self::parts(l, table, d, &s)?;
        let (codes1, residual) = first_stage(l, &unit, &first, opts)?;
        let (signs, rnorm) = kernels::qjl_encode(&residual, &sketch, opts)?;
        let scales = ops::concatenate(&[ops::expand_dims(&norm, -1, &s)?, ops::expand_dims(&rnorm, -1, &s)?], 3, &s)?;
        Ok(Encoded { codes: ops::concatenate(&[codes1, signs], 3, &s)?, scales: Some(scales), zeros: None })
    }
    /// Per token `[B, Hkv, m, 1]`, for both of its norms.
    fn non_finite(&self, _l: &SideLayout, x: &Array, s: &Stream) -> Result<Array> {
        norm_non_finite(x, true, s)
    }
    /// `norm · (ŷ + √(π/2)/D · ‖r‖ · Sᵀ z)`.
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let (first, sketch) = Self::parts(l, side.table, sh.dim, s)?;
        let stage1 = ops::take_axis(&first, &unpacked(side, sh, 0, l.first_len, l.bits - 1, sh.dim, s)?, 0, s)?;
        let z = signs(&unpacked(side, sh, l.first_len, l.row_len, 1, sh.dim, s)?, s)?;
        // (norm, residual norm) `[B, Hkv, n, 2]`.
        let scales = params_of(l, side.scales, "norms", sh, s)?;
        let (b, h, n) = (sh.batch as i32, sh.kv_heads as i32, sh.compressed as i32);
        let norm = ops::slice(&scales, &[0, 0, 0, 0], &[b, h, n, 1], s)?;
        let rnorm = ops::slice(&scales, &[0, 0, 0, 1], &[b, h, n, 2], s)?;
        let c = Array::scalar_f32(sketch_scale(sh.dim))?;
        let qjl = ops::multiply(&ops::multiply(&sketch_t(&z, &sketch, s)?, &c, s)?, &rnorm, s)?;
        ops::multiply(&ops::add(&stage1, &qjl, s)?, &norm, s)
    }
    fn query_extras(&self, l: &SideLayout, framed: &Array, table: Option<&Array>, sh: &KvShape, s: &Stream) -> Result<Option<Array>> {
        let (_, sketch) = Self::parts(l, table, sh.dim, s)?;
        Ok(Some(sketched_query(framed, &sketch, l.sketch_rows, s)?))
    }
}

struct TurboQuantRvq;

impl CodecDef for TurboQuantRvq {
    fn codec(&self) -> Codec {
        Codec::TurboQuantRvq
    }
    fn rotated(&self) -> bool {
        true
    }
    fn flat_norms(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        two_stage_row_len(sc, dim)
    }
    fn first_len(&self, sc: &SideCodec, dim: usize) -> usize {
        packed_len(dim, sc.bits - 1)
    }
    /// First-stage centroids, then the residual's 1-bit codebook.
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        let mut t = centroids(dim, sc.bits - 1)?;
        let second = ScalarCodebook::sphere_residual(dim, sc.bits - 1, 1).map_err(|e| Error::invalid("bits", e.to_string()))?;
        t.extend_from_slice(second.centroids());
        Ok(Some(t))
    }
    /// First stage: `bits − 1`-bit codes of the unit vector; then the
    /// residual's 1-bit codes.
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let (norm, unit) = norm_unit(x, &s)?;
        let (first, second) = first_stage_split(l, table, &s)?;
        let (codes1, residual) = first_stage(l, &unit, &first, opts)?;
        let codes2 = kernels::scalar_quantize(&residual, &second, 1, opts)?;
        Ok(Encoded { codes: ops::concatenate(&[codes1, codes2], 3, &s)?, scales: Some(norm), zeros: None })
    }
    /// `norm · (c1 + c2)`.
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        let (first, second) = first_stage_split(l, side.table, s)?;
        let stage1 = ops::take_axis(&first, &unpacked(side, sh, 0, l.first_len, l.bits - 1, sh.dim, s)?, 0, s)?;
        let stage2 = ops::take_axis(&second, &unpacked(side, sh, l.first_len, l.row_len, 1, sh.dim, s)?, 0, s)?;
        ops::multiply(&ops::add(&stage1, &stage2, s)?, &token_norms(l, side, sh, s)?, s)
    }
}

struct Fp8;

impl CodecDef for Fp8 {
    fn codec(&self) -> Codec {
        Codec::Fp8
    }
    fn rotated(&self) -> bool {
        false
    }
    fn flat_norms(&self) -> bool {
        true
    }
    fn scales_name(&self) -> &'static str {
        "scales"
    }
    fn table(&self, _sc: &SideCodec, _dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(e4m3_grid()))
    }
    /// `scale = max|x| / 448` per token, rounded to float16 before the
    /// elements divide by it, so that decoding multiplies by what is stored.
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, _widths: Option<&[u8]>, _dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let sh = x.shape();
        let xf = ops::astype(x, Dtype::F32, &s)?;
        let magnitude = ops::maximum(&xf, &ops::multiply(&xf, &Array::scalar_f32(-1.0)?, &s)?, &s)?;
        let scale = ops::divide(&ops::max_axis(&magnitude, -1, true, &s)?, &Array::scalar_f32(E4M3_MAX)?, &s)?;
        let scale = ops::astype(&ops::maximum(&scale, &Array::scalar_f32(half::f16::MIN_POSITIVE.to_f32())?, &s)?, Dtype::F16, &s)?;
        let unit = ops::divide(&xf, &ops::astype(&scale, Dtype::F32, &s)?, &s)?;
        let codes = kernels::scalar_quantize(&unit, table.ok_or_else(|| missing(l, "its grid"))?, l.bits, opts)?;
        Ok(Encoded { codes, scales: Some(ops::reshape(&scale, &sh[..3], &s)?), zeros: None })
    }
    /// Per token `[B, Hkv, m]`: a scale is finite wherever the token is.
    fn non_finite(&self, _l: &SideLayout, x: &Array, s: &Stream) -> Result<Array> {
        ops::sum_axis(&times_zero(x, s)?, -1, false, s)
    }
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array> {
        table_times_norm(l, side, sh, "its grid", s)
    }
}
