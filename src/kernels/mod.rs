//! The kernel registry.
//!
//! One kernel is one contract (docs/KERNELS.md) with up to four
//! implementations: a Metal body and a CUDA body run through MLX's custom
//! kernels, a CPU function run as an MLX custom primitive, and a reference
//! graph of plain MLX ops. [`Policy`] picks one per stream when the operation is
//! built; every implementation builds lazy arrays in MLX's graph.

mod bitpack;
pub mod cpu_primitive;
mod cuda_source;
mod framed_dequantize;
mod key_mean;
pub mod gpu;
pub mod kv_attention;
mod quant;
pub mod declaration;
mod store_write;
pub mod tq_codec;
pub mod turboquant;
mod vq;
pub mod window;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

pub use bitpack::{bit_pack, bit_unpack};
pub use framed_dequantize::{framed_dequantize, FramedSide};
pub use key_mean::{key_mean, KeyMean};
pub(crate) use key_mean::mean_offset;
pub use store_write::{store_write, StoreWrite};
pub(crate) use store_write::stored_norms;
pub use cuda_source::{by_include as cuda_source_by_include, CudaSource};
pub use gpu::{cached_kernel_count, compact_source};
pub use quant::{
    kivi_dequantize, kivi_params_shape, kivi_quantize, kivi_quantize_widths, pq_decode, pq_encode, pq_tensor_cores, qjl_encode, qjl_score, qjl_tensor_cores,
    scalar_dequantize, scalar_quantize, KiviMode, PqCodes, PQ_STAGE_FLOATS, PQ_SUB_DIMS, QJL_SCORE_MAX_QM,
};
pub use declaration::{Declaration, Kernel, TemplateArg, DECLARATIONS};
pub use tq_codec::{prod_decode_tensor_cores, prod_encode_tensor_core_parts, rvq_decode_path, tq_prod_decode, tq_prod_encode, tq_rvq_decode, tq_rvq_encode, CudaDecodePath, ProdCodes, RotationInput, RvqCodes, PROD_BITS};
pub use turboquant::{encode_code_table, encode_tensor_core_parts, tq_encode};
pub use vq::{vq_quantize, vq_quantize_reference_chunk_rows, MAX_CODEBOOK_SIZE, VQ_DIMS};

use crate::array::Array;
use crate::error::{Error, Result};
use crate::ffi;
use crate::ops;
use crate::stream::{Backend, Stream};

/// Whether to use the fused kernels (the original's `use_metal_kernels`
/// None / True / False).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The fused kernel where the stream's back-end has one, else the reference graph.
    #[default]
    Auto,
    /// The fused kernel, or an error when the operation is built.
    Require,
    /// Always the reference graph.
    Off,
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Policy::Auto),
            "require" => Ok(Policy::Require),
            "off" => Ok(Policy::Off),
            other => Err(Error::invalid("policy", format!("{other:?} is not one of \"auto\", \"require\", \"off\""))),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Auto => "auto",
            Policy::Require => "require",
            Policy::Off => "off",
        })
    }
}

/// Which implementation runs an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Implementation {
    Metal,
    Cuda,
    Cpu,
    Reference,
}

/// Where and how an operation runs.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub policy: Policy,
    /// `None`: MLX's default stream (the GPU where there is one).
    pub stream: Option<Stream>,
}

impl Options {
    pub fn with_policy(policy: Policy) -> Self {
        Options { policy, stream: None }
    }

    pub fn on(stream: Stream, policy: Policy) -> Self {
        Options { policy, stream: Some(stream) }
    }

    pub(crate) fn resolve_stream(&self) -> Result<Stream> {
        match &self.stream {
            Some(s) => Ok(s.clone()),
            None => Stream::default_stream(),
        }
    }
}

/// Picks the implementation of `kernel` for `stream` under `policy`: its
/// CPU primitive or GPU body where the declaration has one, else the
/// reference graph.
pub fn select(kernel: Kernel, policy: Policy, stream: &Stream) -> Result<Implementation> {
    let backend = stream.backend()?;
    let d = kernel.declaration();
    let fused = match backend {
        Backend::Cpu => d.cpu.then_some(Implementation::Cpu),
        Backend::Metal => d.metal.map(|_| Implementation::Metal),
        Backend::Cuda => d.cuda.map(|_| Implementation::Cuda),
    };
    match (policy, fused) {
        (Policy::Off, _) => Ok(Implementation::Reference),
        (Policy::Auto, None) => Ok(Implementation::Reference),
        (_, Some(imp)) => Ok(imp),
        (Policy::Require, None) => Err(Error::Unsupported(format!(
            "{}: policy \"require\" but the {} back-end has no fused kernel for it",
            d.name,
            backend.name()
        ))),
    }
}

