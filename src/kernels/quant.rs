//! The quantizer kernels: scalar codebook, KIVI, QJL and product
//! quantization, each fused with bit packing (contracts in docs/KERNELS.md).
//!
//! Every function checks its arguments, then builds one of the four
//! implementations lazily on the stream. Element types are float32, float16
//! and bfloat16; codebooks and sketches are float32; scales, zeros and norms
//! float16; codes uint8 in `bit_pack`'s layout.

use half::f16;

use super::bitpack::{pack_reference, unpack_reference};
use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{check_bits, check_float, cpu_primitive, grid_1d, sizes, select, to_i32, Implementation, Options, Policy, Kernel, fragment_blocks, THREADGROUP};
use crate::array::Array;
use crate::cpu;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// Sub-vector sizes of the product-quantization kernels.
pub const PQ_SUB_DIMS: [usize; 3] = [2, 4, 8];
/// `Q * m` limit of the fused `qjl_score` (S q lives in threadgroup memory);
/// larger requests run the reference graph under `auto`.
pub const QJL_SCORE_MAX_QM: usize = 4096;
/// Threads of a CUDA `qjl_score` launch at most: 512 blocks of 256, one
/// resident wave on an H200 (132 SMs of 4 such blocks, as registers allow).
/// Every block copies S q and builds its tables first, so more blocks would
/// repeat that work (with S q from its own kernel, 132 to 528 blocks ran
/// within 3% of each other at N = 1M).
const QJL_SCORE_CUDA_THREADS: usize = 1 << 17;

/// How KIVI groups elements for one (scale, zero) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KiviMode {
    /// Per channel over `group` consecutive rows (tokens); scales `[ceil(N/G), D]`.
    Keys,
    /// Per row over `group` consecutive channels (a multiple of 8 dividing D); scales `[N, D/G]`.
    Values,
}

fn check_dtype(argument: &'static str, a: &Array, want: Dtype) -> Result<()> {
    if a.dtype() == want {
        Ok(())
    } else {
        Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: want.to_string() })
    }
}

fn check_out_dtype(dtype: Dtype) -> Result<()> {
    if matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        Ok(())
    } else {
        Err(Error::Dtype { argument: "dtype", found: dtype.to_string(), expected: super::FLOAT_TYPES.into() })
    }
}

/// `(rows, last)` of an array of at least one dimension.
fn rows_last(argument: &'static str, a: &Array) -> Result<(usize, usize)> {
    if a.ndim() == 0 {
        return Err(Error::invalid(argument, "must have at least one dimension"));
    }
    let s = a.shape();
    Ok((s[..s.len() - 1].iter().map(|&v| v as usize).product(), *s.last().expect("ndim >= 1") as usize))
}

/// A 2-D `[rows, n]` argument.
fn matrix(argument: &'static str, a: &Array) -> Result<(usize, usize)> {
    let s = a.shape();
    if s.len() != 2 {
        return Err(Error::invalid(argument, format!("shape {s:?} must be 2-D")));
    }
    Ok((s[0] as usize, s[1] as usize))
}

/// `shape[:-1] + [last]`.
fn with_last(shape: &[i32], last: usize) -> Result<Vec<i32>> {
    let mut s = shape.to_vec();
    *s.last_mut().expect("ndim >= 1") = to_i32("shape", last)?;
    Ok(s)
}

fn f32_scalar(v: f32) -> Result<Array> {
    Array::scalar_f32(v)
}

/// Rows per chunk of a reference graph that materialises `[chunk, per_row]`.
fn chunk_rows(per_row: usize) -> usize {
    ((1usize << 24) / per_row.max(1)).max(1)
}

/// `f` over chunks of rows of `x` `[n, ...]`, concatenated.
fn chunked(x: &Array, n: usize, per_row: usize, s: &Stream, f: impl Fn(&Array) -> Result<Array>) -> Result<Array> {
    let chunk = chunk_rows(per_row);
    if n <= chunk {
        return f(x);
    }
    let shape = x.shape();
    let mut parts = Vec::new();
    for start in (0..n).step_by(chunk) {
        let mut lo = vec![0i32; shape.len()];
        let mut hi = shape.clone();
        lo[0] = start as i32;
        hi[0] = (start + chunk).min(n) as i32;
        parts.push(f(&ops::slice(x, &lo, &hi, s)?)?);
    }
    ops::concatenate(&parts, 0, s)
}

