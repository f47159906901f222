//! `vq_quantize`: the nearest centroid of each vector.


use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{cpu_primitive, grid_1d, sizes, select, Implementation, Options, Kernel};
use crate::array::Array;
use crate::cpu;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// Sub-vector sizes the fused kernels are compiled for.
pub const VQ_DIMS: [usize; 3] = [2, 4, 8];
/// The largest codebook the kernels accept.
pub const MAX_CODEBOOK_SIZE: usize = 4096;

/// Rows per chunk of the reference graph, which materialises a
/// `[chunk, K, d]` difference: about 16M elements per chunk.
pub fn vq_quantize_reference_chunk_rows(k: usize, d: usize) -> usize {
    ((1usize << 24) / (k * d).max(1)).max(1)
}

fn check(x: &Array, codebook: &Array) -> Result<(usize, usize, usize)> {
    super::check_float("x", x)?;
    if codebook.dtype() != x.dtype() {
        return Err(Error::Dtype {
            argument: "codebook",
            found: codebook.dtype().to_string(),
            expected: format!("{} (the dtype of x)", x.dtype()),
        });
    }
    if x.ndim() == 0 {
        return Err(Error::invalid("x", "must have at least one dimension (the vector size d)"));
    }
    let xs = x.shape();
    let d = *xs.last().expect("ndim >= 1") as usize;
    if !VQ_DIMS.contains(&d) {
        return Err(Error::invalid("x", format!("vector size (last dimension) {d} is not supported; use one of {VQ_DIMS:?}")));
    }
    let cs = codebook.shape();
    if cs.len() != 2 || cs[1] as usize != d {
        return Err(Error::invalid("codebook", format!("shape {cs:?} must be [K, {d}] to match x's vector size {d}")));
    }
    let k = cs[0] as usize;
    if k == 0 || k > MAX_CODEBOOK_SIZE {
        return Err(Error::invalid("codebook", format!("{k} centroids; use 1 to {MAX_CODEBOOK_SIZE}")));
    }
    let n = xs[..xs.len() - 1].iter().map(|&v| v as usize).product();
    Ok((n, k, d))
}

/// The index (uint32) of the centroid of `codebook` `[K, d]` nearest to each
/// vector of `x` `[..., d]`; the result has shape `x.shape[:-1]`.
pub fn vq_quantize(x: &Array, codebook: &Array, opts: &Options) -> Result<Array> {
    let (n, k, d) = check(x, codebook)?;
    let stream = opts.resolve_stream()?;
    let xs = x.shape();
    let out_shape = xs[..xs.len() - 1].to_vec();
    let imp = select(Kernel::VqQuantize, opts.policy, &stream)?;
    if n == 0 {
        return ops::zeros(&out_shape, Dtype::U32, &stream);
    }
    let n_i32 = i32::try_from(n).map_err(|_| Error::invalid("x", format!("{n} vectors exceed 2^31")))?;
    let flat = ops::reshape(x, &[n_i32, d as i32], &stream)?;
    let out = vec![(vec![n_i32], Dtype::U32)];
    let indices = match imp {
        Implementation::Reference => reference(&flat, codebook, n, k, d, &stream)?,
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::VqQuantize.name(),
                &[&flat, codebook],
                &out,
                &stream,
                Box::new(move |ins, outs| {
                    let o = outs[0].as_mut_slice::<u32>()?;
                    cpu_primitive::by_dtype!(dtype, T => cpu::vq_quantize(ins[0].as_slice::<T>()?, ins[1].as_slice::<T>()?, n, k, d, o));
                    Ok(())
                }),
            )?
            .remove(0)
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "x", &[n, k])?;
            let (grid, threadgroup) = grid_1d("x", n)?;
            gpu::launch(
                &Launch {
                    kernel: Kernel::VqQuantize,
                    inputs: &[&flat, codebook, &p],
                    outputs: &out,
                    grid,
                    threadgroup,
                    template: &[("T", TemplateArg::Dtype(x.dtype())), ("D", TemplateArg::Int(d as i32))],
                },
                &stream,
            )?
            .remove(0)
        }
    };
    ops::reshape(&indices, &out_shape, &stream)
}

/// Reference graph: per chunk of rows, the full `[chunk, K, d]` difference,
/// squared, summed, argmin; the path the fused kernels replace.
fn reference(x: &Array, codebook: &Array, n: usize, k: usize, d: usize, s: &Stream) -> Result<Array> {
    let xf = ops::astype(x, Dtype::F32, s)?;
    let cb = ops::expand_dims(&ops::astype(codebook, Dtype::F32, s)?, 0, s)?;
    let chunk = vq_quantize_reference_chunk_rows(k, d);
    let mut parts = Vec::with_capacity(n.div_ceil(chunk));
    for start in (0..n).step_by(chunk) {
        let stop = (start + chunk).min(n);
        let rows = ops::slice(&xf, &[start as i32, 0], &[stop as i32, d as i32], s)?;
        let diff = ops::subtract(&ops::expand_dims(&rows, 1, s)?, &cb, s)?;
        let dist = ops::sum_axis(&ops::square(&diff, s)?, -1, false, s)?;
        parts.push(ops::astype(&ops::argmin_axis(&dist, -1, false, s)?, Dtype::U32, s)?);
    }
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    ops::concatenate(&parts, 0, s)
}
