//! `framed_dequantize`: one TurboQuant-MSE side of a compressed layer as the
//! buffer a prefill chunk attends over (sinks, the compressed history
//! decoded with its norms, the recent window, the chunk), in one operation.
//!
//! As plain ops that is a dequantization, a multiply by the norms and a
//! concatenation, each writing the whole history: at 32K tokens of an 8B
//! model's layer ~0.1 ms of copies per side on the H200, and a dozen ops a
//! layer for the host.

use super::gpu::{self, Launch};
use super::{check_bits, check_float, cpu_primitive, grid_1d, select, sizes, Implementation, Kernel, Options, TemplateArg};
use crate::array::Array;
use crate::cpu::framed_dequantize::{self as cpu_framed, FramedShape};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// One side's arrays as the cache holds them.
pub struct FramedSide<'a> {
    /// The float16 window `[B, Hkv, W, D]` (sinks, then recent tokens).
    pub window: &'a Array,
    /// The store's packed codes `[B, Hkv, capacity, D·bits/8]` (uint8).
    pub codes: &'a Array,
    /// The store's norms `[B, Hkv, capacity]` (float16).
    pub norms: &'a Array,
    /// The codebook `[2^bits]` (float32).
    pub table: &'a Array,
    /// The chunk's tokens in the side's frame `[B, Hkv, L, D]`.
    pub chunk: &'a Array,
    pub bits: u32,
    /// Sinks held, compressed tokens, recent tokens and the window slot of
    /// the first recent token.
    pub sinks: usize,
    pub compressed: usize,
    pub recent: usize,
    pub recent_at: usize,
}

impl FramedSide<'_> {
    fn check(&self) -> Result<FramedShape> {
        let ws = self.window.shape();
        if ws.len() != 4 {
            return Err(Error::invalid("window", format!("shape {ws:?}, expected [batch, heads, slots, dim]")));
        }
        let (b, h, w, d) = (ws[0], ws[1], ws[2], ws[3]);
        let dtype = self.window.dtype();
        check_float("window", self.window)?;
        if d % 8 != 0 {
            return Err(Error::invalid("window", format!("head dimension {d} is not a multiple of 8")));
        }
        check_bits("bits", self.bits)?;
        let cs = self.codes.shape();
        let row = crate::cpu::packed_len(d as usize, self.bits) as i32;
        if cs.len() != 4 || cs[..2] != [b, h] || cs[3] != row || self.codes.dtype() != Dtype::U8 {
            return Err(Error::invalid("codes", format!("{:?} {cs:?}, expected uint8 [{b}, {h}, capacity, {row}]", self.codes.dtype())));
        }
        let cap = cs[2];
        if self.norms.shape() != [b, h, cap] || self.norms.dtype() != Dtype::F16 {
            return Err(Error::invalid("norms", format!("{:?} {:?}, expected float16 [{b}, {h}, {cap}]", self.norms.dtype(), self.norms.shape())));
        }
        if self.table.shape() != [1 << self.bits] || self.table.dtype() != Dtype::F32 {
            return Err(Error::invalid("table", format!("{:?} {:?}, expected float32 [{}]", self.table.dtype(), self.table.shape(), 1 << self.bits)));
        }
        let ls = self.chunk.shape();
        if ls.len() != 4 || ls[..2] != [b, h] || ls[3] != d || self.chunk.dtype() != dtype {
            return Err(Error::invalid("chunk", format!("{:?} {ls:?}, expected {dtype} [{b}, {h}, tokens, {d}]", self.chunk.dtype())));
        }
        if self.sinks > self.recent_at || self.recent_at + self.recent > w as usize {
            return Err(Error::invalid("recent", format!("sinks {} and recent slots {}..{} do not fit {w} window slots", self.sinks, self.recent_at, self.recent_at + self.recent)));
        }
        if self.compressed > cap as usize {
            return Err(Error::invalid("compressed", format!("{} tokens exceed the stores' {cap} slots", self.compressed)));
        }
        Ok(FramedShape {
            rows: (b * h) as usize,
            dim: d as usize,
            bits: self.bits,
            sinks: self.sinks,
            compressed: self.compressed,
            recent: self.recent,
            recent_at: self.recent_at,
            window_slots: w as usize,
            capacity: cap as usize,
            chunk: ls[2] as usize,
        })
    }
}