/// Moves the arrays out of an mlx-c vector and frees it.
pub(crate) fn take_vector(v: ffi::mlx_vector_array) -> Result<Vec<Array>> {
    // SAFETY: `v` is a valid vector owned here; each element is copied into a
    // new handle before the vector is freed.
    unsafe {
        let n = ffi::mlx_vector_array_size(v);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let mut a = Array::empty_handle();
            let status = ffi::mlx_vector_array_get(&mut a, v, i);
            if status != 0 {
                ffi::mlx_vector_array_free(v);
                ffi::check(status)?;
            }
            out.push(Array::from_raw(a)?);
        }
        ffi::mlx_vector_array_free(v);
        Ok(out)
    }
}

/// Element types of the float kernels' inputs.
pub(crate) const FLOAT_TYPES: &str = "float32, float16 or bfloat16";

/// `a` must be float32, float16 or bfloat16.
pub(crate) fn check_float(argument: &'static str, a: &Array) -> Result<()> {
    if matches!(a.dtype(), crate::Dtype::F32 | crate::Dtype::F16 | crate::Dtype::BF16) {
        Ok(())
    } else {
        Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: FLOAT_TYPES.into() })
    }
}

/// Code widths every packing kernel supports.
pub(crate) fn check_bits(argument: &'static str, bits: u32) -> Result<()> {
    if crate::cpu::SUPPORTED_BITS.contains(&bits) {
        Ok(())
    } else {
        Err(Error::invalid(argument, format!("{bits} is not supported; use one of {:?}", crate::cpu::SUPPORTED_BITS)))
    }
}

/// Threads per threadgroup for the one-thread-per-item kernels.
pub(crate) const THREADGROUP: i32 = 256;

/// Streaming multiprocessors of the CUDA device, which size the grids of
/// the kernels that walk their tiles grid-stride: 132 (an H100 or H200 SXM)
/// unless `VELOXQUANT_CUDA_SMS` gives another count (1 to 1024; anything
/// else is an error of every such launch, naming the variable).
fn cuda_sms() -> Result<usize> {
    static SMS: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    env_count(&SMS, "VELOXQUANT_CUDA_SMS", 132, 1024, "an SM count")
}

/// The count environment variable `var` sets ([`parse_count`]), read once
/// into `cell`; where it is not a count, an error naming `var`.
fn env_count(
    cell: &'static OnceLock<std::result::Result<usize, String>>,
    var: &'static str,
    default: usize,
    max: usize,
    what: &str,
) -> Result<usize> {
    cell.get_or_init(|| parse_count(std::env::var(var), default, max, what)).clone().map_err(|message| Error::invalid(var, message))
}

/// A count from 1 to `max` in an environment variable's `value`, `default`
/// where it is not set; `what` names the count in the error.
fn parse_count(value: std::result::Result<String, std::env::VarError>, default: usize, max: usize, what: &str)
    -> std::result::Result<usize, String> {
    match value {
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(std::env::VarError::NotUnicode(v)) => Err(format!("{v:?} is not {what}")),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(format!("{v:?} is not {what} from 1 to {max}")),
        },
    }
}

/// At most this many blocks of a kernel that walks its tiles holding matrix
/// fragments (each block loads them once, up to 128 KB): one per SM. On the
/// H200 the tensor-core codecs and `qjl_encode` ran 2-10% faster at 1M
/// vectors with one block per SM than with eight.
pub(crate) fn fragment_blocks() -> Result<usize> {
    cuda_sms()
}

/// At most this many blocks of a kernel that walks its tiles holding only
/// small tables: eight per SM (`tq_rvq_decode`'s warp rows, which wait on
/// memory, ran 0.245 ms with eight, 0.257 with two).
pub(crate) fn walking_blocks() -> Result<usize> {
    Ok(8 * cuda_sms()?)
}

