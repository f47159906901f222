//! `LayerCache`: the stored arrays of one layer and the operations on them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::{AttentionMask, CacheConfig};
use crate::array::Array;
use crate::cpu::kv_attention::{Codec, KvShape, SideCodec};
use crate::cpu::turboquant::AttentionShape;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::kernels::kv_attention::{self, KvLayer, KvSideArrays};
use crate::kernels::turboquant::{self, TqLayer};
use crate::kernels::window::{self, WindowAppend};
use crate::kernels::{self, KiviMode, Options, Policy};
use crate::ops;
use crate::quant::{Rotation, RotationKind, ScalarCodebook};
use crate::stream::{Device, Stream};

/// `−mean` in the keys' frame (`−mean·Πᵀ/F` when `rotation`, the shared
/// `F·Π`, is given, else `−mean/F`), in `dtype`: what every new key gets
/// added.
fn key_offset(mean: &Array, rotation: Option<&Array>, dtype: Dtype, s: &Stream) -> Result<Array> {
    let f = frame_scale(mean.shape()[3] as usize);
    let framed = match rotation {
        Some(r) => {
            let into = ops::multiply(&ops::transpose(r, &[1, 0], s)?, &Array::scalar_f32(-1.0 / (f * f))?, s)?;
            ops::matmul(mean, &into, s)?
        }
        None => ops::multiply(mean, &Array::scalar_f32(-1.0 / f)?, s)?,
    };
    ops::astype(&framed, dtype, s)
}

/// `F`, the power of two by which a compressed layer's key frame and
/// rotated value frame are scaled down: tokens are held as `x·Πᵀ/F`
/// (rotated) or `x/F` (keys of the other codecs), in the windows and in the
/// codes' norms and scales (float16), so that every float16 input fits, its
/// norm included (at most `2·65504·√D` for a key less its mean: `F >= 2·√D`),
/// and float32 or bfloat16 inputs up to a norm of `65504·F`. The kernels
/// read the rotation as `F·Π` and unrotated keys with the scale times `F`,
/// which puts `F` back into scores and outputs.
pub(crate) fn frame_scale(dim: usize) -> f32 {
    (2.0 * (dim as f32).sqrt()).ceil().max(1.0).log2().ceil().exp2()
}

/// Token slots of a float16 cache's allocation step (mlx_lm's `KVCache`
/// grows by 256 tokens): a window grows no further than keeps the cache
/// within what such a cache holds for the same tokens.
const FP16_STEP: usize = 256;
/// Stores grow to a multiple of this many slots (a multiple of KIVI's key
/// group, so that parameter rows are whole).
const STORE_ROUND: usize = 64;

/// Slots a store (the codes and side data of compressed tokens, or the
/// dense control's tokens) grows to when it must hold `needed`: what is
/// needed, or an eighth more than it holds when that is more (so that a
/// growth copies the store a bounded number of times), rounded up to
/// `STORE_ROUND`.
fn store_capacity(current: usize, needed: usize) -> usize {
    if needed <= current {
        return current;
    }
    needed.max(current + current / 8).div_ceil(STORE_ROUND) * STORE_ROUND
}

/// Slots a window grows to when it must hold `needed` (at most `max`, the
/// configuration's `window_capacity`): double what it holds, but not below
/// `needed` nor above `limit` (where the layer would outgrow a float16
/// cache of its tokens) unless `needed` is.
fn window_slots(current: usize, needed: usize, max: usize, limit: usize) -> usize {
    if needed <= current {
        return current;
    }
    (2 * current).clamp(needed, limit.max(needed)).min(max)
}
const STATE_FORMAT: &str = "veloxquant-layer-cache";
/// Version 4: `to_bytes` adds a CRC-32 of every tensor and of the header.
/// Version 5: rotated frames are scaled by `1/F` (`frame_scale`).
const STATE_VERSION: &str = "5";

/// Row-major `Π` of the cache's rotation for `(dim, seed)`: Hadamard where
/// the size allows, else dense. Computed once per process.
pub fn rotation_matrix(dim: usize, seed: u64) -> Result<Vec<f32>> {
    static CACHE: OnceLock<Mutex<HashMap<(usize, u64), Vec<f32>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(m) = cache.lock().expect("rotation cache").get(&(dim, seed)) {
        return Ok(m.clone());
    }
    let rot = Rotation::new(RotationKind::Hadamard, dim, seed)
        .or_else(|_| Rotation::new(RotationKind::Dense, dim, seed))
        .map_err(|e| Error::invalid("head_dim", e.to_string()))?;
    let m = rot.to_dense();
    cache.lock().expect("rotation cache").insert((dim, seed), m.clone());
    Ok(m)
}

fn centroids(dim: usize, bits: u32) -> Result<Vec<f32>> {
    Ok(ScalarCodebook::sphere(dim, bits).map_err(|e| Error::invalid("bits", e.to_string()))?.centroids().to_vec())
}

/// The product-quantization codebook `[2^PQ_CODE_BITS, sub]` (row-major) for
/// rotated unit vectors of size `dim`: k-means over seeded Gaussian
/// sub-vectors of variance `1/dim` (what a rotated unit vector's coordinates
/// are close to). Trained once per process.
pub fn pq_codebook(dim: usize, sub: usize) -> Result<Vec<f32>> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};
    static CACHE: OnceLock<Mutex<HashMap<(usize, usize), Vec<f32>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache.lock().expect("codebook cache").get(&(dim, sub)) {
        return Ok(c.clone());
    }
    let entries = 1usize << super::PQ_CODE_BITS;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0f_c0de);
    let sd = 1.0 / (dim as f32).sqrt();
    let samples: Vec<f32> = (0..64 * entries * sub).map(|_| { let g: f32 = StandardNormal.sample(&mut rng); sd * g }).collect();
    let (codebook, _) = crate::quant::pq::kmeans(&samples, sub, entries, 0, 25, 1e-4)
        .map_err(|e| Error::invalid("bits", e.to_string()))?;
    cache.lock().expect("codebook cache").insert((dim, sub), codebook.clone());
    Ok(codebook)
}

/// The Gaussian sketch `[rows, dim]` (row-major) of the QJL and
/// TurboQuant-Prod keys: blocks of `dim` rows orthogonalized, each row keeping
/// its Gaussian length (`crate::quant::qjl::Sketch`), seeded by `seed + 1` as
/// `TurboQuantProd` seeds it. Built once per process.
pub fn qjl_sketch(rows: usize, dim: usize, seed: u64) -> Vec<f32> {
    static CACHE: OnceLock<Mutex<HashMap<(usize, usize, u64), Vec<f32>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(m) = cache.lock().expect("sketch cache").get(&(rows, dim, seed)) {
        return m.clone();
    }
    let m = crate::quant::qjl::Sketch::new(rows, dim, true, seed.wrapping_add(1)).s;
    cache.lock().expect("sketch cache").insert((rows, dim, seed), m.clone());
    m
}

/// The float32 table a codec reads (`KvSide::table`), for heads of `dim` and
/// the cache's `seed`; `None` for the codecs without one.
pub fn codec_table(sc: &SideCodec, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
    Ok(match sc.codec {
        Codec::TurboQuantMse => Some(centroids(dim, sc.bits)?),
        Codec::ProductQuantized => Some(pq_codebook(dim, sc.group)?),
        Codec::Qjl => Some(qjl_sketch(sc.sketch_rows(dim), dim, seed)),
        // First-stage centroids, then the sketch or the residual codebook.
        Codec::TurboQuantProd => {
            let mut t = centroids(dim, sc.bits - 1)?;
            t.extend(qjl_sketch(dim, dim, seed));
            Some(t)
        }
        Codec::TurboQuantRvq => {
            let mut t = centroids(dim, sc.bits - 1)?;
            let second = ScalarCodebook::sphere_residual(dim, sc.bits - 1, 1).map_err(|e| Error::invalid("bits", e.to_string()))?;
            t.extend_from_slice(second.centroids());
            Some(t)
        }
        Codec::Dense | Codec::KiviPerChannel | Codec::KiviPerToken => None,
    })
}

/// Arrays shared by every layer with the same head size, seed, methods and
/// bits, dtype and device: one set per process, held while some layer
/// holds it. They are evaluated before any layer gets them, so that layers
/// on every thread can read them (MLX streams are per thread: a lazy array
/// can be evaluated only on the thread that built it).
struct Shared {
    /// `F·Π` float32 (`frame_scale`), when either side's frame is rotated:
    /// what the kernels and decoding read as the rotation, so that a query
    /// enters the key frame, and an output or a decoded token leaves the
    /// value frame, scaled by `F`.
    rotation: Option<Array>,
    /// `Πᵀ/F` in the cache's dtype, the inverse of `rotation`: new tokens
    /// enter the rotated frame with one matmul and no casts (its rounding is
    /// below the windows' own).
    rotation_t: Option<Array>,
    /// `I/F` in the cache's dtype, when the keys' frame is not rotated: new
    /// keys enter it with one `addmm` (the mean's offset added), as rotated
    /// ones do.
    key_frame: Option<Array>,
    /// Codebooks of the key and value codecs that have one.
    k_table: Option<Array>,
    v_table: Option<Array>,
}

/// What makes two layers' shared arrays the same.
#[derive(Clone, PartialEq, Eq, Hash)]
struct SharedKey {
    dim: usize,
    seed: u64,
    key: (Codec, u32, usize),
    value: (Codec, u32, usize),
    dtype: Dtype,
    device: Device,
}

impl Shared {
    fn arrays(&self) -> impl Iterator<Item = &Array> {
        [&self.rotation, &self.rotation_t, &self.key_frame, &self.k_table, &self.v_table].into_iter().flatten()
    }
}

// SAFETY: a `Shared` is evaluated in `shared_for` before it is published and
// is never changed after; other threads only copy its handles (MLX arrays
// count references atomically) and read shapes and data, which no thread
// writes.
unsafe impl Sync for Shared {}

/// The live shared sets of the process. Weak: a set goes with its last layer.
fn shared_sets() -> std::sync::MutexGuard<'static, HashMap<SharedKey, Weak<Shared>>> {
    static SHARED: OnceLock<Mutex<HashMap<SharedKey, Weak<Shared>>>> = OnceLock::new();
    // Nothing panics while holding the lock, but a poisoned map is still a
    // valid map: keep using it.
    SHARED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared arrays for `key`: the set a live layer already holds, else a
