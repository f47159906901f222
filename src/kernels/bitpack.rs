//! `bit_pack` / `bit_unpack`: dense b-bit codes along the last axis.

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{check_bits, cpu_primitive, grid_1d, sizes, select, Implementation, Options, Kernel};
use crate::array::Array;
use crate::cpu;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

fn check_u8(argument: &'static str, a: &Array) -> Result<()> {
    if a.dtype() != Dtype::U8 {
        return Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: "uint8".into() });
    }
    if a.ndim() == 0 {
        return Err(Error::invalid(argument, "must have at least one dimension"));
    }
    Ok(())
}

/// Leading dimensions flattened into rows, and the last axis.
fn rows_and_last(shape: &[i32]) -> (usize, usize) {
    let last = *shape.last().unwrap_or(&0) as usize;
    let rows = shape[..shape.len() - 1].iter().map(|&d| d as usize).product();
    (rows, last)
}

/// Packs b-bit `codes` (uint8, `[..., n]`; the low `bits` bits of each code are
/// stored) into uint8 `[..., ceil(n * bits / 8)]`.
pub fn bit_pack(codes: &Array, bits: u32, opts: &Options) -> Result<Array> {
    check_u8("codes", codes)?;
    check_bits("bits", bits)?;
    let stream = opts.resolve_stream()?;
    let shape = codes.shape();
    let (rows, n) = rows_and_last(&shape);
    let nbytes = cpu::packed_len(n, bits);
    let mut out_shape = shape.clone();
    *out_shape.last_mut().expect("ndim >= 1") = i32::try_from(nbytes).expect("smaller than n");
    let imp = select(Kernel::BitPack, opts.policy, &stream)?;
    if rows * n == 0 {
        return ops::zeros(&out_shape, Dtype::U8, &stream);
    }
    let flat = ops::reshape(codes, &[rows as i32, n as i32], &stream)?;
    let packed = match imp {
        Implementation::Reference => pack_reference(&flat, rows, n, bits, &stream)?,
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::BitPack.name(),
            &[&flat],
            &[(vec![rows as i32, nbytes as i32], Dtype::U8)],
            &stream,
            Box::new(move |ins, outs| {
                let src = ins[0].as_slice::<u8>()?;
                cpu::bit_pack(src, rows, n, bits, outs[0].as_mut_slice::<u8>()?);
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "codes", &[rows, n, nbytes])?;
            let (grid, threadgroup) = grid_1d("codes", rows * n.div_ceil(8))?;
            gpu::launch(
                &Launch {
                    kernel: Kernel::BitPack,
                    inputs: &[&flat, &p],
                    outputs: &[(vec![rows as i32, nbytes as i32], Dtype::U8)],
                    grid,
                    threadgroup,
                    template: &[("B_BITS", TemplateArg::Int(bits as i32))],
                },
                &stream,
            )?
            .remove(0)
        }
    };
    ops::reshape(&packed, &out_shape, &stream)
}

/// Unpacks uint8 `[..., ceil(n * bits / 8)]` into `n` codes (uint8 `[..., n]`).
pub fn bit_unpack(packed: &Array, bits: u32, n: usize, opts: &Options) -> Result<Array> {
    check_u8("packed", packed)?;
    check_bits("bits", bits)?;
    let stream = opts.resolve_stream()?;
    let shape = packed.shape();
    let (rows, nbytes) = rows_and_last(&shape);
    if cpu::packed_len(n, bits) != nbytes {
        return Err(Error::invalid(
            "packed",
            format!(
                "last dimension is {nbytes} bytes, but {n} codes of {bits} bits take {}",
                cpu::packed_len(n, bits)
            ),
        ));
    }
    let n_i32 = i32::try_from(n).map_err(|_| Error::invalid("n", format!("{n} exceeds 2^31")))?;
    let mut out_shape = shape.clone();
    *out_shape.last_mut().expect("ndim >= 1") = n_i32;
    let imp = select(Kernel::BitUnpack, opts.policy, &stream)?;
    if rows * n == 0 {
        return ops::zeros(&out_shape, Dtype::U8, &stream);
    }
    let flat = ops::reshape(packed, &[rows as i32, nbytes as i32], &stream)?;
    let codes = match imp {
        Implementation::Reference => unpack_reference(&flat, rows, n, bits, &stream)?,
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::BitUnpack.name(),
            &[&flat],
            &[(vec![rows as i32, n_i32], Dtype::U8)],
            &stream,
            Box::new(move |ins, outs| {
                let src = ins[0].as_slice::<u8>()?;
                cpu::bit_unpack(src, rows, n, bits, outs[0].as_mut_slice::<u8>()?);
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "packed", &[rows, n, nbytes])?;
            let (grid, threadgroup) = grid_1d("packed", rows * n.div_ceil(8))?;
            gpu::launch(
                &Launch {
                    kernel: Kernel::BitUnpack,
                    inputs: &[&flat, &p],
                    outputs: &[(vec![rows as i32, n_i32], Dtype::U8)],
                    grid,
                    threadgroup,
                    template: &[("B_BITS", TemplateArg::Int(bits as i32))],
                },
                &stream,
            )?
            .remove(0)
        }
    };
    ops::reshape(&codes, &out_shape, &stream)
}

