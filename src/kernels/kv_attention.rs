//! `kv_attention`: fused decode attention over a cache whose keys and values
//! each have their own codec (`crate::cpu::kv_attention::Codec`). The host
//! prepares the queries once (the key frame's rotation and the softmax scale
//! applied), one pass scores straight from the key codes with an online
//! softmax and decodes values on the fly, split across the sequence, and
//! `tq_reduce` combines the splits and rotates the output back where the
//! value frame is rotated.

use half::f16;

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{check_float, cpu_primitive, select, split_sizes, times_transpose, Implementation, Options, Policy, Kernel};
use crate::array::Array;
use crate::cpu::kv_attention::{self as kv, Codec, KvShape, KvSide, SideCodec};
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
    fn rotation_for(&self, side: &SideCodec) -> Result<Option<&Array>> {
        if !side.codec.rotated() {
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

/// Floats per prepared query row for this key codec: the query in the key
/// frame, and for product quantization its lookup table (one row of
/// `2^bits` entries per sub-vector), for the sketched codecs the sketched
/// query (one float per sketch row).
pub fn query_features(dim: usize, key: &SideCodec) -> usize {
    match key.codec {
        Codec::ProductQuantized => dim + dim / key.group * (1 << key.bits),
        Codec::Qjl | Codec::TurboQuantProd => dim + key.sketch_rows(dim),
        _ => dim,
    }
}

/// `x` in a buffer of its own. The sketch starts a few floats into the
/// table, and a matrix at such an offset makes cuBLASLt refuse the matmul
/// (NOT_SUPPORTED: its kernels assume aligned operands).
fn aligned(x: &Array, s: &Stream) -> Result<Array> {
    ops::add(x, &Array::scalar_f32(0.0)?, s)
}

/// The two parts of a codec's table (1-D float32): TurboQuant-Prod's
/// centroids and sketch `[D, D]`, TurboQuant-RVQ's first and second
/// codebooks; QJL's table is its sketch `[m, D]` whole (second part).
pub fn table_parts(table: &Array, sc: &SideCodec, dim: usize, s: &Stream) -> Result<(Option<Array>, Array)> {
    let first = 1i32 << (sc.bits - 1);
    let len = table.shape()[0];
    match sc.codec {
        Codec::Qjl => Ok((None, ops::reshape(table, &[sc.sketch_rows(dim) as i32, dim as i32], s)?)),
        Codec::TurboQuantProd => Ok((
            Some(ops::slice(table, &[0], &[first], s)?),
            aligned(&ops::reshape(&ops::slice(table, &[first], &[len], s)?, &[dim as i32, dim as i32], s)?, s)?,
        )),
        Codec::TurboQuantRvq => Ok((Some(ops::slice(table, &[0], &[first], s)?), ops::slice(table, &[first], &[len], s)?)),
        other => Err(Error::invalid("layer", format!("{other:?} has a one-part table"))),
    }
}

/// The queries prepared once for every threadgroup: float32 `[B, Hq, L,
/// query_features]`, `scale * q` in the key frame.
fn prepare_queries(q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
    let sh = layer.shape;
    let qf = ops::astype(q, Dtype::F32, s)?;
    let framed = match layer.rotation_for(&sh.key)? {
        None => qf,
        Some(rot) => times_transpose(&qf, rot, s)?,
    };
    let framed = ops::multiply(&framed, &Array::scalar_f32(scale)?, s)?;
    if !matches!(sh.key.codec, Codec::ProductQuantized | Codec::Qjl | Codec::TurboQuantProd) {
        return Ok(framed);
    }
    let table = layer.keys.table.ok_or_else(|| Error::invalid("layer", format!("{:?} needs its table", sh.key.codec)))?;
    if sh.key.codec != Codec::ProductQuantized {
        // The sketched query, times the estimator's constant.
        let (_, sketch) = table_parts(table, &sh.key, sh.dim, s)?;
        let c = kv::sketch_scale(sh.key.sketch_rows(sh.dim));
        let sketched = ops::multiply(&times_transpose(&framed, &sketch, s)?, &Array::scalar_f32(c)?, s)?;
        return ops::concatenate(&[framed, sketched], 3, s);
    }
    // The lookup table ⟨q_p, codebook[c]⟩: [..., D/s, s] x [s, K].
    let (sub, entries) = (sh.key.group as i32, 1i32 << sh.key.bits);
    let lead = [sh.batch as i32, sh.q_heads as i32, sh.queries as i32];
    let parts = ops::reshape(&framed, &[lead[0], lead[1], lead[2], sh.dim as i32 / sub, sub], s)?;
    let codebook_t = ops::transpose(&ops::reshape(table, &[entries, sub], s)?, &[1, 0], s)?;
    let lut = ops::sum_axis(&ops::multiply(&ops::expand_dims(&parts, -1, s)?, &codebook_t, s)?, -2, false, s)?;
    let lut = ops::reshape(&lut, &[lead[0], lead[1], lead[2], sh.dim as i32 / sub * entries], s)?;
    ops::concatenate(&[framed, lut], 3, s)
}

/// Attention of `q` `[B, Hq, L, D]` over one layer's stored keys and values
/// and its float16 windows. Returns `[B, Hq, L, D]` in `q`'s dtype.
pub fn kv_attention(q: &Array, layer: &KvLayer<'_>, scale: f32, opts: &Options) -> Result<Array> {
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
    let g = sh.q_heads / sh.kv_heads;
    let backend = stream.backend()?;
    let tiles = tile_rows(g, sh.queries, shared_limit(backend), sh.dim);
    if matches!(imp, Implementation::Metal | Implementation::Cuda) && tiles.is_none() {
        let why = if g > MAX_TILE_ROWS {
            format!("{g} query heads per KV head exceed the fused kernel's {MAX_TILE_ROWS}")
        } else {
            format!("head_dim {} needs more threadgroup memory than {} offers", sh.dim, backend.name())
        };
        if opts.policy == Policy::Require {
            return Err(Error::Unsupported(format!("kv_attention: {why}")));
        }
        imp = Implementation::Reference;
    }
    if sh.total() == 0 || sh.queries == 0 {
        return ops::zeros(&want, q.dtype(), &stream);
    }
    if imp == Implementation::Reference {
        return attention_reference(q, layer, scale, &stream);
    }
    let qf = prepare_queries(q, layer, scale, &stream)?;
    // Arrays a codec does not use travel as placeholders it never reads.
    let none_f16 = Array::from_slice(&[f16::ZERO; 8], &[8])?;
    let none_f32 = Array::from_slice(&[0.0f32; 8], &[8])?;
    let side_inputs = |side: &KvSideArrays<'_>, sc: &SideCodec| -> Result<[Array; 4]> {
        let table = match (side.table, sc.codec) {
            (Some(t), _) => t.clone(),
            // KIVI keys are read at the bit offsets of their table: uniform
            // widths when the caller gave none.
            (None, Codec::KiviPerChannel) => {
                let offsets = kv::kivi_bit_offsets(None, sh.dim, sc.bits);
                Array::from_slice(&offsets, &[offsets.len() as i32])?
            }
            (None, _) => none_f32.clone(),
        };
        Ok([
            side.codes.clone(),
            side.scales.cloned().unwrap_or_else(|| none_f16.clone()),
            side.zeros.cloned().unwrap_or_else(|| none_f16.clone()),
            table,
        ])
    };
    let (ki, vi) = (side_inputs(&layer.keys, &sh.key)?, side_inputs(&layer.values, &sh.value)?);
    let rot_v = layer.rotation_for(&sh.value)?.cloned();
    match imp {
        Implementation::Cpu => {
            let dtype = q.dtype();
            let rot_input = rot_v.clone().unwrap_or_else(|| none_f32.clone());
            let rotate_back = rot_v.is_some();
            let mask = layer.mask.cloned().unwrap_or_else(|| none_f32.clone());
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
                                scales: if $sc.param_cols(sh.dim) > 0 { ins[$i + 1].as_slice::<f16>()? } else { &[] },
                                zeros: if $sc.has_zeros() { ins[$i + 2].as_slice::<f16>()? } else { &[] },
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
        _ => {
            let (per_tile, rows) = tiles.expect("checked above");
            let mask = layer.mask.cloned().unwrap_or_else(|| none_f32.clone());
            attention_gpu(q, &qf, layer, &ki, &vi, rot_v.as_ref(), &mask, per_tile, rows, &stream)
        }
    }
}

/// Threadgroup memory of one attention threadgroup for `rows` query rows
/// (bytes): the rows' first `dim` features are staged; lookup tables are read
/// from device memory.
fn attention_shared_bytes(rows: usize, dim: usize) -> usize {
    4 * rows * dim + 4 * rows * TILE + 4 * rows * (TILE / 32)
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

#[allow(clippy::too_many_arguments)]
fn attention_gpu(
    q: &Array,
    qf: &Array,
    layer: &KvLayer<'_>,
    ki: &[Array; 4],
    vi: &[Array; 4],
    rot_v: Option<&Array>,
    mask: &Array,
    per_tile: usize,
    tile_rows: usize,
    s: &Stream,
) -> Result<Array> {
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
            ],
        },
        s,
    )?;
    super::turboquant::reduce_partials(&parts, rot_v, q, s)
}

