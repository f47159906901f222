//! TurboQuant-Prod and TurboQuant-RVQ encoders and decoders, each one fused
//! kernel (contracts in docs/KERNELS.md): encode = norm, rotation, first-stage
//! code, residual stage (Prod: QJL sign bits of `S r` and `‖r‖`; RVQ: a second
//! codebook on the residual) and packing in one pass; decode = unpack,
//! codebooks (+ Prod's QJL reconstruction), inverse rotation.
//!
//! The buffers are those of `crate::quant::{TurboQuantProd, TurboQuantRvq}`'s
//! encodings, byte for byte for float32 input and a dense rotation (pass
//! `Rotation::to_dense()`); a Hadamard rotation passed as its dense matrix
//! rounds differently from the quantizer's fast transform.

use half::f16;

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::turboquant::{check_head_dim, check_rotation_input, dense_rotation, encode_tensor_core_parts, launch_encoder};
use super::{check_bits, check_float, codec_grid, cpu_primitive, sizes, select, Implementation, Options, Policy, Kernel, fragment_blocks, walking_blocks, LaunchShape, CUDA_TILE_VECTORS};
use crate::array::Array;
use crate::cpu::turboquant as tq;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// Bit widths of TurboQuant-Prod: `bits − 1` MSE bits plus one QJL bit per coordinate.
pub const PROD_BITS: [u32; 6] = [1, 2, 3, 4, 5, 9];

/// TurboQuant-Prod's stored form of `[..., d]` vectors, named as the buffers
/// of `TurboQuantProd`'s encoding.
#[derive(Debug)]
pub struct ProdCodes {
    /// uint8 `[..., d * (bits − 1) / 8]`; `None` at 1 bit.
    pub codes: Option<Array>,
    /// uint8 `[..., d / 8]`: bit `i` set where `(S r)_i ≥ 0`.
    pub signs: Array,
    /// float16 `[...]`: `‖x‖`.
    pub norms: Array,
    /// float16 `[...]`: `‖r‖`; `None` at 1 bit.
    pub residual_norms: Option<Array>,
}

/// TurboQuant-RVQ's stored form of `[..., d]` vectors.
#[derive(Debug)]
pub struct RvqCodes {
    /// uint8 `[..., d * bits1 / 8]`.
    pub codes1: Array,
    /// uint8 `[..., d * bits2 / 8]`.
    pub codes2: Array,
    /// float16 `[...]`: `‖x‖`.
    pub norms: Array,
}

fn check_array(argument: &'static str, a: &Array, dtype: Dtype, shape: &[i32]) -> Result<()> {
    if a.dtype() != dtype {
        return Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: dtype.to_string() });
    }
    if a.shape() != shape {
        return Err(Error::invalid(argument, format!("shape {:?}, expected {shape:?}", a.shape())));
    }
    Ok(())
}

fn check_prod_bits(bits: u32) -> Result<u32> {
    if PROD_BITS.contains(&bits) {
        Ok(bits - 1)
    } else {
        Err(Error::invalid("bits", format!("{bits} is not supported by TurboQuant-Prod; use one of {PROD_BITS:?}")))
    }
}

/// `[..., d]` input vectors as `[n, d]`.
struct Rows {
    flat: Array,
    lead: Vec<i32>,
    n: usize,
    d: usize,
}

fn vector_rows(argument: &'static str, x: &Array, s: &Stream) -> Result<Rows> {
    check_float(argument, x)?;
    if x.ndim() == 0 {
        return Err(Error::invalid(argument, "must have at least one dimension"));
    }
    let shape = x.shape();
    let d = *shape.last().expect("ndim >= 1") as usize;
    check_head_dim(argument, d)?;
    let lead = shape[..shape.len() - 1].to_vec();
    let n: usize = lead.iter().map(|&v| v as usize).product();
    let ni = i32::try_from(n).map_err(|_| Error::invalid(argument, format!("{n} vectors exceed 2^31")))?;
    let flat = ops::reshape(x, &[ni, d as i32], s)?;
    Ok(Rows { flat, lead, n, d })
}

fn with_last(lead: &[i32], last: usize) -> Vec<i32> {
    let mut s = lead.to_vec();
    s.push(last as i32);
    s
}

fn placeholder(dtype: Dtype) -> Result<Array> {
    match dtype {
        Dtype::U8 => Array::from_slice(&[0u8], &[1]),
        Dtype::F16 => Array::from_slice(&[f16::ZERO], &[1]),
        _ => Array::from_slice(&[0.0f32], &[1]),
    }
}

fn check_out_dtype(dtype: Dtype) -> Result<()> {
    if matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        Ok(())
    } else {
        Err(Error::Dtype { argument: "dtype", found: dtype.to_string(), expected: super::FLOAT_TYPES.into() })
    }
}