/// new one from `make`, evaluated.
fn shared_for(key: SharedKey, make: impl FnOnce() -> Result<Shared>) -> Result<Arc<Shared>> {
    if let Some(found) = shared_sets().get(&key).and_then(Weak::upgrade) {
        return Ok(found);
    }
    // Made without the lock (training a codebook takes a while); a set
    // another thread published meanwhile wins, so that layers agree.
    let made = make()?;
    // `Array::eval` waits until each is available: other threads then only
    // read them, and never touch their status or events.
    for a in made.arrays() {
        a.eval()?;
    }
    let mut sets = shared_sets();
    if let Some(found) = sets.get(&key).and_then(Weak::upgrade) {
        return Ok(found);
    }
    let made = Arc::new(made);
    sets.retain(|_, w| w.strong_count() > 0);
    sets.insert(key, Arc::downgrade(&made));
    Ok(made)
}

struct Dense {
    keys: Array,
    values: Array,
    len: usize,
    capacity: usize,
}

/// One side's (keys' or values') compressed tokens and window.
struct Side {
    codec: SideCodec,
    /// `[B, Hkv, capacity, row_len]`: uint8 codes, or the tokens in the
    /// cache's dtype for the dense codec.
    codes: Array,
    /// Norms (TurboQuant-MSE and -RVQ, product quantization, QJL: `[B, Hkv,
    /// capacity]`; TurboQuant-Prod: norm and residual norm, `[B, Hkv,
    /// capacity, 2]`) or KIVI scales (`[B, Hkv, param_rows, param_cols]`), float16.
    scales: Option<Array>,
    /// KIVI zeros, float16, shaped as the scales.
    zeros: Option<Array>,
    /// Float16 window `[B, Hkv, window_capacity, D]` in the side's frame
    /// (rotated for the rotating codecs): sinks first.
    window: Array,
}

/// A compressed side's new tokens, encoded.
struct Encoded {
    codes: Array,
    scales: Option<Array>,
    zeros: Option<Array>,
}

impl Side {
    /// Shape of the scale and zero arrays for `rows` parameter rows.
    fn param_shape(&self, b: i32, h: i32, rows: usize, dim: usize) -> Vec<i32> {
        match self.codec.codec {
            // Norms keep the layout `tq_attention` reads.
            Codec::TurboQuantMse | Codec::ProductQuantized | Codec::Qjl | Codec::TurboQuantRvq => vec![b, h, rows as i32],
            _ => vec![b, h, rows as i32, self.codec.param_cols(dim) as i32],
        }
    }

    /// Name of the scale array in the state (what it holds).
    fn scales_name(&self) -> &'static str {
        match self.codec.codec {
            Codec::KiviPerChannel | Codec::KiviPerToken => "scales",
            _ => "norms",
        }
    }

    fn arrays(&self) -> impl Iterator<Item = &Array> {
        [Some(&self.codes), self.scales.as_ref(), self.zeros.as_ref(), Some(&self.window)].into_iter().flatten()
    }

    fn nbytes(&self) -> usize {
        self.arrays().map(Array::nbytes).sum()
    }

    /// Bytes of what this side stores for `len` compressed tokens and
    /// `window` window tokens (codes, norms or scales and zeros, float16
    /// rows); the rest of its arrays is allocated capacity.
    fn data_nbytes(&self, len: usize, window: usize) -> usize {
        // Bytes of `used` of an array's `shape[2]` token (or parameter) rows.
        let rows = |a: &Array, used: usize| match a.shape().get(2) {
            Some(&n) if n > 0 => a.nbytes() / n as usize * used,
            _ => 0,
        };
        let params = self.codec.param_rows(len);
        rows(&self.codes, len)
            + [self.scales.as_ref(), self.zeros.as_ref()].into_iter().flatten().map(|a| rows(a, params)).sum::<usize>()
            + rows(&self.window, window)
    }

    /// Grows the stores to `new` token slots (zeros appended).
    fn grow(&mut self, new: usize, s: &Stream) -> Result<()> {
        extend_slots(&mut self.codes, new, s)?;
        let rows = self.codec.param_rows(new);
        for a in [self.scales.as_mut(), self.zeros.as_mut()].into_iter().flatten() {
            extend_slots(a, rows, s)?;
        }
        Ok(())
    }

    /// Encodes `x` `[B, Hkv, m, D]` (in the side's frame; `m` a whole number
    /// of the codec's token groups). A token holding a NaN or an infinity
    /// gets a NaN norm or scale (see [`non_finite`]), whatever the encoder
    /// made of it, so that it decodes to NaN and makes every query that sees
    /// it NaN: no non-finite input becomes a finite value.
    fn encode(&self, x: &Array, table: Option<&Array>, dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let mut e = self.encode_values(x, table, dtype, opts)?;
        if let Some(scales) = e.scales.take() {
            let s = opts.resolve_stream()?;
            let bad = self.non_finite(x, &s)?;
            e.scales = Some(ops::add(&scales, &ops::astype(&bad, Dtype::F16, &s)?, &s)?);
        }
        Ok(e)
    }

    /// NaN where the tokens of `x` `[B, Hkv, m, D]` hold a NaN or an
    /// infinity, or (codecs with a norm) where the norm exceeds float16's
    /// range, 0 elsewhere, float32, shaped to add to the codec's norms or
    /// scales: per token for norms (`[B, Hkv, m]`; TurboQuant-Prod's
    /// `[B, Hkv, m, 1]` for both of its norms) and for KIVI values (`[B, Hkv,
    /// m, 1]`, every channel group), per token group and channel for KIVI
    /// keys (their scales are shared by the group's tokens in that channel,
    /// which therefore decode to NaN too).
    fn non_finite(&self, x: &Array, s: &Stream) -> Result<Array> {
        let shape = x.shape();
        let (b, h, m, d) = (shape[0], shape[1], shape[2], shape[3]);
        let zero = Array::scalar_f32(0.0)?;
        let xf = ops::astype(x, Dtype::F32, s)?;
        let g = self.codec.group as i32;
        match self.codec.codec {
            Codec::KiviPerToken | Codec::KiviPerChannel => {
                // x * 0 is NaN exactly where x is NaN or infinite. (KIVI's
                // float16 scales and zeros overflow to infinities, which
                // decode non-finite.)
                let z = ops::multiply(&xf, &zero, s)?;
                if self.codec.codec == Codec::KiviPerToken {
                    ops::sum_axis(&z, -1, true, s)
                } else {
                    ops::sum_axis(&ops::reshape(&z, &[b, h, m / g, g, d], s)?, 3, false, s)
                }
            }
            _ => {
                // The norm as float16 (infinite beyond its range; NaN or
                // infinite for a non-finite input), times 0.
                let keep = self.codec.codec == Codec::TurboQuantProd;
                let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, s)?, -1, keep, s)?, s)?;
                ops::multiply(&ops::astype(&ops::astype(&norm, Dtype::F16, s)?, Dtype::F32, s)?, &zero, s)
            }
        }
    }

    fn encode_values(&self, x: &Array, table: Option<&Array>, dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let s = opts.resolve_stream()?;
        let shape = x.shape();
        let (b, h, m, d) = (shape[0], shape[1], shape[2], shape[3]);
        let sc = self.codec;
        let flat = |a: &Array| ops::reshape(a, &[b * h * m, d], &s);
        let per_head = |a: Array, rows: usize, cols: usize| ops::reshape(&a, &[b, h, rows as i32, cols as i32], &s);
        // Norm (saturated at float16's largest, as `tq_encode` stores it) and
        // unit vector, float32.
        let norm_unit = || -> Result<(Array, Array)> {
            let xf = ops::astype(x, Dtype::F32, &s)?;
            let norm = ops::sqrt(&ops::sum_axis(&ops::square(&xf, &s)?, -1, true, &s)?, &s)?;
            let unit = ops::divide(&xf, &ops::maximum(&norm, &Array::scalar_f32(f32::MIN_POSITIVE)?, &s)?, &s)?;
            let norm = ops::minimum(&norm, &Array::scalar_f32(crate::cpu::turboquant::MAX_NORM)?, &s)?;
            Ok((ops::astype(&norm, Dtype::F16, &s)?, unit))
        };
        let parts = |table: Option<&Array>| kv_attention::table_parts(table.expect("the codec has a table"), &sc, d as usize, &s);
        Ok(match sc.codec {
            Codec::Dense => Encoded { codes: ops::astype(x, dtype, &s)?, scales: None, zeros: None },
            Codec::Qjl => {
                let (norm, _) = norm_unit()?;
                let (_, sketch) = parts(table)?;
                let (signs, _) = kernels::qjl_encode(x, &sketch, opts)?;
                Encoded { codes: signs, scales: Some(ops::reshape(&norm, &[b, h, m], &s)?), zeros: None }
            }
            Codec::TurboQuantProd | Codec::TurboQuantRvq => {
                // First stage: `bits − 1`-bit codes of the unit vector; then the
                // residual's QJL signs and norm (Prod) or 1-bit codes (RVQ).
                let (norm, unit) = norm_unit()?;
                let (first, second) = parts(table)?;
                let first = first.expect("two parts");
                let codes1 = kernels::scalar_quantize(&unit, &first, sc.bits - 1, opts)?;
                let approx = kernels::scalar_dequantize(&codes1, &first, sc.bits - 1, d as usize, Dtype::F32, opts)?;
                let residual = ops::subtract(&unit, &approx, &s)?;
                let norm = ops::reshape(&norm, &[b, h, m], &s)?;
                if sc.codec == Codec::TurboQuantProd {
                    let (signs, rnorm) = kernels::qjl_encode(&residual, &second, opts)?;
                    let scales = ops::concatenate(&[ops::expand_dims(&norm, -1, &s)?, ops::expand_dims(&rnorm, -1, &s)?], 3, &s)?;
                    Encoded { codes: ops::concatenate(&[codes1, signs], 3, &s)?, scales: Some(scales), zeros: None }
                } else {
                    let codes2 = kernels::scalar_quantize(&residual, &second, 1, opts)?;
                    Encoded { codes: ops::concatenate(&[codes1, codes2], 3, &s)?, scales: Some(norm), zeros: None }
                }
            }
            Codec::TurboQuantMse => {
                let table = table.expect("TurboQuant has centroids");
                let (codes, norms) = turboquant::tq_encode(x, None, table, sc.bits, opts)?;
                Encoded { codes, scales: Some(norms), zeros: None }
            }
            Codec::ProductQuantized => {
                // The unit vector's sub-vectors into the codebook.
                let (norm, unit) = norm_unit()?;
                let table = table.expect("product quantization has a codebook");
                let codebook = ops::reshape(table, &[1 << sc.bits, sc.group as i32], &s)?;
                // 8-bit codes: one plane, no high bits.
                let codes = kernels::pq_encode(&unit, &codebook, sc.bits, opts)?.codes;
                Encoded { codes, scales: Some(ops::reshape(&norm, &[b, h, m], &s)?), zeros: None }
            }
            Codec::KiviPerChannel | Codec::KiviPerToken => {
                let mode = if sc.codec == Codec::KiviPerChannel { KiviMode::Keys } else { KiviMode::Values };
                // Per channel, groups of rows never cross heads: m is a whole
                // number of groups.
                let (codes, scales, zeros) = kernels::kivi_quantize(&flat(x)?, sc.bits, sc.group, mode, opts)?;
                let (rows, cols) = (sc.param_rows(m as usize), sc.param_cols(d as usize));
                Encoded {
                    codes: per_head(codes, m as usize, sc.row_len(d as usize))?,
                    scales: Some(per_head(scales, rows, cols)?),
                    zeros: Some(per_head(zeros, rows, cols)?),
                }
            }
        })
    }

    /// Writes `e` at token slot `lo` (a multiple of the codec's token group).
    fn write(&mut self, e: Encoded, lo: usize, s: &Stream) -> Result<()> {
        let put = |a: &Array, new: &Array, lo: usize| -> Result<Array> {
            let sh = new.shape();
            let mut start = vec![0i32; sh.len()];
            start[2] = lo as i32;
            let mut stop = sh.clone();
            stop[2] += lo as i32;
            ops::slice_update(a, new, &start, &stop, s)
        };
        self.codes = put(&self.codes, &e.codes, lo)?;
        let plo = self.codec.param_rows(lo);
        if let (Some(a), Some(n)) = (&self.scales, &e.scales) {
            self.scales = Some(put(a, n, plo)?);
        }
        if let (Some(a), Some(n)) = (&self.zeros, &e.zeros) {
            self.zeros = Some(put(a, n, plo)?);
        }
        Ok(())
    }

    fn arrays_for_kernel<'a>(&'a self, table: Option<&'a Array>) -> KvSideArrays<'a> {
        KvSideArrays { codes: &self.codes, scales: self.scales.as_ref(), zeros: self.zeros.as_ref(), table, window: &self.window }
    }
}