/// Blocks CUDA's tensor-core `tq_decode` aims at for a batch of `batch`
/// sequences. Its blocks loop over their splits a chunk at a time with the
/// next chunk's loads in flight, so a few long splits beat many short ones:
/// one sequence takes two blocks per SM (on the H200 at llama-8b 32K: 60 µs
/// a call with two, 71 with ~1040 short splits; four per SM read slower
/// too, and three no faster: 34.1 against 33.8 µs); a batch takes three,
/// the most that fit at its 76 registers and 72 KB of shared memory, for
/// its blocks' long splits are bound by the rate they issue at, which more
/// warps an SM raise (llama-8b 32K batch 8 end to end: 1.23× of float16 with
/// three, 0.90× with two at 39b7e56's kernels). The last block of a tile
/// merges fewer partials with fewer splits. Variant 6 of the kernel
/// ([`decode_variant`]) takes 127 registers, so two of its blocks fit an SM
/// and a batch's grid runs in one and a half waves; at llama-8b 32K batch 8
/// on an H100 it decoded 581.4 tok/s so, 575.8 with two blocks an SM, and
/// variant 0 (72 registers, three blocks resident) 585.0.
/// `VELOXQUANT_DECODE_BLOCKS_PER_SM` (1 to 64) sets another count per SM,
/// to tune a device.
pub(crate) fn decode_blocks(batch: usize) -> Result<usize> {
    static PER_SM: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let per_sm = match env_count(&PER_SM, "VELOXQUANT_DECODE_BLOCKS_PER_SM", 0, 64, "a block count per SM")? {
        0 if batch > 1 => 3,
        0 => 2,
        n => n,
    };
    Ok(per_sm * cuda_sms()?)
}

/// Which stages of CUDA's tensor-core decode run as launches of their own
/// where the decode would fuse them: bit 0 the queries' rotation
/// (`tq_rotate`), bit 1 the merge of the splits (`tq_reduce`).
/// `VELOXQUANT_DECODE_APART` (1 to 3) sets them, to time each stage's share
/// of a call on a device; unset, a sequence's decode fuses both.
pub(crate) fn decode_apart() -> Result<usize> {
    static APART: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    env_count(&APART, "VELOXQUANT_DECODE_APART", 0, 3, "a stage mask")
}

/// How CUDA's tensor-core `tq_decode` reads its operands (its `VARIANT`, 0
/// to 63): bit 0 looks 4-bit keys up one code at a time rather than two, bit
/// 1 decodes values of at most 3 bits by byte permutes of registers rather
/// than a shared table, bit 2 loads the queries' fragments without their
/// zero words, bit 3 makes a 16-token tile of keys the scores' A operand
/// and the queries their B operand (heads of at most 128), bit 4
/// ([`DECODE_UNIFORM_VALUES`], with bit 3) reads 3-bit values on a uniform
/// grid without a table, bit 5 (with bit 3 and 4-bit keys) copies the
/// key-pair table once per shared-memory bank (32 KB), so that a warp's
/// lookups never conflict. `VELOXQUANT_TQ_DECODE_VARIANT` (1 to 64: the
/// variant plus one) sets another, to compare them on a device.
pub(crate) fn decode_variant() -> Result<usize> {
    static VARIANT: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    Ok(env_count(&VARIANT, "VELOXQUANT_TQ_DECODE_VARIANT", DECODE_VARIANT + 1, 64, "a decode variant plus one")? - 1)
}

/// [`decode_variant`]'s bit that reads 3-bit value codes as float16
/// subnormals and maps each dimension's sum back to the grid at the end (no
/// table): only for a uniform value grid (`Codec::TurboQuantUniform`), and
/// the launch clears it for any other.
pub(crate) const DECODE_UNIFORM_VALUES: usize = 16;

/// `tq_decode`'s default [`decode_variant`]: keys as the scores' A operand,
/// values through byte permutes (14), values on a uniform grid without a
/// table (30), and the 4-bit key-pair table once per bank (62). The 16-token
/// loop at llama-8b's instantiation (K4, uniform V3) is 350 instructions
/// against variant 14's 452 (ptxas for sm_90a,
/// `scripts/gpu/cuda-compile-check.py --loop-stats`). On an H100 at B=1
/// Hq=32 Hkv=8 D=128, 16 calls an evaluation (`bench_attention`): 109 µs a
/// call at 128K against variant 30's 120; llama-8b decoded 116.3 tok/s at
/// 128K against 110.9, and 672.4 against 619.3 at 32K batch 8
/// (docs/results/cuda_decode_variants.md).
const DECODE_VARIANT: usize = 62;