/// Whether CUDA's `tq_prod_decode` runs its sketch product (and a dense
/// rotation's) on the tensor cores: a float16 or bfloat16 output (whose
/// rounding dwarfs the sums' reordering) and `d` = 64 or 128 (a split
/// matrix's fragments fit a block's registers or shared memory).
pub fn prod_decode_tensor_cores(dtype: Dtype, d: usize) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16) && matches!(d, 64 | 128)
}

/// How CUDA's `tq_prod_encode` runs both its products, `Π x` and the sketch
/// `S r` of the residual: 0 on the CUDA cores (sums by fma for float16 and
/// bfloat16 inputs), else on the tensor cores with a dense `Π` in that many
/// parts, where [`encode_tensor_core_parts`] takes them (never at 1 bit,
/// which has no MSE stage). Always two parts: a sign flips where `y`'s
/// error reaches `(S r)_j`, and one float16 part of `Π` (y within about
/// 2.5e-5) would flip about one sign in 400 at 4 MSE bits, where `‖r‖` is
/// near 0.1. `S` enters in one float16 part and the residual as float16,
/// each rounding `S r` by about 1e-5 of `‖S_j‖ ‖r‖`.
pub fn prod_encode_tensor_core_parts(dtype: Dtype, d: usize, rotate: bool, mse_bits: u32) -> i32 {
    if mse_bits == 0 || encode_tensor_core_parts(dtype, d, rotate, mse_bits) == 0 {
        return 0;
    }
    2
}

/// How CUDA runs a TurboQuant decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaDecodePath {
    /// Blocks of 256 threads tile 32 vectors through shared memory, sums in
    /// the CPU's order (every case; bit for bit the CPU's).
    Tiles,
    /// Products on the tensor cores, blocks walking the tiles (a float16 or
    /// bfloat16 output: within its rounding of the CPU's).
    TensorCores,
    /// Warp rows: a warp decodes whole vectors in registers, butterflies by
    /// shuffles (bit for bit the CPU's).
    Rows,
}

/// How CUDA's `tq_rvq_decode` runs: a dense `[d, d]` rotation on the tensor
/// cores for a float16 or bfloat16 output at `d` = 64 or 128, as
/// [`prod_decode_tensor_cores`]; Hadamard signs or no rotation in lane rows
/// for `d` a multiple of 32 up to 128 (a lane holds 32 coordinates, a
/// vector `d / 32` lanes); the tiles otherwise.
pub fn rvq_decode_path(dtype: Dtype, d: usize, rotation: RotationInput) -> CudaDecodePath {
    match rotation {
        RotationInput::Dense if prod_decode_tensor_cores(dtype, d) => CudaDecodePath::TensorCores,
        RotationInput::Hadamard | RotationInput::None if d % 32 == 0 && d <= 128 => CudaDecodePath::Rows,
        _ => CudaDecodePath::Tiles,
    }
}

/// The form of the rotation a codec kernel is given (not
/// `quant::RotationKind`, which says how a quantizer draws its rotation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotationInput {
    /// A float32 `[d, d]` matrix.
    Dense,
    /// The ±1 signs `[d]` of a Hadamard rotation.
    Hadamard,
    /// None: the vectors are rotated already.
    None,
}

impl RotationInput {
    fn of(rotation: Option<&Array>, hadamard: bool) -> Self {
        match (rotation, hadamard) {
            (None, _) => RotationInput::None,
            (Some(_), true) => RotationInput::Hadamard,
            (Some(_), false) => RotationInput::Dense,
        }
    }
}

/// Vectors one pass of a block of 256 threads decodes in `tq_rvq_decode`'s
/// lane rows: 8 warps of `32 / (d / 32)` vectors (a lane holds 32
/// coordinates).
fn rvq_rows_vectors_per_block(d: usize) -> usize {
    8 * (32 / (d / 32))
}

/// The grid of a decoder whose blocks of 256 threads walk the tiles (or
/// `tq_rvq_decode`'s passes of lane rows), each loading its split matrices
/// (tensor cores) or tables (rows) once.
fn walking_grid(kernel: Kernel, (n, d): (usize, usize), path: CudaDecodePath) -> Result<LaunchShape> {
    let cap = if path == CudaDecodePath::Rows { walking_blocks()? } else { fragment_blocks()? };
    let per_block =
        if kernel == Kernel::TqRvqDecode && path == CudaDecodePath::Rows { rvq_rows_vectors_per_block(d) } else { CUDA_TILE_VECTORS };
    let blocks = n.div_ceil(per_block).min(cap);
    Ok(((blocks as i32 * 256, 1, 1), (256, 1, 1)))
}

