//! TurboQuant-MSE kernels of the compressed cache: `tq_encode` (norm, rotate,
//! nearest centroid, pack in one pass) and TurboQuant's attention: the CPU's,
//! and `tq_decode` for one query on a GPU (scores straight from the codes,
//! online softmax, values decoded on the fly, split across the sequence with
//! a final reduction). Several queries on a GPU attend through
//! `kv_attention`, the kernel of every codec.

use std::sync::Mutex;

use half::f16;

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::declaration::{decode_on_tensor_cores, DECODE_SPLIT_MAX};
use super::{check_bits, check_float, codec_grid, cpu_primitive, select, Implementation, Options, Kernel, fragment_blocks};
use crate::array::Array;
use crate::cpu::turboquant::{self as tq, AttentionInputs, AttentionShape};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::{Backend, Stream};

/// Bit widths of the cache's TurboQuant codes.
pub const TQ_BITS: [u32; 5] = crate::cpu::SUPPORTED_BITS;
/// Tokens per GPU threadgroup iteration (its thread count).
const ATTENTION_THREADS: usize = 128;

pub(crate) fn check_f32(argument: &'static str, a: &Array, shape: &[i32]) -> Result<()> {
    if a.dtype() != Dtype::F32 {
        return Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: "float32".into() });
    }
    if a.shape() != shape {
        return Err(Error::invalid(argument, format!("shape {:?}, expected {shape:?}", a.shape())));
    }
    Ok(())
}

/// Head dimensions the cache kernels accept: multiples of 8 up to 256.
pub fn check_head_dim(argument: &'static str, d: usize) -> Result<()> {
    if d % 8 != 0 || !(8..=256).contains(&d) {
        return Err(Error::invalid(argument, format!("head dimension {d} is not supported (a multiple of 8, at most 256)")));
    }
    Ok(())
}

/// Checks an encoder's rotation input: `Π` float32 `[d, d]`, or the ±1 signs
/// float32 `[d]` of a Hadamard rotation (`d` a power of two). True for signs.
pub(crate) fn check_rotation_input(rotation: Option<&Array>, d: usize) -> Result<bool> {
    let Some(r) = rotation else { return Ok(false) };
    if r.ndim() == 1 {
        if !d.is_power_of_two() {
            return Err(Error::invalid(
                "rotation",
                format!("Hadamard signs need a power-of-two head dimension, not {d}; pass the dense [d, d] matrix"),
            ));
        }
        check_f32("rotation", r, &[d as i32])?;
        Ok(true)
    } else {
        check_f32("rotation", r, &[d as i32, d as i32])?;
        Ok(false)
    }
}

/// A rotation input as the dense `Π` the reference graphs multiply by: the
/// matrix itself, or `H diag(s) / √d` from Hadamard signs `s` (plain ops).
pub(crate) fn dense_rotation(r: &Array, s: &Stream) -> Result<Array> {
    if r.ndim() != 1 {
        return Ok(r.clone());
    }
    let d = r.shape()[0] as usize;
    let h = Array::from_slice(&crate::quant::rotation::sylvester_hadamard(d), &[d as i32, d as i32])?;
    let scale = Array::scalar_f32(1.0 / (d as f32).sqrt())?;
    ops::multiply(&ops::multiply(&h, &ops::reshape(r, &[1, d as i32], s)?, s)?, &scale, s)
}

/// Vectors per tile of CUDA's tensor-core `tq_encode` (`ROWS` in
/// cuda/tq_encode_tensor_cores.cuh).
const ENCODE_TILE_VECTORS: usize = 64;

/// How CUDA's `tq_encode` and `tq_rvq_encode` rotate: 0 for the exact path
/// (`crate::cpu`'s arithmetic bit for bit), else on the tensor cores, a dense
/// `Π` in that many parts of `x`'s type. For float16 and bfloat16 `x` (exact
/// as mma operands) with a rotation and `d` = 64 or 128 (`Π`'s fragments fit
/// a block's registers). `bits`, the code bits per coordinate (both stages of
/// RVQ), sets the parts: rounding `Π` to float16 moves `y` by about
/// 2^-11 / √(3d) (2.5e-5 at d = 128), a thousandth of 4-bit codes' error but
/// a third of 12-bit ones', so float16 takes one part up to 4 bits and two
/// (about 22 bits) beyond; bfloat16 (8 bits a part) always two. The sums'
/// order then differs from the exact path's and the centroid search rounds
/// `y` (and RVQ's residual) to float16 where a stage has at most 4 bits, so a
/// code may differ where that value lies within rounding of a midpoint
/// between two centroids: the parity rule's near-ties for these types.
pub fn encode_tensor_core_parts(dtype: Dtype, d: usize, rotate: bool, bits: u32) -> i32 {
    if !rotate || !matches!(d, 64 | 128) {
        return 0;
    }
    match dtype {
        Dtype::F16 if bits <= 4 => 1,
        Dtype::F16 | Dtype::BF16 => 2,
        _ => 0,
    }
}

/// Vectors from which CUDA's tensor-core `tq_encode` and `tq_rvq_encode`
/// code their first stage by a table of every float16 value's code
/// (`TABLE` in cuda/tq_encode_tensor_cores.cuh): each block builds the 64 KB
/// table once, worth it from several tiles of 64 vectors per block on.
const ENCODE_TABLE_VECTORS: usize = 1 << 16;

/// Whether CUDA's tensor-core `tq_encode` or `tq_rvq_encode` of `n` vectors
/// with `parts` (`TC`) codes its first stage of `bits.0` by the table: at 3
/// or 4 bits, where the paired search it replaces costs most (at 1 and 2
/// bits it is a step or two), with RVQ's second stage (`bits.1`, 0 for
/// `tq_encode`) at most 2 bits (a wider one's thresholds would not fit the
/// registers beside the table's path), and for large `n`.
pub fn encode_code_table(parts: i32, bits: (u32, u32), n: usize) -> bool {
    parts > 0 && matches!(bits.0, 3 | 4) && bits.1 <= 2 && n >= ENCODE_TABLE_VECTORS
}