/// The compressed tokens of one side decoded in its frame, float32
/// `[B, Hkv, compressed, D]`, with plain MLX ops.
pub fn decode_compressed(side: &KvSideArrays<'_>, sc: &SideCodec, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (b, h, d, n) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32, sh.compressed as i32);
    let codes = |row: i32| ops::slice(side.codes, &[0, 0, 0, 0], &[b, h, n, row], s);
    let off = Options::on(s.clone(), Policy::Off);
    let unpacked = || -> Result<Array> {
        let c = codes(sc.row_len(sh.dim) as i32)?;
        ops::astype(&super::bit_unpack(&c, sc.bits, sh.dim, &off)?, Dtype::F32, s)
    };
    let missing = |what: &str| Error::invalid("layer", format!("{:?} needs {what}", sc.codec));
    let params_of = |a: Option<&Array>, what: &str| -> Result<Array> {
        let a = a.ok_or_else(|| missing(what))?;
        let rows = sc.param_rows(sh.compressed) as i32;
        ops::astype(&ops::slice(a, &[0, 0, 0, 0], &[b, h, rows, sc.param_cols(sh.dim) as i32], s)?, Dtype::F32, s)
    };
    // Index arrays that spread one parameter row (column) over its group.
    let spread = |len: usize, group: usize| -> Result<Array> {
        let idx: Vec<u32> = (0..len).map(|i| (i / group) as u32).collect();
        Array::from_slice(&idx, &[len as i32])
    };
    match sc.codec {
        Codec::Dense => ops::astype(&codes(d)?, Dtype::F32, s),
        Codec::TurboQuantMse => {
            let idx = ops::astype(&unpacked()?, Dtype::U32, s)?;
            let vals = ops::take_axis(side.table.ok_or_else(|| missing("centroids"))?, &idx, 0, s)?;
            // Norms are `[B, Hkv, capacity]`, the layout `tq_attention` reads.
            let norms = ops::slice(side.scales.ok_or_else(|| missing("norms"))?, &[0, 0, 0], &[b, h, n], s)?;
            let norms = ops::expand_dims(&ops::astype(&norms, Dtype::F32, s)?, -1, s)?;
            ops::multiply(&vals, &norms, s)
        }
        Codec::ProductQuantized => {
            let c = codes(sc.row_len(sh.dim) as i32)?;
            let idx = ops::astype(&super::bit_unpack(&c, sc.bits, sh.dim / sc.group, &off)?, Dtype::U32, s)?;
            let table = side.table.ok_or_else(|| missing("its codebook"))?;
            let entries = ops::reshape(table, &[1 << sc.bits, sc.group as i32], s)?;
            let vals = ops::reshape(&ops::take_axis(&entries, &idx, 0, s)?, &[b, h, n, d], s)?;
            let norms = ops::slice(side.scales.ok_or_else(|| missing("norms"))?, &[0, 0, 0], &[b, h, n], s)?;
            ops::multiply(&vals, &ops::expand_dims(&ops::astype(&norms, Dtype::F32, s)?, -1, s)?, s)
        }
        Codec::Qjl | Codec::TurboQuantProd | Codec::TurboQuantRvq => {
            let table = side.table.ok_or_else(|| missing("its table"))?;
            let (first, second) = table_parts(table, sc, sh.dim, s)?;
            let row = sc.row_len(sh.dim) as i32;
            let first_len = if sc.codec == Codec::Qjl { 0 } else { sc.first_len(sh.dim) as i32 };
            let part = |lo: i32, hi: i32, bits: u32, n_codes: usize| -> Result<Array> {
                let c = ops::slice(side.codes, &[0, 0, 0, lo], &[b, h, n, hi], s)?;
                ops::astype(&super::bit_unpack(&c, bits, n_codes, &off)?, Dtype::U32, s)
            };
            // ±1 from the sign bits (QJL's and Prod's last part).
            let signs = |bits: Array| -> Result<Array> {
                let z = ops::astype(&bits, Dtype::F32, s)?;
                ops::subtract(&ops::multiply(&z, &Array::scalar_f32(2.0)?, s)?, &Array::scalar_f32(1.0)?, s)
            };
            let stage1 = |cb: &Array| -> Result<Array> { ops::take_axis(cb, &part(0, first_len, sc.bits - 1, sh.dim)?, 0, s) };
            // Norms `[B, Hkv, capacity]`; Prod's (norm, residual norm) `[B, Hkv, capacity, 2]`.
            let scales = side.scales.ok_or_else(|| missing("norms"))?;
            let scales = if sc.codec != Codec::TurboQuantProd {
                ops::expand_dims(&ops::astype(&ops::slice(scales, &[0, 0, 0], &[b, h, n], s)?, Dtype::F32, s)?, -1, s)?
            } else {
                params_of(Some(scales), "norms")?
            };
            let norm = ops::slice(&scales, &[0, 0, 0, 0], &[b, h, n, 1], s)?;
            // Σ_r z_r S[r, :], exactly where small (see `times_transpose`).
            let sketch_t = |z: &Array| times_transpose(z, &ops::transpose(&second, &[1, 0], s)?, s);
            let unit = match sc.codec {
                Codec::Qjl => {
                    let z = signs(part(0, row, 1, sc.sketch_rows(sh.dim))?)?;
                    let c = kv::sketch_scale(sc.sketch_rows(sh.dim));
                    ops::multiply(&sketch_t(&z)?, &Array::scalar_f32(c)?, s)?
                }
                Codec::TurboQuantProd => {
                    // ŷ + √(π/2)/D · ‖r‖ · Sᵀ z.
                    let z = signs(part(first_len, row, 1, sh.dim)?)?;
                    let rnorm = ops::slice(&scales, &[0, 0, 0, 1], &[b, h, n, 2], s)?;
                    let c = Array::scalar_f32(kv::sketch_scale(sh.dim))?;
                    let qjl = ops::multiply(&ops::multiply(&sketch_t(&z)?, &c, s)?, &rnorm, s)?;
                    ops::add(&stage1(first.as_ref().expect("two parts"))?, &qjl, s)?
                }
                _ => {
                    let r = ops::take_axis(&second, &part(first_len, row, 1, sh.dim)?, 0, s)?;
                    ops::add(&stage1(first.as_ref().expect("two parts"))?, &r, s)?
                }
            };
            ops::multiply(&unit, &norm, s)
        }
        Codec::KiviPerChannel | Codec::KiviPerToken => {
            let (scales, zeros) = (params_of(side.scales, "scales")?, params_of(side.zeros, "zeros")?);
            let (idx, axis) = if sc.codec == Codec::KiviPerChannel {
                (spread(sh.compressed, sc.group)?, 2)
            } else {
                (spread(sh.dim, sc.group)?, 3)
            };
            let scales = ops::take_axis(&scales, &idx, axis, s)?;
            let zeros = ops::take_axis(&zeros, &idx, axis, s)?;
            let codes = match (sc.codec, side.table) {
                (Codec::KiviPerChannel, Some(layout)) => kivi_codes_at(&codes(sc.row_len(sh.dim) as i32)?, layout, sh, s)?,
                _ => unpacked()?,
            };
            ops::add(&zeros, &ops::multiply(&scales, &codes, s)?, s)
        }
    }
}