/// Launches a TurboQuant decoder on Metal or CUDA. On CUDA the body takes
/// the template arguments `TC` and `ROWS` of `path` and, for those two, the
/// walking grid; otherwise the codecs' grid.
#[allow(clippy::too_many_arguments)]
fn launch_decoder(
    imp: Implementation,
    kernel: Kernel,
    inputs: &[&Array],
    outputs: &[(Vec<i32>, Dtype)],
    (n, d): (usize, usize),
    mut template: Vec<(&'static str, TemplateArg)>,
    path: CudaDecodePath,
    s: &Stream,
) -> Result<Array> {
    let path = if imp == Implementation::Cuda { path } else { CudaDecodePath::Tiles };
    if imp == Implementation::Cuda {
        template.push(("TC", TemplateArg::Bool(path == CudaDecodePath::TensorCores)));
        template.push(("ROWS", TemplateArg::Bool(path == CudaDecodePath::Rows)));
    }
    let (grid, threadgroup) = if path == CudaDecodePath::Tiles { codec_grid(imp, n, d)? } else { walking_grid(kernel, (n, d), path)? };
    let launch = Launch { kernel, inputs, outputs, grid, threadgroup, template: &template };
    Ok(gpu::launch(&launch, s)?.remove(0))
}

/// Reference graph: `(‖x‖ [n, 1], y = Π x/‖x‖ [n, d])` in float32.
fn normalize_rotate_reference(x: &Array, rotation: Option<&Array>, s: &Stream) -> Result<(Array, Array)> {
    let xf = ops::astype(x, Dtype::F32, s)?;
    let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, s)?, -1, true, s)?, s)?;
    let tiny = Array::scalar_f32(f32::MIN_POSITIVE)?;
    let u = ops::divide(&xf, &ops::maximum(&norm, &tiny, s)?, s)?;
    let y = match rotation {
        Some(r) => ops::matmul(&u, &ops::transpose(&dense_rotation(r, s)?, &[1, 0], s)?, s)?,
        None => u,
    };
    Ok((norm, y))
}

/// Reference graph: float16 norms `[n]`, saturated at 65504 as the kernels store them.
fn norms_f16_reference(norm: &Array, n: usize, s: &Stream) -> Result<Array> {
    let capped = ops::minimum(norm, &Array::scalar_f32(tq::MAX_NORM)?, s)?;
    ops::astype(&ops::reshape(&capped, &[n as i32], s)?, Dtype::F16, s)
}

/// Reference graph: `norm · y Π` (row vectors: `Πᵀ y` each), as `dtype`.
fn unrotate_reference(y: &Array, rotation: Option<&Array>, norms: &Array, dtype: Dtype, s: &Stream) -> Result<Array> {
    let x = match rotation {
        Some(r) => ops::matmul(y, &dense_rotation(r, s)?, s)?,
        None => y.clone(),
    };
    let nf = ops::expand_dims(&ops::astype(norms, Dtype::F32, s)?, -1, s)?;
    ops::astype(&ops::multiply(&x, &nf, s)?, dtype, s)
}