/// Launches a TurboQuant encoder on Metal or CUDA: the codecs' grid, or for
/// a body with a tensor-core path (`parts`: [`encode_tensor_core_parts`] of
/// its input; `tq_encode`, `tq_rvq_encode` and `tq_prod_encode`) on CUDA the
/// template argument `TC` = parts and, when that is not 0, blocks of `2d`
/// threads that walk tiles of 64 vectors, each loading `Π`'s fragments once.
/// `tq_encode` and `tq_rvq_encode` on CUDA also take `TABLE`
/// ([`encode_code_table`] of their first stage's bits, `B_BITS` or
/// `B1_BITS`), and with it two blocks per SM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_encoder(
    imp: Implementation,
    kernel: Kernel,
    inputs: &[&Array],
    outputs: &[(Vec<i32>, Dtype)],
    (n, d): (usize, usize),
    template: &[(&'static str, TemplateArg)],
    parts: Option<i32>,
    s: &Stream,
) -> Result<Vec<Array>> {
    let mut template = template.to_vec();
    let parts = if imp == Implementation::Cuda { parts } else { None };
    let mut table = false;
    if let Some(p) = parts {
        template.push(("TC", TemplateArg::Int(p)));
        if matches!(kernel, Kernel::TqEncode | Kernel::TqRvqEncode) {
            let bits = |names: &[&str]| {
                template.iter().find_map(|(name, v)| match v {
                    TemplateArg::Int(b) if names.contains(name) => Some(*b as u32),
                    _ => None,
                })
            };
            let first = bits(&["B_BITS", "B1_BITS"]).expect("an encoder's template names its bits");
            table = encode_code_table(p, (first, bits(&["B2_BITS"]).unwrap_or(0)), n);
            template.push(("TABLE", TemplateArg::Bool(table)));
        }
    }
    let (grid, threadgroup) = match parts {
        Some(p) if p > 0 => {
            // With the table the search's integer work is gone and the
            // blocks wait on dependent chains (products, loads, shuffles);
            // two blocks per SM (86 KB of shared memory each) hide more.
            let per_sm = if table { 2 } else { 1 };
            let blocks = n.div_ceil(ENCODE_TILE_VECTORS).min(per_sm * fragment_blocks()?) as i32;
            let threads = 2 * d as i32;
            ((blocks * threads, 1, 1), (threads, 1, 1))
        }
        _ => codec_grid(imp, n, d)?,
    };
    gpu::launch(&Launch { kernel, inputs, outputs, grid, threadgroup, template: &template }, s)
}

/// Encodes `x` `[..., d]`: packed codes uint8 `[..., d * bits / 8]` and norms
/// float16 `[...]`. `rotation` is `Π` (float32 `[d, d]`), the ±1 signs of a
/// Hadamard rotation (float32 `[d]`, `d` a power of two: `Π u = H (s ⊙ u) /
/// √d`, applied by butterflies, `d log d` adds instead of `d²` multiply-adds,
/// as `quant::Rotation::forward` computes it), or `None` when `x` is rotated
/// already; `centroids` the sorted codebook (float32 `[2^bits]`).
pub fn tq_encode(x: &Array, rotation: Option<&Array>, centroids: &Array, bits: u32, opts: &Options) -> Result<(Array, Array)> {
    check_float("x", x)?;
    if x.ndim() == 0 {
        return Err(Error::invalid("x", "must have at least one dimension"));
    }
    let xs = x.shape();
    let d = *xs.last().expect("ndim >= 1") as usize;
    check_head_dim("x", d)?;
    check_bits("bits", bits)?;
    let hadamard = check_rotation_input(rotation, d)?;
    // Bodies always take a `rotation` input; without one they never read it,
    // so any device array stands in (not a new host array per call).
    let rot_input = rotation.unwrap_or(centroids);
    let rotate = rotation.is_some();
    check_f32("centroids", centroids, &[1 << bits])?;
    let stream = opts.resolve_stream()?;
    let n: usize = xs[..xs.len() - 1].iter().map(|&v| v as usize).product();
    let row_bytes = d * bits as usize / 8;
    let lead = xs[..xs.len() - 1].to_vec();
    let mut codes_shape = lead.clone();
    codes_shape.push(row_bytes as i32);
    let imp = select(Kernel::TqEncode, opts.policy, &stream)?;
    if n == 0 {
        return Ok((ops::zeros(&codes_shape, Dtype::U8, &stream)?, ops::zeros(&lead, Dtype::F16, &stream)?));
    }
    let n_i32 = i32::try_from(n).map_err(|_| Error::invalid("x", format!("{n} vectors exceed 2^31")))?;
    let flat = ops::reshape(x, &[n_i32, d as i32], &stream)?;
    // The kernels write flat rows; their outputs take `x`'s leading shape as
    // they are made (a reshape each would be an op of host time).
    let outputs = [(codes_shape.clone(), Dtype::U8), (lead.clone(), Dtype::F16)];
    let mut outs = match imp {
        Implementation::Reference => {
            let outs = encode_reference(&flat, rotation, centroids, bits, &stream)?;
            vec![ops::reshape(&outs[0], &codes_shape, &stream)?, ops::reshape(&outs[1], &lead, &stream)?]
        }
        Implementation::Cpu => {
            let dtype = x.dtype();
            cpu_primitive::apply(
                Kernel::TqEncode.name(),
                &[&flat, rot_input, centroids],
                &outputs,
                &stream,
                Box::new(move |ins, outs| {
                    let rot = if rotate { Some(ins[1].as_slice::<f32>()?) } else { None };
                    let cent = ins[2].as_slice::<f32>()?;
                    let (codes, norms) = outs.split_at_mut(1);
                    let (codes, norms) = (codes[0].as_mut_slice::<u8>()?, norms[0].as_mut_slice::<f16>()?);
                    cpu_primitive::by_dtype!(dtype, T => tq::tq_encode(ins[0].as_slice::<T>()?, rot, cent, d, bits, codes, norms));
                    Ok(())
                }),
            )?
        }
        Implementation::Metal | Implementation::Cuda => {
            let template = [
                ("T", TemplateArg::Dtype(x.dtype())),
                ("D", TemplateArg::Int(d as i32)),
                ("B_BITS", TemplateArg::Int(bits as i32)),
                ("ROTATE", TemplateArg::Bool(rotate)),
                ("HADAMARD", TemplateArg::Bool(hadamard)),
            ];
            let parts = encode_tensor_core_parts(x.dtype(), d, rotate, bits);
            launch_encoder(imp, Kernel::TqEncode, &[&flat, rot_input, centroids], &outputs, (n, d), &template, Some(parts), &stream)?
        }
    };
    let norms = outs.remove(1);
    Ok((outs.remove(0), norms))
}

fn encode_reference(x: &Array, rotation: Option<&Array>, centroids: &Array, bits: u32, s: &Stream) -> Result<Vec<Array>> {
    let xf = ops::astype(x, Dtype::F32, s)?;
    let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, s)?, -1, true, s)?, s)?;
    let tiny = Array::scalar_f32(f32::MIN_POSITIVE)?;
    let u = ops::divide(&xf, &ops::maximum(&norm, &tiny, s)?, s)?;
    let y = match rotation {
        Some(r) => ops::matmul(&u, &ops::transpose(&dense_rotation(r, s)?, &[1, 0], s)?, s)?,
        None => u,
    };
    let dist = ops::square(&ops::subtract(&ops::expand_dims(&y, -1, s)?, centroids, s)?, s)?;
    let idx = ops::astype(&ops::argmin_axis(&dist, -1, false, s)?, Dtype::U8, s)?;
    let codes = super::bit_pack(&idx, bits, &Options::on(s.clone(), super::Policy::Off))?;
    let norms = ops::astype(&ops::reshape(&norm, &[x.shape()[0]], s)?, Dtype::F16, s)?;
    Ok(vec![codes, norms])
}