/// A launch's grid (threads, as MLX counts them) and threadgroup sizes.
pub(crate) type LaunchShape = ((i32, i32, i32), (i32, i32, i32));

/// Vectors per CUDA block of the TurboQuant codecs (`TQ_TV` in
/// cuda/tq_common.cuh): 256 threads tile them as a matrix product.
pub(crate) const CUDA_TILE_VECTORS: usize = 32;

/// The launch shape of the TurboQuant codec kernels: on CUDA one block of 256
/// threads per 32 vectors, on Metal one threadgroup of `d` threads per vector.
pub(crate) fn codec_grid(imp: Implementation, n: usize, d: usize) -> Result<LaunchShape> {
    let (threads, group) = if imp == Implementation::Cuda { (n.div_ceil(CUDA_TILE_VECTORS) * 256, 256) } else { (n * d, d) };
    let threads = i32::try_from(threads).map_err(|_| Error::invalid("x", "too many elements for one launch"))?;
    Ok(((threads, 1, 1), (group as i32, 1, 1)))
}

/// `x · mᵀ` over the last axis of `x` (`m` float32 `[rows, D]`). MLX's CUDA
/// matmul rounds float32 through TF32 (relative error ~3e-4), so up to 2^24
/// products (decoding, short verification) use an exact broadcast product;
/// larger ones (long prefills) the matmul.
pub(crate) fn times_transpose(x: &Array, m: &Array, s: &Stream) -> Result<Array> {
    let ms = m.shape();
    let xs = x.shape();
    let rows: usize = xs[..xs.len() - 1].iter().map(|&v| v as usize).product();
    if rows * ms[0] as usize * ms[1] as usize <= 1 << 24 {
        ops::sum_axis(&ops::multiply(&ops::expand_dims(x, -2, s)?, m, s)?, -1, false, s)
    } else {
        ops::matmul(x, &ops::transpose(m, &[1, 0], s)?, s)
    }
}

/// `a` `[B, H, N, ...]` cut to its first `len` entries along axis 2 (a
/// view): how the GPU bodies receive a length without a host array.
pub(crate) fn leading(a: &Array, len: i32, s: &Stream) -> Result<Array> {
    let mut stop = a.shape();
    stop[2] = len;
    ops::slice(a, &vec![0; stop.len()], &stop, s)
}

/// `0..n` cut into runs of consecutive indices, each at most `max` long,
/// where `joins(first, i)` says whether `i` may join the run that starts at
/// `first`: the launches of a kernel over several sequences.
pub(crate) fn runs(n: usize, max: usize, joins: impl Fn(usize, usize) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut first = 0;
    while first < n {
        let mut end = first + 1;
        while end < n && end - first < max && joins(first, end) {
            end += 1;
        }
        out.push(first..end);
        first = end;
    }
    out
}

/// A 1-D launch over `items` threads.
pub(crate) fn grid_1d(argument: &'static str, items: usize) -> Result<LaunchShape> {
    let n = i32::try_from(items)
        .map_err(|_| Error::invalid(argument, format!("{items} work items exceed the 2^31 a launch can hold")))?;
    Ok(((n, 1, 1), (THREADGROUP.min(n.max(1)), 1, 1)))
}