/// TurboQuant-Prod encoding of `x` `[..., d]` (float32, float16 or bfloat16;
/// `d` a multiple of 8 up to 256) with `bits` in [`PROD_BITS`]: `rotation` `Π`
/// float32 `[d, d]`, or the ±1 signs `[d]` of a Hadamard rotation (`d` a power
/// of two; butterflies, as `tq_encode`), `None` when `x` is rotated already; `centroids` the
/// sorted float32 codebook `[2^(bits−1)]` (`None` at 1 bit), `sketch` `S`
/// float32 `[d, d]`.
///
/// The CPU and Metal kernels, and CUDA's for a float32 `x`, agree bit for
/// bit. For a float16 or bfloat16 `x` CUDA sums the products by fma, or
/// runs them on the tensor cores ([`prod_encode_tensor_core_parts`]), so a
/// code or sign may differ from the CPU's at a near-tie (the parity rule of
/// those types); the norms agree, within one float16 step on the tensor
/// cores.
pub fn tq_prod_encode(
    x: &Array,
    rotation: Option<&Array>,
    centroids: Option<&Array>,
    sketch: &Array,
    bits: u32,
    opts: &Options,
) -> Result<ProdCodes> {
    let mse_bits = check_prod_bits(bits)?;
    let stream = opts.resolve_stream()?;
    let rows = vector_rows("x", x, &stream)?;
    let (n, d) = (rows.n, rows.d);
    let hadamard = check_rotation_input(rotation, d)?;
    match (centroids, mse_bits) {
        (Some(c), 1..) => check_array("centroids", c, Dtype::F32, &[1 << mse_bits])?,
        (None, 1..) => return Err(Error::invalid("centroids", format!("a codebook of {} entries is needed", 1 << mse_bits))),
        (Some(_), 0) => return Err(Error::invalid("centroids", "TurboQuant-Prod has no codebook at 1 bit; pass None")),
        (None, 0) => {}
    }
    check_array("sketch", sketch, Dtype::F32, &[d as i32, d as i32])?;
    let imp = select(Kernel::TqProdEncode, opts.policy, &stream)?;
    let code_bytes = d * mse_bits as usize / 8;
    let lead = &rows.lead;
    if n == 0 {
        let z = |shape: &[i32], dt| ops::zeros(shape, dt, &stream);
        return Ok(ProdCodes {
            codes: (mse_bits > 0).then(|| z(&with_last(lead, code_bytes), Dtype::U8)).transpose()?,
            signs: z(&with_last(lead, d / 8), Dtype::U8)?,
            norms: z(lead, Dtype::F16)?,
            residual_norms: (mse_bits > 0).then(|| z(lead, Dtype::F16)).transpose()?,
        });
    }
    let ni = n as i32;
    let mut outs = match imp {
        Implementation::Reference => {
            let off = Options::on(stream.clone(), Policy::Off);
            let s = &stream;
            let (norm, y) = normalize_rotate_reference(&rows.flat, rotation, s)?;
            let (codes, r, rnorm) = match centroids {
                Some(c) => {
                    let codes = super::scalar_quantize(&y, c, mse_bits, &off)?;
                    let yhat = super::scalar_dequantize(&codes, c, mse_bits, d, Dtype::F32, &off)?;
                    let r = ops::subtract(&y, &yhat, s)?;
                    let rn = ops::sqrt(&ops::sum_axis(&ops::square(&r, s)?, -1, true, s)?, s)?;
                    (Some(codes), r, Some(norms_f16_reference(&rn, n, s)?))
                }
                None => (None, y, None),
            };
            let proj = ops::matmul(&r, &ops::transpose(sketch, &[1, 0], s)?, s)?;
            let zero = Array::scalar_f32(0.0)?;
            let sbits = ops::astype(&ops::greater_equal(&proj, &zero, s)?, Dtype::U8, s)?;
            let signs = super::bit_pack(&sbits, 1, &off)?;
            vec![
                codes.unwrap_or(placeholder(Dtype::U8)?),
                signs,
                norms_f16_reference(&norm, n, s)?,
                rnorm.unwrap_or(placeholder(Dtype::F16)?),
            ]
        }
        imp => {
            let code_shape = if mse_bits > 0 { vec![ni, code_bytes as i32] } else { vec![1] };
            let rn_shape = if mse_bits > 0 { vec![ni] } else { vec![1] };
            let outputs = [
                (code_shape, Dtype::U8),
                (vec![ni, (d / 8) as i32], Dtype::U8),
                (vec![ni], Dtype::F16),
                (rn_shape, Dtype::F16),
            ];
            let no_rotation = placeholder(Dtype::F32)?;
            let rot_input = rotation.unwrap_or(&no_rotation);
            let no_centroids = placeholder(Dtype::F32)?;
            let cent_input = centroids.unwrap_or(&no_centroids);
            let rotate = rotation.is_some();
            if imp == Implementation::Cpu {
                let dtype = x.dtype();
                cpu_primitive::apply(
                    Kernel::TqProdEncode.name(),
                    &[&rows.flat, rot_input, cent_input, sketch],
                    &outputs,
                    &stream,
                    Box::new(move |ins, outs| {
                        let rot = if rotate { Some(ins[1].as_slice::<f32>()?) } else { None };
                        let cent = if mse_bits > 0 { ins[2].as_slice::<f32>()? } else { &[] };
                        let sk = ins[3].as_slice::<f32>()?;
                        let [codes, signs, norms, rnorms] = outs else { return Err("four outputs expected".into()) };
                        let codes = if mse_bits > 0 { codes.as_mut_slice::<u8>()? } else { &mut [] };
                        let rnorms = if mse_bits > 0 { rnorms.as_mut_slice::<f16>()? } else { &mut [] };
                        let (signs, norms) = (signs.as_mut_slice::<u8>()?, norms.as_mut_slice::<f16>()?);
                        cpu_primitive::by_dtype!(dtype, T => tq::tq_prod_encode(ins[0].as_slice::<T>()?, rot, cent, sk, d, mse_bits, codes, signs, norms, rnorms));
                        Ok(())
                    }),
                )?
            } else {
                let p = sizes(imp, "x", &[n])?;
                launch_encoder(
                    imp,
                    Kernel::TqProdEncode,
                    &[&rows.flat, rot_input, cent_input, sketch, &p],
                    &outputs,
                    (n, d),
                    &[
                        ("T", TemplateArg::Dtype(x.dtype())),
                        ("D", TemplateArg::Int(d as i32)),
                        ("B_BITS", TemplateArg::Int(bits as i32)),
                        ("ROTATE", TemplateArg::Bool(rotate)),
                        ("HADAMARD", TemplateArg::Bool(hadamard)),
                    ],
                    Some(prod_encode_tensor_core_parts(x.dtype(), d, rotate, mse_bits)),
                    &stream,
                )?
            }
        }
    };
    let s = &stream;
    let rnorms = outs.pop().expect("four outputs");
    let norms = outs.pop().expect("four outputs");
    let signs = outs.pop().expect("four outputs");
    let codes = outs.pop().expect("four outputs");
    Ok(ProdCodes {
        codes: (mse_bits > 0).then(|| ops::reshape(&codes, &with_last(lead, code_bytes), s)).transpose()?,
        signs: ops::reshape(&signs, &with_last(lead, d / 8), s)?,
        norms: ops::reshape(&norms, lead, s)?,
        residual_norms: (mse_bits > 0).then(|| ops::reshape(&rnorms, lead, s)).transpose()?,
    })
}