struct Compressed {
    /// Per-channel mean of the keys of the first append `[B, Hkv, 1, D]`
    /// (float32), subtracted from every key before it is stored. Softmax is
    /// unchanged by it (it shifts a query's scores by one constant), and it
    /// takes the channel offsets of real keys out of what the codes must hold.
    k_mean: Option<Array>,
    /// `−k_mean` in the keys' frame and the cache's dtype, added to every new
    /// key (derived from `k_mean`, not stored in the state).
    k_offset: Option<Array>,
    keys: Side,
    values: Side,
    /// Token slots of the stores.
    capacity: usize,
    /// Token slots of the windows (at most the configuration's
    /// `window_capacity`).
    window_slots: usize,
    len: usize,
    n_sink: usize,
    n_recent: usize,
    /// Scratch of the decode kernel (`turboquant::decode_counters`): not
    /// data, zero between calls.
    decode_counters: Array,
}

impl Compressed {
    /// Grows both windows so that they hold at least `needed` slots, when the
    /// layer holds `tokens` tokens: by doubling, within the bytes of a
    /// float16 cache of those tokens (the stores and the key mean counted).
    fn reserve_window(&mut self, needed: usize, tokens: usize, max: usize, s: &Stream) -> Result<()> {
        if needed <= self.window_slots {
            return Ok(());
        }
        let slot_bytes = 2 * self.keys.window.nbytes() / self.window_slots.max(1);
        let others = self.keys.arrays().chain(self.values.arrays()).map(Array::nbytes).sum::<usize>()
            - self.keys.window.nbytes()
            - self.values.window.nbytes()
            + self.k_mean.as_ref().map_or(0, Array::nbytes)
            + self.k_offset.as_ref().map_or(0, Array::nbytes);
        let fp16_slots = tokens.div_ceil(FP16_STEP) * FP16_STEP;
        let limit = fp16_slots.saturating_sub(others.div_ceil(slot_bytes.max(1)));
        let slots = window_slots(self.window_slots, needed, max, limit);
        if slots > self.window_slots {
            extend_slots(&mut self.keys.window, slots, s)?;
            extend_slots(&mut self.values.window, slots, s)?;
            self.window_slots = slots;
        }
        Ok(())
    }

    /// Tokens both sides compress together: a flush starts and ends on a
    /// multiple of it.
    fn token_group(&self) -> usize {
        let group = |sc: &SideCodec| if sc.codec == Codec::KiviPerChannel { sc.group } else { 1 };
        let (a, b) = (group(&self.keys.codec), group(&self.values.codec));
        let gcd = |mut x: usize, mut y: usize| {
            while y != 0 {
                (x, y) = (y, x % y);
            }
            x
        };
        a / gcd(a, b) * b
    }
}

/// MLX's SDPA of dense keys and values under a prepared additive mask (see
/// `kv_attention::prepare_mask`), or causal (for more than one query), or none.
fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: Option<&Array>, causal: bool, s: &Stream) -> Result<Array> {
    match mask {
        // MLX takes an additive mask in the queries' dtype.
        Some(m) => ops::scaled_dot_product_attention_masked(q, k, v, scale, &ops::astype(m, q.dtype(), s)?, s),
        None => ops::scaled_dot_product_attention(q, k, v, scale, causal && q.shape()[2] > 1, s),
    }
}

/// The matrix new keys enter their frame through: `Πᵀ/F` when their codec
/// rotates, else `I/F`.
fn key_frame<'a>(shared: &'a Shared, c: &Compressed) -> &'a Array {
    let frame = if c.keys.codec.codec.rotated() { &shared.rotation_t } else { &shared.key_frame };
    frame.as_ref().expect("the keys' frame is made with the shared arrays")
}

/// The matrix new values enter their frame through, when their codec rotates.
fn value_frame<'a>(shared: &'a Shared, c: &Compressed) -> Option<&'a Array> {
    shared.rotation_t.as_ref().filter(|_| c.values.codec.codec.rotated())
}

/// New tokens in each side's frame (the windows hold them so, and attention
/// works in those frames): keys rotated when their codec rotates and shifted
/// by `−mean` once the mean is known, in one matmul or one add; values
/// rotated when theirs does.
fn into_frames(shared: &Shared, c: &Compressed, keys: &Array, values: &Array, s: &Stream) -> Result<(Array, Array)> {
    Ok((
        window::into_frame(keys, Some(key_frame(shared, c)), c.k_offset.as_ref(), s)?,
        window::into_frame(values, value_frame(shared, c), None, s)?,
    ))
}

enum Store {
    Dense(Dense),
    Compressed(Compressed),
}

/// The cache of one attention layer.
///
/// It may be moved to and used on any thread: its work goes to the calling
/// thread's default stream of its device (MLX streams are per thread). Work
/// it left pending on one thread must be evaluated there before another
/// thread uses the cache, as for any MLX array.
pub struct LayerCache {
    cfg: CacheConfig,
    device: Device,
    batch: usize,
    dtype: Dtype,
    shared: Option<Arc<Shared>>,
    store: Option<Store>,
}

impl LayerCache {
    /// An empty cache on `stream`'s device (MLX's default device when `None`).
    pub fn new(cfg: CacheConfig, stream: Option<Stream>) -> Result<Self> {
        cfg.validate()?;
        let stream = match stream {
            Some(s) => s,
            None => Stream::default_stream()?,
        };
        if cfg.policy == Policy::Require && cfg.compressed() {
            // Fail at construction, not at the first append.
            let (name, source) = if Self::turboquant_only(&cfg) {
                ("tq_attention", kernels::Source::TqAttention)
            } else {
                ("kv_attention", kernels::Source::KvAttention)
            };
            let probe = kernels::KernelSpec { name, gpu: Some(source), cpu: true };
            kernels::select(&probe, Policy::Require, &stream)?;
        }
        Ok(LayerCache { cfg, device: stream.device()?, batch: 0, dtype: Dtype::F16, shared: None, store: None })
    }

    /// The calling thread's default stream of the cache's device.
    fn stream(&self) -> Result<Stream> {
        match self.device {
            Device::Cpu => Ok(Stream::cpu()),
            Device::Gpu => Stream::gpu(),
        }
    }