/// A one-thread-per-item GPU launch with a single output.
fn launch_gpu(
    kernel: Kernel,
    inputs: &[&Array],
    outputs: &[(Vec<i32>, Dtype)],
    items: (&'static str, usize),
    template: &[(&'static str, TemplateArg)],
    s: &Stream,
) -> Result<Vec<Array>> {
    let (grid, threadgroup) = grid_1d(items.0, items.1)?;
    gpu::launch(&Launch { kernel, inputs, outputs, grid, threadgroup, template }, s)
}

/// Work items each thread of a CUDA body that takes `ITEMS` handles (the
/// Metal bodies take one): more bytes in flight per thread, and a block's
/// set-up paid once per `ITEMS` items.
const SCALAR_Q_ITEMS: usize = 4;
/// From this many elements of a float16 or bfloat16 input, CUDA
/// scalar_quantize codes by a table of the 65536 codes of the type's values
/// (`cuda/scalar_quantize.cu`, `TABLE`), which each block builds once in
/// about a thousand cycles: 8 elements per table entry at this size. Smaller
/// inputs search the boundaries per element.
const SCALAR_Q_TABLE_ELEMENTS: usize = 1 << 19;
/// Threads of each block of that path, two blocks per SM.
const SCALAR_Q_TABLE_THREADS: usize = 1024;
const KIVI_DQ_ITEMS: usize = 4;
/// CUDA pq_decode (`cuda/pq_decode.cu`) picks its layout by the codebook's
/// size in the output type. Up to PQ_SMALL_TABLE_BYTES, each block of
/// PQ_DEC_ITEMS_STAGED items per thread copies it to shared memory (after
/// requesting its codes); up to PQ_TABLE_BYTES, at most PQ_DEC_BLOCKS
/// blocks copy it once each and stride over quads of 4 sub-vectors,
/// PQ_DEC_QUADS per thread and round (a copy per block of items would cost
/// more reads than the block's codes); larger codebooks are read through
/// the L1 cache, PQ_DEC_ITEMS per thread.
const PQ_SMALL_TABLE_BYTES: usize = 4096;
const PQ_TABLE_BYTES: usize = 16384;
const PQ_DEC_ITEMS_STAGED: usize = 16;
const PQ_DEC_ITEMS: usize = 2;
const PQ_DEC_QUADS: usize = 4;
const PQ_DEC_BLOCKS: usize = 1024;

/// The items and template arguments of a body that, on CUDA, strides each
/// thread over `per_thread` of the items (its `ITEMS` template argument);
/// other back-ends keep one item per thread.
fn strided(
    imp: Implementation,
    per_thread: usize,
    items: (&'static str, usize),
    template: &[(&'static str, TemplateArg)],
) -> ((&'static str, usize), Vec<(&'static str, TemplateArg)>) {
    let mut template = template.to_vec();
    if imp != Implementation::Cuda {
        return (items, template);
    }
    template.push(("ITEMS", TemplateArg::Int(per_thread as i32)));
    ((items.0, items.1.div_ceil(per_thread)), template)
}

// ------------------------------------------------------------ scalar codebook

fn check_codebook_1d(codebook: &Array, bits: u32) -> Result<()> {
    check_dtype("codebook", codebook, Dtype::F32)?;
    let cs = codebook.shape();
    if cs != [1 << bits] {
        return Err(Error::invalid("codebook", format!("shape {cs:?} must be [{}] for {bits} bits", 1 << bits)));
    }
    Ok(())
}

/// Quantizes each element of `x` `[..., D]` to the nearest entry of the sorted
/// float32 `codebook` `[2^bits]` (a value on a decision boundary goes to the
/// lower entry) and packs the codes along the last axis: uint8
/// `[..., ceil(D * bits / 8)]`, `bit_pack`'s layout.
pub fn scalar_quantize(x: &Array, codebook: &Array, bits: u32, opts: &Options) -> Result<Array> {
    check_float("x", x)?;
    check_bits("bits", bits)?;
    check_codebook_1d(codebook, bits)?;
    let (n, d) = rows_last("x", x)?;
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::ScalarQuantize, opts.policy, &stream)?;
    let nbytes = cpu::packed_len(d, bits);
    let out_shape = with_last(&x.shape(), nbytes)?;
    if n * d == 0 {
        return ops::zeros(&out_shape, Dtype::U8, &stream);
    }
    let (ni, di) = (to_i32("x", n)?, to_i32("x", d)?);
    let flat = ops::reshape(x, &[ni, di], &stream)?;
    let out = vec![(vec![ni, nbytes as i32], Dtype::U8)];
    let packed = match imp {
        Implementation::Reference => {
            let cb = codebook;
            let k = 1i32 << bits;
            let lo = ops::slice(cb, &[0], &[k - 1], &stream)?;
            let hi = ops::slice(cb, &[1], &[k], &stream)?;
            let bounds = ops::multiply(&ops::add(&lo, &hi, &stream)?, &f32_scalar(0.5)?, &stream)?;
            let xf = ops::astype(&flat, Dtype::F32, &stream)?;
            let codes = chunked(&xf, n, d * (k as usize - 1), &stream, |rows| {
                let above = ops::greater(&ops::expand_dims(rows, -1, &stream)?, &bounds, &stream)?;
                ops::astype(&ops::sum_axis(&above, -1, false, &stream)?, Dtype::U8, &stream)
            })?;
            pack_reference(&codes, n, d, bits, &stream)?
        }
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::ScalarQuantize.name(),
                &[&flat, codebook],
                &out,
                &stream,
                Box::new(move |ins, outs| {
                    let cb = ins[1].as_slice::<f32>()?;
                    let o = outs[0].as_mut_slice::<u8>()?;
                    cpu_primitive::by_dtype!(dtype, T => cpu::scalar_quantize(ins[0].as_slice::<T>()?, n, d, cb, bits, o));
                    Ok(())
                }),
            )?
            .remove(0)
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "x", &[n, d, nbytes])?;
            let (items, mut template) = strided(
                imp,
                SCALAR_Q_ITEMS,
                ("x", n * d.div_ceil(8)),
                &[("T", TemplateArg::Dtype(x.dtype())), ("B_BITS", TemplateArg::Int(bits as i32))],
            );
            let table = imp == Implementation::Cuda && x.dtype().size() == 2 && n * d >= SCALAR_Q_TABLE_ELEMENTS;
            if imp == Implementation::Cuda {
                template.push(("TABLE", TemplateArg::Bool(table)));
            }
            let inputs = [&flat, codebook, &p];
            if table {
                // Blocks that each build the table once, then walk their chunks of items.
                let blocks = items.1.div_ceil(SCALAR_Q_TABLE_THREADS).min(2 * fragment_blocks()?);
                let grid = ((blocks * SCALAR_Q_TABLE_THREADS) as i32, 1, 1);
                let threadgroup = (SCALAR_Q_TABLE_THREADS as i32, 1, 1);
                let launch = Launch { kernel: Kernel::ScalarQuantize, inputs: &inputs, outputs: &out, grid, threadgroup, template: &template };
                gpu::launch(&launch, &stream)?.remove(0)
            } else {
                launch_gpu(Kernel::ScalarQuantize, &inputs, &out, items, &template, &stream)?.remove(0)
            }
        }
    };
    ops::reshape(&packed, &out_shape, &stream)
}

/// Inverse of [`scalar_quantize`]: `codebook[code]` for the `d` packed codes
/// of each row of `packed` `[..., ceil(d * bits / 8)]`, as `dtype` `[..., d]`.
pub fn scalar_dequantize(
    packed: &Array,
    codebook: &Array,
    bits: u32,
    d: usize,
    dtype: Dtype,
    opts: &Options,
) -> Result<Array> {
    check_dtype("packed", packed, Dtype::U8)?;
    check_bits("bits", bits)?;
    check_codebook_1d(codebook, bits)?;
    check_out_dtype(dtype)?;
    let (n, nbytes) = rows_last("packed", packed)?;
    if cpu::packed_len(d, bits) != nbytes {
        return Err(Error::invalid(
            "packed",
            format!("last dimension is {nbytes} bytes, but {d} codes of {bits} bits take {}", cpu::packed_len(d, bits)),
        ));
    }
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::ScalarDequantize, opts.policy, &stream)?;
    let out_shape = with_last(&packed.shape(), d)?;
    if n * d == 0 {
        return ops::zeros(&out_shape, dtype, &stream);
    }
    let (ni, di) = (to_i32("packed", n)?, to_i32("d", d)?);
    let flat = ops::reshape(packed, &[ni, nbytes as i32], &stream)?;
    let out = vec![(vec![ni, di], dtype)];
    let y = match imp {
        Implementation::Reference => {
            let codes = ops::astype(&unpack_reference(&flat, n, d, bits, &stream)?, Dtype::U32, &stream)?;
            ops::astype(&ops::take(codebook, &codes, &stream)?, dtype, &stream)?
        }
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::ScalarDequantize.name(),
            &[&flat, codebook],
            &out,
            &stream,
            Box::new(move |ins, outs| {
                let (p, cb) = (ins[0].as_slice::<u8>()?, ins[1].as_slice::<f32>()?);
                cpu_primitive::by_dtype!(dtype, T => cpu::scalar_dequantize(p, n, d, cb, bits, outs[0].as_mut_slice::<T>()?));
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "packed", &[n, d, nbytes])?;
            launch_gpu(
                Kernel::ScalarDequantize,
                &[&flat, codebook, &p],
                &out,
                ("packed", n * d.div_ceil(8)),
                &[("T", TemplateArg::Dtype(dtype)), ("B_BITS", TemplateArg::Int(bits as i32))],
                &stream,
            )?
            .remove(0)
        }
    };
    ops::reshape(&y, &out_shape, &stream)
}

// ------------------------------------------------------------------- KIVI

fn check_kivi_group(mode: KiviMode, group: usize, d: usize) -> Result<()> {
    if group == 0 {
        return Err(Error::invalid("group", "must be positive"));
    }
    if mode == KiviMode::Values && (group % 8 != 0 || d % group != 0) {
        return Err(Error::invalid(
            "group",
            format!("{group} channels must be a multiple of 8 that divides the vector size {d}"),
        ));
    }
    Ok(())
}

/// The shape of KIVI's scales and zeros for `n` rows of `d`.
pub fn kivi_params_shape(mode: KiviMode, n: usize, d: usize, group: usize) -> [usize; 2] {
    match mode {
        KiviMode::Keys => [n.div_ceil(group), d],
        KiviMode::Values => [n, d / group],
    }
}

/// KIVI group quantization of `x` `[N, D]`: returns (codes uint8
/// `[N, ceil(D * bits / 8)]`, scales float16, zeros float16), the scales and
/// zeros `[ceil(N/G), D]` for [`KiviMode::Keys`] and `[N, D/G]` for
/// [`KiviMode::Values`]. `scale = f16((max − min)/(2^b − 1))`, `zero = f16(min)`,
/// `code = round((x − zero)/scale)` clamped (0 where scale is 0), as
/// `crate::quant::kivi`. A group whose scale or minimum does not fit in
/// float16 stores infinity.
pub fn kivi_quantize(x: &Array, bits: u32, group: usize, mode: KiviMode, opts: &Options) -> Result<(Array, Array, Array)> {
    check_float("x", x)?;
    check_bits("bits", bits)?;
    let (n, d) = matrix("x", x)?;
    check_kivi_group(mode, group, d)?;
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::KiviQuantize, opts.policy, &stream)?;
    let nbytes = cpu::packed_len(d, bits);
    let [pr, pc] = kivi_params_shape(mode, n, d, group);
    let (ni, pri, pci) = (to_i32("x", n)?, to_i32("x", pr)?, to_i32("x", pc)?);
    let outs = vec![(vec![ni, nbytes as i32], Dtype::U8), (vec![pri, pci], Dtype::F16), (vec![pri, pci], Dtype::F16)];
    if n * d == 0 {
        let z = |(sh, dt): &(Vec<i32>, Dtype)| ops::zeros(sh, *dt, &stream);
        return Ok((z(&outs[0])?, z(&outs[1])?, z(&outs[2])?));
    }
    let per_channel = mode == KiviMode::Keys;
    let mut r = match imp {
        Implementation::Reference => kivi_q_reference(x, n, d, bits, group, mode, &stream)?,
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::KiviQuantize.name(),
                &[x],
                &outs,
                &stream,
                Box::new(move |ins, outs| {
                    let [c, s, z] = outs else { return Err("three outputs".into()) };
                    let (c, s, z) = (c.as_mut_slice::<u8>()?, s.as_mut_slice::<f16>()?, z.as_mut_slice::<f16>()?);
                    cpu_primitive::by_dtype!(dtype, T => cpu::kivi_quantize(ins[0].as_slice::<T>()?, n, d, bits, group, per_channel, c, s, z));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "x", &[n, d, nbytes, group])?;
            let items = match mode {
                // The CUDA body's fast layouts, in whole warps for their
                // shuffles: a thread per (row group, 4 bytes of a row) where
                // 32-bit words hold whole rows' codes of its lanes...
                KiviMode::Keys if imp == Implementation::Cuda && group <= 32 && [1, 2, 4, 8].contains(&bits) && (d * bits as usize) % 32 == 0 => {
                    (n.div_ceil(group) * (d * x.dtype().size() / 4)).next_multiple_of(32)
                }
                // ... else, at 3 bits, eight threads per (row group, 8 channels).
                KiviMode::Keys if imp == Implementation::Cuda && bits == 3 && group <= 32 && d % 8 == 0 => {
                    (n.div_ceil(group) * (d / 8) * 8).next_multiple_of(32)
                }
                KiviMode::Keys => n.div_ceil(group) * d.div_ceil(8),
                KiviMode::Values => n * (d / group),
            };
            launch_gpu(
                Kernel::KiviQuantize,
                &[x, &p],
                &outs,
                ("x", items),
                &[
                    ("T", TemplateArg::Dtype(x.dtype())),
                    ("B_BITS", TemplateArg::Int(bits as i32)),
                    ("PER_CHANNEL", TemplateArg::Bool(per_channel)),
                ],
                &stream,
            )?
        }
    };
    let zeros = r.pop().expect("three outputs");
    let scales = r.pop().expect("three outputs");
    Ok((r.pop().expect("three outputs"), scales, zeros))
}

