//! `kv_attention`: fused decode attention over a cache whose keys and values
//! each have their own codec (`crate::codec::Codec`). The host prepares the
//! queries once (the key frame's rotation and the softmax scale applied, and
//! the key codec's features, through [`KvGraphs`]), one pass scores straight
//! from the key codes with an online softmax and decodes values on the fly,
//! split across the sequence, and `tq_reduce` combines the splits and rotates
//! the output back where the value frame is rotated.

use half::f16;

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{check_float, cpu_primitive, select, split_sizes, Implementation, Options, Policy, Kernel};
use crate::array::Array;
use crate::codec::layout::{Codec, SideLayout};
use crate::codec::tables::kivi_bit_offsets;
use crate::cpu::kv_attention::{self as kv, KvShape, KvSide};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::{Backend, Stream};

/// Query rows one GPU threadgroup serves (heads sharing a KV head x queries).
const MAX_TILE_ROWS: usize = 16;
/// Threads of an attention threadgroup, and tokens per tile.
const TILE: usize = 128;

/// One side's stored arrays, as the kernels read them.
pub struct KvSideArrays<'a> {
    /// uint8 codes `[B, Hkv, capacity, row_len]` (`Dense`: the tokens in the cache's dtype).
    pub codes: &'a Array,
    /// float16 `[B, Hkv, param_rows, param_cols]`, when the codec has scales or norms.
    pub scales: Option<&'a Array>,
    pub zeros: Option<&'a Array>,
    /// float32 codebook, when the codec has one.
    pub table: Option<&'a Array>,
    /// `[B, Hkv, window_capacity, D]` in the cache's dtype, in the side's frame.
    pub window: &'a Array,
}

/// One layer's stored keys and values.
pub struct KvLayer<'a> {
    pub shape: KvShape,
    /// `Π` float32 `[D, D]`, present when either side's frame is rotated.
    pub rotation: Option<&'a Array>,
    pub keys: KvSideArrays<'a>,
    pub values: KvSideArrays<'a>,
    /// The additive mask `shape.mask_heads` describes (see `prepare_mask`).
    pub mask: Option<&'a Array>,
}

impl KvLayer<'_> {
    /// `Π` where `side`'s frame is rotated, else `None`.
    pub fn rotation_for(&self, side: &SideLayout) -> Result<Option<&Array>> {
        if !side.rotated {
            return Ok(None);
        }
        self.rotation.map(Some).ok_or_else(|| Error::invalid("rotation", "a rotated codec needs the rotation"))
    }
}

/// An attention mask as the kernels read it: float32 `[batch, heads,
/// queries, total]`, contiguous, added to the scaled scores, with `heads` 1
/// when every query head shares it (else `q_heads`). `mask` is boolean (true
/// attends) or additive (any float dtype), of any shape that broadcasts to
/// `[batch, q_heads, queries, total]` (MLX's and mlx_lm's masks).
pub fn prepare_mask(mask: &Array, batch: usize, q_heads: usize, queries: usize, total: usize, s: &Stream) -> Result<(Array, usize)> {
    let full = [batch, q_heads, queries, total].map(|v| v as i32);
    let shape = mask.shape();
    let fits = shape.len() <= 4
        && shape.iter().rev().zip(full.iter().rev()).all(|(&m, &f)| m == 1 || m == f);
    if !fits {
        return Err(Error::invalid("mask", format!("shape {shape:?} does not broadcast to [batch, heads, queries, keys] = {full:?}")));
    }
    let additive = match mask.dtype() {
        Dtype::Bool => {
            let zero = Array::scalar_f32(0.0)?;
            ops::where_(mask, &zero, &Array::scalar_f32(f32::NEG_INFINITY)?, s)?
        }
        Dtype::F32 | Dtype::F16 | Dtype::BF16 => ops::astype(mask, Dtype::F32, s)?,
        other => {
            return Err(Error::Dtype { argument: "mask", found: other.to_string(), expected: "bool or a float dtype".into() })
        }
    };
    let head_axis = (shape.len() >= 3).then(|| shape[shape.len() - 3] as usize);
    let heads = if head_axis == Some(q_heads) { q_heads } else { 1 };
    let m = ops::broadcast_to(&additive, &[full[0], heads as i32, full[2], full[3]], s)?;
    Ok((ops::contiguous(&m, s)?, heads))
}