    /// TurboQuant-MSE keys and values: the `tq_attention` fast path.
    fn turboquant_only(cfg: &CacheConfig) -> bool {
        cfg.key_codec().codec == Codec::TurboQuantMse && cfg.value_codec().codec == Codec::TurboQuantMse
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Tokens held.
    pub fn offset(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Dense(d)) => d.len,
            Some(Store::Compressed(c)) => c.n_sink + c.len + c.n_recent,
        }
    }

    /// Tokens held as codes (the rest are in the float16 windows).
    pub fn compressed_tokens(&self) -> usize {
        match &self.store {
            Some(Store::Compressed(c)) => c.len,
            _ => 0,
        }
    }

    fn opts(&self, s: &Stream) -> Options {
        Options::on(s.clone(), self.cfg.policy)
    }

    /// The arrays this layer holds (stores, windows, key offsets), to
    /// evaluate them together or to inspect the work an append left pending.
    pub fn arrays(&self) -> Vec<&Array> {
        match &self.store {
            None => Vec::new(),
            Some(Store::Dense(d)) => vec![&d.keys, &d.values],
            Some(Store::Compressed(c)) => c
                .keys
                .arrays()
                .chain(c.values.arrays())
                .chain(c.k_mean.as_ref())
                .chain(c.k_offset.as_ref())
                .chain([&c.decode_counters])
                .collect(),
        }
    }

    /// Bytes of the arrays this layer holds (capacity, not only the used part).
    pub fn nbytes(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Dense(d)) => d.keys.nbytes() + d.values.nbytes(),
            Some(Store::Compressed(c)) => {
                c.keys.nbytes()
                    + c.values.nbytes()
                    + c.k_mean.as_ref().map_or(0, Array::nbytes)
                    + c.k_offset.as_ref().map_or(0, Array::nbytes)
                    + c.decode_counters.nbytes()
            }
        }
    }

    /// Bytes of the data this layer stores for the tokens it holds: the
    /// codes and side data of its compressed tokens, its float16 window rows
    /// and the keys' mean (or the dense control's tokens). What
    /// [`nbytes`](Self::nbytes) holds beyond it is allocated capacity and the
    /// keys' offset derived from the mean.
    pub fn data_nbytes(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Dense(d)) if d.capacity > 0 => (d.keys.nbytes() + d.values.nbytes()) / d.capacity * d.len,
            Some(Store::Dense(_)) => 0,
            Some(Store::Compressed(c)) => {
                let window = c.n_sink + c.n_recent;
                c.keys.data_nbytes(c.len, window)
                    + c.values.data_nbytes(c.len, window)
                    + c.k_mean.as_ref().map_or(0, Array::nbytes)
            }
        }
    }

    /// Bytes of the rotation and codebooks, which every layer of the process
    /// with the same head size, seed, methods, bits, dtype and device holds
    /// once (the same arrays: see [`shared_id`](Self::shared_id)); count them
    /// once per model, as [`total_nbytes`] does.
    pub fn shared_nbytes(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.arrays().map(Array::nbytes).sum())
    }

    /// Identifies the shared arrays this layer holds (none before the first
    /// append): layers with the same id hold the very same rotation and
    /// codebooks, whose bytes [`shared_nbytes`](Self::shared_nbytes) gives.
    pub fn shared_id(&self) -> Option<usize> {
        self.shared.as_ref().map(|s| Arc::as_ptr(s) as usize)
    }

    fn check_input(&self, argument: &'static str, a: &Array) -> Result<Vec<i32>> {
        crate::kernels::check_float(argument, a)?;
        let s = a.shape();
        if s.len() != 4 || s[1] as usize != self.cfg.kv_heads || s[3] as usize != self.cfg.head_dim {
            return Err(Error::invalid(
                argument,
                format!("shape {s:?}, expected [batch, {}, tokens, {}]", self.cfg.kv_heads, self.cfg.head_dim),
            ));
        }
        if self.store.is_some() {
            if s[0] as usize != self.batch {
                return Err(Error::invalid(argument, format!("batch {} but the cache holds batch {}", s[0], self.batch)));
            }
            if a.dtype() != self.dtype {
                return Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: format!("{} (the cache's dtype)", self.dtype) });
            }
        }
        Ok(s)
    }

    /// Checks a chunk of keys and values `[B, Hkv, T, D]`; returns its shape.
    fn check_pair(&self, keys: &Array, values: &Array) -> Result<Vec<i32>> {
        let ks = self.check_input("keys", keys)?;
        let vs = self.check_input("values", values)?;
        if ks != vs || keys.dtype() != values.dtype() {
            return Err(Error::invalid("values", format!("shape {vs:?} / {} must match keys {ks:?} / {}", values.dtype(), keys.dtype())));
        }
        Ok(ks)
    }

    fn table(&self, sc: &SideCodec) -> Result<Option<Array>> {
        codec_table(sc, self.cfg.head_dim, self.cfg.seed)?.map(|t| Array::from_slice(&t, &[t.len() as i32])).transpose()
    }

    /// Creates the empty stores for `batch` and `dtype`, sized for a first
    /// chunk of `tokens` (they grow as tokens come).
    fn init(&mut self, batch: usize, dtype: Dtype, tokens: usize) -> Result<()> {
        let s = &self.stream()?;
        let (b, h, d) = (batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        self.batch = batch;
        self.dtype = dtype;
        if !self.cfg.compressed() {
            let cap = store_capacity(0, tokens.max(1));
            self.store = Some(Store::Dense(Dense {
                keys: ops::zeros(&[b, h, cap as i32, d], dtype, s)?,
                values: ops::zeros(&[b, h, cap as i32, d], dtype, s)?,
                len: 0,
                capacity: cap,
            }));
            return Ok(());
        }
        let (kc, vc) = (self.cfg.key_codec(), self.cfg.value_codec());
        let key = SharedKey {
            dim: self.cfg.head_dim,
            seed: self.cfg.seed,
            key: (kc.codec, kc.bits, kc.group),
            value: (vc.codec, vc.bits, vc.group),
            dtype,
            device: self.device,
        };
        self.shared = Some(shared_for(key, || {
            let (rotation, rotation_t) = if kc.codec.rotated() || vc.codec.rotated() {
                let dim = self.cfg.head_dim;
                let rot = rotation_matrix(dim, self.cfg.seed)?;
                let f = frame_scale(dim);
                // Powers of two: exact in float32.
                let scaled: Vec<f32> = rot.iter().map(|v| v * f).collect();
                let inverse: Vec<f32> = (0..dim * dim).map(|i| rot[(i % dim) * dim + i / dim] / f).collect();
                (Some(Array::from_slice(&scaled, &[d, d])?), Some(ops::astype(&Array::from_slice(&inverse, &[d, d])?, dtype, s)?))
            } else {
                (None, None)
            };
            let key_frame = if kc.codec.rotated() {
                None
            } else {
                let dim = self.cfg.head_dim;
                let f = frame_scale(dim);
                let diag: Vec<f32> = (0..dim * dim).map(|i| if i % (dim + 1) == 0 { 1.0 / f } else { 0.0 }).collect();
                Some(ops::astype(&Array::from_slice(&diag, &[d, d])?, dtype, s)?)
            };
            Ok(Shared { rotation, rotation_t, key_frame, k_table: self.table(&kc)?, v_table: self.table(&vc)? })
        })?);
        // No compressed token yet: one slot (the kernels take no empty
        // array), grown at the first flush. The windows hold what the first
        // chunk puts in them.
        let cap = 1;
        let wslots = tokens.clamp(1, self.cfg.window_capacity());
        let wcap = wslots as i32;
        let side = |codec: SideCodec| -> Result<Side> {
            let codes_dtype = if codec.codec == Codec::Dense { dtype } else { Dtype::U8 };
            let mut side = Side {
                codec,
                codes: ops::zeros(&[b, h, cap as i32, codec.row_len(d as usize) as i32], codes_dtype, s)?,
                scales: None,
                zeros: None,
                window: ops::zeros(&[b, h, wcap, d], dtype, s)?,
            };
            if codec.param_cols(d as usize) > 0 {
                let shape = side.param_shape(b, h, codec.param_rows(cap), d as usize);
                side.scales = Some(ops::zeros(&shape, Dtype::F16, s)?);
                if codec.has_zeros() {
                    side.zeros = Some(ops::zeros(&shape, Dtype::F16, s)?);
                }
            }
            Ok(side)
        };
        self.store = Some(Store::Compressed(Compressed {
            k_mean: None,
            k_offset: None,
            keys: side(kc)?,
            values: side(vc)?,
            capacity: cap,
            window_slots: wslots,
            len: 0,
            n_sink: 0,
            n_recent: 0,
            decode_counters: kernels::turboquant::decode_counters(batch, self.cfg.kv_heads)?,
        }));
        Ok(())
    }

    /// Appends `keys` and `values` `[B, Hkv, T, D]` (a prefill chunk or one token).
    pub fn append(&mut self, keys: &Array, values: &Array) -> Result<()> {
        let ks = self.check_pair(keys, values)?;
        let t = ks[2] as usize;
        if self.store.is_none() {
            self.init(ks[0] as usize, keys.dtype(), t)?;
        }
        if t == 0 {
            return Ok(());
        }
        let shape = ks;
        if matches!(self.store, Some(Store::Dense(_))) {
            return self.append_dense(keys, values, &shape);
        }
        self.append_compressed(keys, values, &shape)
    }

    fn append_dense(&mut self, keys: &Array, values: &Array, shape: &[i32]) -> Result<()> {
        let s = self.stream()?;
        let Some(Store::Dense(d)) = &mut self.store else { unreachable!() };
        let t = shape[2] as usize;
        grow(&mut [&mut d.keys, &mut d.values], &mut d.capacity, d.len + t, &s)?;
        let (b, h, dim) = (shape[0], shape[1], shape[3]);
        let (lo, hi) = (d.len as i32, (d.len + t) as i32);
        d.keys = ops::slice_update(&d.keys, keys, &[0, 0, lo, 0], &[b, h, hi, dim], &s)?;
        d.values = ops::slice_update(&d.values, values, &[0, 0, lo, 0], &[b, h, hi, dim], &s)?;
        d.len += t;
        Ok(())
    }

    fn append_compressed(&mut self, keys: &Array, values: &Array, shape: &[i32]) -> Result<()> {
        let s = self.stream()?;
        let opts = self.opts(&s);
        let (sinks, window) = (self.cfg.sinks, self.cfg.window);
        let dtype = self.dtype;
        // A trim may have cut into a token group of the compressed store: the
        // group's kept tokens are decoded and compressed again with the next
        // flush, so that groups stay aligned.
        let reopened = self.reopened_tokens()?;
        let shared = self.shared.as_ref().expect("initialised with the store");
        let Some(Store::Compressed(c)) = &mut self.store else { unreachable!() };
        let (b, h, t, d) = (shape[0], shape[1], shape[2] as usize, shape[3]);
        if c.k_mean.is_none() {
            // Over the finite entries only (a NaN or an infinity counts as 0),
            // so that a non-finite key shifts no other key.
            let kf = ops::astype(keys, Dtype::F32, &s)?;
            let zero = Array::scalar_f32(0.0)?;
            let bad = ops::astype(&ops::multiply(&kf, &zero, &s)?, Dtype::Bool, &s)?;
            let kf = ops::where_(&bad, &zero, &kf, &s)?;
            let sum = ops::sum_axis(&kf, 2, true, &s)?;
            c.k_mean = Some(ops::divide(&sum, &Array::scalar_f32(t as f32)?, &s)?);
        }
        let key_rotated = c.keys.codec.codec.rotated();
        if c.k_offset.is_none() {
            let mean = c.k_mean.as_ref().expect("set above");
            c.k_offset = Some(key_offset(mean, shared.rotation.as_ref().filter(|_| key_rotated), dtype, &s)?);
        }
        let max_slots = self.cfg.window_capacity();
        let held = c.n_sink + c.len + c.n_recent + t;
        if c.n_sink >= sinks && reopened.is_none() && c.n_recent + t <= self.cfg.recent_capacity()
            && keys.dtype() == dtype && values.dtype() == dtype
        {
            // A decode step: the tokens go into the windows, in one operation.
            c.reserve_window(sinks + c.n_recent + t, held, max_slots, &s)?;
            let (win_k, win_v) = window::window_append(
                &WindowAppend {
                    keys,
                    values,
                    key_frame: key_frame(shared, c),
                    key_offset: c.k_offset.as_ref(),
                    value_frame: value_frame(shared, c),
                    win_k: &c.keys.window,
                    win_v: &c.values.window,
                    at: sinks + c.n_recent,
                },
                &opts,
            )?;
            c.keys.window = win_k;
            c.values.window = win_v;
            c.n_recent += t;
            return Ok(());
        }
        let (rk, rv) = into_frames(shared, c, keys, values, &s)?;
        let mut start = 0usize;
        if c.n_sink < sinks {
            let take = (sinks - c.n_sink).min(t);
            c.reserve_window(c.n_sink + take, held, max_slots, &s)?;
            let (lo, hi) = (c.n_sink as i32, (c.n_sink + take) as i32);
            for (side, x) in [(&mut c.keys, &rk), (&mut c.values, &rv)] {
                let part = ops::slice(x, &[0, 0, 0, 0], &[b, h, take as i32, d], &s)?;
                side.window = ops::slice_update(&side.window, &part, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
            }
            c.n_sink += take;
            start = take;
        }
        let rest = t - start;
        if rest == 0 {
            return Ok(());
        }
        let new_k = ops::slice(&rk, &[0, 0, start as i32, 0], &[b, h, t as i32, d], &s)?;
        let new_v = ops::slice(&rv, &[0, 0, start as i32, 0], &[b, h, t as i32, d], &s)?;
        let w0 = sinks as i32;
        if c.n_recent + rest <= self.cfg.recent_capacity() {
            c.reserve_window(sinks + c.n_recent + rest, held, max_slots, &s)?;
            let (lo, hi) = (w0 + c.n_recent as i32, w0 + (c.n_recent + rest) as i32);
            for (side, x) in [(&mut c.keys, &new_k), (&mut c.values, &new_v)] {
                side.window = ops::slice_update(&side.window, x, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
            }
            c.n_recent += rest;
            return Ok(());
        }
        // Compress the oldest pending tokens in one batch, a whole number of
        // token groups starting on a group boundary; keep the newest (at
        // least `window`) in float16.
        let group = c.token_group();
        let reopen = reopened.as_ref().map_or(0, |(k, _)| k.shape()[2] as usize);
        let first = c.len - reopen;
        let pending = reopen + c.n_recent + rest;
        let m = (pending - window) / group * group;
        let gather = |side: &Side, new: &Array, reopened: Option<&Array>| -> Result<Array> {
            let mut parts = Vec::new();
            if let Some(r) = reopened {
                parts.push(ops::astype(r, dtype, &s)?);
            }
            if c.n_recent > 0 {
                parts.push(ops::slice(&side.window, &[0, 0, w0, 0], &[b, h, w0 + c.n_recent as i32, d], &s)?);
            }
            parts.push(new.clone());
            ops::concatenate(&parts, 2, &s)
        };
        let pk = gather(&c.keys, &new_k, reopened.as_ref().map(|r| &r.0))?;
        let pv = gather(&c.values, &new_v, reopened.as_ref().map(|r| &r.1))?;
        let pend = pending as i32;
        let split = |p: &Array| -> Result<(Array, Array)> {
            Ok((
                ops::slice(p, &[0, 0, 0, 0], &[b, h, m as i32, d], &s)?,
                ops::slice(p, &[0, 0, m as i32, 0], &[b, h, pend, d], &s)?,
            ))
        };
        let (ck, keep_k) = split(&pk)?;
        let (cv, keep_v) = split(&pv)?;
        let ek = c.keys.encode(&ck, shared.k_table.as_ref(), dtype, &opts)?;
        let ev = c.values.encode(&cv, shared.v_table.as_ref(), dtype, &opts)?;
        let needed = first + m;
        if needed > c.capacity {
            let cap = store_capacity(c.capacity, needed);
            c.keys.grow(cap, &s)?;
            c.values.grow(cap, &s)?;
            c.capacity = cap;
        }
        c.keys.write(ek, first, &s)?;
        c.values.write(ev, first, &s)?;
        c.reserve_window(sinks + pending - m, held, max_slots, &s)?;
        let keep = (pending - m) as i32;
        for (side, x) in [(&mut c.keys, &keep_k), (&mut c.values, &keep_v)] {
            side.window = ops::slice_update(&side.window, x, &[0, 0, w0, 0], &[b, h, w0 + keep, d], &s)?;
        }
        c.len = needed;
        c.n_recent = pending - m;
        Ok(())
    }

    /// The compressed tokens after the last whole token group, decoded into
    /// each side's frame (float32), when a trim left a partial group.
    fn reopened_tokens(&self) -> Result<Option<(Array, Array)>> {
        let Some(Store::Compressed(c)) = &self.store else { return Ok(None) };
        let partial = c.len % c.token_group();
        if partial == 0 {
            return Ok(None);
        }
        let layer = self.kv_layer(self.cfg.kv_heads, 1, false)?;
        let s = &self.stream()?;
        let sh = &layer.shape;
        let (b, h, d) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        let tail = |side: &KvSideArrays<'_>, sc: &SideCodec| -> Result<Array> {
            let all = kv_attention::decode_compressed(side, sc, sh, s)?;
            ops::slice(&all, &[0, 0, (c.len - partial) as i32, 0], &[b, h, c.len as i32, d], s)
        };
        Ok(Some((tail(&layer.keys, &sh.key)?, tail(&layer.values, &sh.value)?)))
    }

    /// Attention of `queries` `[B, Hq, L, D]` over the cache. With `causal`,
    /// query `l` sits at position `offset - L + l` and sees tokens up to it.
    pub fn attention(&self, queries: &Array, scale: f32, causal: bool) -> Result<Array> {
        self.attention_with_mask(queries, scale, if causal { AttentionMask::Causal } else { AttentionMask::None })
    }

    /// `queries`' shape `qs` is `[batch, heads, queries, head_dim]` with
    /// heads a multiple of the cache's KV heads.
    fn check_query_heads(&self, qs: &[i32]) -> Result<()> {
        if qs.len() != 4 || qs[3] as usize != self.cfg.head_dim {
            return Err(Error::invalid("queries", format!("shape {qs:?}, expected [batch, heads, queries, {}]", self.cfg.head_dim)));
        }
        let hq = qs[1] as usize;
        if hq % self.cfg.kv_heads != 0 {
            return Err(Error::invalid("queries", format!("{hq} heads are not a multiple of the cache's {} KV heads", self.cfg.kv_heads)));
        }
        Ok(())
    }

    /// Attention of `queries` `[B, Hq, L, D]` over the cache under `mask`.
    pub fn attention_with_mask(&self, queries: &Array, scale: f32, mask: AttentionMask<'_>) -> Result<Array> {
        let causal = matches!(mask, AttentionMask::Causal);
        let qs = queries.shape();
        self.check_query_heads(&qs)?;
        let Some(store) = &self.store else {
            return Err(Error::invalid("queries", "the cache is empty: append keys and values first"));
        };
        if qs[0] as usize != self.batch {
            return Err(Error::invalid("queries", format!("batch {} but the cache holds batch {}", qs[0], self.batch)));
        }
        if causal && qs[2] as usize > self.offset() {
            return Err(Error::invalid("queries", format!("{} causal queries but only {} tokens are cached", qs[2], self.offset())));
        }
        let s = &self.stream()?;
        let (hq, l) = (qs[1] as usize, qs[2] as usize);
        // Unrotated compressed keys are held as `k/F`.
        let scale = match store {
            Store::Compressed(c) if !c.keys.codec.codec.rotated() => scale * frame_scale(self.cfg.head_dim),
            _ => scale,
        };
        let prepared = match mask {
            AttentionMask::Array(m) => Some(kv_attention::prepare_mask(m, self.batch, hq, l, self.offset(), s)?),
            _ => None,
        };
        match store {
            Store::Dense(d) => {
                if queries.dtype() != self.dtype {
                    return Err(Error::Dtype { argument: "queries", found: queries.dtype().to_string(), expected: self.dtype.to_string() });
                }
                let (b, h, dim) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
                let k = ops::slice(&d.keys, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?;
                let v = ops::slice(&d.values, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?;
                sdpa(queries, &k, &v, scale, prepared.as_ref().map(|(m, _)| m), causal, s)
            }
            Store::Compressed(_) if prepared.is_some() => {
                // Only the generic kernel reads a mask.
                let (m, heads) = prepared.as_ref().expect("matched");
                let mut layer = self.kv_layer(hq, l, false)?;
                layer.shape.mask_heads = *heads;
                layer.mask = Some(m);
                kv_attention::kv_attention(queries, &layer, scale, &self.opts(s))
            }
            Store::Compressed(_) if Self::turboquant_only(&self.cfg) => {
                let layer = self.tq_layer(qs[1] as usize, qs[2] as usize, causal)?;
                turboquant::tq_attention(queries, &layer, scale, &self.opts(s))
            }
            Store::Compressed(_) => {
                let layer = self.kv_layer(qs[1] as usize, qs[2] as usize, causal)?;
                kv_attention::kv_attention(queries, &layer, scale, &self.opts(s))
            }
        }
    }

    /// Decode attention of a batch whose sequences each have their own
    /// cache: `queries` `[B, Hq, 1, D]`, row `b` over `caches[b]` (batch 1
    /// each, any lengths), `[B, Hq, 1, D]` out. Caches on the CPU holding
    /// TurboQuant-MSE codes with one configuration attend as one operation
    /// ([`turboquant::tq_attention_each`]); any other set sequence by
    /// sequence, concatenated.
    pub fn attention_each(caches: &[&LayerCache], queries: &Array, scale: f32) -> Result<Array> {
        let Some(first) = caches.first() else {
            return Err(Error::invalid("caches", "no cache given"));
        };
        let qs = queries.shape();
        if qs.len() != 4 || qs[0] as usize != caches.len() || qs[2] != 1 {
            return Err(Error::invalid(
                "queries",
                format!("shape {qs:?}, expected [{}, heads, 1, head_dim]: one decode query per cache", caches.len()),
            ));
        }
        let s = &first.stream()?;
        let fused = s.backend()? == crate::stream::Backend::Cpu
            && caches.iter().all(|c| {
                c.batch == 1
                    && c.cfg == first.cfg
                    && c.device == first.device
                    && Self::turboquant_only(&c.cfg)
                    && matches!(c.store, Some(Store::Compressed(_)))
            });
        if fused {
            // The per-sequence path checks in `attention`; this one here.
            first.check_query_heads(&qs)?;
            let layers = caches.iter().map(|c| c.tq_layer(qs[1] as usize, 1, false)).collect::<Result<Vec<_>>>()?;
            return turboquant::tq_attention_each(queries, &layers, scale, s);
        }
        let (hq, d) = (qs[1], qs[3]);
        let outs = caches
            .iter()
            .enumerate()
            .map(|(b, c)| {
                let q = ops::slice(queries, &[b as i32, 0, 0, 0], &[b as i32 + 1, hq, 1, d], s)?;
                c.attention(&q, scale, false)
            })
            .collect::<Result<Vec<_>>>()?;
        ops::concatenate(&outs, 0, s)
    }

    /// The cache's keys and values followed by a chunk `keys`/`values`
    /// `[B, Hkv, T, D]` about to be appended, `[B, Hkv, offset + T, D]` in
    /// each side's attention frame (rotated for the rotating codecs, keys less
    /// their channel mean) and the cache's dtype: a transient buffer that
    /// [`attend_framed`](Self::attend_framed) reads with MLX's SDPA, so that a
    /// prefill chunk attends at float16 speed, its own tokens exactly. Call
    /// it before appending the chunk.
    pub fn framed_with(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let shape = self.check_pair(keys, values)?;
        if self.store.is_none() {
            self.init(shape[0] as usize, keys.dtype(), shape[2] as usize)?;
        }
        let s = self.stream()?;
        let (b, h, d) = (shape[0], shape[1], shape[3]);
        let join = |mut parts: Vec<Array>, chunk: &Array| -> Result<Array> {
            if parts.is_empty() {
                return Ok(chunk.clone());
            }
            parts.push(chunk.clone());
            ops::concatenate(&parts, 2, &s)
        };
        match self.store.as_ref().expect("initialised above") {
            Store::Dense(x) => {
                let held = |a: &Array| -> Result<Vec<Array>> {
                    Ok(if x.len == 0 { Vec::new() } else { vec![ops::slice(a, &[0, 0, 0, 0], &[b, h, x.len as i32, d], &s)?] })
                };
                Ok((join(held(&x.keys)?, keys)?, join(held(&x.values)?, values)?))
            }
            Store::Compressed(c) => {
                let shared = self.shared.as_ref().expect("initialised with the store");
                let (rk, rv) = into_frames(shared, c, keys, values, &s)?;
                let layer = self.kv_layer(self.cfg.kv_heads, 1, false)?;
                let opts = self.opts(&s);
                let sh = &layer.shape;
                let framed_k = kv_attention::framed_parts(&layer.keys, &sh.key, sh, self.dtype, &opts)?;
                let framed_v = kv_attention::framed_parts(&layer.values, &sh.value, sh, self.dtype, &opts)?;
                Ok((join(framed_k, &rk)?, join(framed_v, &rv)?))
            }
        }
    }

    /// Attention of `queries` `[B, Hq, L, D]` over `keys`/`values` from
    /// [`framed_with`](Self::framed_with), with MLX's SDPA: the queries enter
    /// the keys' frame and the output leaves the values' frame, one matmul of
    /// `L` rows each. Query `l` sits at position `total - L + l` (`Causal`).
    pub fn attend_framed(&self, queries: &Array, keys: &Array, values: &Array, scale: f32, mask: AttentionMask<'_>) -> Result<Array> {
        let qs = queries.shape();
        let ks = keys.shape();
        if qs.len() != 4 || qs[0] as usize != self.batch || qs[3] as usize != self.cfg.head_dim || qs[1] as usize % self.cfg.kv_heads != 0 {
            return Err(Error::invalid(
                "queries",
                format!("shape {qs:?}, expected [{}, a multiple of {} heads, queries, {}]", self.batch, self.cfg.kv_heads, self.cfg.head_dim),
            ));
        }
        if queries.dtype() != self.dtype {
            return Err(Error::Dtype { argument: "queries", found: queries.dtype().to_string(), expected: format!("{} (the cache's dtype)", self.dtype) });
        }
        if ks.len() != 4 || ks != values.shape() || ks[0] != qs[0] || ks[1] as usize != self.cfg.kv_heads || ks[3] != qs[3] || ks[2] < qs[2] {
            return Err(Error::invalid("keys", format!("shape {ks:?} (values {:?}) is not the buffer framed_with returns for {} queries", values.shape(), qs[2])));
        }
        let s = &self.stream()?;
        let (compressed, key_rotated, value_rotated) = match &self.store {
            Some(Store::Compressed(c)) => (true, c.keys.codec.codec.rotated(), c.values.codec.codec.rotated()),
            _ => (false, false, false),
        };
        // A compressed layer's buffer holds keys as `k·Πᵀ/F` or `k/F`, and
        // rotated values as `v·Πᵀ/F`: a query entering the rotated key frame
        // the same way gets its scores back with `scale·F²` (unrotated keys:
        // `scale·F`), and the output leaves the value frame as `out·Π·F`.
        let rotation_t = self.shared.as_ref().and_then(|x| x.rotation_t.as_ref());
        let f = frame_scale(self.cfg.head_dim);
        let q = match rotation_t.filter(|_| key_rotated) {
            Some(r) => ops::matmul(queries, r, s)?,
            None => queries.clone(),
        };
        let scale = match (compressed, key_rotated) {
            (true, true) => scale * f * f,
            (true, false) => scale * f,
            _ => scale,
        };
        let prepared = match mask {
            AttentionMask::Array(m) => Some(kv_attention::prepare_mask(m, self.batch, qs[1] as usize, qs[2] as usize, ks[2] as usize, s)?.0),
            _ => None,
        };
        let out = sdpa(&q, keys, values, scale, prepared.as_ref(), matches!(mask, AttentionMask::Causal), s)?;
        match rotation_t.filter(|_| value_rotated) {
            Some(r) => {
                let back = ops::matmul(&out, &ops::transpose(r, &[1, 0], s)?, s)?;
                ops::multiply(&back, &ops::astype(&Array::scalar_f32(f * f)?, self.dtype, s)?, s)
            }
            None => Ok(out),
        }
    }

    fn tq_layer(&self, q_heads: usize, queries: usize, causal: bool) -> Result<TqLayer<'_>> {
        let Some(Store::Compressed(c)) = &self.store else {
            return Err(Error::invalid("method", "not a compressed cache"));
        };
        let sh = self.shared.as_ref().expect("initialised");
        let rot = sh.rotation.as_ref().expect("TurboQuant rotates");
        fn norms(side: &Side) -> &Array {
            side.scales.as_ref().expect("TurboQuant has norms")
        }
        fn table(t: &Option<Array>) -> &Array {
            t.as_ref().expect("TurboQuant has centroids")
        }
        Ok(TqLayer {
            shape: AttentionShape {
                batch: self.batch,
                q_heads,
                kv_heads: self.cfg.kv_heads,
                queries,
                dim: self.cfg.head_dim,
                key_bits: self.cfg.key_bits,
                value_bits: self.cfg.value_bits,
                sinks: c.n_sink,
                compressed: c.len,
                recent: c.n_recent,
                capacity: c.capacity,
                window_capacity: c.window_slots,
                causal,
            },
            rot_k: rot,
            rot_v: rot,
            k_codes: &c.keys.codes,
            k_norms: norms(&c.keys),
            k_centroids: table(&sh.k_table),
            v_codes: &c.values.codes,
            v_norms: norms(&c.values),
            v_centroids: table(&sh.v_table),
            win_k: &c.keys.window,
            win_v: &c.values.window,
            counters: &c.decode_counters,
        })
    }

    fn kv_layer(&self, q_heads: usize, queries: usize, causal: bool) -> Result<KvLayer<'_>> {
        let Some(Store::Compressed(c)) = &self.store else {
            return Err(Error::invalid("method", "not a compressed cache"));
        };
        let sh = self.shared.as_ref().expect("initialised");
        let key = c.keys.codec;
        Ok(KvLayer {
            shape: KvShape {
                batch: self.batch,
                q_heads,
                kv_heads: self.cfg.kv_heads,
                queries,
                dim: self.cfg.head_dim,
                key,
                value: c.values.codec,
                query_features: kv_attention::query_features(self.cfg.head_dim, &key),
                sinks: c.n_sink,
                compressed: c.len,
                recent: c.n_recent,
                capacity: c.capacity,
                window_capacity: c.window_slots,
                causal,
                mask_heads: 0,
            },
            rotation: sh.rotation.as_ref(),
            keys: c.keys.arrays_for_kernel(sh.k_table.as_ref()),
            values: c.values.arrays_for_kernel(sh.v_table.as_ref()),
            mask: None,
        })
    }

    /// The keys and values as the cache reconstructs them, `[B, Hkv, offset, D]`
    /// in the cache's dtype (for tests and the reference path).
    pub fn dequantize(&self) -> Result<(Array, Array)> {
        let s = &self.stream()?;
        let (b, h, dim) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        match &self.store {
            None => Err(Error::invalid("cache", "empty")),
            Some(Store::Dense(d)) => Ok((
                ops::slice(&d.keys, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?,
                ops::slice(&d.values, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?,
            )),
            Some(Store::Compressed(c)) => {
                let layer = self.kv_layer(self.cfg.kv_heads, 1, false)?;
                let mut keys = kv_attention::decode(&layer, false, s)?;
                if !c.keys.codec.codec.rotated() {
                    // Held as `k/F` (the rotation's `F·Π` undoes rotated ones).
                    keys = ops::multiply(&keys, &Array::scalar_f32(frame_scale(self.cfg.head_dim))?, s)?;
                }
                if let Some(mean) = &c.k_mean {
                    keys = ops::add(&keys, mean, s)?;
                }
                let values = kv_attention::decode(&layer, true, s)?;
                Ok((self.decoded_out(&keys)?, self.decoded_out(&values)?))
            }
        }
    }

    /// Decoded float32 tokens in the cache's dtype. Float16 saturates what
    /// the codes' rounding put past its range (±65504) instead of making it
    /// infinite, and keeps a non-finite token non-finite (NaN).
    fn decoded_out(&self, x: &Array) -> Result<Array> {
        let s = &self.stream()?;
        if self.dtype != Dtype::F16 {
            return ops::astype(x, self.dtype, s);
        }
        let max = crate::cpu::turboquant::MAX_NORM;
        let clipped = ops::minimum(&ops::maximum(x, &Array::scalar_f32(-max)?, s)?, &Array::scalar_f32(max)?, s)?;
        // + x * 0: NaN where x is NaN or infinite (min and max keep NaN but
        // would make an infinity finite), 0 elsewhere.
        let kept = ops::add(&clipped, &ops::multiply(x, &Array::scalar_f32(0.0)?, s)?, s)?;
        ops::astype(&kept, self.dtype, s)
    }

    /// Drops the last `n` tokens (speculative-decoding rollback, prompt
    /// reuse); returns how many were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset());
        match &mut self.store {
            None => {}
            Some(Store::Dense(d)) => d.len -= n,
            Some(Store::Compressed(c)) => {
                let mut left = n;
                for part in [&mut c.n_recent, &mut c.len, &mut c.n_sink] {
                    let k = left.min(*part);
                    *part -= k;
                    left -= k;
                }
            }
        }
        n
    }

    /// The compressed state as bytes (safetensors; only the used slots).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        state_io::save(self)
    }

    /// A cache rebuilt from [`to_bytes`](Self::to_bytes) on `stream`.
    pub fn from_bytes(bytes: &[u8], stream: Option<Stream>) -> Result<Self> {
        state_io::load(bytes, stream)
    }

    /// The state [`to_bytes`](Self::to_bytes) writes, as named arrays (lazy
    /// views of the used slots: evaluating them copies nothing to the host)
    /// and string metadata.
    pub fn state_parts(&self) -> Result<(Vec<(String, Array)>, BTreeMap<String, String>)> {
        state_io::parts(self)
    }

    /// A cache rebuilt from [`state_parts`](Self::state_parts) on `stream`.
    pub fn from_state_parts(tensors: &HashMap<String, Array>, meta: &HashMap<String, String>, stream: Option<Stream>) -> Result<Self> {
        state_io::from_parts(tensors, meta, stream)
    }
}

/// Bytes the caches hold together: every layer's [`nbytes`](LayerCache::nbytes)
/// and each distinct set of shared arrays (rotation, codebooks) once.
pub fn total_nbytes<'a>(layers: impl IntoIterator<Item = &'a LayerCache>) -> usize {
    let mut seen = std::collections::HashSet::new();
    layers
        .into_iter()
        .map(|l| l.nbytes() + l.shared_id().filter(|id| seen.insert(*id)).map_or(0, |_| l.shared_nbytes()))
        .sum()
}