/// Reference graph of KIVI quantization: min/max reductions, the float16
/// rounding of scale and zero, round/clip, then the bit-pack graph.
fn kivi_q_reference(
    x: &Array,
    n: usize,
    d: usize,
    bits: u32,
    group: usize,
    mode: KiviMode,
    s: &Stream,
) -> Result<Vec<Array>> {
    let xf = ops::astype(x, Dtype::F32, s)?;
    let levels = f32_scalar(((1u32 << bits) - 1) as f32)?;
    // Grouped view: keys [Gr, G, D] (rows padded by repeating the group's
    // first row, which leaves min and max unchanged), values [N, D/G, G].
    let (grouped, axis) = match mode {
        KiviMode::Keys => {
            let gr = n.div_ceil(group);
            let pad = gr * group - n;
            let full = if pad == 0 {
                xf.clone()
            } else {
                let last0 = ((gr - 1) * group) as i32;
                let first = ops::slice(&xf, &[last0, 0], &[last0 + 1, d as i32], s)?;
                let fill = ops::add(&ops::zeros(&[pad as i32, d as i32], Dtype::F32, s)?, &first, s)?;
                ops::concatenate(&[xf.clone(), fill], 0, s)?
            };
            (ops::reshape(&full, &[gr as i32, group as i32, d as i32], s)?, 1)
        }
        KiviMode::Values => (ops::reshape(&xf, &[n as i32, (d / group) as i32, group as i32], s)?, 2),
    };
    let (q, scale, zero) = kivi_levels_graph(&grouped, axis, &levels, s)?;
    let codes = ops::astype(&q, Dtype::U8, s)?;
    let codes = match mode {
        KiviMode::Keys => {
            let all = ops::reshape(&codes, &[(n.div_ceil(group) * group) as i32, d as i32], s)?;
            ops::slice(&all, &[0, 0], &[n as i32, d as i32], s)?
        }
        KiviMode::Values => ops::reshape(&codes, &[n as i32, d as i32], s)?,
    };
    let [pr, pc] = kivi_params_shape(mode, n, d, group);
    let shape = [pr as i32, pc as i32];
    let out = |a: &Array| -> Result<Array> { ops::reshape(&ops::astype(a, Dtype::F16, s)?, &shape, s) };
    Ok(vec![pack_reference(&codes, n, d, bits, s)?, out(&scale)?, out(&zero)?])
}