/// What the attention takes from the codecs' definitions, which build on
/// these kernels (`crate::codec::graphs::CodecGraphs`).
pub trait KvGraphs {
    /// The queries prepared once for every threadgroup: float32 `[B, Hq, L,
    /// query_features]`, `scale * q` in the key frame, then what the key
    /// codec scores against besides it.
    fn prepare_queries(&self, q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array>;
    /// The reference graph of plain MLX ops, in `q`'s dtype.
    fn reference(&self, q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array>;
}

/// Attention of `q` `[B, Hq, L, D]` over one layer's stored keys and values
/// and its float16 windows. Returns `[B, Hq, L, D]` in `q`'s dtype.
pub fn kv_attention(q: &Array, layer: &KvLayer<'_>, scale: f32, opts: &Options, graphs: &dyn KvGraphs) -> Result<Array> {
    let sh = layer.shape;
    check_float("queries", q)?;
    let want = [sh.batch as i32, sh.q_heads as i32, sh.queries as i32, sh.dim as i32];
    if q.shape() != want {
        return Err(Error::invalid("queries", format!("shape {:?}, expected {want:?}", q.shape())));
    }
    let mask_len = sh.batch * sh.mask_heads * sh.queries * sh.total();
    match layer.mask {
        Some(m) if m.dtype() != Dtype::F32 || m.size() != mask_len => {
            return Err(Error::invalid("mask", format!("{} {:?} is not the prepared mask of {} floats", m.dtype(), m.shape(), mask_len)));
        }
        None if sh.mask_heads > 0 => return Err(Error::invalid("mask", "the shape names mask heads but the layer has no mask")),
        _ => {}
    }
    if layer.keys.window.dtype() != q.dtype() {
        return Err(Error::Dtype {
            argument: "queries",
            found: q.dtype().to_string(),
            expected: format!("{} (the cache's dtype)", layer.keys.window.dtype()),
        });
    }
    let stream = opts.resolve_stream()?;
    let mut imp = select(Kernel::KvAttention, opts.policy, &stream)?;
    let gpu = matches!(imp, Implementation::Metal | Implementation::Cuda);
    let plan = if gpu { gpu_plan(&sh, stream.backend()?, opts.policy)? } else { None };
    if gpu && plan.is_none() {
        imp = Implementation::Reference;
    }
    if sh.total() == 0 || sh.queries == 0 {
        return ops::zeros(&want, q.dtype(), &stream);
    }
    if imp == Implementation::Reference {
        return graphs.reference(q, layer, scale, &stream);
    }
    let qf = graphs.prepare_queries(q, layer, scale, &stream)?;
    let rot_v = layer.rotation_for(&sh.value)?;
    let none = Placeholders::new()?;
    match imp {
        Implementation::Cpu => {
            let (ki, vi) = (side_inputs(&layer.keys, &sh.key, sh.dim, &none)?, side_inputs(&layer.values, &sh.value, sh.dim, &none)?);
            let dtype = q.dtype();
            let rot_input = rot_v.unwrap_or(&none.f32).clone();
            let rotate_back = rot_v.is_some();
            let mask = layer.mask.unwrap_or(&none.f32).clone();
            let masked = layer.mask.is_some();
            let inputs = [&qf, &ki[0], &ki[1], &ki[2], &ki[3], &vi[0], &vi[1], &vi[2], &vi[3], layer.keys.window,
                          layer.values.window, &rot_input, &mask];
            cpu_primitive::apply_one(
                Kernel::KvAttention.name(),
                &inputs,
                (want.to_vec(), dtype),
                &stream,
                Box::new(move |ins, outs| {
                    macro_rules! side {
                        ($t:ty, $sc:expr, $i:expr, $win:expr) => {
                            KvSide::<$t> {
                                codes: if $sc.codec == Codec::Dense { &[] } else { ins[$i].as_slice::<u8>()? },
                                dense: if $sc.codec == Codec::Dense { ins[$i].as_slice::<$t>()? } else { &[] },
                                scales: if $sc.param_cols > 0 { ins[$i + 1].as_slice::<f16>()? } else { &[] },
                                zeros: if $sc.has_zeros { ins[$i + 2].as_slice::<f16>()? } else { &[] },
                                table: ins[$i + 3].as_slice::<f32>()?,
                                window: ins[$win].as_slice::<$t>()?,
                            }
                        };
                    }
                    cpu_primitive::by_dtype!(dtype, T => {
                        let keys = side!(T, sh.key, 1, 9);
                        let values = side!(T, sh.value, 5, 10);
                        let rot = if rotate_back { ins[11].as_slice::<f32>()? } else { &[] };
                        let mask = if masked { ins[12].as_slice::<f32>()? } else { &[] };
                        kv::kv_attention(ins[0].as_slice::<f32>()?, &keys, &values, rot, mask, &sh, outs[0].as_mut_slice::<T>()?)
                    });
                    Ok(())
                }),
            )
        }
        _ => attention_gpu(q, &qf, layer, rot_v, plan.expect("a GPU implementation has a plan"), &none, &stream),
    }
}

/// Arrays a codec does not use travel as placeholders it never reads: one
/// of each dtype a call, whichever inputs it stands in for.
struct Placeholders {
    f16: Array,
    f32: Array,
}

impl Placeholders {
    fn new() -> Result<Self> {
        Ok(Placeholders { f16: Array::from_slice(&[f16::ZERO; 8], &[8])?, f32: Array::from_slice(&[0.0f32; 8], &[8])? })
    }
}

/// One side's four kernel inputs (codes, scales, zeros, table), with
/// placeholders for what its codec lacks.
fn side_inputs(side: &KvSideArrays<'_>, sc: &SideLayout, dim: usize, none: &Placeholders) -> Result<[Array; 4]> {
    let table = match (side.table, sc.codec) {
        (Some(t), _) => t.clone(),
        // KIVI keys are read at the bit offsets of their table: uniform
        // widths when the caller gave none.
        (None, Codec::KiviPerChannel) => {
            let offsets = kivi_bit_offsets(None, dim, sc.bits);
            Array::from_slice(&offsets, &[offsets.len() as i32])?
        }
        (None, _) => none.f32.clone(),
    };
    Ok([side.codes.clone(), side.scales.unwrap_or(&none.f16).clone(), side.zeros.unwrap_or(&none.f16).clone(), table])
}

/// How a GPU launch tiles its query rows, and whether it stages the sides
/// whose codec allows it ([`Codec::staged_in_attention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuPlan {
    pub per_tile: usize,
    pub rows: usize,
    pub stage: bool,
}

/// The GPU launch's plan for `sh` on `backend`: staged where a tile fits
/// beside the staging, else unstaged; `None` (the reference graph) where
/// not even one query per tile fits, or an error under `Policy::Require`.
pub fn gpu_plan(sh: &KvShape, backend: Backend, policy: Policy) -> Result<Option<GpuPlan>> {
    let g = sh.q_heads / sh.kv_heads;
    let limit = shared_limit(backend);
    let staged = staged_bytes(sh);
    let plan = (staged > 0)
        .then(|| tile_rows(g, sh.queries, limit.saturating_sub(staged), sh.dim))
        .flatten()
        .map(|(per_tile, rows)| GpuPlan { per_tile, rows, stage: true })
        .or_else(|| tile_rows(g, sh.queries, limit, sh.dim).map(|(per_tile, rows)| GpuPlan { per_tile, rows, stage: false }));
    if plan.is_some() {
        return Ok(plan);
    }
    if policy == Policy::Require {
        let why = if g > MAX_TILE_ROWS {
            format!("{g} query heads per KV head exceed the fused kernel's {MAX_TILE_ROWS}")
        } else {
            format!("head_dim {} needs more threadgroup memory than {} offers", sh.dim, backend.name())
        };
        return Err(Error::Unsupported(format!("kv_attention: {why}")));
    }
    Ok(None)
}

/// Threadgroup memory the GPU bodies spend staging the sides whose codec
/// they stage: a tile of code rows (key rows padded to an odd number of
/// words, value rows to whole words, 8 bytes of slack), the tile's scales
/// and the codebook.
fn staged_bytes(sh: &KvShape) -> usize {
    let side = |sc: &SideLayout, stride: usize| {
        if sc.codec.staged_in_attention() {
            TILE * stride + 8 + 4 * TILE + 4 * (1usize << sc.bits)
        } else {
            0
        }
    };
    let (krow, vrow) = (sh.dim * sh.key.bits as usize / 8, sh.dim * sh.value.bits as usize / 8);
    side(&sh.key, (krow.div_ceil(4) | 1) * 4) + side(&sh.value, vrow.div_ceil(4) * 4)
}

/// Threadgroup memory of one attention threadgroup for `rows` query rows
/// (bytes), besides the staging ([`staged_bytes`]): the rows' first `dim`
/// features, their weights and reductions, and the staging buffers' small
/// stand-ins where nothing is staged (64 bytes covers them).
fn attention_shared_bytes(rows: usize, dim: usize) -> usize {
    4 * rows * dim + 4 * rows * TILE + 4 * rows * (TILE / 32) + 64
}

/// Threadgroup memory one threadgroup may use, per back-end.
fn shared_limit(backend: Backend) -> usize {
    match backend {
        Backend::Metal => 32 * 1024,
        _ => 48 * 1024,
    }
}

/// (queries per tile, rows per tile): the query heads of one KV head times as
/// many queries as fit in `MAX_TILE_ROWS` and the threadgroup memory; `None`
/// when not even one query per tile fits.
pub fn tile_rows(g: usize, queries: usize, limit: usize, dim: usize) -> Option<(usize, usize)> {
    if g > MAX_TILE_ROWS {
        return None;
    }
    let mut per_tile = if queries <= 1 { 1 } else { (MAX_TILE_ROWS / g).min(queries) };
    while per_tile > 1 && attention_shared_bytes(g * per_tile, dim) > limit {
        per_tile -= 1;
    }
    (attention_shared_bytes(g * per_tile, dim) <= limit).then_some((per_tile, g * per_tile))
}

/// How the GPU pass splits the sequence: (split_tokens, comp_splits, num_splits).
pub fn split_plan(sh: &KvShape, units: usize) -> (usize, usize, usize) {
    // Compressed tokens: enough splits to fill the GPU several times over,
    // each a whole number of tiles. Window slots: one tile per split.
    let wanted_splits = (1024 / units.max(1)).max(1);
    let split_tokens = sh.compressed.div_ceil(wanted_splits).div_ceil(TILE).max(1) * TILE;
    let comp_splits = sh.compressed.div_ceil(split_tokens);
    (split_tokens, comp_splits, comp_splits + (sh.sinks + sh.recent).div_ceil(TILE))
}

/// The GPU launch over queries already prepared (`qf`, as
/// [`KvGraphs::prepare_queries`] makes them), then `tq_reduce`, which
/// rotates the output back by `rot_v` where given.
fn attention_gpu(q: &Array, qf: &Array, layer: &KvLayer<'_>, rot_v: Option<&Array>, plan: GpuPlan, none: &Placeholders, s: &Stream) -> Result<Array> {
    let GpuPlan { per_tile, rows: tile_rows, stage } = plan;
    let sh = layer.shape;
    let q_tiles = sh.queries.div_ceil(per_tile);
    let units = sh.batch * sh.kv_heads * q_tiles;
    let (split_tokens, comp_splits, num_splits) = split_plan(&sh, units);
    let rows = sh.batch * sh.q_heads * sh.queries;
    let p = split_sizes(
        s.backend()?,
        "queries",
        &[sh.batch, sh.q_heads, sh.kv_heads, sh.queries, sh.sinks, sh.compressed, sh.recent, sh.capacity,
          sh.window_capacity, split_tokens, num_splits, q_tiles, usize::from(sh.causal), comp_splits, sh.mask_heads],
    )?;
    let (ki, vi) = (side_inputs(&layer.keys, &sh.key, sh.dim, none)?, side_inputs(&layer.values, &sh.value, sh.dim, none)?);
    let mask = layer.mask.unwrap_or(&none.f32);
    let mut inputs = vec![qf, &ki[0], &ki[1], &ki[2], &ki[3], &vi[0], &vi[1], &vi[2], &vi[3], layer.keys.window,
                          layer.values.window, mask];
    inputs.extend(&p);
    let threads = i32::try_from(units * num_splits * TILE).map_err(|_| Error::invalid("queries", "too many threadgroups"))?;
    let (r, sp, d) = (rows as i32, num_splits as i32, sh.dim as i32);
    let int = |v: usize| TemplateArg::Int(v as i32);
    let parts = gpu::launch(
        &Launch {
            kernel: Kernel::KvAttention,
            inputs: &inputs,
            outputs: &[(vec![r, sp], Dtype::F32), (vec![r, sp], Dtype::F32), (vec![r, sp, d], Dtype::F32)],
            grid: (threads, 1, 1),
            threadgroup: (TILE as i32, 1, 1),
            template: &[
                ("T", TemplateArg::Dtype(q.dtype())),
                ("D", int(sh.dim)),
                ("KM", TemplateArg::Int(sh.key.codec.id())),
                ("KB", int(sh.key.bits as usize)),
                ("KG", int(sh.key.group)),
                ("VM", TemplateArg::Int(sh.value.codec.id())),
                ("VB", int(sh.value.bits as usize)),
                ("VG", int(sh.value.group)),
                ("QN", int(tile_rows)),
                ("QF", int(sh.query_features)),
                ("STAGE", TemplateArg::Bool(stage)),
            ],
        },
        s,
    )?;
    super::turboquant::reduce_partials(&parts, rot_v, q, s)
}