/// KIVI keys' codes `[B, Hkv, n, row]` read at the bit offsets of `layout`
/// (`kivi_bit_offsets`: a stride, then the heads' rows), float32 `[B, Hkv,
/// n, D]`. A code of at most 8 bits spans at most two bytes: `((byte[o/8] |
/// byte[o/8 + 1] << 8) >> o%8) & (2^width − 1)`, gathered head by head
/// (each may have its own offsets).
fn kivi_codes_at(codes: &Array, layout: &Array, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (h, d) = (sh.kv_heads as i32, sh.dim as i32);
    let cs = codes.shape();
    let (b, n, row) = (cs[0], cs[2], cs[3]);
    // Row h of the table starts at 1 + h * stride (the stride is on the device).
    let stride = ops::slice(layout, &[0], &[1], s)?;
    let heads = Array::from_slice(&(0..h).map(|i| i as f32).collect::<Vec<_>>(), &[h, 1])?;
    let cols = Array::from_slice(&(0..=d).map(|c| (c + 1) as f32).collect::<Vec<_>>(), &[1, d + 1])?;
    let at = ops::astype(&ops::add(&ops::multiply(&heads, &stride, s)?, &cols, s)?, Dtype::U32, s)?;
    let offsets = ops::astype(&ops::take(layout, &at, s)?, Dtype::U32, s)?;
    let start = ops::slice(&offsets, &[0, 0], &[h, d], s)?;
    let end = ops::slice(&offsets, &[0, 1], &[h, d + 1], s)?;
    let u32s = |v: u32| Array::from_slice(&[v], &[1]);
    let byte = ops::right_shift(&start, &u32s(3)?, s)?;
    let next = ops::minimum(&ops::add(&byte, &u32s(1)?, s)?, &u32s(row as u32 - 1)?, s)?;
    let shift = ops::bitwise_and(&start, &u32s(7)?, s)?;
    let mask = ops::subtract(&ops::left_shift(&u32s(1)?, &ops::subtract(&end, &start, s)?, s)?, &u32s(1)?, s)?;
    let wide = ops::astype(codes, Dtype::U32, s)?;
    let heads = (0..h)
        .map(|i| -> Result<Array> {
            let of = |a: &Array| -> Result<Array> { ops::reshape(&ops::slice(a, &[i, 0], &[i + 1, d], s)?, &[d], s) };
            let x = ops::slice(&wide, &[0, i, 0, 0], &[b, i + 1, n, row], s)?;
            let lo = ops::take_axis(&x, &of(&byte)?, 3, s)?;
            let hi = ops::left_shift(&ops::take_axis(&x, &of(&next)?, 3, s)?, &u32s(8)?, s)?;
            let v = ops::right_shift(&ops::bitwise_or(&lo, &hi, s)?, &of(&shift)?, s)?;
            ops::bitwise_and(&v, &of(&mask)?, s)
        })
        .collect::<Result<Vec<_>>>()?;
    ops::astype(&ops::concatenate(&heads, 1, s)?, Dtype::F32, s)
}