/// KIVI keys with bits per channel: `x` `[B, Hkv, m, D]` (`m` a whole
/// number of `group`-token groups) quantized per channel and group as
/// [`kivi_quantize`] does, channel `c` of head `h` with `widths[h * D + c]`
/// bits, and packed at the bit offsets of
/// [`kivi_bit_offsets`](crate::codec::tables::kivi_bit_offsets) (each
/// head's widths adding up to `D * bits`, a row's size at `bits`). Returns
/// codes uint8 `[B, Hkv, m, D * bits / 8]`, scales and zeros float16 `[B,
/// Hkv, m / group, D]`. One graph of MLX ops for every backend: it runs once
/// per flush, on the tokens flushed.
pub fn kivi_quantize_widths(x: &Array, widths: &[u8], bits: u32, group: usize, s: &Stream) -> Result<(Array, Array, Array)> {
    check_float("x", x)?;
    let sh = x.shape();
    if sh.len() != 4 || group == 0 || sh[2] as usize % group != 0 {
        return Err(Error::invalid("x", format!("shape {sh:?}, expected [batch, kv_heads, a multiple of {group} tokens, head_dim]")));
    }
    let (b, h, m, d) = (sh[0], sh[1], sh[2], sh[3]);
    let (hu, du) = (h as usize, d as usize);
    if widths.len() != hu * du || widths.chunks(du).any(|w| w.iter().map(|&v| v as usize).sum::<usize>() != du * bits as usize) {
        return Err(Error::invalid("widths", format!("expected {h} heads of {d} widths adding up to {} bits each", du * bits as usize)));
    }
    let row = cpu::packed_len(du, bits) as i32;
    let gr = m / group as i32;
    let levels: Vec<f32> = widths.iter().map(|&w| ((1u32 << w) - 1) as f32).collect();
    let levels = Array::from_slice(&levels, &[1, h, 1, 1, d])?;
    let grouped = ops::reshape(&ops::astype(x, Dtype::F32, s)?, &[b, h, gr, group as i32, d], s)?;
    let (q, scale, zero) = kivi_levels_graph(&grouped, 3, &levels, s)?;
    let q = ops::reshape(&ops::astype(&q, Dtype::U32, s)?, &[b, h, m, d], s)?;
    // Each code shifted to its bit offset spans its byte and the next: the
    // low and high parts land in the row's bytes through 0/1 matrices
    // `[Hkv, D, row]` (exact: the parts of one byte never overlap).
    let offsets = crate::codec::tables::kivi_bit_offsets(Some(widths), du, bits);
    let (mut shifts, mut at_lo, mut at_hi) = (vec![0u32; hu * du], vec![0f32; hu * du * row as usize], vec![0f32; hu * du * row as usize]);
    for hh in 0..hu {
        for c in 0..du {
            let o = offsets[1 + hh * (du + 1) + c] as usize;
            shifts[hh * du + c] = (o & 7) as u32;
            let base = (hh * du + c) * row as usize;
            at_lo[base + o / 8] = 1.0;
            if o / 8 + 1 < row as usize {
                at_hi[base + o / 8 + 1] = 1.0;
            }
        }
    }
    let shifted = ops::left_shift(&q, &Array::from_slice(&shifts, &[1, h, 1, d])?, s)?;
    let low = ops::astype(&ops::bitwise_and(&shifted, &Array::from_slice(&[255u32], &[1])?, s)?, Dtype::F32, s)?;
    let high = ops::astype(&ops::right_shift(&shifted, &Array::from_slice(&[8u32], &[1])?, s)?, Dtype::F32, s)?;
    let place = |at: Vec<f32>| Array::from_slice(&at, &[1, h, d, row]);
    let bytes = ops::add(&ops::matmul(&low, &place(at_lo)?, s)?, &ops::matmul(&high, &place(at_hi)?, s)?, s)?;
    let params = |a: &Array| -> Result<Array> { ops::reshape(&ops::astype(a, Dtype::F16, s)?, &[b, h, gr, d], s) };
    Ok((ops::astype(&bytes, Dtype::U8, s)?, params(&scale)?, params(&zero)?))
}

/// KIVI's min/max quantization of `grouped` (float32) over `axis`, with
/// `levels` (`2^bits − 1`, broadcast against the groups): `scale =
/// f16((max − min)/levels)`, `zero = f16(min)`, `code = round((x −
/// zero)/scale)` clamped to the levels (0 where scale is 0). Returns the
/// codes (float32, integers), the scales and the zeros (float16-rounded
/// float32, `axis` kept).
fn kivi_levels_graph(grouped: &Array, axis: i32, levels: &Array, s: &Stream) -> Result<(Array, Array, Array)> {
    let f16_round = |a: &Array| -> Result<Array> { ops::astype(&ops::astype(a, Dtype::F16, s)?, Dtype::F32, s) };
    let lo = ops::min_axis(grouped, axis, true, s)?;
    let hi = ops::max_axis(grouped, axis, true, s)?;
    let scale = f16_round(&ops::divide(&ops::subtract(&hi, &lo, s)?, levels, s)?)?;
    let zero = f16_round(&lo)?;
    let q = ops::divide(&ops::subtract(grouped, &zero, s)?, &scale, s)?;
    let q = ops::minimum(&ops::maximum(&ops::round(&q, s)?, &f32_scalar(0.0)?, s)?, levels, s)?;
    let positive = ops::greater(&scale, &f32_scalar(0.0)?, s)?;
    Ok((ops::where_(&positive, &q, &f32_scalar(0.0)?, s)?, scale, zero))
}