/// `[0, step, 2*step, ...]` (count values) as uint64.
fn shifts(count: usize, step: usize, s: &Stream) -> Result<Array> {
    ops::arange(0.0, (count * step) as f64, step as f64, Dtype::U64, s)
}

/// Reference graph: groups of 8 codes become one 64-bit word, then `bits` bytes.
pub(crate) fn pack_reference(codes: &Array, rows: usize, n: usize, bits: u32, s: &Stream) -> Result<Array> {
    let b = bits as usize;
    let groups = n.div_ceil(8);
    let nbytes = cpu::packed_len(n, bits);
    let padded = ops::pad_zeros(codes, &[1], &[0], &[(groups * 8 - n) as i32], s)?;
    let grouped = ops::reshape(&padded, &[rows as i32, groups as i32, 8], s)?;
    let wide = ops::astype(&grouped, Dtype::U64, s)?;
    let mask = ops::astype(&Array::scalar_f32(((1u32 << bits) - 1) as f32)?, Dtype::U64, s)?;
    let masked = ops::bitwise_and(&wide, &mask, s)?;
    let placed = ops::left_shift(&masked, &shifts(8, b, s)?, s)?;
    let word = ops::sum_axis(&placed, -1, true, s)?;
    let bytes = ops::right_shift(&word, &shifts(b, 8, s)?, s)?;
    let ff = ops::astype(&Array::scalar_f32(255.0)?, Dtype::U64, s)?;
    let bytes = ops::astype(&ops::bitwise_and(&bytes, &ff, s)?, Dtype::U8, s)?;
    let flat = ops::reshape(&bytes, &[rows as i32, (groups * b) as i32], s)?;
    ops::slice(&flat, &[0, 0], &[rows as i32, nbytes as i32], s)
}

/// Reference graph: `bits` bytes become one 64-bit word, then 8 codes.
pub(crate) fn unpack_reference(packed: &Array, rows: usize, n: usize, bits: u32, s: &Stream) -> Result<Array> {
    let b = bits as usize;
    let groups = n.div_ceil(8);
    let nbytes = cpu::packed_len(n, bits);
    let padded = ops::pad_zeros(packed, &[1], &[0], &[(groups * b - nbytes) as i32], s)?;
    let grouped = ops::reshape(&padded, &[rows as i32, groups as i32, b as i32], s)?;
    let wide = ops::astype(&grouped, Dtype::U64, s)?;
    let word = ops::sum_axis(&ops::left_shift(&wide, &shifts(b, 8, s)?, s)?, -1, true, s)?;
    let mask = ops::astype(&Array::scalar_f32(((1u32 << bits) - 1) as f32)?, Dtype::U64, s)?;
    let codes = ops::bitwise_and(&ops::right_shift(&word, &shifts(8, b, s)?, s)?, &mask, s)?;
    let codes = ops::astype(&codes, Dtype::U8, s)?;
    let flat = ops::reshape(&codes, &[rows as i32, (groups * 8) as i32], s)?;
    ops::slice(&flat, &[0, 0], &[rows as i32, n as i32], s)
}