/// Inverse of [`tq_prod_encode`]: `‖x‖ Πᵀ (c[code] + √(π/2)/d · ‖r‖ · Sᵀ z)`
/// as `dtype` `[..., d]`, `d` from the sketch, `z` the ±1 signs. `rotation`
/// as the encoder's: `Π` `[d, d]`, a Hadamard rotation's signs `[d]`
/// (`Πᵀ y = s ⊙ (H y / √d)` by butterflies), or `None`.
pub fn tq_prod_decode(
    enc: &ProdCodes,
    rotation: Option<&Array>,
    centroids: Option<&Array>,
    sketch: &Array,
    bits: u32,
    dtype: Dtype,
    opts: &Options,
) -> Result<Array> {
    let mse_bits = check_prod_bits(bits)?;
    check_out_dtype(dtype)?;
    let ss = sketch.shape();
    if ss.len() != 2 || ss[0] != ss[1] {
        return Err(Error::invalid("sketch", format!("shape {ss:?} must be [d, d]")));
    }
    let d = ss[0] as usize;
    check_head_dim("sketch", d)?;
    check_array("sketch", sketch, Dtype::F32, &[d as i32, d as i32])?;
    let hadamard = check_rotation_input(rotation, d)?;
    if enc.norms.dtype() != Dtype::F16 {
        return Err(Error::Dtype { argument: "norms", found: enc.norms.dtype().to_string(), expected: "float16".into() });
    }
    let lead = enc.norms.shape();
    let n: usize = lead.iter().map(|&v| v as usize).product();
    check_array("signs", &enc.signs, Dtype::U8, &with_last(&lead, d / 8))?;
    let code_bytes = d * mse_bits as usize / 8;
    match (&enc.codes, &enc.residual_norms, centroids, mse_bits) {
        (_, _, _, 0) => {
            if enc.codes.is_some() || enc.residual_norms.is_some() || centroids.is_some() {
                return Err(Error::invalid("codes", "TurboQuant-Prod stores no codes, residual norms or codebook at 1 bit"));
            }
        }
        (Some(c), Some(r), Some(cb), _) => {
            check_array("codes", c, Dtype::U8, &with_last(&lead, code_bytes))?;
            check_array("residual_norms", r, Dtype::F16, &lead)?;
            check_array("centroids", cb, Dtype::F32, &[1 << mse_bits])?;
        }
        (None, _, _, _) => return Err(Error::invalid("codes", format!("needed at {bits} bits"))),
        (_, None, _, _) => return Err(Error::invalid("residual_norms", format!("needed at {bits} bits"))),
        (_, _, None, _) => return Err(Error::invalid("centroids", format!("a codebook of {} entries is needed", 1 << mse_bits))),
    }
    let stream = opts.resolve_stream()?;
    let s = &stream;
    let imp = select(Kernel::TqProdDecode, opts.policy, s)?;
    let out_shape = with_last(&lead, d);
    if n == 0 {
        return ops::zeros(&out_shape, dtype, s);
    }
    let ni = i32::try_from(n).map_err(|_| Error::invalid("norms", format!("{n} vectors exceed 2^31")))?;
    let flat = |a: &Array, last: Option<usize>| -> Result<Array> {
        match last {
            Some(l) => ops::reshape(a, &[ni, l as i32], s),
            None => ops::reshape(a, &[ni], s),
        }
    };
    let signs = flat(&enc.signs, Some(d / 8))?;
    let norms = flat(&enc.norms, None)?;
    let scale = tq::prod_scale(d);
    let y = match imp {
        Implementation::Reference => {
            let off = Options::on(stream.clone(), Policy::Off);
            let zs = ops::astype(&super::bit_unpack(&signs, 1, d, &off)?, Dtype::F32, s)?;
            // ±1 from the bits: 2b − 1.
            let pm = ops::subtract(&ops::multiply(&zs, &Array::scalar_f32(2.0)?, s)?, &Array::scalar_f32(1.0)?, s)?;
            let (yhat, a) = match mse_bits {
                0 => (None, Array::scalar_f32(scale)?),
                _ => {
                    let codes = flat(enc.codes.as_ref().expect("checked"), Some(code_bytes))?;
                    let cb = centroids.expect("checked");
                    let yhat = super::scalar_dequantize(&codes, cb, mse_bits, d, Dtype::F32, &off)?;
                    let rn = ops::astype(&flat(enc.residual_norms.as_ref().expect("checked"), None)?, Dtype::F32, s)?;
                    let a = ops::expand_dims(&ops::multiply(&rn, &Array::scalar_f32(scale)?, s)?, -1, s)?;
                    (Some(yhat), a)
                }
            };
            let qjl = ops::matmul(&ops::multiply(&pm, &a, s)?, sketch, s)?;
            let y = match yhat {
                Some(h) => ops::add(&h, &qjl, s)?,
                None => qjl,
            };
            unrotate_reference(&y, rotation, &norms, dtype, s)?
        }
        imp => {
            let no_rotation = placeholder(Dtype::F32)?;
            let rot_input = rotation.unwrap_or(&no_rotation);
            let (codes, rnorms, cent) = if mse_bits > 0 {
                (
                    flat(enc.codes.as_ref().expect("checked"), Some(code_bytes))?,
                    flat(enc.residual_norms.as_ref().expect("checked"), None)?,
                    centroids.expect("checked").clone(),
                )
            } else {
                (placeholder(Dtype::U8)?, placeholder(Dtype::F16)?, placeholder(Dtype::F32)?)
            };
            let rotate = rotation.is_some();
            let outputs = [(vec![ni, d as i32], dtype)];
            if imp == Implementation::Cpu {
                cpu_primitive::apply(
                    Kernel::TqProdDecode.name(),
                    &[&codes, &signs, &norms, &rnorms, rot_input, &cent, sketch],
                    &outputs,
                    s,
                    Box::new(move |ins, outs| {
                        let codes = if mse_bits > 0 { ins[0].as_slice::<u8>()? } else { &[] };
                        let rn = if mse_bits > 0 { ins[3].as_slice::<f16>()? } else { &[] };
                        let cent = if mse_bits > 0 { ins[5].as_slice::<f32>()? } else { &[] };
                        let rot = if rotate { Some(ins[4].as_slice::<f32>()?) } else { None };
                        let (sg, nm, sk) = (ins[1].as_slice::<u8>()?, ins[2].as_slice::<f16>()?, ins[6].as_slice::<f32>()?);
                        cpu_primitive::by_dtype!(dtype, T => tq::tq_prod_decode(codes, sg, nm, rn, rot, cent, sk, d, mse_bits, scale, outs[0].as_mut_slice::<T>()?));
                        Ok(())
                    }),
                )?
                .remove(0)
            } else {
                let p = sizes(imp, "norms", &[n, scale.to_bits() as usize])?;
                let template = vec![
                    ("T", TemplateArg::Dtype(dtype)),
                    ("D", TemplateArg::Int(d as i32)),
                    ("B_BITS", TemplateArg::Int(bits as i32)),
                    ("ROTATE", TemplateArg::Bool(rotate)),
                    ("HADAMARD", TemplateArg::Bool(hadamard)),
                ];
                let inputs = [&codes, &signs, &norms, &rnorms, rot_input, &cent, sketch, &p];
                let path = if prod_decode_tensor_cores(dtype, d) { CudaDecodePath::TensorCores } else { CudaDecodePath::Tiles };
                launch_decoder(imp, Kernel::TqProdDecode, &inputs, &outputs, (n, d), template, path, s)?
            }
        }
    };
    ops::reshape(&y, &out_shape, s)
}