/// Inverse of [`kivi_quantize`]: `zero + scale * code` as `dtype` `[N, d]`.
#[allow(clippy::too_many_arguments)]
pub fn kivi_dequantize(
    packed: &Array,
    scales: &Array,
    zeros: &Array,
    bits: u32,
    group: usize,
    mode: KiviMode,
    d: usize,
    dtype: Dtype,
    opts: &Options,
) -> Result<Array> {
    check_dtype("packed", packed, Dtype::U8)?;
    check_dtype("scales", scales, Dtype::F16)?;
    check_dtype("zeros", zeros, Dtype::F16)?;
    check_bits("bits", bits)?;
    check_out_dtype(dtype)?;
    let (n, nbytes) = matrix("packed", packed)?;
    if cpu::packed_len(d, bits) != nbytes {
        return Err(Error::invalid("packed", format!("{nbytes} bytes per row do not hold {d} codes of {bits} bits")));
    }
    check_kivi_group(mode, group, d)?;
    let want = kivi_params_shape(mode, n, d, group);
    for (name, a) in [("scales", scales), ("zeros", zeros)] {
        let sh = a.shape();
        if sh.len() != 2 || sh[0] as usize != want[0] || sh[1] as usize != want[1] {
            return Err(Error::invalid(name, format!("shape {sh:?} must be {want:?}")));
        }
    }
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::KiviDequantize, opts.policy, &stream)?;
    let (ni, di) = (to_i32("packed", n)?, to_i32("d", d)?);
    if n * d == 0 {
        return ops::zeros(&[ni, di], dtype, &stream);
    }
    let out = vec![(vec![ni, di], dtype)];
    let per_channel = mode == KiviMode::Keys;
    Ok(match imp {
        Implementation::Reference => {
            let codes = ops::astype(&unpack_reference(packed, n, d, bits, &stream)?, Dtype::F32, &stream)?;
            let sf = ops::astype(scales, Dtype::F32, &stream)?;
            let zf = ops::astype(zeros, Dtype::F32, &stream)?;
            let y = match mode {
                KiviMode::Keys => {
                    let gr = n.div_ceil(group);
                    let pad = (gr * group - n) as i32;
                    let c = ops::pad_zeros(&codes, &[0], &[0], &[pad], &stream)?;
                    let c = ops::reshape(&c, &[gr as i32, group as i32, di], &stream)?;
                    let sf = ops::expand_dims(&sf, 1, &stream)?;
                    let zf = ops::expand_dims(&zf, 1, &stream)?;
                    let y = ops::add(&zf, &ops::multiply(&sf, &c, &stream)?, &stream)?;
                    let y = ops::reshape(&y, &[(gr * group) as i32, di], &stream)?;
                    ops::slice(&y, &[0, 0], &[ni, di], &stream)?
                }
                KiviMode::Values => {
                    let c = ops::reshape(&codes, &[ni, (d / group) as i32, group as i32], &stream)?;
                    let sf = ops::expand_dims(&sf, -1, &stream)?;
                    let zf = ops::expand_dims(&zf, -1, &stream)?;
                    let y = ops::add(&zf, &ops::multiply(&sf, &c, &stream)?, &stream)?;
                    ops::reshape(&y, &[ni, di], &stream)?
                }
            };
            ops::astype(&y, dtype, &stream)?
        }
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::KiviDequantize.name(),
            &[packed, scales, zeros],
            &out,
            &stream,
            Box::new(move |ins, outs| {
                let (c, sc, z) = (ins[0].as_slice::<u8>()?, ins[1].as_slice::<f16>()?, ins[2].as_slice::<f16>()?);
                cpu_primitive::by_dtype!(dtype, T => cpu::kivi_dequantize(c, sc, z, n, d, bits, group, per_channel, outs[0].as_mut_slice::<T>()?));
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "packed", &[n, d, nbytes, group])?;
            let (items, template) = strided(
                imp,
                KIVI_DQ_ITEMS,
                // CUDA: each thread a group of 8 channels in KIVI_DQ_ITEMS rows.
                ("packed", n.next_multiple_of(KIVI_DQ_ITEMS) * d.div_ceil(8)),
                &[
                    ("T", TemplateArg::Dtype(dtype)),
                    ("B_BITS", TemplateArg::Int(bits as i32)),
                    ("PER_CHANNEL", TemplateArg::Bool(per_channel)),
                ],
            );
            launch_gpu(Kernel::KiviDequantize, &[packed, scales, zeros, &p], &out, items, &template, &stream)?
            .remove(0)
        }
    })
}

// -------------------------------------------------------------------- QJL

fn check_sketch(sketch: &Array, d: usize) -> Result<usize> {
    check_dtype("sketch", sketch, Dtype::F32)?;
    let sh = sketch.shape();
    if sh.len() != 2 || sh[1] as usize != d || sh[0] == 0 {
        return Err(Error::invalid("sketch", format!("shape {sh:?} must be [m, {d}] with m >= 1")));
    }
    Ok(sh[0] as usize)
}

/// Whether CUDA's `qjl_encode` runs on the tensor cores: float16 keys (exact
/// as mma operands), `D` a multiple of 16 up to 128 and `m` a multiple of 16
/// from 64 to 256 (the split sketch fits a warp's registers). Its signs may
/// differ from the exact path's only where `(S k)_r` is within float32
/// rounding of zero.
pub fn qjl_tensor_cores(dtype: Dtype, d: usize, m: usize) -> bool {
    dtype == Dtype::F16 && d % 16 == 0 && d <= 128 && m % 16 == 0 && (64..=256).contains(&m)
}

