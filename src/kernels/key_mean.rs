//! `key_mean`: a compressed layer's key mean over its first chunk and that
//! mean's offset in the keys' frame, in one operation.
//!
//! As plain ops that is nine launches a layer (the finite entries' mask, the
//! sum, the division, the product into the frame and the casts) in a
//! prompt's first chunk, each a few microseconds of host and GPU time.

use super::gpu::{self, Launch};
use super::{check_float, cpu_primitive, select, Implementation, Kernel, Options, TemplateArg};
use crate::array::Array;
use crate::cpu::key_mean::{self as cpu_key_mean, KeyMeanShape};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// Threads of one `key_mean` threadgroup, which reduces one (batch, head)
/// row: CUDA's blocks take 1024 (a 2048-token chunk is 32 loads a thread);
/// Metal's lanes' sums must fit its 32 KB of threadgroup memory.
fn threads(imp: Implementation) -> i32 {
    if imp == Implementation::Cuda { 1024 } else { 512 }
}

/// The keys a layer's mean is taken over, and the frame they enter.
pub struct KeyMean<'a> {
    /// The first chunk's keys `[B, Hkv, T, D]`.
    pub keys: &'a Array,
    /// `F·Π` float32 `[D, D]` when the keys' frame is rotated, else `None`.
    pub rotation: Option<&'a Array>,
    /// The frame's scale `F` (a power of two).
    pub frame: f32,
}

impl KeyMean<'_> {
    fn check(&self) -> Result<KeyMeanShape> {
        check_float("keys", self.keys)?;
        let ks = self.keys.shape();
        if ks.len() != 4 || ks[2] == 0 {
            return Err(Error::invalid("keys", format!("shape {ks:?}, expected [batch, heads, tokens, head_dim] with tokens")));
        }
        let d = ks[3];
        super::turboquant::check_head_dim("keys", d as usize)?;
        if let Some(r) = self.rotation {
            super::turboquant::check_f32("rotation", r, &[d, d])?;
        }
        if !(self.frame >= 1.0 && self.frame.log2().fract() == 0.0) {
            return Err(Error::invalid("frame", format!("{} is not a power of two (the frame's scale)", self.frame)));
        }
        Ok(KeyMeanShape { rows: (ks[0] * ks[1]) as usize, tokens: ks[2] as usize, dim: d as usize, frame: self.frame })
    }
}

/// The keys' mean float32 `[B, Hkv, 1, D]` over the tokens, a NaN or an
/// infinity counted as 0 (so that a non-finite key shifts no other key),
/// and the offset `[B, Hkv, 1, D]` in the keys' dtype that every framed key
/// gets added: [`mean_offset`] of that mean.
pub fn key_mean(a: &KeyMean<'_>, opts: &Options) -> Result<(Array, Array)> {
    let sh = a.check()?;
    let stream = opts.resolve_stream()?;
    let ks = a.keys.shape();
    let out_shape = vec![ks[0], ks[1], 1, ks[3]];
    let dtype = a.keys.dtype();
    let outputs = [(out_shape.clone(), Dtype::F32), (out_shape, dtype)];
    let imp = select(Kernel::KeyMean, opts.policy, &stream)?;
    let mut outs = match imp {
        Implementation::Reference => return reference(a, &stream),
        Implementation::Cpu => {
            let inputs: Vec<&Array> = [Some(a.keys), a.rotation].into_iter().flatten().collect();
            cpu_primitive::apply(
                Kernel::KeyMean.name(),
                &inputs,
                &outputs,
                &stream,
                Box::new(move |ins, outs| {
                    let rotation = if ins.len() > 1 { Some(ins[1].as_slice::<f32>()?) } else { None };
                    let (mean, offset) = outs.split_at_mut(1);
                    cpu_primitive::by_dtype!(dtype, T => cpu_key_mean::key_mean(
                        ins[0].as_slice::<T>()?, rotation, &sh, mean[0].as_mut_slice::<f32>()?, offset[0].as_mut_slice::<T>()?,
                    ));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            // Without a rotation the bodies never read that input: a float32
            // scalar stands in, so that every launch has one signature.
            let stand_in;
            let rotation = match a.rotation {
                Some(r) => r,
                None => {
                    stand_in = Array::scalar_f32(0.0)?;
                    &stand_in
                }
            };
            let rows = i32::try_from(sh.rows).map_err(|_| Error::invalid("keys", "too many rows"))?;
            let tg = threads(imp);
            let grid = rows.checked_mul(tg).ok_or_else(|| Error::invalid("keys", "too many rows for one launch"))?;
            gpu::launch(
                &Launch {
                    kernel: Kernel::KeyMean,
                    inputs: &[a.keys, rotation],
                    outputs: &outputs,
                    grid: (grid, 1, 1),
                    threadgroup: (tg, 1, 1),
                    template: &[
                        ("T", TemplateArg::Dtype(dtype)),
                        ("D", TemplateArg::Int(sh.dim as i32)),
                        ("ROTATE", TemplateArg::Bool(a.rotation.is_some())),
                        ("FRAME", TemplateArg::Int(sh.frame as i32)),
                        ("TG", TemplateArg::Int(tg)),
                    ],
                },
                &stream,
            )?
        }
    };
    let offset = outs.remove(1);
    Ok((outs.remove(0), offset))
}

/// `−mean` in the keys' frame, in `dtype`: `−mean·Πᵀ/F` when `rotation`
/// (`F·Π`) is given, else `−mean/F`; what every new key gets added.
pub(crate) fn mean_offset(mean: &Array, rotation: Option<&Array>, frame: f32, dtype: Dtype, s: &Stream) -> Result<Array> {
    let framed = match rotation {
        Some(r) => {
            let into = ops::multiply(&ops::transpose(r, &[1, 0], s)?, &Array::scalar_f32(-1.0 / (frame * frame))?, s)?;
            ops::matmul(mean, &into, s)?
        }
        None => ops::multiply(mean, &Array::scalar_f32(-1.0 / frame)?, s)?,
    };
    ops::astype(&framed, dtype, s)
}

/// The same as plain MLX ops.
fn reference(a: &KeyMean<'_>, s: &Stream) -> Result<(Array, Array)> {
    let kf = ops::astype(a.keys, Dtype::F32, s)?;
    let zero = Array::scalar_f32(0.0)?;
    // x·0 is NaN exactly where x is a NaN or an infinity.
    let bad = ops::astype(&ops::multiply(&kf, &zero, s)?, Dtype::Bool, s)?;
    let kf = ops::where_(&bad, &zero, &kf, s)?;
    let sum = ops::sum_axis(&kf, 2, true, s)?;
    let mean = ops::divide(&sum, &Array::scalar_f32(a.keys.shape()[2] as f32)?, s)?;
    let offset = mean_offset(&mean, a.rotation, a.frame, a.keys.dtype(), s)?;
    Ok((mean, offset))
}