fn check_rvq_codebooks(c1: &Array, c2: &Array, bits: (u32, u32)) -> Result<()> {
    check_bits("bits1", bits.0)?;
    check_bits("bits2", bits.1)?;
    check_array("centroids1", c1, Dtype::F32, &[1 << bits.0])?;
    check_array("centroids2", c2, Dtype::F32, &[1 << bits.1])
}

/// TurboQuant-RVQ encoding of `x` `[..., d]` (float32, float16 or bfloat16;
/// `d` a multiple of 8 up to 256): `rotation` `Π` float32 `[d, d]`, or the ±1
/// signs `[d]` of a Hadamard rotation (`d` a power of two; butterflies, as
/// `tq_encode`), `None` when `x` is rotated already; the sorted float32 codebooks `centroids1`
/// `[2^bits.0]` and `centroids2` `[2^bits.1]` (each width 1, 2, 3, 4 or 8).
pub fn tq_rvq_encode(
    x: &Array,
    rotation: Option<&Array>,
    centroids1: &Array,
    centroids2: &Array,
    bits: (u32, u32),
    opts: &Options,
) -> Result<RvqCodes> {
    let stream = opts.resolve_stream()?;
    let s = &stream;
    let rows = vector_rows("x", x, s)?;
    let (n, d) = (rows.n, rows.d);
    let hadamard = check_rotation_input(rotation, d)?;
    check_rvq_codebooks(centroids1, centroids2, bits)?;
    let imp = select(Kernel::TqRvqEncode, opts.policy, s)?;
    let (b1, b2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
    let lead = &rows.lead;
    if n == 0 {
        return Ok(RvqCodes {
            codes1: ops::zeros(&with_last(lead, b1), Dtype::U8, s)?,
            codes2: ops::zeros(&with_last(lead, b2), Dtype::U8, s)?,
            norms: ops::zeros(lead, Dtype::F16, s)?,
        });
    }
    let ni = n as i32;
    let outputs = [(vec![ni, b1 as i32], Dtype::U8), (vec![ni, b2 as i32], Dtype::U8), (vec![ni], Dtype::F16)];
    let no_rotation = placeholder(Dtype::F32)?;
    let rot_input = rotation.unwrap_or(&no_rotation);
    let rotate = rotation.is_some();
    let mut outs = match imp {
        Implementation::Reference => {
            let off = Options::on(stream.clone(), Policy::Off);
            let (norm, y) = normalize_rotate_reference(&rows.flat, rotation, s)?;
            let codes1 = super::scalar_quantize(&y, centroids1, bits.0, &off)?;
            let yhat = super::scalar_dequantize(&codes1, centroids1, bits.0, d, Dtype::F32, &off)?;
            let codes2 = super::scalar_quantize(&ops::subtract(&y, &yhat, s)?, centroids2, bits.1, &off)?;
            vec![codes1, codes2, norms_f16_reference(&norm, n, s)?]
        }
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::TqRvqEncode.name(),
                &[&rows.flat, rot_input, centroids1, centroids2],
                &outputs,
                s,
                Box::new(move |ins, outs| {
                    let rot = if rotate { Some(ins[1].as_slice::<f32>()?) } else { None };
                    let (c1, c2) = (ins[2].as_slice::<f32>()?, ins[3].as_slice::<f32>()?);
                    let [k1, k2, nm] = outs else { return Err("three outputs expected".into()) };
                    let (k1, k2, nm) = (k1.as_mut_slice::<u8>()?, k2.as_mut_slice::<u8>()?, nm.as_mut_slice::<f16>()?);
                    cpu_primitive::by_dtype!(dtype, T => tq::tq_rvq_encode(ins[0].as_slice::<T>()?, rot, c1, c2, d, bits, k1, k2, nm));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "x", &[n])?;
            launch_encoder(
                imp,
                Kernel::TqRvqEncode,
                &[&rows.flat, rot_input, centroids1, centroids2, &p],
                &outputs,
                (n, d),
                &[
                    ("T", TemplateArg::Dtype(x.dtype())),
                    ("D", TemplateArg::Int(d as i32)),
                    ("B1_BITS", TemplateArg::Int(bits.0 as i32)),
                    ("B2_BITS", TemplateArg::Int(bits.1 as i32)),
                    ("ROTATE", TemplateArg::Bool(rotate)),
                    ("HADAMARD", TemplateArg::Bool(hadamard)),
                ],
                Some(encode_tensor_core_parts(x.dtype(), d, rotate, bits.0 + bits.1)),
                s,
            )?
        }
    };
    let norms = ops::reshape(&outs.pop().expect("three outputs"), lead, s)?;
    let codes2 = ops::reshape(&outs.pop().expect("three outputs"), &with_last(lead, b2), s)?;
    let codes1 = ops::reshape(&outs.pop().expect("three outputs"), &with_last(lead, b1), s)?;
    Ok(RvqCodes { codes1, codes2, norms })
}

/// Inverse of [`tq_rvq_encode`]: `‖x‖ Πᵀ (centroids1[a] + centroids2[b])` as
/// `dtype` `[..., d]`; `rotation` as the encoder's (`[d, d]`, Hadamard signs
/// `[d]` by butterflies, or `None`).
#[allow(clippy::too_many_arguments)]
pub fn tq_rvq_decode(
    enc: &RvqCodes,
    rotation: Option<&Array>,
    centroids1: &Array,
    centroids2: &Array,
    bits: (u32, u32),
    d: usize,
    dtype: Dtype,
    opts: &Options,
) -> Result<Array> {
    check_head_dim("d", d)?;
    check_out_dtype(dtype)?;
    let hadamard = check_rotation_input(rotation, d)?;
    check_rvq_codebooks(centroids1, centroids2, bits)?;
    if enc.norms.dtype() != Dtype::F16 {
        return Err(Error::Dtype { argument: "norms", found: enc.norms.dtype().to_string(), expected: "float16".into() });
    }
    let lead = enc.norms.shape();
    let n: usize = lead.iter().map(|&v| v as usize).product();
    let (b1, b2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
    check_array("codes1", &enc.codes1, Dtype::U8, &with_last(&lead, b1))?;
    check_array("codes2", &enc.codes2, Dtype::U8, &with_last(&lead, b2))?;
    let stream = opts.resolve_stream()?;
    let s = &stream;
    let imp = select(Kernel::TqRvqDecode, opts.policy, s)?;
    let out_shape = with_last(&lead, d);
    if n == 0 {
        return ops::zeros(&out_shape, dtype, s);
    }
    let ni = i32::try_from(n).map_err(|_| Error::invalid("norms", format!("{n} vectors exceed 2^31")))?;
    let codes1 = ops::reshape(&enc.codes1, &[ni, b1 as i32], s)?;
    let codes2 = ops::reshape(&enc.codes2, &[ni, b2 as i32], s)?;
    let norms = ops::reshape(&enc.norms, &[ni], s)?;
    let no_rotation = placeholder(Dtype::F32)?;
    let rot_input = rotation.unwrap_or(&no_rotation);
    let rotate = rotation.is_some();
    let outputs = [(vec![ni, d as i32], dtype)];
    let y = match imp {
        Implementation::Reference => {
            let off = Options::on(stream.clone(), Policy::Off);
            let y1 = super::scalar_dequantize(&codes1, centroids1, bits.0, d, Dtype::F32, &off)?;
            let y2 = super::scalar_dequantize(&codes2, centroids2, bits.1, d, Dtype::F32, &off)?;
            unrotate_reference(&ops::add(&y1, &y2, s)?, rotation, &norms, dtype, s)?
        }
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::TqRvqDecode.name(),
            &[&codes1, &codes2, &norms, rot_input, centroids1, centroids2],
            &outputs,
            s,
            Box::new(move |ins, outs| {
                let rot = if rotate { Some(ins[3].as_slice::<f32>()?) } else { None };
                let (k1, k2, nm) = (ins[0].as_slice::<u8>()?, ins[1].as_slice::<u8>()?, ins[2].as_slice::<f16>()?);
                let (c1, c2) = (ins[4].as_slice::<f32>()?, ins[5].as_slice::<f32>()?);
                cpu_primitive::by_dtype!(dtype, T => tq::tq_rvq_decode(k1, k2, nm, rot, c1, c2, d, bits, outs[0].as_mut_slice::<T>()?));
                Ok(())
            }),
        )?
        .remove(0),
        Implementation::Metal | Implementation::Cuda => {
            let p = sizes(imp, "norms", &[n])?;
            let template = vec![
                ("T", TemplateArg::Dtype(dtype)),
                ("D", TemplateArg::Int(d as i32)),
                ("B1_BITS", TemplateArg::Int(bits.0 as i32)),
                ("B2_BITS", TemplateArg::Int(bits.1 as i32)),
                ("ROTATE", TemplateArg::Bool(rotate)),
                ("HADAMARD", TemplateArg::Bool(hadamard)),
            ];
            let inputs = [&codes1, &codes2, &norms, rot_input, centroids1, centroids2, &p];
            let path = rvq_decode_path(dtype, d, RotationInput::of(rotation, hadamard));
            launch_decoder(imp, Kernel::TqRvqDecode, &inputs, &outputs, (n, d), template, path, s)?
        }
    };
    ops::reshape(&y, &out_shape, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prod_encode_parts() {
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F16, 128, true, 3), 2);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F16, 64, true, 8), 2);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::BF16, 128, true, 1), 2);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F16, 128, true, 0), 0);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F16, 128, false, 3), 0);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F32, 128, true, 3), 0);
        assert_eq!(prod_encode_tensor_core_parts(Dtype::F16, 256, true, 3), 0);
    }

    #[test]
    fn rvq_decode_paths() {
        use CudaDecodePath::*;
        use RotationInput::{Dense, Hadamard};
        assert_eq!(rvq_decode_path(Dtype::F16, 128, Dense), TensorCores);
        assert_eq!(rvq_decode_path(Dtype::BF16, 64, Dense), TensorCores);
        assert_eq!(rvq_decode_path(Dtype::F32, 128, Dense), Tiles);
        assert_eq!(rvq_decode_path(Dtype::F16, 256, Dense), Tiles);
        for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            assert_eq!(rvq_decode_path(dtype, 128, Hadamard), Rows);
            assert_eq!(rvq_decode_path(dtype, 32, Hadamard), Rows);
            assert_eq!(rvq_decode_path(dtype, 256, Hadamard), Tiles);
            assert_eq!(rvq_decode_path(dtype, 96, RotationInput::None), Rows);
            assert_eq!(rvq_decode_path(dtype, 72, RotationInput::None), Tiles);
            assert_eq!(rvq_decode_path(dtype, 16, Hadamard), Tiles);
        }
    }

    #[test]
    fn rvq_rows_passes() {
        // 8 warps of 32 / (d / 32) vectors; at d = 96 two lanes of each warp idle.
        assert_eq!(rvq_rows_vectors_per_block(128), 64);
        assert_eq!(rvq_rows_vectors_per_block(96), 80);
        assert_eq!(rvq_rows_vectors_per_block(64), 128);
        assert_eq!(rvq_rows_vectors_per_block(32), 256);
    }
}