/// Grows the token axis (2) of `arrays` to at least `needed` slots
/// (`store_capacity`).
fn grow(arrays: &mut [&mut Array], capacity: &mut usize, needed: usize, s: &Stream) -> Result<()> {
    if needed <= *capacity {
        return Ok(());
    }
    let cap = store_capacity(*capacity, needed);
    for a in arrays.iter_mut() {
        extend_slots(a, cap, s)?;
    }
    *capacity = cap;
    Ok(())
}

/// Appends zero slots to the token axis (2) of `a` up to `slots`.
fn extend_slots(a: &mut Array, slots: usize, s: &Stream) -> Result<()> {
    let mut shape = a.shape();
    let extra = slots.saturating_sub(shape[2] as usize);
    if extra > 0 {
        shape[2] = extra as i32;
        *a = ops::concatenate(&[a.clone(), ops::zeros(&shape, a.dtype(), s)?], 2, s)?;
    }
    Ok(())
}

mod state_io {
    //! The versioned byte form of a layer cache.
    use safetensors::tensor::Dtype as StDtype;
    use safetensors::SafeTensors;

    use super::*;

    fn st_name(d: Dtype) -> &'static str {
        match d {
            Dtype::U8 => "U8",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            _ => "F32",
        }
    }

    fn corrupt(msg: impl Into<String>) -> Error {
        Error::invalid("state", msg)
    }

    /// The first `rows` rows (axis 2) of `a`.
    fn head_rows(a: &Array, rows: usize, s: &Stream) -> Result<Array> {
        let mut stop = a.shape();
        stop[2] = rows as i32;
        ops::slice(a, &vec![0; stop.len()], &stop, s)
    }

    /// The state tensors of one side: its used codes, scales and zeros.
    fn side_tensors(side: &Side, prefix: &str, len: usize, s: &Stream) -> Result<Vec<(String, Array)>> {
        let mut out = vec![(format!("{prefix}_codes"), head_rows(&side.codes, len, s)?)];
        let rows = side.codec.param_rows(len);
        if let Some(a) = &side.scales {
            out.push((format!("{prefix}_{}", side.scales_name()), head_rows(a, rows, s)?));
        }
        if let Some(a) = &side.zeros {
            out.push((format!("{prefix}_zeros"), head_rows(a, rows, s)?));
        }
        Ok(out)
    }

    /// The state as named arrays (lazy views of the used slots, nothing
    /// copied to the host) and string metadata.
    pub(super) fn parts(cache: &LayerCache) -> Result<(Vec<(String, Array)>, BTreeMap<String, String>)> {
        let c = &cache.cfg;
        let mut meta: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in [
            ("format", STATE_FORMAT.to_string()),
            ("version", STATE_VERSION.to_string()),
            ("head_dim", c.head_dim.to_string()),
            ("kv_heads", c.kv_heads.to_string()),
            ("key_method", c.key_method.to_string()),
            ("key_bits", c.key_bits.to_string()),
            ("value_method", c.value_method.to_string()),
            ("value_bits", c.value_bits.to_string()),
            ("window", c.window.to_string()),
            ("sinks", c.sinks.to_string()),
            ("key_group", c.key_group.to_string()),
            ("seed", c.seed.to_string()),
            ("batch", cache.batch.to_string()),
            ("dtype", cache.dtype.to_string()),
        ] {
            meta.insert(k.to_string(), v);
        }
        let s = &cache.stream()?;
        let (b, h, d) = (cache.batch as i32, c.kv_heads as i32, c.head_dim as i32);
        let mut tensors: Vec<(String, Array)> = Vec::new();
        match &cache.store {
            None => {}
            Some(Store::Dense(x)) => {
                let n = x.len as i32;
                tensors.push(("keys".into(), ops::slice(&x.keys, &[0, 0, 0, 0], &[b, h, n, d], s)?));
                tensors.push(("values".into(), ops::slice(&x.values, &[0, 0, 0, 0], &[b, h, n, d], s)?));
            }
            Some(Store::Compressed(x)) => {
                if let Some(mean) = &x.k_mean {
                    tensors.push(("k_mean".into(), mean.clone()));
                }
                tensors.extend(side_tensors(&x.keys, "k", x.len, s)?);
                tensors.extend(side_tensors(&x.values, "v", x.len, s)?);
                // Sinks then recent tokens, as stored.
                let (ns, nr, w0) = (x.n_sink as i32, x.n_recent as i32, c.sinks as i32);
                let take = |w: &Array| -> Result<Array> {
                    let sink = ops::slice(w, &[0, 0, 0, 0], &[b, h, ns, d], s)?;
                    let recent = ops::slice(w, &[0, 0, w0, 0], &[b, h, w0 + nr, d], s)?;
                    ops::concatenate(&[sink, recent], 2, s)
                };
                tensors.push(("win_k".into(), take(&x.keys.window)?));
                tensors.push(("win_v".into(), take(&x.values.window)?));
                meta.insert("n_sink".into(), x.n_sink.to_string());
                meta.insert("n_recent".into(), x.n_recent.to_string());
                meta.insert("compressed".into(), x.len.to_string());
            }
        }
        Ok((tensors, meta))
    }

    /// Metadata key of a tensor's CRC-32 (lowercase hex of its bytes).
    fn crc_key(name: &str) -> String {
        format!("crc32:{name}")
    }

    /// Metadata key of the header's CRC-32.
    const HEADER_CRC: &str = "crc32";

    /// CRC-32 of the header: every metadata entry but this checksum, then
    /// each tensor's name, dtype and shape, in name order.
    fn header_crc<'a>(meta: impl Iterator<Item = (&'a String, &'a String)>, tensors: &mut [(String, &'static str, Vec<usize>)]) -> String {
        let mut meta: Vec<_> = meta.filter(|(k, _)| k.as_str() != HEADER_CRC).collect();
        meta.sort();
        tensors.sort();
        let mut h = crc32fast::Hasher::new();
        for (k, v) in meta {
            h.update(format!("{}={}\n", k.len(), k).as_bytes());
            h.update(format!("{}={}\n", v.len(), v).as_bytes());
        }
        for (name, dtype, shape) in tensors.iter() {
            h.update(format!("{}:{name} {dtype} {shape:?}\n", name.len()).as_bytes());
        }
        format!("{:08x}", h.finalize())
    }

    pub(super) fn save(cache: &LayerCache) -> Result<Vec<u8>> {
        let (tensors, mut meta) = parts(cache)?;
        let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(name, a)| {
                let shape = a.shape().iter().map(|&v| v as usize).collect();
                Ok((name, a.dtype(), shape, a.to_bytes()?))
            })
            .collect::<Result<_>>()?;
        for (name, _, _, bytes) in &data {
            meta.insert(crc_key(name), format!("{:08x}", crc32fast::hash(bytes)));
        }
        let mut layout: Vec<_> = data.iter().map(|(n, dt, shape, _)| (n.clone(), st_name(*dt), shape.clone())).collect();
        let crc = header_crc(meta.iter(), &mut layout);
        meta.insert(HEADER_CRC.to_string(), crc);
        let views: Vec<crate::safetensors_io::TensorBytes<'_>> = data
            .iter()
            .map(|(n, dt, shape, bytes)| crate::safetensors_io::TensorBytes { name: n, dtype: st_name(*dt), shape, data: bytes })
            .collect();
        Ok(crate::safetensors_io::write(&meta, &views))
    }

    fn field<T: std::str::FromStr>(meta: &HashMap<String, String>, key: &str) -> Result<T> {
        let v = meta.get(key).ok_or_else(|| corrupt(format!("missing field {key:?}")))?;
        v.parse().map_err(|_| corrupt(format!("field {key:?}: {v:?} is not a valid value (a non-negative integer)")))
    }

    fn dtype_of(d: StDtype) -> Option<Dtype> {
        match d {
            StDtype::U8 => Some(Dtype::U8),
            StDtype::F16 => Some(Dtype::F16),
            StDtype::BF16 => Some(Dtype::BF16),
            StDtype::F32 => Some(Dtype::F32),
            _ => None,
        }
    }

    /// Reads [`save`]'s bytes: the header's and every tensor's CRC-32 are
    /// checked before anything is built, so a corrupt or truncated state is
    /// refused.
    pub(super) fn load(bytes: &[u8], stream: Option<Stream>) -> Result<LayerCache> {
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
        let meta = header.metadata().clone().ok_or_else(|| corrupt("no metadata"))?;
        check_format(&meta)?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
        let mut layout: Vec<_> = st
            .tensors()
            .iter()
            .map(|(name, t)| Ok((name.clone(), dtype_of(t.dtype()).map(st_name).ok_or_else(|| corrupt(format!("{name}: dtype {:?} is not a cache dtype", t.dtype())))?, t.shape().to_vec())))
            .collect::<Result<_>>()?;
        let want = meta.get(HEADER_CRC).ok_or_else(|| corrupt("no checksum of the header"))?;
        if header_crc(meta.iter(), &mut layout) != *want {
            return Err(corrupt("the header's checksum does not match: the state is corrupt"));
        }
        let mut tensors = HashMap::new();
        for (name, t) in st.tensors() {
            let want = meta.get(&crc_key(&name)).ok_or_else(|| corrupt(format!("{name}: no checksum")))?;
            if format!("{:08x}", crc32fast::hash(t.data())) != *want {
                return Err(corrupt(format!("{name}: the data's checksum does not match: the state is corrupt")));
            }
            let dt = dtype_of(t.dtype()).ok_or_else(|| corrupt(format!("{name}: dtype {:?} is not a cache dtype", t.dtype())))?;
            let shape = t.shape().iter().map(|&v| i32::try_from(v).map_err(|_| corrupt(format!("{name}: shape {:?}", t.shape())))).collect::<Result<Vec<_>>>()?;
            tensors.insert(name, Array::from_bytes(t.data(), &shape, dt)?);
        }
        let checked = meta.keys().filter(|k| k.starts_with("crc32:")).count();
        if checked != tensors.len() {
            return Err(corrupt(format!("{checked} tensor checksums for {} tensors", tensors.len())));
        }
        from_parts(&tensors, &meta, stream)
    }

    fn check_format(meta: &HashMap<String, String>) -> Result<()> {
        match meta.get("format") {
            Some(f) if f == STATE_FORMAT => {}
            Some(f) => return Err(corrupt(format!("format {f:?} is not {STATE_FORMAT:?}: not a layer cache state"))),
            None => return Err(corrupt(format!("no format field (expected {STATE_FORMAT:?}): not a layer cache state"))),
        }
        match meta.get("version") {
            Some(v) if v == STATE_VERSION => {}
            Some(v) => {
                return Err(corrupt(format!(
                    "version {v:?} is not supported: this veloxquant reads version {STATE_VERSION} (states of other \
                     versions are refused; rebuild the cache from its tokens)"
                )))
            }
            None => return Err(corrupt(format!("no version (expected {STATE_VERSION})"))),
        }
        Ok(())
    }

    /// A cache rebuilt from [`parts`]' arrays and metadata (each array's dtype
    /// and shape checked against the metadata).
    pub(super) fn from_parts(tensors: &HashMap<String, Array>, meta: &HashMap<String, String>, stream: Option<Stream>) -> Result<LayerCache> {
        check_format(meta)?;
        let mut cfg = CacheConfig::new(field(&meta, "head_dim")?, field(&meta, "kv_heads")?);
        let method = |key: &str| -> Result<super::super::Method> {
            meta.get(key).ok_or_else(|| corrupt(format!("missing field {key:?}")))?.parse().map_err(|e: Error| corrupt(e.to_string()))
        };
        cfg.key_method = method("key_method")?;
        cfg.value_method = method("value_method")?;
        cfg.key_bits = field(&meta, "key_bits")?;
        cfg.value_bits = field(&meta, "value_bits")?;
        cfg.window = field(&meta, "window")?;
        cfg.sinks = field(&meta, "sinks")?;
        // States written before the key group was a setting held KIVI's 32.
        if meta.contains_key("key_group") {
            cfg.key_group = field(&meta, "key_group")?;
        }
        cfg.seed = field(&meta, "seed")?;
        let mut cache = LayerCache::new(cfg, stream).map_err(|e| corrupt(e.to_string()))?;
        let batch: usize = field(meta, "batch")?;
        if tensors.is_empty() {
            return Ok(cache);
        }
        let dtype = match meta.get("dtype").map(String::as_str) {
            Some("float16") => Dtype::F16,
            Some("bfloat16") => Dtype::BF16,
            Some("float32") => Dtype::F32,
            Some(other) => return Err(corrupt(format!("dtype {other:?} is not one of \"float16\", \"bfloat16\", \"float32\""))),
            None => return Err(corrupt("missing field \"dtype\"")),
        };
        let (b, h, d) = (batch as i32, cache.cfg.kv_heads as i32, cache.cfg.head_dim as i32);
        let tensor = |name: &str, dt: Dtype, shape: &[i32]| -> Result<Array> {
            let t = tensors.get(name).ok_or_else(|| corrupt(format!("{name}: missing")))?;
            if t.dtype() != dt || t.shape() != shape {
                return Err(corrupt(format!("{name}: {} {:?}, expected {dt} {shape:?}", t.dtype(), t.shape())));
            }
            Ok(t.clone())
        };
        cache.init(batch, dtype, 0)?;
        let s = cache.stream()?;
        if !cache.cfg.compressed() {
            let n = tensors.get("keys").ok_or_else(|| corrupt("keys: missing"))?.shape().get(2).copied().unwrap_or(0);
            let k = tensor("keys", dtype, &[b, h, n as i32, d])?;
            let v = tensor("values", dtype, &[b, h, n as i32, d])?;
            cache.append(&k, &v)?;
            return Ok(cache);
        }
        let n: usize = field(&meta, "compressed")?;
        let ns: usize = field(&meta, "n_sink")?;
        let nr: usize = field(&meta, "n_recent")?;
        if ns > cache.cfg.sinks || nr > cache.cfg.recent_capacity() || (ns < cache.cfg.sinks && n + nr > 0) {
            return Err(corrupt(format!("inconsistent counts: {ns} sinks, {n} compressed, {nr} recent")));
        }
        let wk = tensor("win_k", dtype, &[b, h, (ns + nr) as i32, d])?;
        let wv = tensor("win_v", dtype, &[b, h, (ns + nr) as i32, d])?;
        let mean = match tensors.get("k_mean") {
            Some(_) => Some(tensor("k_mean", Dtype::F32, &[b, h, 1, d])?),
            None if n + ns + nr == 0 => None,
            None => return Err(corrupt("k_mean: missing")),
        };
        let key_rotation = cache.shared.as_ref().and_then(|sh| sh.rotation.clone());
        let Some(Store::Compressed(c)) = &mut cache.store else { unreachable!() };
        let rotation = key_rotation.as_ref().filter(|_| c.keys.codec.codec.rotated());
        c.k_offset = mean.as_ref().map(|m| key_offset(m, rotation, dtype, &s)).transpose()?;
        c.k_mean = mean;
        let cap = store_capacity(c.capacity, n);
        c.reserve_window(if nr > 0 { cache.cfg.sinks + nr } else { ns }, n + ns + nr, cache.cfg.window_capacity(), &s)?;
        let w0 = cache.cfg.sinks as i32;
        for (side, prefix, win) in [(&mut c.keys, "k", &wk), (&mut c.values, "v", &wv)] {
            side.grow(cap, &s)?;
            let sc = side.codec;
            let codes_dtype = side.codes.dtype();
            let codes = tensor(&format!("{prefix}_codes"), codes_dtype, &[b, h, n as i32, sc.row_len(d as usize) as i32])?;
            let params_shape = side.param_shape(b, h, sc.param_rows(n), d as usize);
            let scales = match side.scales {
                Some(_) => Some(tensor(&format!("{prefix}_{}", side.scales_name()), Dtype::F16, &params_shape)?),
                None => None,
            };
            let zeros = match side.zeros {
                Some(_) => Some(tensor(&format!("{prefix}_zeros"), Dtype::F16, &params_shape)?),
                None => None,
            };
            side.write(Encoded { codes, scales, zeros }, 0, &s)?;
            let sink = ops::slice(win, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
            let recent = ops::slice(win, &[0, 0, ns as i32, 0], &[b, h, (ns + nr) as i32, d], &s)?;
            let w = ops::slice_update(&side.window, &sink, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
            side.window = ops::slice_update(&w, &recent, &[0, 0, w0, 0], &[b, h, w0 + nr as i32, d], &s)?;
        }
        c.capacity = cap;
        c.len = n;
        c.n_sink = ns;
        c.n_recent = nr;
        Ok(cache)
    }
}