/// The sizes a kernel body reads from its input `params`. Metal takes them
/// as uint32 data ([`params`]). CUDA takes them as the shape `[0, v0, v1,
/// ...]` of an empty uint32 array, which MLX passes by value among the
/// launch's arguments (the body's `params_shape`, read by quant_common.cuh's
/// `vq_size`), so that the GPU never reads memory the host wrote. At most 9
/// sizes (MLX's 10 dimensions), each below 2^31 (the shape's int32).
///
/// A CUDA call whose sizes match an earlier call's on this thread (every
/// append of a decoding step does) gets that call's array back. On the H200
/// an array of sizes made for every launch cost a 0.1 ms `scalar_dequantize`
/// 9–15 us, and up to 11 us at 4096 vectors, against one made once
/// (`scripts/gpu/kernel_variants.py`, docs/results/cuda_quant_kernels.md).
pub(crate) fn sizes(imp: Implementation, argument: &'static str, values: &[usize]) -> Result<Array> {
    if imp != Implementation::Cuda {
        return params(argument, values);
    }
    if values.len() > 9 {
        return Err(Error::invalid(argument, format!("{} sizes exceed the 9 a CUDA launch carries", values.len())));
    }
    let mut shape = vec![0i32];
    for &v in values {
        shape.push(to_i32(argument, v)?);
    }
    SIZE_CARRIERS.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(carrier) = cache.get(&shape) {
            return Ok(carrier.clone());
        }
        let carrier = Array::from_slice::<u32>(&[], &shape)?;
        if cache.len() >= SIZE_CARRIERS_MAX {
            cache.clear();
        }
        cache.insert(shape, carrier.clone());
        Ok(carrier)
    })
}

/// More sizes than one CUDA carrier holds (the attention kernels' 14–15):
/// Metal's single data array, or for CUDA the first 9 in `params` and the
/// rest in `params_hi`, both carriers of [`sizes`].
pub(crate) fn split_sizes(backend: Backend, argument: &'static str, values: &[usize]) -> Result<Vec<Array>> {
    if backend != Backend::Cuda {
        return Ok(vec![params(argument, values)?]);
    }
    let (lo, hi) = values.split_at(values.len().min(9));
    Ok(vec![sizes(Implementation::Cuda, argument, lo)?, sizes(Implementation::Cuda, argument, hi)?])
}

/// `v` as an MLX dimension, or an error naming `argument`.
pub(crate) fn to_i32(argument: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(argument, format!("size {v} exceeds 2^31")))
}

/// Size carriers kept per thread; past this many, the cache starts over.
const SIZE_CARRIERS_MAX: usize = 256;

thread_local! {
    /// [`sizes`]'s CUDA carriers by shape. MLX arrays are immutable once
    /// made, so one carrier serves any number of launches.
    static SIZE_CARRIERS: RefCell<HashMap<Vec<i32>, Array>> = RefCell::new(HashMap::new());
}

/// Sizes that travel to the GPU bodies as data (`params`, uint32): Metal's
/// bodies.
pub(crate) fn params(argument: &'static str, values: &[usize]) -> Result<Array> {
    let v: Vec<u32> = values
        .iter()
        .map(|&x| u32::try_from(x).map_err(|_| Error::invalid(argument, format!("size {x} exceeds 2^32"))))
        .collect::<Result<_>>()?;
    Array::from_slice(&v, &[v.len() as i32])
}

#[cfg(test)]
mod tests {
    use super::{parse_count, sizes, split_sizes, Implementation, Kernel, SIZE_CARRIERS, SIZE_CARRIERS_MAX};
    use crate::stream::Backend;
    use crate::{Dtype, Error};
    use std::env::VarError;

