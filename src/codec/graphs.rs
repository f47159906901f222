//! A compressed side's host graphs, built from its codec's hooks: its tokens
//! decoded with MLX ops (the reference, and the prefill's buffers for codecs
//! without a fused one) and the query rows the fused attention scores keys
//! against. [`CodecGraphs`] hands the last two to `kv_attention`, which
//! cannot name the codecs' definitions: they build on it.

use super::SideLayout;
use crate::array::Array;
use crate::cpu::kv_attention::KvShape;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::kernels::kv_attention::{KvGraphs, KvLayer, KvSideArrays};
use crate::kernels::{self, times_transpose, Options};
use crate::ops;
use crate::stream::Stream;

/// The compressed tokens of one side decoded in its frame, float32
/// `[B, Hkv, compressed, D]`, with plain MLX ops.
pub fn decode_compressed(side: &KvSideArrays<'_>, l: &SideLayout, sh: &KvShape, s: &Stream) -> Result<Array> {
    l.codec.def().decode(l, side, sh, s)
}

/// One side's tokens in its frame, float32 `[B, Hkv, total, D]`, in position
/// order (sinks, compressed, recent).
pub fn decode_framed(side: &KvSideArrays<'_>, l: &SideLayout, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let win = ops::astype(side.window, Dtype::F32, s)?;
    let mut parts = Vec::new();
    if sh.sinks > 0 {
        parts.push(ops::slice(&win, &[0, 0, 0, 0], &[b, h, sh.sinks as i32, d], s)?);
    }
    if sh.compressed > 0 {
        parts.push(decode_compressed(side, l, sh, s)?);
    }
    if sh.recent > 0 {
        let w0 = sh.sinks as i32;
        parts.push(ops::slice(&win, &[0, 0, w0, 0], &[b, h, w0 + sh.recent as i32, d], s)?);
    }
    ops::concatenate(&parts, 2, s)
}

/// One side's tokens in its frame and `dtype`, as the parts of position
/// order (sinks, compressed, recent) for a caller to concatenate with more:
/// TurboQuant-MSE codes through the fused `scalar_dequantize` (one pass,
/// no float32 intermediate), other codecs through the reference decode.
pub fn framed_parts(side: &KvSideArrays<'_>, l: &SideLayout, sh: &KvShape, dtype: Dtype, opts: &Options) -> Result<Vec<Array>> {
    let s = &opts.resolve_stream()?;
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let mut parts = Vec::new();
    if sh.sinks > 0 {
        parts.push(ops::slice(side.window, &[0, 0, 0, 0], &[b, h, sh.sinks as i32, d], s)?);
    }
    if sh.compressed > 0 {
        let n = sh.compressed as i32;
        parts.push(match (l.codec, side.table, side.scales) {
            (c, Some(table), Some(norms)) if c.turboquant_mse() => {
                let codes = ops::slice(side.codes, &[0, 0, 0, 0], &[b, h, n, l.row_len as i32], s)?;
                let unit = kernels::scalar_dequantize(&codes, table, l.bits, sh.dim, dtype, opts)?;
                let norms = ops::astype(&ops::slice(norms, &[0, 0, 0], &[b, h, n], s)?, dtype, s)?;
                ops::multiply(&unit, &ops::expand_dims(&norms, -1, s)?, s)?
            }
            _ => ops::astype(&decode_compressed(side, l, sh, s)?, dtype, s)?,
        });
    }
    if sh.recent > 0 {
        let w0 = sh.sinks as i32;
        parts.push(ops::slice(side.window, &[0, 0, w0, 0], &[b, h, w0 + sh.recent as i32, d], s)?);
    }
    Ok(parts)
}

/// One side's tokens back in the model's frame, float32 `[B, Hkv, total, D]`.
pub fn decode(layer: &KvLayer<'_>, values: bool, s: &Stream) -> Result<Array> {
    let sh = &layer.shape;
    let (side, l) = if values { (&layer.values, &sh.value) } else { (&layer.keys, &sh.key) };
    let framed = decode_framed(side, l, sh, s)?;
    match layer.rotation_for(l)? {
        Some(rot) => ops::matmul(&framed, rot, s),
        None => Ok(framed),
    }
}

/// What `kv_attention` takes from the codecs' definitions.
pub struct CodecGraphs;

impl KvGraphs for CodecGraphs {
    /// `scale * q` in the key frame, then what the key codec scores against
    /// besides it (a lookup table, a sketched query).
    fn prepare_queries(&self, q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
        let sh = layer.shape;
        let qf = ops::astype(q, Dtype::F32, s)?;
        let framed = match layer.rotation_for(&sh.key)? {
            None => qf,
            Some(rot) => times_transpose(&qf, rot, s)?,
        };
        let framed = ops::multiply(&framed, &Array::scalar_f32(scale)?, s)?;
        match sh.key.codec.def().query_extras(&sh.key, &framed, layer.keys.table, &sh, s)? {
            Some(extras) => ops::concatenate(&[framed, extras], 3, s),
            None => Ok(framed),
        }
    }

    /// Both sides decoded, then MLX's attention.
    fn reference(&self, q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
        let keys = decode(layer, false, s)?;
        let values = decode(layer, true, s)?;
        let qf = ops::astype(q, Dtype::F32, s)?;
        let sh = layer.shape;
        let o = match layer.mask {
            Some(m) => ops::scaled_dot_product_attention_masked(&qf, &keys, &values, scale, m, s)?,
            None => ops::scaled_dot_product_attention(&qf, &keys, &values, scale, sh.causal && sh.queries > 1, s)?,
        };
        ops::astype(&o, q.dtype(), s)
    }
}