/// QJL encoding of keys `k` `[..., D]` with the float32 sketch `S` `[m, D]`:
/// (signs uint8 `[..., ceil(m/8)]`, bit r set where `(S k)_r ≥ 0`; norms
/// float16 `[...]`, `‖k‖`).
pub fn qjl_encode(k: &Array, sketch: &Array, opts: &Options) -> Result<(Array, Array)> {
    check_float("k", k)?;
    let (n, d) = rows_last("k", k)?;
    let m = check_sketch(sketch, d)?;
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::QjlEncode, opts.policy, &stream)?;
    let nbytes = cpu::packed_len(m, 1);
    let shape = k.shape();
    let signs_shape = with_last(&shape, nbytes)?;
    let norms_shape = shape[..shape.len() - 1].to_vec();
    if n == 0 || d == 0 {
        let norms = ops::zeros(&norms_shape, Dtype::F16, &stream)?;
        if n == 0 {
            return Ok((ops::zeros(&signs_shape, Dtype::U8, &stream)?, norms));
        }
        // Zero-length keys: every (S k)_r is 0, so every sign bit is set.
        let ones = ops::add(&ops::zeros(&[to_i32("k", n)?, m as i32], Dtype::U8, &stream)?, &ops::astype(&f32_scalar(1.0)?, Dtype::U8, &stream)?, &stream)?;
        let signs = pack_reference(&ones, n, m, 1, &stream)?;
        return Ok((ops::reshape(&signs, &signs_shape, &stream)?, norms));
    }
    let (ni, di) = (to_i32("k", n)?, to_i32("k", d)?);
    let flat = ops::reshape(k, &[ni, di], &stream)?;
    let outs = vec![(vec![ni, nbytes as i32], Dtype::U8), (vec![ni], Dtype::F16)];
    let mut r = match imp {
        Implementation::Reference => {
            let kf = ops::astype(&flat, Dtype::F32, &stream)?;
            let proj = ops::matmul(&kf, &ops::transpose(sketch, &[1, 0], &stream)?, &stream)?;
            let bits = ops::astype(&ops::greater_equal(&proj, &f32_scalar(0.0)?, &stream)?, Dtype::U8, &stream)?;
            let norms = ops::sqrt(&ops::sum_axis(&ops::square(&kf, &stream)?, -1, false, &stream)?, &stream)?;
            vec![pack_reference(&bits, n, m, 1, &stream)?, ops::astype(&norms, Dtype::F16, &stream)?]
        }
        Implementation::Cpu => {
            let dtype = k.dtype();
            cpu_primitive::apply(
                Kernel::QjlEncode.name(),
                &[&flat, sketch],
                &outs,
                &stream,
                Box::new(move |ins, outs| {
                    let [sg, nm] = outs else { return Err("two outputs".into()) };
                    let (sg, nm) = (sg.as_mut_slice::<u8>()?, nm.as_mut_slice::<f16>()?);
                    let s = ins[1].as_slice::<f32>()?;
                    cpu_primitive::by_dtype!(dtype, T => cpu::qjl_encode(ins[0].as_slice::<T>()?, n, d, s, m, sg, nm));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "k", &[n, d, m, nbytes])?;
            let tensor_cores = imp == Implementation::Cuda && qjl_tensor_cores(k.dtype(), d, m);
            let (threads, group) = if tensor_cores {
                // Blocks of 2m threads walk tiles of 64 keys, each loading
                // the whole sketch once.
                let blocks = n.div_ceil(64).min(fragment_blocks()?);
                (to_i32("k", blocks * 2 * m)?, 2 * m as i32)
            } else if imp == Implementation::Cuda {
                // Blocks of 256 threads, one per tile of 64 keys x 64 sketch rows.
                (to_i32("k", n.div_ceil(64) * m.div_ceil(64) * 256)?, 256)
            } else {
                // 32 lanes per key; threadgroups stay a multiple of 32.
                let threads = to_i32("k", n * 32)?;
                (threads, THREADGROUP.min(threads))
            };
            let mut template = vec![("T", TemplateArg::Dtype(k.dtype()))];
            if imp == Implementation::Cuda {
                let (tc_d, tc_m) = if tensor_cores { (d as i32, m as i32) } else { (0, 0) };
                template.extend([("TC_D", TemplateArg::Int(tc_d)), ("TC_M", TemplateArg::Int(tc_m))]);
            }
            gpu::launch(
                &Launch {
                    kernel: Kernel::QjlEncode,
                    inputs: &[&flat, sketch, &p],
                    outputs: &outs,
                    grid: (threads, 1, 1),
                    threadgroup: (group, 1, 1),
                    template: &template,
                },
                &stream,
            )?
        }
    };
    let norms = r.pop().expect("two outputs");
    let signs = r.pop().expect("two outputs");
    Ok((ops::reshape(&signs, &signs_shape, &stream)?, ops::reshape(&norms, &norms_shape, &stream)?))
}

/// QJL inner-product estimates of queries `q` `[Q, D]` against `N` encoded
/// keys (`signs` uint8 `[N, ceil(m/8)]`, `norms` float16 `[N]`, from
/// [`qjl_encode`] with the same `sketch` `[m, D]`): float32 `[Q, N]`,
/// `√(π/2)/m · ‖k‖ · ⟨S q, sign(S k)⟩`.
pub fn qjl_score(q: &Array, sketch: &Array, signs: &Array, norms: &Array, opts: &Options) -> Result<Array> {
    check_float("q", q)?;
    let (nq, d) = matrix("q", q)?;
    let m = check_sketch(sketch, d)?;
    check_dtype("signs", signs, Dtype::U8)?;
    check_dtype("norms", norms, Dtype::F16)?;
    let nbytes = cpu::packed_len(m, 1);
    let (n, sb) = matrix("signs", signs)?;
    if sb != nbytes {
        return Err(Error::invalid("signs", format!("{sb} bytes per key, but a sketch of {m} rows gives {nbytes}")));
    }
    if norms.shape() != [n as i32] {
        return Err(Error::invalid("norms", format!("shape {:?} must be [{n}] (one per key)", norms.shape())));
    }
    let stream = opts.resolve_stream()?;
    let fits = nq * m <= QJL_SCORE_MAX_QM;
    let policy = if fits || opts.policy == Policy::Off {
        opts.policy
    } else if opts.policy == Policy::Require {
        return Err(Error::invalid("q", format!("{nq} queries x {m} sketch rows exceed the fused kernel's {QJL_SCORE_MAX_QM}")));
    } else {
        Policy::Off
    };
    let imp = select(Kernel::QjlScore, policy, &stream)?;
    let (nqi, ni) = (to_i32("q", nq)?, to_i32("signs", n)?);
    if nq * n == 0 {
        return ops::zeros(&[nqi, ni], Dtype::F32, &stream);
    }
    let out = vec![(vec![nqi, ni], Dtype::F32)];
    Ok(match imp {
        Implementation::Reference => {
            let qf = ops::astype(q, Dtype::F32, &stream)?;
            let sq = ops::matmul(&qf, &ops::transpose(sketch, &[1, 0], &stream)?, &stream)?;
            let bits = ops::astype(&unpack_reference(signs, n, m, 1, &stream)?, Dtype::F32, &stream)?;
            let z = ops::subtract(&ops::multiply(&bits, &f32_scalar(2.0)?, &stream)?, &f32_scalar(1.0)?, &stream)?;
            let dots = ops::matmul(&sq, &ops::transpose(&z, &[1, 0], &stream)?, &stream)?;
            let scale = f32_scalar(std::f32::consts::FRAC_PI_2.sqrt() / m as f32)?;
            let w = ops::multiply(&ops::astype(norms, Dtype::F32, &stream)?, &scale, &stream)?;
            ops::multiply(&dots, &w, &stream)?
        }
        Implementation::Cpu => {
            let dtype = q.dtype();
            cpu_primitive::apply(
                Kernel::QjlScore.name(),
                &[q, sketch, signs, norms],
                &out,
                &stream,
                Box::new(move |ins, outs| {
                    let (s, sg, nm) = (ins[1].as_slice::<f32>()?, ins[2].as_slice::<u8>()?, ins[3].as_slice::<f16>()?);
                    let o = outs[0].as_mut_slice::<f32>()?;
                    cpu_primitive::by_dtype!(dtype, T => cpu::qjl_score(ins[0].as_slice::<T>()?, nq, d, s, m, sg, nm, n, o));
                    Ok(())
                }),
            )?
            .remove(0)
        }
        Implementation::Metal | Implementation::Cuda => {
            // S q by its own kernel, once: the score kernel's blocks copy
            // its Q m floats rather than each reading the whole sketch.
            let ps = sizes(imp, "q", &[nq, d, m])?;
            let sq = launch_gpu(
                Kernel::QjlSketchQuery,
                &[q, sketch, &ps],
                &[(vec![nqi, to_i32("sketch", m)?], Dtype::F32)],
                ("q", nq * m),
                &[("T", TemplateArg::Dtype(q.dtype()))],
                &stream,
            )?
            .remove(0);
            let p = sizes(imp, "signs", &[n, m, nbytes, nq])?;
            // The CUDA body strides over the keys: a capped grid builds the
            // tables in fewer blocks.
            let threads = if imp == Implementation::Cuda { n.min(QJL_SCORE_CUDA_THREADS) } else { n };
            launch_gpu(Kernel::QjlScore, &[&sq, signs, norms, &p], &out, ("signs", threads), &[], &stream)?.remove(0)
        }
    })
}

// --------------------------------------------------------------------- PQ

/// Floats of a PQ codebook that the GPU encoder stages in threadgroup memory
/// (16 KiB); larger codebooks are read from device memory.
pub const PQ_STAGE_FLOATS: usize = 4096;

/// Packed product-quantization codes, named as the buffers of
/// `ProductQuantizer`'s encoding: `codes` holds the low plane, `codes_hi` the
/// high bits for widths other than 1, 2, 3, 4 and 8 (`crate::cpu::code_planes`).
#[derive(Debug)]
pub struct PqCodes {
    pub codes: Array,
    pub codes_hi: Option<Array>,
}

fn check_pq_bits(bits: u32) -> Result<(u32, u32)> {
    if cpu::PQ_BITS.contains(&bits) {
        Ok(crate::cpu::code_planes(bits))
    } else {
        Err(Error::invalid("bits", format!("{bits} is not supported; product quantization takes 1..=12")))
    }
}

fn check_pq_codebook(codebook: &Array, bits: u32) -> Result<(usize, usize)> {
    check_dtype("codebook", codebook, Dtype::F32)?;
    let sh = codebook.shape();
    let ok = sh.len() == 2 && PQ_SUB_DIMS.contains(&(sh[1] as usize)) && sh[0] >= 1 && sh[0] as usize <= 1 << bits;
    if !ok {
        return Err(Error::invalid(
            "codebook",
            format!("shape {sh:?} must be [K, s] with s in {PQ_SUB_DIMS:?} and 1 <= K <= 2^{bits}"),
        ));
    }
    Ok((sh[0] as usize, sh[1] as usize))
}

/// Product quantization of `x` `[..., D]`: each of the `D/s` sub-vectors is
/// replaced by the index of the nearest entry of `codebook` float32 `[K, s]`
/// (`vq_quantize`'s arithmetic and ties), `bits` bits per code (1..=12;
/// `K ≤ 2^bits`), packed in `ProductQuantizer`'s planes: `codes` uint8
/// `[..., ceil(D/s · lo / 8)]` and, when `hi > 0`, `codes_hi` uint8
/// `[..., ceil(D/s · hi / 8)]`, `(lo, hi) = crate::cpu::code_planes(bits)`.
/// On CUDA, float16 and bfloat16 inputs within [`pq_tensor_cores`] are
/// searched on the tensor cores: codes then equal the exact search's but at
/// near-ties.
pub fn pq_encode(x: &Array, codebook: &Array, bits: u32, opts: &Options) -> Result<PqCodes> {
    check_float("x", x)?;
    let (lo, hi) = check_pq_bits(bits)?;
    let (k, s) = check_pq_codebook(codebook, bits)?;
    let (n, d) = rows_last("x", x)?;
    if d % s != 0 {
        return Err(Error::invalid("x", format!("vector size {d} is not a multiple of the sub-vector size {s}")));
    }
    let per = d / s;
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::PqEncode, opts.policy, &stream)?;
    let nb_lo = cpu::packed_len(per, lo);
    let nb_hi = if hi > 0 { cpu::packed_len(per, hi) } else { 0 };
    let shape_lo = with_last(&x.shape(), nb_lo)?;
    let shape_hi = with_last(&x.shape(), nb_hi)?;
    let finish = |mut planes: Vec<Array>, s: &Stream| -> Result<PqCodes> {
        let high = planes.pop().expect("two planes");
        Ok(PqCodes {
            codes: ops::reshape(&planes.pop().expect("two planes"), &shape_lo, s)?,
            codes_hi: if hi > 0 { Some(ops::reshape(&high, &shape_hi, s)?) } else { None },
        })
    };
    if n * d == 0 {
        let z = |shape: &[i32]| ops::zeros(shape, Dtype::U8, &stream);
        return finish(vec![z(&shape_lo)?, z(&shape_hi)?], &stream);
    }
    let (ni, di) = (to_i32("x", n)?, to_i32("x", d)?);
    let flat = ops::reshape(x, &[ni, di], &stream)?;
    // A one-plane width still has a (1-element, unwritten) high output, so
    // that one kernel signature serves every width.
    let out = vec![
        (vec![ni, nb_lo as i32], Dtype::U8),
        (if hi > 0 { vec![ni, nb_hi as i32] } else { vec![1] }, Dtype::U8),
    ];
    let planes = match imp {
        Implementation::Reference => {
            let sub = ops::reshape(&ops::astype(&flat, Dtype::F32, &stream)?, &[to_i32("x", n * per)?, s as i32], &stream)?;
            let idx = super::vq_quantize(&sub, codebook, &Options::on(stream.clone(), Policy::Off))?;
            let idx = ops::reshape(&idx, &[ni, per as i32], &stream)?;
            let u32s = |v: u32| ops::astype(&f32_scalar(v as f32)?, Dtype::U32, &stream);
            let low = ops::astype(&ops::bitwise_and(&idx, &u32s((1 << lo) - 1)?, &stream)?, Dtype::U8, &stream)?;
            let high = if hi > 0 {
                let h = ops::astype(&ops::right_shift(&idx, &u32s(lo)?, &stream)?, Dtype::U8, &stream)?;
                pack_reference(&h, n, per, hi, &stream)?
            } else {
                ops::zeros(&[1], Dtype::U8, &stream)?
            };
            vec![pack_reference(&low, n, per, lo, &stream)?, high]
        }
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::PqEncode.name(),
                &[&flat, codebook],
                &out,
                &stream,
                Box::new(move |ins, outs| {
                    let cb = ins[1].as_slice::<f32>()?;
                    let [o, o_hi] = outs else { return Err("two outputs expected".into()) };
                    let o = o.as_mut_slice::<u8>()?;
                    let o_hi = if hi > 0 { o_hi.as_mut_slice::<u8>()? } else { &mut [] };
                    cpu_primitive::by_dtype!(dtype, T => cpu::pq_encode(ins[0].as_slice::<T>()?, n, d, cb, s, bits, o, o_hi));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "x", &[n, d, k, nb_lo, nb_hi])?;
            let tensor_cores = imp == Implementation::Cuda && pq_tensor_cores(x.dtype(), d, s, bits);
            let mut template = vec![
                ("T", TemplateArg::Dtype(x.dtype())),
                ("S", TemplateArg::Int(s as i32)),
                ("C_BITS", TemplateArg::Int(bits as i32)),
                ("STAGED", TemplateArg::Bool(!tensor_cores && k * s <= PQ_STAGE_FLOATS)),
            ];
            let (grid, threadgroup) = if tensor_cores {
                // Blocks of 256 threads walk chunks of whole rows, at most
                // PQ_TC_CHUNK sub-vectors each; all of them resident at once
                // (a second, partial wave of blocks left SMs idle).
                let rows = (PQ_TC_CHUNK / per).max(1);
                let blocks = n.div_ceil(rows).min(PQ_TC_BLOCKS_PER_SM * fragment_blocks()?);
                ((to_i32("x", blocks * PQ_TC_THREADS)?, 1, 1), (PQ_TC_THREADS as i32, 1, 1))
            } else {
                grid_1d("x", n * per.div_ceil(8))?
            };
            if imp == Implementation::Cuda {
                template.push(("TC", TemplateArg::Bool(tensor_cores)));
            }
            gpu::launch(
                &Launch { kernel: Kernel::PqEncode, inputs: &[&flat, codebook, &p], outputs: &out, grid, threadgroup, template: &template },
                &stream,
            )?
        }
    };
    finish(planes, &stream)
}