/// The decode variant for `layer`: [`super::decode_variant`], less the bit
/// that reads values as a uniform grid's places where the layer's value
/// table is not one.
fn decode_variant_for(layer: &TqLayer<'_>) -> Result<usize> {
    let v = super::decode_variant()?;
    Ok(if layer.values_uniform { v } else { v & !super::DECODE_UNIFORM_VALUES })
}

/// One layer's stored keys and values, as the attention kernels read them.
pub struct TqLayer<'a> {
    pub shape: AttentionShape,
    pub rot_k: &'a Array,
    pub rot_v: &'a Array,
    pub k_codes: &'a Array,
    pub k_norms: &'a Array,
    pub k_centroids: &'a Array,
    pub v_codes: &'a Array,
    pub v_norms: &'a Array,
    pub v_centroids: &'a Array,
    /// Whether `v_centroids` is a uniform grid (`Codec::TurboQuantUniform`):
    /// CUDA's decode then reads 3-bit value codes as their places on it.
    pub values_uniform: bool,
    pub win_k: &'a Array,
    pub win_v: &'a Array,
    /// `DECODE_COUNTERS` uint32 zeros per (batch, KV head), which CUDA's
    /// decode mutates ([`decode_counters`]); the layer's own. Each decode
    /// replaces them with zeroed counters it outputs, so that the next one
    /// reads its predecessor's output and MLX never runs two at once (two
    /// overlapping decodes counting into the same words merge each other's
    /// splits and leave them non-zero).
    pub counters: &'a Mutex<Array>,
}

/// Tiles of query rows per (batch, KV head) that a layer's decode counters
/// serve: GQA groups of up to `DECODE_COUNTERS * DECODE_TILE_ROWS` query heads
/// a KV head merge their splits in the decode kernel itself.
pub const DECODE_COUNTERS: usize = 16;

/// The zeroed counters a layer of `batch` x `kv_heads` hands the decode
/// (`TqLayer::counters`).
pub fn decode_counters(batch: usize, kv_heads: usize) -> Result<Array> {
    let n = batch * kv_heads * DECODE_COUNTERS;
    Array::from_slice(&vec![0u32; n], &[n as i32])
}

/// Attention of `q` `[B, Hq, L, d]` over one layer's compressed keys and
/// values and its float16 windows. Returns `[B, Hq, L, d]` in `q`'s dtype.
pub fn tq_attention(q: &Array, layer: &TqLayer<'_>, scale: f32, opts: &Options) -> Result<Array> {
    let sh = layer.shape;
    check_float("queries", q)?;
    let want = [sh.batch as i32, sh.q_heads as i32, sh.queries as i32, sh.dim as i32];
    if q.shape() != want {
        return Err(Error::invalid("queries", format!("shape {:?}, expected {want:?}", q.shape())));
    }
    if layer.win_k.dtype() != q.dtype() {
        return Err(Error::Dtype {
            argument: "queries",
            found: q.dtype().to_string(),
            expected: format!("{} (the cache's dtype)", layer.win_k.dtype()),
        });
    }
    let stream = opts.resolve_stream()?;
    // The CPU's TurboQuant attention, or TurboQuant's decode on a GPU. A GPU
    // attends several queries with `kv_attention`, the kernel of every codec
    // (the cache sends them there); given them here, the reference graph.
    let gpu = stream.backend()? != Backend::Cpu;
    let kernel = if gpu { Kernel::TqDecode } else { Kernel::TqAttention };
    let mut imp = select(kernel, opts.policy, &stream)?;
    if gpu && sh.queries > 1 && imp != Implementation::Reference {
        if opts.policy == super::Policy::Require {
            return Err(Error::Unsupported(format!(
                "tq_attention: {} queries a head on a GPU attend through kv_attention, the kernel of every codec",
                sh.queries
            )));
        }
        imp = Implementation::Reference;
    }
    if sh.total() == 0 || sh.queries == 0 {
        return ops::zeros(&want, q.dtype(), &stream);
    }
    match imp {
        Implementation::Reference => attention_reference(q, layer, scale, &stream),
        Implementation::Cpu => {
            let dtype = q.dtype();
            let scale_copy = scale;
            cpu_primitive::apply_one(
                Kernel::TqAttention.name(),
                &[q, layer.rot_k, layer.rot_v, layer.k_codes, layer.k_norms, layer.k_centroids, layer.v_codes,
                  layer.v_norms, layer.v_centroids, layer.win_k, layer.win_v],
                (want.to_vec(), dtype),
                &stream,
                Box::new(move |ins, outs| {
                    cpu_primitive::by_dtype!(dtype, T => {
                        let inp = attention_inputs::<T>(&ins[1..11])?;
                        tq::tq_attention(ins[0].as_slice::<T>()?, &inp, &sh, scale_copy, outs[0].as_mut_slice::<T>()?)
                    });
                    Ok(())
                }),
            )
        }
        Implementation::Metal | Implementation::Cuda => decode(q, layer, scale, &stream),
    }
}