    #[test]
    fn cuda_sizes_ride_in_an_empty_arrays_shape_and_metal_sizes_in_data() {
        let cuda = sizes(Implementation::Cuda, "x", &[1 << 20, 128, 64]).unwrap();
        assert_eq!(cuda.shape(), vec![0, 1 << 20, 128, 64]);
        assert_eq!((cuda.size(), cuda.dtype()), (0, Dtype::U32));
        let metal = sizes(Implementation::Metal, "x", &[1 << 20, 128, 64]).unwrap();
        assert_eq!(metal.shape(), vec![3]);
        assert_eq!(metal.to_vec::<u32>().unwrap(), vec![1 << 20, 128, 64]);
        // Past int32 or past 9 sizes: an error naming the argument, not a wrapped size.
        for bad in [sizes(Implementation::Cuda, "codes", &[1 << 31]), sizes(Implementation::Cuda, "codes", &[1; 10])] {
            match bad {
                Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "codes"),
                other => panic!("expected an invalid-argument error, got {:?}", other.map(|a| a.shape())),
            }
        }
        assert!(sizes(Implementation::Metal, "codes", &[1 << 31]).is_ok());
    }

    #[test]
    fn attention_sizes_ride_in_two_cuda_carriers_and_one_metal_array() {
        let values: Vec<usize> = (1..=15).collect();
        let cuda = split_sizes(Backend::Cuda, "queries", &values).unwrap();
        let shapes: Vec<Vec<i32>> = cuda.iter().map(|a| a.shape()).collect();
        assert_eq!(shapes, vec![vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9], vec![0, 10, 11, 12, 13, 14, 15]]);
        assert!(cuda.iter().all(|a| a.size() == 0 && a.dtype() == Dtype::U32));
        let metal = split_sizes(Backend::Metal, "queries", &values).unwrap();
        assert_eq!(metal.len(), 1);
        assert_eq!(metal[0].to_vec::<u32>().unwrap(), (1..=15).collect::<Vec<u32>>());
        // The CUDA bodies name the second carrier; every other body takes one.
        let d = Kernel::KvAttention.declaration();
        assert_eq!(d.cuda_inputs, ["params_hi"]);
        let cuda = d.cuda.unwrap();
        assert!(cuda.contains("params_hi_shape") && !cuda.contains("params["));
        assert!(d.inputs.ends_with(&["params"]));
        assert!(Kernel::KiviQuantize.declaration().cuda_inputs.is_empty());
        match split_sizes(Backend::Cuda, "queries", &[1 << 31; 15]) {
            Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "queries"),
            other => panic!("expected an invalid-argument error, got {:?}", other.map(|v| v.len())),
        }
    }

    #[test]
    fn cuda_size_carriers_are_kept_per_shape_and_bounded() {
        let kept = || SIZE_CARRIERS.with(|c| c.borrow().len());
        let before = kept();
        let a = sizes(Implementation::Cuda, "x", &[7, 11]).unwrap();
        let b = sizes(Implementation::Cuda, "x", &[7, 11]).unwrap();
        assert_eq!(kept(), before + 1, "equal sizes share one carrier");
        assert_eq!((a.shape(), b.shape()), (vec![0, 7, 11], vec![0, 7, 11]));
        for v in 0..2 * SIZE_CARRIERS_MAX {
            assert_eq!(sizes(Implementation::Cuda, "x", &[v, 3]).unwrap().shape(), vec![0, v as i32, 3]);
            assert!(kept() <= SIZE_CARRIERS_MAX);
        }
    }

    #[test]
    fn counts_from_the_environment_default_and_reject_what_is_not_a_count() {
        let sms = |v: std::result::Result<String, VarError>| parse_count(v, 132, 1024, "an SM count");
        assert_eq!(sms(Err(VarError::NotPresent)), Ok(132));
        assert_eq!(sms(Ok("114".into())), Ok(114));
        assert_eq!(sms(Ok(" 80\n".into())), Ok(80));
        for bad in ["0", "-1", "many", "", "1025", "1.5"] {
            let err = sms(Ok(bad.into())).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")) && err.contains("SM count"), "{bad}: {err}");
        }
        let per_sm = |v: &str| parse_count(Ok(v.into()), 2, 64, "a block count per SM");
        assert_eq!(per_sm("4"), Ok(4));
        assert!(per_sm("65").unwrap_err().contains("block count per SM from 1 to 64"));
    }

    #[test]
    fn runs_are_consecutive_capped_and_break_where_an_index_may_not_join() {
        assert_eq!(super::runs(5, 2, |_, _| true), vec![0..2, 2..4, 4..5]);
        assert_eq!(super::runs(3, 16, |_, _| false), vec![0..1, 1..2, 2..3]);
        let key = [4, 4, 2, 4, 4, 4];
        assert_eq!(super::runs(6, 16, |first, i| key[i] == key[first]), vec![0..2, 2..3, 3..6]);
        assert!(super::runs(0, 4, |_, _| true).is_empty());
    }

    #[test]
    fn decode_grids_take_two_blocks_an_sm_for_one_sequence_and_three_for_a_batch() {
        if std::env::var_os("VELOXQUANT_DECODE_BLOCKS_PER_SM").is_some() {
            return; // a count set by hand applies to every batch
        }
        let sms = super::cuda_sms().unwrap();
        assert_eq!(super::decode_blocks(1).unwrap(), 2 * sms);
        assert_eq!(super::decode_blocks(2).unwrap(), 3 * sms);
        assert_eq!(super::decode_blocks(8).unwrap(), 3 * sms);
    }
}