/// Threads of a block of CUDA pq_encode's tensor-core search, and the most
/// sub-vectors whose codes it stages at once (`cuda/pq_encode_tensor_cores.cuh`).
const PQ_TC_THREADS: usize = 256;
const PQ_TC_CHUNK: usize = 512;
/// Blocks of that search per SM: four fit by their registers (at most 64 a
/// thread) and shared memory (at most 34 KB a block).
const PQ_TC_BLOCKS_PER_SM: usize = 4;

/// Whether CUDA pq_encode searches on the tensor cores
/// (`cuda/pq_encode_tensor_cores.cuh`): float16 or bfloat16 x, rows of at
/// most `PQ_TC_CHUNK` sub-vectors, and the B fragments of `2^bits` entries
/// in 32 KB of shared memory (up to 10 bits; 9 at `s` = 8, whose entries
/// take two k-steps). Codes may then differ from the exact search's at
/// near-ties (distances within about 2^-16 of each other, or the tensor
/// cores' rounding).
pub fn pq_tensor_cores(dtype: Dtype, d: usize, s: usize, bits: u32) -> bool {
    // Checked in order: `bits` before it shifts.
    let ksteps = || (3 * s + 4).div_ceil(16);
    let ntiles = || (1usize << bits).div_ceil(16) * 2;
    matches!(dtype, Dtype::F16 | Dtype::BF16)
        && matches!(s, 2 | 4 | 8)
        && d % s == 0
        && d / s <= PQ_TC_CHUNK
        && bits <= 12
        && ntiles() * ksteps() <= 128
}