/// `[B, Hkv, sinks + compressed + recent + L, D]` in the window's dtype:
/// the sinks, `table[code]·norm` of each compressed token (rounded once),
/// the recent tokens, then the chunk.
pub fn framed_dequantize(a: &FramedSide<'_>, opts: &Options) -> Result<Array> {
    let sh = a.check()?;
    let stream = opts.resolve_stream()?;
    let dtype = a.window.dtype();
    let ws = a.window.shape();
    let out = vec![ws[0], ws[1], sh.total() as i32, ws[3]];
    match select(Kernel::FramedDequantize, opts.policy, &stream)? {
        Implementation::Reference => reference(a, &sh, &out, &stream),
        Implementation::Cpu => cpu_primitive::apply_one(
            Kernel::FramedDequantize.name(),
            &[a.window, a.codes, a.norms, a.table, a.chunk],
            (out, dtype),
            &stream,
            Box::new(move |ins, outs| {
                let (codes, norms, table) = (ins[1].as_slice::<u8>()?, ins[2].as_slice::<half::f16>()?, ins[3].as_slice::<f32>()?);
                cpu_primitive::by_dtype!(dtype, T => cpu_framed::framed_dequantize(
                    ins[0].as_slice::<T>()?, codes, norms, table, ins[4].as_slice::<T>()?, &sh, outs[0].as_mut_slice::<T>()?));
                Ok(())
            }),
        ),
        imp @ (Implementation::Metal | Implementation::Cuda) => {
            let p = sizes(imp, "window", &[sh.rows, sh.sinks, sh.compressed, sh.recent, sh.recent_at, sh.window_slots, sh.capacity, sh.chunk])?;
            let (grid, threadgroup) = grid_1d("window", sh.rows * sh.total() * (sh.dim / 8))?;
            let template = [("T", TemplateArg::Dtype(dtype)), ("D", TemplateArg::Int(sh.dim as i32)), ("B_BITS", TemplateArg::Int(a.bits as i32))];
            let inputs = [a.window, a.codes, a.norms, a.table, a.chunk, &p];
            let mut outs = gpu::launch(&Launch { kernel: Kernel::FramedDequantize, inputs: &inputs, outputs: &[(out, dtype)], grid, threadgroup, template: &template }, &stream)?;
            Ok(outs.remove(0))
        }
    }
}

/// The same as plain MLX ops.
fn reference(a: &FramedSide<'_>, sh: &FramedShape, out: &[i32], s: &Stream) -> Result<Array> {
    let (b, h, d) = (out[0], out[1], out[3]);
    let window = |lo: usize, n: usize| ops::slice(a.window, &[0, 0, lo as i32, 0], &[b, h, (lo + n) as i32, d], s);
    let mut parts = vec![window(0, sh.sinks)?];
    let n = sh.compressed as i32;
    let codes = ops::slice(a.codes, &[0, 0, 0, 0], &[b, h, n, sh.row_bytes() as i32], s)?;
    let off = Options::on(s.clone(), super::Policy::Off);
    let unit = super::scalar_dequantize(&codes, a.table, a.bits, sh.dim, Dtype::F32, &off)?;
    let norms = ops::astype(&ops::slice(a.norms, &[0, 0, 0], &[b, h, n], s)?, Dtype::F32, s)?;
    parts.push(ops::astype(&ops::multiply(&unit, &ops::expand_dims(&norms, -1, s)?, s)?, a.window.dtype(), s)?);
    parts.push(window(sh.recent_at, sh.recent)?);
    parts.push(a.chunk.clone());
    ops::concatenate(&parts, 2, s)
}