/// A layer's ten CPU buffers in `TqLayer` order after the queries (rot_k,
/// rot_v, key codes, norms and centroids, value codes, norms and centroids,
/// the two windows) as the CPU attention reads them.
fn attention_inputs<'a, T: crate::dtype::Element>(i: &'a [cpu_primitive::Tensor<'a>]) -> std::result::Result<AttentionInputs<'a, T>, String> {
    Ok(AttentionInputs {
        rot_k: i[0].as_slice::<f32>()?,
        rot_v: i[1].as_slice::<f32>()?,
        k_codes: i[2].as_slice::<u8>()?,
        k_norms: i[3].as_slice::<f16>()?,
        k_centroids: i[4].as_slice::<f32>()?,
        v_codes: i[5].as_slice::<u8>()?,
        v_norms: i[6].as_slice::<f16>()?,
        v_centroids: i[7].as_slice::<f32>()?,
        win_k: i[8].as_slice::<T>()?,
        win_v: i[9].as_slice::<T>()?,
    })
}

/// Decode attention of a batch whose sequences each have their own cache:
/// `q` `[B, Hq, 1, D]`, row `b` over `layers[b]` (each of batch 1, lengths
/// free), as one CPU primitive for the whole batch instead of one per
/// sequence (a batch's graph holds one node a layer, not `B`), the same
/// arithmetic as [`tq_attention`] sequence by sequence; on CUDA as one
/// `tq_decode` per run of up to [`DECODE_EACH_MAX`] sequences, whose layers
/// share the first one's rotation and codebooks (the caller's to ensure).
pub fn tq_attention_each(q: &Array, layers: &[TqLayer<'_>], scale: f32, stream: &Stream) -> Result<Array> {
    check_float("queries", q)?;
    let Some(first) = layers.first() else {
        return Err(Error::invalid("caches", "no cache given"));
    };
    let sh0 = first.shape;
    let want = [layers.len() as i32, sh0.q_heads as i32, 1, sh0.dim as i32];
    if q.shape() != want {
        return Err(Error::invalid("queries", format!("shape {:?}, expected {want:?} (one decode query per sequence)", q.shape())));
    }
    for (b, l) in layers.iter().enumerate() {
        let sh = l.shape;
        let same = (sh.batch, sh.queries, sh.q_heads, sh.kv_heads, sh.dim, sh.key_bits, sh.value_bits)
            == (1, 1, sh0.q_heads, sh0.kv_heads, sh0.dim, sh0.key_bits, sh0.value_bits);
        if !same {
            return Err(Error::invalid("caches", format!("cache {b} differs from cache 0 in heads, head size or bits, or holds a batch")));
        }
        if l.win_k.dtype() != q.dtype() {
            return Err(Error::Dtype { argument: "queries", found: q.dtype().to_string(), expected: format!("{} (the caches' dtype)", l.win_k.dtype()) });
        }
    }
    match stream.backend()? {
        crate::stream::Backend::Cpu => {}
        crate::stream::Backend::Cuda => return attention_each_cuda(q, layers, scale, stream),
        crate::stream::Backend::Metal => {
            return Err(Error::Unsupported("tq_attention_each: Metal attends sequence by sequence (a kernel takes at most 31 buffers)".into()))
        }
    }
    let mut inputs: Vec<&Array> = vec![q];
    for l in layers {
        inputs.extend([l.rot_k, l.rot_v, l.k_codes, l.k_norms, l.k_centroids, l.v_codes, l.v_norms, l.v_centroids, l.win_k, l.win_v]);
    }
    let shapes: Vec<AttentionShape> = layers.iter().map(|l| l.shape).collect();
    let dtype = q.dtype();
    let row = sh0.q_heads * sh0.dim;
    cpu_primitive::apply_one(
        Kernel::TqAttentionEach.name(),
        &inputs,
        (want.to_vec(), dtype),
        stream,
        Box::new(move |ins, outs| {
            cpu_primitive::by_dtype!(dtype, T => {
                let q = ins[0].as_slice::<T>()?;
                let out = outs[0].as_mut_slice::<T>()?;
                let inputs = (0..shapes.len())
                    .map(|b| attention_inputs::<T>(&ins[1 + 10 * b..11 + 10 * b]))
                    .collect::<std::result::Result<Vec<_>, String>>()?;
                // Sequences over the cores: a short sequence's own call
                // stays on one thread, so a batch of them would use one.
                let work = shapes.iter().map(|sh| 2 * sh.q_heads * sh.total() * sh.dim).sum();
                let min_rows = crate::cpu::min_rows_for_work(shapes.len(), work);
                crate::cpu::for_each_chunk(out, row, min_rows, |first, chunk| {
                    for (i, dst) in chunk.chunks_mut(row).enumerate() {
                        let b = first + i;
                        if shapes[b].total() == 0 {
                            dst.fill(<T>::default());
                        } else {
                            tq::tq_attention(&q[b * row..(b + 1) * row], &inputs[b], &shapes[b], scale, dst);
                        }
                    }
                });
            });
            Ok(())
        }),
    )
}

/// Sequences one CUDA `tq_decode` over per-sequence caches serves at most.
/// Each adds seven inputs (about 660 bytes of kernel parameters, past the
/// 4 KB CUDA allowed before 12.1) and the kernel picks its inputs by a chain
/// of comparisons as long as the launch's slots.
pub const DECODE_EACH_MAX: usize = 16;

/// [`tq_attention_each`] on CUDA: runs of consecutive sequences that hold
/// as many sink tokens (a template argument), up to [`DECODE_EACH_MAX`],
/// each one `tq_decode` over the run's own caches; a run of one, or a cache
/// off the tensor-core path, its own decode.
fn attention_each_cuda(q: &Array, layers: &[TqLayer<'_>], scale: f32, s: &Stream) -> Result<Array> {
    let sh0 = layers[0].shape;
    let (hq, d) = (sh0.q_heads as i32, sh0.dim as i32);
    let fused = decode_on_tensor_cores(q.dtype(), sh0.dim);
    let mut outs = Vec::new();
    for r in super::runs(layers.len(), DECODE_EACH_MAX, |first, i| fused && layers[i].shape.sinks == layers[first].shape.sinks) {
        let rows = ops::slice(q, &[r.start as i32, 0, 0, 0], &[r.end as i32, hq, 1, d], s)?;
        let run = &layers[r];
        outs.push(if run.iter().all(|l| l.shape.total() == 0) {
            ops::zeros(&rows.shape(), q.dtype(), s)?
        } else if run.len() == 1 {
            decode(&rows, &run[0], scale, s)?
        } else {
            decode_each(&rows, run, scale, s)?
        });
    }
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    ops::concatenate(&outs, 0, s)
}

/// One CUDA `tq_decode` (the tensor-core path) for `q` `[n, Hq, 1, D]`,
/// row `b` over `layers[b]` (each batch 1, its own lengths and counters;
/// the rotation and codebooks of the first serve all, as caches of one
/// shared set have them). The split plan is the longest sequence's, and
/// each sequence cuts its own tokens into that many splits. The launch
/// names a power of two of sequence slots (one compiled kernel each), the
/// slots past `n` holding the first sequence's arrays, which no block
/// reads.
fn decode_each(q: &Array, layers: &[TqLayer<'_>], scale: f32, s: &Stream) -> Result<Array> {
    let n = layers.len();
    let slots = n.next_power_of_two().max(2);
    let sh0 = layers[0].shape;
    let head_rows = sh0.q_heads / sh0.kv_heads;
    let qn = head_rows.min(DECODE_TILE_ROWS);
    let tiles = head_rows.div_ceil(qn);
    let units = n * sh0.kv_heads * tiles;
    let mut widest = sh0;
    widest.compressed = layers.iter().map(|l| l.shape.compressed).max().unwrap_or(0);
    widest.sinks = 0;
    widest.recent = layers.iter().map(|l| l.shape.sinks + l.shape.recent).max().unwrap_or(0);
    let (_, _, num_splits) = chunked_split_plan(&widest, units, super::decode_blocks(n)?);
    let reduce = tiles <= DECODE_COUNTERS && layers.iter().all(|l| std::ptr::eq(l.rot_k, l.rot_v));
    let per_block = decode_threads(true);
    let threads = i32::try_from(units * num_splits * per_block).map_err(|_| Error::invalid("queries", "too many threadgroups"))?;
    let (rows, sp, d) = ((n * sh0.q_heads) as i32, num_splits as i32, sh0.dim as i32);
    let views = layers
        .iter()
        .map(|l| Ok((super::leading(l.k_norms, l.shape.compressed as i32, s)?, super::leading(l.win_k, (l.shape.sinks + l.shape.recent) as i32, s)?)))
        .collect::<Result<Vec<_>>>()?;
    // A poisoned lock still holds valid counters (see `decode`).
    let mut counters = layers.iter().map(|l| l.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).collect::<Vec<_>>();
    let current = counters.iter().map(|c| Array::clone(c)).collect::<Vec<_>>();
    let l0 = &layers[0];
    let mut inputs: Vec<&Array> = vec![q, l0.rot_k, l0.k_centroids, l0.v_centroids];
    let mut outputs = vec![(vec![rows, sp], Dtype::F32), (vec![rows, sp], Dtype::F32), (vec![rows, sp, d], Dtype::F32), (q.shape(), q.dtype())];
    for i in 0..slots {
        let b = if i < n { i } else { 0 };
        let (l, (k_norms, win_k)) = (&layers[b], &views[b]);
        inputs.extend([l.k_codes, k_norms, l.v_codes, l.v_norms, win_k, l.win_v, &current[b]]);
        outputs.push((current[b].shape(), Dtype::U32));
    }
    let plan = AttentionShape { causal: false, ..sh0 };
    let mut parts = DecodeLaunch { sh: &plan, qn, scale, rotated: false, each: slots, cuda: Some((reduce, decode_variant_for(l0)?)), threads, per_block }
        .run(q, &inputs, &outputs, s)?;
    for (c, x) in counters.iter_mut().zip(parts.split_off(4)) {
        **c = x;
    }
    drop(counters);
    if reduce {
        return Ok(parts.remove(3));
    }
    parts.truncate(3);
    reduce_partials(&parts, Some(l0.rot_v), q, s)
}

/// `tq_decode`'s launch: its template arguments (the CUDA-only `EACH`,
/// `REDUCE` and `VARIANT` where `cuda` gives the last two), `threads` in
/// blocks of `per_block`.
struct DecodeLaunch<'a> {
    sh: &'a AttentionShape,
    qn: usize,
    scale: f32,
    rotated: bool,
    each: usize,
    cuda: Option<(bool, usize)>,
    threads: i32,
    per_block: usize,
}

impl DecodeLaunch<'_> {
    fn run(&self, q: &Array, inputs: &[&Array], outputs: &[(Vec<i32>, Dtype)], s: &Stream) -> Result<Vec<Array>> {
        let sh = self.sh;
        let mut template = vec![
            ("T", TemplateArg::Dtype(q.dtype())),
            ("D", TemplateArg::Int(sh.dim as i32)),
            ("KB", TemplateArg::Int(sh.key_bits as i32)),
            ("VB", TemplateArg::Int(sh.value_bits as i32)),
            ("QN", TemplateArg::Int(self.qn as i32)),
            ("TPT", TemplateArg::Int(decode_lanes(sh.dim) as i32)),
            ("N_SINK", TemplateArg::Int(sh.sinks as i32)),
            ("CAUSAL", TemplateArg::Bool(sh.causal)),
            ("SCALE", TemplateArg::Int(self.scale.to_bits() as i32)),
            ("ROTATED", TemplateArg::Bool(self.rotated)),
        ];
        if let Some((reduce, variant)) = self.cuda {
            template.push(("EACH", TemplateArg::Int(self.each as i32)));
            template.push(("REDUCE", TemplateArg::Bool(reduce)));
            template.push(("VARIANT", TemplateArg::Int(variant as i32)));
        }
        gpu::launch(
            &Launch {
                kernel: Kernel::TqDecode,
                inputs,
                outputs,
                grid: (self.threads, 1, 1),
                threadgroup: (self.per_block as i32, 1, 1),
                template: &template,
            },
            s,
        )
    }
}

/// Threads of an attention threadgroup, and tokens per tile.
const TILE: usize = ATTENTION_THREADS;

/// Query rows one `tq_decode` threadgroup serves (they live in registers).
const DECODE_TILE_ROWS: usize = 4;

/// Lanes of `tq_decode` that share one token: one chunk of 8 dimensions each
/// (two at head size 256), so that queries and accumulators stay in
/// registers and many warps fit on a core.
pub fn decode_lanes(d: usize) -> usize {
    (d / 8).next_power_of_two().min(16)
}

/// Threadgroups a split plan aims at: enough to fill the GPU several times
/// over.
const TARGET_THREADGROUPS: usize = 1024;

/// Threads of a `tq_decode` block: eight warps on CUDA's tensor-core path
/// (the kernel's `TG`), four elsewhere.
fn decode_threads(tensor_cores: bool) -> usize {
    if tensor_cores { 2 * ATTENTION_THREADS } else { ATTENTION_THREADS }
}

/// How the compressed tokens are split: `(split_tokens, comp_splits,
/// num_splits)` for `units` independent (batch, KV head, row tile) units,
/// splits of at most `max_split` tokens, aiming at `target` threadgroups
/// ([`TARGET_THREADGROUPS`] fills the GPU several times over; CUDA's chunked
/// `tq_decode` aims at its own). Each split is a whole number of tiles; the
/// window slots take one split per tile after them.
fn split_plan(sh: &AttentionShape, units: usize, max_split: usize, target: usize) -> (usize, usize, usize) {
    let wanted_splits = (target / units.max(1)).max(1);
    let split_tokens = (sh.compressed.div_ceil(wanted_splits).div_ceil(TILE).max(1) * TILE).min(max_split);
    let comp_splits = sh.compressed.div_ceil(split_tokens);
    (split_tokens, comp_splits, comp_splits + (sh.sinks + sh.recent).div_ceil(TILE))
}

/// [`split_plan`] of CUDA's chunked `tq_decode`, whose blocks loop over
/// splits of any length, aiming at `target` blocks in all. Where the
/// window's splits are a few, they take their slots out of the target, so
/// that the grid runs in one wave (a second wave of a few blocks left most
/// SMs idle for a fifth of the call at llama-8b 32K); where they are many
/// (batches: a short split each), they would leave the compressed tokens
/// too few splits, and the target is the compressed tokens' alone.
fn chunked_split_plan(sh: &AttentionShape, units: usize, target: usize) -> (usize, usize, usize) {
    let window_blocks = units * (sh.sinks + sh.recent).div_ceil(TILE);
    let aim = if 4 * window_blocks <= target { target - window_blocks } else { target };
    split_plan(sh, units, usize::MAX, aim)
}

/// Threads of a `tq_reduce` threadgroup for head size `d`: `P` parts of `d`
/// threads (at most 16 parts, about 512 threads), rounded up to whole
/// 32-lane groups (the kernel's shuffles need full warps).
pub fn reduce_threads(d: usize) -> usize {
    reduce_threads_within(d, 512)
}

/// [`reduce_threads`] for about `budget` threads: CUDA's blocks take 1024,
/// and a decode's few rows (one block each) read their partials faster with
/// twice the parts in flight.
fn reduce_threads_within(d: usize, budget: usize) -> usize {
    let parts = (budget / d).clamp(1, 16);
    (d * parts).div_ceil(32) * 32
}

/// `tq_reduce` over an attention kernel's partials (`m`, `l`, `acc` with
/// `rows` = queries' rows), rotated back by `rot_v` when given: the output in
/// `q`'s shape and dtype.
pub(crate) fn reduce_partials(parts: &[Array], rot_v: Option<&Array>, q: &Array, s: &Stream) -> Result<Array> {
    let rows = parts[0].shape()[0];
    let d = *q.shape().last().expect("queries have a head dimension");
    let budget = if s.backend()? == crate::stream::Backend::Cuda { 1024 } else { 512 };
    let threads = reduce_threads_within(d as usize, budget) as i32;
    // Without a rotation the reduction never reads `rot_v`; a float32 array
    // already at hand stands in (no new host array per call).
    Ok(gpu::launch(
        &Launch {
            kernel: Kernel::TqReduce,
            inputs: &[&parts[0], &parts[1], &parts[2], rot_v.unwrap_or(&parts[0])],
            outputs: &[(q.shape(), q.dtype())],
            grid: (rows * threads, 1, 1),
            threadgroup: (threads, 1, 1),
            template: &[
                ("T", TemplateArg::Dtype(q.dtype())),
                ("D", TemplateArg::Int(d)),
                ("ROTATE", TemplateArg::Bool(rot_v.is_some())),
            ],
        },
        s,
    )?
    .remove(0))
}

/// One decode query per head: `tq_decode` reads the query as given (or as
/// `tq_rotate` rotated and scaled it) and the stores through their strides;
/// two views carry the lengths (the compressed norms, the keys' window), so
/// that a call creates no host array and copies nothing. CUDA's tensor-core
/// path merges the splits in its last block of each tile (`REDUCE`); other
/// paths hand the partials to `tq_reduce`.
fn decode(q: &Array, layer: &TqLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
    let sh = layer.shape;
    let head_rows = sh.q_heads / sh.kv_heads * sh.queries;
    let qn = head_rows.min(DECODE_TILE_ROWS);
    let tiles = head_rows.div_ceil(qn);
    let units = sh.batch * sh.kv_heads * tiles;
    let cuda = s.backend()? == crate::stream::Backend::Cuda;
    let chunked = cuda && decode_on_tensor_cores(q.dtype(), sh.dim);
    let (_, _, num_splits) = if chunked {
        chunked_split_plan(&sh, units, super::decode_blocks(sh.batch)?)
    } else {
        split_plan(&sh, units, DECODE_SPLIT_MAX, TARGET_THREADGROUPS)
    };
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let (nc, nw) = (sh.compressed as i32, (sh.sinks + sh.recent) as i32);
    let rows = (sh.batch * sh.q_heads * sh.queries) as i32;
    // CUDA's chunked blocks of a batch take the queries rotated and scaled
    // by one tq_rotate per call; elsewhere each block rotates its own. One
    // sequence's decode is bound by the host, where the launch costs more
    // than the blocks' rotations (a fifth of tq_decode's GPU time).
    let apart = if chunked { super::decode_apart()? } else { 0 };
    let rotated = chunked && sh.dim % 32 == 0 && (rotate_apart(sh.batch) || apart & 1 != 0);
    // The values share the keys' rotation (the kernel rotates back with it).
    let reduce = chunked && tiles <= DECODE_COUNTERS && std::ptr::eq(layer.rot_k, layer.rot_v) && apart & 2 == 0;
    let q_rot;
    let q_in = if rotated {
        q_rot = rotate_queries(q, layer.rot_k, scale, s)?;
        &q_rot
    } else {
        q
    };
    let blocks = units * num_splits;
    let per_block = decode_threads(chunked);
    let threads = i32::try_from(blocks * per_block).map_err(|_| Error::invalid("queries", "too many threadgroups"))?;
    let sp = num_splits as i32;
    debug_assert_eq!(layer.win_k.shape()[..2], [b, h]);
    let (k_norms, win_k) = (super::leading(layer.k_norms, nc, s)?, super::leading(layer.win_k, nw, s)?);
    let mut inputs = vec![q_in, layer.rot_k, layer.k_codes, &k_norms, layer.k_centroids, layer.v_codes,
                          layer.v_norms, layer.v_centroids, &win_k, layer.win_v];
    let mut outputs = vec![(vec![rows, sp], Dtype::F32), (vec![rows, sp], Dtype::F32), (vec![rows, sp, d], Dtype::F32)];
    // Only CUDA's decode reads the counters. A poisoned lock still holds
    // valid counters (the launch that panicked never replaced them).
    let mut counters = cuda.then(|| layer.counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    let current = counters.as_ref().map(|c| Array::clone(c));
    if let Some(current) = &current {
        // CUDA's signature has the counters, the merged output and the next
        // decode's counters; without REDUCE the kernel leaves the merged
        // output alone.
        inputs.push(current);
        outputs.push((q.shape(), q.dtype()));
        outputs.push((current.shape(), Dtype::U32));
    }
    let cuda_args = if cuda { Some((reduce, decode_variant_for(layer)?)) } else { None };
    let mut parts = DecodeLaunch { sh: &sh, qn, scale, rotated, each: 0, cuda: cuda_args, threads, per_block }
        .run(q, &inputs, &outputs, s)?;
    if let Some(counters) = counters.as_mut() {
        **counters = parts.remove(4);
    }
    drop(counters);
    if reduce {
        return Ok(parts.remove(3));
    }
    parts.truncate(3);
    reduce_partials(&parts, Some(layer.rot_v), q, s)
}

/// Whether a decode of `batch` sequences rotates its queries in a launch of
/// its own (`tq_rotate`) rather than in every `tq_decode` block.
fn rotate_apart(batch: usize) -> bool {
    batch > 1
}

/// Query rows a `tq_rotate` block serves.
const ROTATE_ROWS: usize = 4;

/// `scale * Π q` for every row of `q` [B, Hq, L, D] (read through its
/// strides; D a multiple of 32), float32 in `q`'s shape: `tq_rotate`.
fn rotate_queries(q: &Array, rot: &Array, scale: f32, s: &Stream) -> Result<Array> {
    let shape = q.shape();
    let d = shape[3] as usize;
    let rows: usize = shape[..3].iter().map(|&x| x as usize).product();
    let blocks = rows.div_ceil(ROTATE_ROWS) * d.div_ceil(32);
    Ok(gpu::launch(
        &Launch {
            kernel: Kernel::TqRotate,
            inputs: &[q, rot],
            outputs: &[(shape, Dtype::F32)],
            grid: ((blocks * 256) as i32, 1, 1),
            threadgroup: (256, 1, 1),
            template: &[
                ("T", TemplateArg::Dtype(q.dtype())),
                ("D", TemplateArg::Int(d as i32)),
                ("QR", TemplateArg::Int(ROTATE_ROWS as i32)),
                ("SCALE", TemplateArg::Int(scale.to_bits() as i32)),
            ],
        },
        s,
    )?
    .remove(0))
}

/// Decoded keys or values of the layer in the rotated frame, float32
/// `[B, Hkv, total, d]`, in position order (sinks, compressed, recent).
pub fn decode_rotated(layer: &TqLayer<'_>, values: bool, s: &Stream) -> Result<Array> {
    let sh = layer.shape;
    let (codes, norms, cent, win, bits) = if values {
        (layer.v_codes, layer.v_norms, layer.v_centroids, layer.win_v, sh.value_bits)
    } else {
        (layer.k_codes, layer.k_norms, layer.k_centroids, layer.win_k, sh.key_bits)
    };
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let nc = sh.compressed as i32;
    let row_bytes = (sh.dim * bits as usize / 8) as i32;
    let mut parts = Vec::new();
    let winf = ops::astype(win, Dtype::F32, s)?;
    if sh.sinks > 0 {
        parts.push(ops::slice(&winf, &[0, 0, 0, 0], &[b, h, sh.sinks as i32, d], s)?);
    }
    if sh.compressed > 0 {
        let c = ops::slice(codes, &[0, 0, 0, 0], &[b, h, nc, row_bytes], s)?;
        let off = Options::on(s.clone(), super::Policy::Off);
        let idx = ops::astype(&super::bit_unpack(&c, bits, sh.dim, &off)?, Dtype::U32, s)?;
        let vals = ops::take_axis(cent, &idx, 0, s)?;
        let n = ops::astype(&ops::slice(norms, &[0, 0, 0], &[b, h, nc], s)?, Dtype::F32, s)?;
        parts.push(ops::multiply(&vals, &ops::expand_dims(&n, -1, s)?, s)?);
    }
    if sh.recent > 0 {
        let w0 = sh.sinks as i32;
        parts.push(ops::slice(&winf, &[0, 0, w0, 0], &[b, h, w0 + sh.recent as i32, d], s)?);
    }
    ops::concatenate(&parts, 2, s)
}

/// Reference graph: decode everything, then plain attention.
fn attention_reference(q: &Array, layer: &TqLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
    let sh = layer.shape;
    let g = sh.q_heads / sh.kv_heads;
    let (b, hkv, l, d) = (sh.batch as i32, sh.kv_heads as i32, sh.queries as i32, sh.dim as i32);
    let total = sh.total();
    let keys = decode_rotated(layer, false, s)?;
    let values = decode_rotated(layer, true, s)?;
    let qf = ops::astype(q, Dtype::F32, s)?;
    let qr = ops::matmul(&qf, &ops::transpose(layer.rot_k, &[1, 0], s)?, s)?;
    let qr = ops::multiply(&qr, &Array::scalar_f32(scale)?, s)?;
    let qr = ops::reshape(&qr, &[b, hkv, g as i32 * l, d], s)?;
    let mut scores = ops::matmul(&qr, &ops::transpose(&keys, &[0, 1, 3, 2], s)?, s)?;
    if sh.causal && sh.queries > 1 {
        let rows = g * sh.queries;
        let mut mask = vec![0.0f32; rows * total];
        for r in 0..rows {
            let pos = total - sh.queries + r % sh.queries;
            for t in pos + 1..total {
                mask[r * total + t] = f32::NEG_INFINITY;
            }
        }
        let m = Array::from_slice(&mask, &[rows as i32, total as i32])?;
        scores = ops::add(&scores, &m, s)?;
    }
    let p = ops::softmax(&scores, -1, s)?;
    let o = ops::matmul(&ops::matmul(&p, &values, s)?, layer.rot_v, s)?;
    ops::astype(&ops::reshape(&o, &q.shape(), s)?, q.dtype(), s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b_decode(batch: usize, compressed: usize) -> AttentionShape {
        AttentionShape {
            batch, q_heads: 32, kv_heads: 8, queries: 1, dim: 128, key_bits: 4, value_bits: 3, sinks: 4, compressed,
            recent: 256, capacity: compressed, window_capacity: 260, causal: false,
        }
    }

    #[test]
    fn the_chunked_decode_plan_runs_in_one_wave_at_batch_one_and_keeps_splits_at_batch_eight() {
        // llama-8b at 32K on 132 SMs aiming at two blocks each: 8 units of
        // 3 window splits take 24 of the 264 slots, the compressed tokens
        // the rest, so that every block starts at once.
        let sh = llama_8b_decode(1, 32500);
        let (tokens, comp, all) = chunked_split_plan(&sh, 8, 264);
        assert_eq!(all - comp, 3);
        assert!(8 * all <= 264, "{} blocks", 8 * all);
        assert!(comp * tokens >= sh.compressed && tokens % TILE == 0);
        // At batch 8 the window's 192 blocks would leave one split per unit:
        // the compressed tokens keep the whole target.
        let (_, comp, _) = chunked_split_plan(&llama_8b_decode(8, 32500), 64, 264);
        assert_eq!(comp, 4);
        // Few compressed tokens: one split, never none.
        let (_, comp, all) = chunked_split_plan(&llama_8b_decode(1, 10), 8, 264);
        assert_eq!((comp, all), (1, 4));
    }

    #[test]
    fn reduce_threads_are_whole_warps_of_at_least_one_part() {
        for d in [32, 64, 80, 96, 128, 256] {
            let t = reduce_threads(d);
            assert_eq!(t % 32, 0, "d = {d}");
            assert!(t >= d && t / d <= 16 && t <= 1024, "d = {d}: {t} threads");
        }
        assert_eq!(reduce_threads(128), 512);
    }

    #[test]
    fn tensor_core_encoders_take_16_bit_inputs_with_a_rotation_at_d_64_and_128() {
        assert_eq!(encode_tensor_core_parts(Dtype::F16, 128, true, 4), 1);
        assert_eq!(encode_tensor_core_parts(Dtype::F16, 64, true, 1), 1);
        // Past 4 bits a float16 Π's rounding would show in the codes.
        assert_eq!(encode_tensor_core_parts(Dtype::F16, 128, true, 5), 2);
        assert_eq!(encode_tensor_core_parts(Dtype::F16, 128, true, 12), 2);
        assert_eq!(encode_tensor_core_parts(Dtype::BF16, 128, true, 2), 2);
        // The exact path: float32, no rotation, other head dimensions.
        assert_eq!(encode_tensor_core_parts(Dtype::F32, 128, true, 4), 0);
        assert_eq!(encode_tensor_core_parts(Dtype::F16, 128, false, 4), 0);
        for d in [32, 96, 256] {
            assert_eq!(encode_tensor_core_parts(Dtype::F16, d, true, 4), 0, "d = {d}");
        }
    }

    #[test]
    fn the_code_table_codes_large_3_and_4_bit_first_stages_on_the_tensor_cores() {
        let n = ENCODE_TABLE_VECTORS;
        assert!(encode_code_table(1, (4, 0), n));
        assert!(encode_code_table(2, (3, 0), n));
        assert!(encode_code_table(1, (4, 2), n));
        assert!(encode_code_table(1, (3, 1), 10 * n));
        // Too few vectors to pay for the build; the exact path; at 1, 2 and
        // 8 bits the search is short or the table does not apply; an RVQ
        // second stage past 2 bits.
        assert!(!encode_code_table(1, (4, 0), n - 1));
        assert!(!encode_code_table(0, (4, 0), n));
        for bits in [1, 2, 8] {
            assert!(!encode_code_table(1, (bits, 0), n), "{bits} bits");
        }
        assert!(!encode_code_table(1, (4, 3), n));
    }
}