/// Inverse of [`pq_encode`]: the codebook entries of the `d/s` packed codes of
/// each row, as `dtype` `[..., d]`. A code past the codebook reads entry 0.
pub fn pq_decode(codes: &PqCodes, codebook: &Array, bits: u32, d: usize, dtype: Dtype, opts: &Options) -> Result<Array> {
    let packed = &codes.codes;
    check_dtype("codes", packed, Dtype::U8)?;
    let (lo, hi) = check_pq_bits(bits)?;
    check_out_dtype(dtype)?;
    let (k, s) = check_pq_codebook(codebook, bits)?;
    if d % s != 0 {
        return Err(Error::invalid("d", format!("{d} is not a multiple of the sub-vector size {s}")));
    }
    let per = d / s;
    let (n, nb_lo) = rows_last("codes", packed)?;
    if cpu::packed_len(per, lo) != nb_lo {
        return Err(Error::invalid("codes", format!("{nb_lo} bytes per row do not hold {per} codes of {lo} bits")));
    }
    let nb_hi = if hi > 0 { cpu::packed_len(per, hi) } else { 0 };
    match (&codes.codes_hi, hi) {
        (None, 0) => {}
        (Some(_), 0) => return Err(Error::invalid("codes_hi", format!("{bits}-bit codes have no high plane"))),
        (None, _) => return Err(Error::invalid("codes_hi", format!("{bits}-bit codes need a high plane of {hi} bits"))),
        (Some(h), _) => {
            check_dtype("codes_hi", h, Dtype::U8)?;
            let want = with_last(&packed.shape(), nb_hi)?;
            if h.shape() != want {
                return Err(Error::invalid("codes_hi", format!("shape {:?}, expected {want:?}", h.shape())));
            }
        }
    }
    let stream = opts.resolve_stream()?;
    let imp = select(Kernel::PqDecode, opts.policy, &stream)?;
    let out_shape = with_last(&packed.shape(), d)?;
    if n * d == 0 {
        return ops::zeros(&out_shape, dtype, &stream);
    }
    let (ni, di) = (to_i32("codes", n)?, to_i32("d", d)?);
    let flat = ops::reshape(packed, &[ni, nb_lo as i32], &stream)?;
    // Codes of one plane: the low plane stands in for the high one, which no
    // implementation then reads (no new host array per call).
    let flat_hi = match &codes.codes_hi {
        Some(h) => ops::reshape(h, &[ni, nb_hi as i32], &stream)?,
        None => flat.clone(),
    };
    let out = vec![(vec![ni, di], dtype)];
    let y = match imp {
        Implementation::Reference => {
            let u32s = |v: u32| ops::astype(&f32_scalar(v as f32)?, Dtype::U32, &stream);
            let mut idx = ops::astype(&unpack_reference(&flat, n, per, lo, &stream)?, Dtype::U32, &stream)?;
            if hi > 0 {
                let h = ops::astype(&unpack_reference(&flat_hi, n, per, hi, &stream)?, Dtype::U32, &stream)?;
                idx = ops::bitwise_or(&idx, &ops::left_shift(&h, &u32s(lo)?, &stream)?, &stream)?;
            }
            let valid = ops::greater(&u32s(k as u32)?, &idx, &stream)?;
            let idx = ops::where_(&valid, &idx, &u32s(0)?, &stream)?;
            // Flat index of element e of entry c: c * s + e.
            let base = ops::multiply(&ops::expand_dims(&idx, -1, &stream)?, &u32s(s as u32)?, &stream)?;
            let idx = ops::add(&base, &ops::arange(0.0, s as f64, 1.0, Dtype::U32, &stream)?, &stream)?;
            let y = ops::take(codebook, &ops::reshape(&idx, &[ni, di], &stream)?, &stream)?;
            ops::astype(&y, dtype, &stream)?
        }
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::PqDecode.name(),
            &[&flat, &flat_hi, codebook],
            &out,
            &stream,
            Box::new(move |ins, outs| {
                let (p, cb) = (ins[0].as_slice::<u8>()?, ins[2].as_slice::<f32>()?);
                let p_hi = if hi > 0 { ins[1].as_slice::<u8>()? } else { &[] };
                cpu_primitive::by_dtype!(dtype, T => cpu::pq_decode(p, p_hi, n, d, cb, s, bits, outs[0].as_mut_slice::<T>()?));
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "codes", &[n, d, k, nb_lo, nb_hi])?;
            let mut template =
                vec![("T", TemplateArg::Dtype(dtype)), ("S", TemplateArg::Int(s as i32)), ("C_BITS", TemplateArg::Int(bits as i32))];
            let threads = if imp == Implementation::Cuda {
                let table = k * s * dtype.size();
                let (table_bytes, items, quads) = if table <= PQ_SMALL_TABLE_BYTES {
                    (PQ_SMALL_TABLE_BYTES, PQ_DEC_ITEMS_STAGED, 0)
                } else if table <= PQ_TABLE_BYTES {
                    (PQ_TABLE_BYTES, 1, PQ_DEC_QUADS)
                } else {
                    (0, PQ_DEC_ITEMS, 0)
                };
                for (name, v) in [("TABLE_BYTES", table_bytes), ("ITEMS", items), ("QUADS", quads)] {
                    template.push((name, TemplateArg::Int(v as i32)));
                }
                if quads > 0 {
                    // The body counts quads in 32 bits.
                    let quads_total = to_i32("codes", (n * per).div_ceil(4))? as usize;
                    quads_total.div_ceil(quads).min(PQ_DEC_BLOCKS * THREADGROUP as usize)
                } else {
                    (n * per).div_ceil(items)
                }
            } else {
                // A thread per group of 8 sub-vectors.
                n * per.div_ceil(8)
            };
            launch_gpu(Kernel::PqDecode, &[&flat, &flat_hi, codebook, &p], &out, ("codes", threads), &template, &stream)?
            .remove(0)
        }
    };
    ops::reshape(&y, &out_shape, &stream)
}