/// One side's tokens in its frame, float32 `[B, Hkv, total, D]`, in position
/// order (sinks, compressed, recent).
pub fn decode_framed(side: &KvSideArrays<'_>, sc: &SideCodec, sh: &KvShape, s: &Stream) -> Result<Array> {
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let win = ops::astype(side.window, Dtype::F32, s)?;
    let mut parts = Vec::new();
    if sh.sinks > 0 {
        parts.push(ops::slice(&win, &[0, 0, 0, 0], &[b, h, sh.sinks as i32, d], s)?);
    }
    if sh.compressed > 0 {
        parts.push(decode_compressed(side, sc, sh, s)?);
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
pub fn framed_parts(side: &KvSideArrays<'_>, sc: &SideCodec, sh: &KvShape, dtype: Dtype, opts: &Options) -> Result<Vec<Array>> {
    let s = &opts.resolve_stream()?;
    let (b, h, d) = (sh.batch as i32, sh.kv_heads as i32, sh.dim as i32);
    let mut parts = Vec::new();
    if sh.sinks > 0 {
        parts.push(ops::slice(side.window, &[0, 0, 0, 0], &[b, h, sh.sinks as i32, d], s)?);
    }
    if sh.compressed > 0 {
        let n = sh.compressed as i32;
        parts.push(match (sc.codec, side.table, side.scales) {
            (Codec::TurboQuantMse, Some(table), Some(norms)) => {
                let codes = ops::slice(side.codes, &[0, 0, 0, 0], &[b, h, n, sc.row_len(sh.dim) as i32], s)?;
                let unit = super::scalar_dequantize(&codes, table, sc.bits, sh.dim, dtype, opts)?;
                let norms = ops::astype(&ops::slice(norms, &[0, 0, 0], &[b, h, n], s)?, dtype, s)?;
                ops::multiply(&unit, &ops::expand_dims(&norms, -1, s)?, s)?
            }
            _ => ops::astype(&decode_compressed(side, sc, sh, s)?, dtype, s)?,
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
    let (side, sc) = if values { (&layer.values, &sh.value) } else { (&layer.keys, &sh.key) };
    let framed = decode_framed(side, sc, sh, s)?;
    match layer.rotation_for(sc)? {
        Some(rot) => ops::matmul(&framed, rot, s),
        None => Ok(framed),
    }
}

/// Reference graph: decode both sides, then MLX's attention.
fn attention_reference(q: &Array, layer: &KvLayer<'_>, scale: f32, s: &Stream) -> Result<Array> {
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
