//! `LayerCache`: the stored arrays of one layer and the operations on them.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::{CacheConfig, Method};
use crate::array::Array;
use crate::cpu::turboquant::AttentionShape;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::kernels::turboquant::{self, TqLayer};
use crate::kernels::{Options, Policy};
use crate::ops;
use crate::quant::{Rotation, RotationKind, ScalarCodebook};
use crate::stream::Stream;

/// Slots a store starts with; it then doubles.
const MIN_CAPACITY: usize = 256;
const STATE_FORMAT: &str = "veloxquant-layer-cache";
const STATE_VERSION: &str = "2";

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

/// Arrays shared by every layer with the same head size, seed and bits.
struct Shared {
    rotation: Array,
    k_centroids: Array,
    v_centroids: Array,
}

struct Dense {
    keys: Array,
    values: Array,
    len: usize,
    capacity: usize,
}

struct Compressed {
    /// Per-channel mean of the keys of the first append `[B, Hkv, 1, D]`
    /// (float32), subtracted from every key before it is stored. Softmax is
    /// unchanged by it (it shifts a query's scores by one constant), and it
    /// takes the channel offsets of real keys out of what the codes must hold.
    k_mean: Option<Array>,
    k_codes: Array,
    k_norms: Array,
    v_codes: Array,
    v_norms: Array,
    capacity: usize,
    len: usize,
    /// Float16 windows `[B, Hkv, sinks + 2 * window, D]`, rotated: sinks first.
    win_k: Array,
    win_v: Array,
    n_sink: usize,
    n_recent: usize,
}

enum Store {
    Dense(Dense),
    Compressed(Compressed),
}

/// The cache of one attention layer.
pub struct LayerCache {
    cfg: CacheConfig,
    stream: Stream,
    batch: usize,
    dtype: Dtype,
    shared: Option<Shared>,
    store: Option<Store>,
}

impl LayerCache {
    /// An empty cache on `stream` (MLX's default stream when `None`).
    pub fn new(cfg: CacheConfig, stream: Option<Stream>) -> Result<Self> {
        cfg.validate()?;
        let stream = match stream {
            Some(s) => s,
            None => Stream::default_stream()?,
        };
        if cfg.policy == Policy::Require && cfg.key_method == Method::TurboQuantMse {
            // Fail at construction, not at the first append.
            let probe = crate::kernels::KernelSpec { name: "tq_attention", gpu: Some(crate::kernels::Source::TqAttention), cpu: true };
            crate::kernels::select(&probe, Policy::Require, &stream)?;
        }
        Ok(LayerCache { cfg, stream, batch: 0, dtype: Dtype::F16, shared: None, store: None })
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

    fn opts(&self) -> Options {
        Options::on(self.stream.clone(), self.cfg.policy)
    }

    /// Bytes of the arrays this layer holds (capacity, not only the used part).
    pub fn nbytes(&self) -> usize {
        match &self.store {
            None => 0,
            Some(Store::Dense(d)) => d.keys.nbytes() + d.values.nbytes(),
            Some(Store::Compressed(c)) => {
                c.k_codes.nbytes() + c.k_norms.nbytes() + c.v_codes.nbytes() + c.v_norms.nbytes() + c.win_k.nbytes()
                    + c.win_v.nbytes()
                    + c.k_mean.as_ref().map_or(0, Array::nbytes)
            }
        }
    }

    /// Bytes of the rotation and codebooks, which every layer with the same
    /// head size, seed and bits shares; count them once per model.
    pub fn shared_nbytes(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| {
            s.rotation.nbytes() + s.k_centroids.nbytes() + s.v_centroids.nbytes()
        })
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

    fn init(&mut self, batch: usize, dtype: Dtype) -> Result<()> {
        let s = &self.stream;
        let (b, h, d) = (batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        self.batch = batch;
        self.dtype = dtype;
        self.store = Some(match self.cfg.key_method {
            Method::Fp16 => Store::Dense(Dense {
                keys: ops::zeros(&[b, h, MIN_CAPACITY as i32, d], dtype, s)?,
                values: ops::zeros(&[b, h, MIN_CAPACITY as i32, d], dtype, s)?,
                len: 0,
                capacity: MIN_CAPACITY,
            }),
            Method::TurboQuantMse => {
                let dim = self.cfg.head_dim;
                let rot = rotation_matrix(dim, self.cfg.seed)?;
                let kc = centroids(dim, self.cfg.key_bits)?;
                let vc = centroids(dim, self.cfg.value_bits)?;
                self.shared = Some(Shared {
                    rotation: Array::from_slice(&rot, &[d, d])?,
                    k_centroids: Array::from_slice(&kc, &[kc.len() as i32])?,
                    v_centroids: Array::from_slice(&vc, &[vc.len() as i32])?,
                });
                let wcap = (self.cfg.sinks + 2 * self.cfg.window) as i32;
                let cap = MIN_CAPACITY as i32;
                Store::Compressed(Compressed {
                    k_mean: None,
                    k_codes: ops::zeros(&[b, h, cap, self.key_row_bytes() as i32], Dtype::U8, s)?,
                    k_norms: ops::zeros(&[b, h, cap], Dtype::F16, s)?,
                    v_codes: ops::zeros(&[b, h, cap, self.value_row_bytes() as i32], Dtype::U8, s)?,
                    v_norms: ops::zeros(&[b, h, cap], Dtype::F16, s)?,
                    capacity: MIN_CAPACITY,
                    len: 0,
                    win_k: ops::zeros(&[b, h, wcap, d], dtype, s)?,
                    win_v: ops::zeros(&[b, h, wcap, d], dtype, s)?,
                    n_sink: 0,
                    n_recent: 0,
                })
            }
        });
        Ok(())
    }

    fn key_row_bytes(&self) -> usize {
        self.cfg.head_dim * self.cfg.key_bits as usize / 8
    }

    fn value_row_bytes(&self) -> usize {
        self.cfg.head_dim * self.cfg.value_bits as usize / 8
    }

    /// Appends `keys` and `values` `[B, Hkv, T, D]` (a prefill chunk or one token).
    pub fn append(&mut self, keys: &Array, values: &Array) -> Result<()> {
        let ks = self.check_input("keys", keys)?;
        let vs = self.check_input("values", values)?;
        if ks != vs || keys.dtype() != values.dtype() {
            return Err(Error::invalid("values", format!("shape {vs:?} / {} must match keys {ks:?} / {}", values.dtype(), keys.dtype())));
        }
        let t = ks[2] as usize;
        if self.store.is_none() {
            self.init(ks[0] as usize, keys.dtype())?;
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
        let s = self.stream.clone();
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
        let s = self.stream.clone();
        let opts = self.opts();
        let (kbits, vbits) = (self.cfg.key_bits, self.cfg.value_bits);
        let (sinks, window) = (self.cfg.sinks, self.cfg.window);
        let shared = self.shared.as_ref().expect("initialised with the store");
        let dtype = self.dtype;
        let Some(Store::Compressed(c)) = &mut self.store else { unreachable!() };
        let (b, h, t, d) = (shape[0], shape[1], shape[2] as usize, shape[3]);
        // Rotate the new tokens once; the windows hold them rotated, so that
        // attention works in one frame.
        let rot_t = ops::transpose(&shared.rotation, &[1, 0], &s)?;
        let rotate = |x: &Array| -> Result<Array> {
            ops::astype(&ops::matmul(&ops::astype(x, Dtype::F32, &s)?, &rot_t, &s)?, dtype, &s)
        };
        if c.k_mean.is_none() {
            let kf = ops::astype(keys, Dtype::F32, &s)?;
            let sum = ops::sum_axis(&kf, 2, true, &s)?;
            c.k_mean = Some(ops::divide(&sum, &Array::scalar_f32(t as f32)?, &s)?);
        }
        let centred = ops::subtract(&ops::astype(keys, Dtype::F32, &s)?, c.k_mean.as_ref().expect("set above"), &s)?;
        let (rk, rv) = (rotate(&centred)?, rotate(values)?);
        let mut start = 0usize;
        if c.n_sink < sinks {
            let take = (sinks - c.n_sink).min(t);
            let (lo, hi) = (c.n_sink as i32, (c.n_sink + take) as i32);
            let part_k = ops::slice(&rk, &[0, 0, 0, 0], &[b, h, take as i32, d], &s)?;
            let part_v = ops::slice(&rv, &[0, 0, 0, 0], &[b, h, take as i32, d], &s)?;
            c.win_k = ops::slice_update(&c.win_k, &part_k, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
            c.win_v = ops::slice_update(&c.win_v, &part_v, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
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
        let pending = c.n_recent + rest;
        if pending <= 2 * window {
            let (lo, hi) = (w0 + c.n_recent as i32, w0 + pending as i32);
            c.win_k = ops::slice_update(&c.win_k, &new_k, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
            c.win_v = ops::slice_update(&c.win_v, &new_v, &[0, 0, lo, 0], &[b, h, hi, d], &s)?;
            c.n_recent = pending;
            return Ok(());
        }
        // Compress the oldest `m` pending tokens in one batch; keep the newest
        // `window` in float16.
        let m = pending - window;
        let gather = |win: &Array, new: &Array| -> Result<Array> {
            if c.n_recent == 0 {
                return Ok(new.clone());
            }
            let old = ops::slice(win, &[0, 0, w0, 0], &[b, h, w0 + c.n_recent as i32, d], &s)?;
            ops::concatenate(&[old, new.clone()], 2, &s)
        };
        let (pk, pv) = (gather(&c.win_k, &new_k)?, gather(&c.win_v, &new_v)?);
        let pend = pending as i32;
        let split = |p: &Array| -> Result<(Array, Array)> {
            Ok((
                ops::slice(p, &[0, 0, 0, 0], &[b, h, m as i32, d], &s)?,
                ops::slice(p, &[0, 0, m as i32, 0], &[b, h, pend, d], &s)?,
            ))
        };
        let (ck, keep_k) = split(&pk)?;
        let (cv, keep_v) = split(&pv)?;
        // The windows are rotated already.
        let (kcodes, knorms) = turboquant::tq_encode(&ck, None, &shared.k_centroids, kbits, &opts)?;
        let (vcodes, vnorms) = turboquant::tq_encode(&cv, None, &shared.v_centroids, vbits, &opts)?;
        let needed = c.len + m;
        if needed > c.capacity {
            let mut cap = c.capacity;
            grow(&mut [&mut c.k_codes, &mut c.k_norms, &mut c.v_codes, &mut c.v_norms], &mut cap, needed, &s)?;
            c.capacity = cap;
        }
        let (lo, hi) = (c.len as i32, needed as i32);
        let (kr, vr) = ((d as u32 * kbits / 8) as i32, (d as u32 * vbits / 8) as i32);
        c.k_codes = ops::slice_update(&c.k_codes, &kcodes, &[0, 0, lo, 0], &[b, h, hi, kr], &s)?;
        c.v_codes = ops::slice_update(&c.v_codes, &vcodes, &[0, 0, lo, 0], &[b, h, hi, vr], &s)?;
        c.k_norms = ops::slice_update(&c.k_norms, &knorms, &[0, 0, lo], &[b, h, hi], &s)?;
        c.v_norms = ops::slice_update(&c.v_norms, &vnorms, &[0, 0, lo], &[b, h, hi], &s)?;
        let keep = window as i32;
        c.win_k = ops::slice_update(&c.win_k, &keep_k, &[0, 0, w0, 0], &[b, h, w0 + keep, d], &s)?;
        c.win_v = ops::slice_update(&c.win_v, &keep_v, &[0, 0, w0, 0], &[b, h, w0 + keep, d], &s)?;
        c.len = needed;
        c.n_recent = window;
        Ok(())
    }

    /// Attention of `queries` `[B, Hq, L, D]` over the cache. With `causal`,
    /// query `l` sits at position `offset - L + l` and sees tokens up to it.
    pub fn attention(&self, queries: &Array, scale: f32, causal: bool) -> Result<Array> {
        let qs = queries.shape();
        if qs.len() != 4 || qs[3] as usize != self.cfg.head_dim {
            return Err(Error::invalid("queries", format!("shape {qs:?}, expected [batch, heads, queries, {}]", self.cfg.head_dim)));
        }
        let hq = qs[1] as usize;
        if hq % self.cfg.kv_heads != 0 {
            return Err(Error::invalid("queries", format!("{hq} heads are not a multiple of the cache's {} KV heads", self.cfg.kv_heads)));
        }
        let Some(store) = &self.store else {
            return Err(Error::invalid("queries", "the cache is empty: append keys and values first"));
        };
        if qs[0] as usize != self.batch {
            return Err(Error::invalid("queries", format!("batch {} but the cache holds batch {}", qs[0], self.batch)));
        }
        if causal && qs[2] as usize > self.offset() {
            return Err(Error::invalid("queries", format!("{} causal queries but only {} tokens are cached", qs[2], self.offset())));
        }
        let s = &self.stream;
        match store {
            Store::Dense(d) => {
                if queries.dtype() != self.dtype {
                    return Err(Error::Dtype { argument: "queries", found: queries.dtype().to_string(), expected: self.dtype.to_string() });
                }
                let (b, h, dim) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
                let k = ops::slice(&d.keys, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?;
                let v = ops::slice(&d.values, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?;
                ops::scaled_dot_product_attention(queries, &k, &v, scale, causal && qs[2] > 1, s)
            }
            Store::Compressed(_) => {
                let layer = self.tq_layer(qs[1] as usize, qs[2] as usize, causal)?;
                turboquant::tq_attention(queries, &layer, scale, &self.opts())
            }
        }
    }

    fn tq_layer(&self, q_heads: usize, queries: usize, causal: bool) -> Result<TqLayer<'_>> {
        let Some(Store::Compressed(c)) = &self.store else {
            return Err(Error::invalid("method", "not a compressed cache"));
        };
        let sh = self.shared.as_ref().expect("initialised");
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
                window_capacity: self.cfg.sinks + 2 * self.cfg.window,
                causal,
            },
            rot_k: &sh.rotation,
            rot_v: &sh.rotation,
            k_codes: &c.k_codes,
            k_norms: &c.k_norms,
            k_centroids: &sh.k_centroids,
            v_codes: &c.v_codes,
            v_norms: &c.v_norms,
            v_centroids: &sh.v_centroids,
            win_k: &c.win_k,
            win_v: &c.win_v,
        })
    }

    /// The keys and values as the cache reconstructs them, `[B, Hkv, offset, D]`
    /// in the cache's dtype (for tests and the reference path).
    pub fn dequantize(&self) -> Result<(Array, Array)> {
        let s = &self.stream;
        let (b, h, dim) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        match &self.store {
            None => Err(Error::invalid("cache", "empty")),
            Some(Store::Dense(d)) => Ok((
                ops::slice(&d.keys, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?,
                ops::slice(&d.values, &[0, 0, 0, 0], &[b, h, d.len as i32, dim], s)?,
            )),
            Some(Store::Compressed(_)) => {
                let layer = self.tq_layer(self.cfg.kv_heads, 1, false)?;
                let rot = &self.shared.as_ref().expect("initialised").rotation;
                let back = |values: bool| -> Result<Array> {
                    let r = turboquant::decode_rotated(&layer, values, s)?;
                    ops::astype(&ops::matmul(&r, rot, s)?, self.dtype, s)
                };
                let Some(Store::Compressed(c)) = &self.store else { unreachable!() };
                let keys = match &c.k_mean {
                    Some(mean) => {
                        let r = turboquant::decode_rotated(&layer, false, s)?;
                        ops::astype(&ops::add(&ops::matmul(&r, rot, s)?, mean, s)?, self.dtype, s)?
                    }
                    None => back(false)?,
                };
                Ok((keys, back(true)?))
            }
        }
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
}

/// Grows the token axis (2) of `arrays` to at least `needed` slots, doubling.
fn grow(arrays: &mut [&mut Array], capacity: &mut usize, needed: usize, s: &Stream) -> Result<()> {
    if needed <= *capacity {
        return Ok(());
    }
    let mut cap = (*capacity).max(MIN_CAPACITY);
    while cap < needed {
        cap *= 2;
    }
    for a in arrays.iter_mut() {
        let mut shape = a.shape();
        shape[2] = (cap - *capacity) as i32;
        let extra = ops::zeros(&shape, a.dtype(), s)?;
        **a = ops::concatenate(&[(**a).clone(), extra], 2, s)?;
    }
    *capacity = cap;
    Ok(())
}

mod state_io {
    //! The versioned byte form of a layer cache.
    use std::collections::{BTreeMap, HashMap};

    use safetensors::tensor::Dtype as StDtype;
    use safetensors::SafeTensors;

    use super::*;

    fn st_dtype(d: Dtype) -> StDtype {
        match d {
            Dtype::U8 => StDtype::U8,
            Dtype::F16 => StDtype::F16,
            Dtype::BF16 => StDtype::BF16,
            _ => StDtype::F32,
        }
    }

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

    pub(super) fn save(cache: &LayerCache) -> Result<Vec<u8>> {
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
            ("seed", c.seed.to_string()),
            ("batch", cache.batch.to_string()),
            ("dtype", cache.dtype.to_string()),
        ] {
            meta.insert(k.to_string(), v);
        }
        let s = &cache.stream;
        let (b, h, d) = (cache.batch as i32, c.kv_heads as i32, c.head_dim as i32);
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut put = |name: &str, a: Array| -> Result<()> {
            let shape = a.shape().iter().map(|&v| v as usize).collect();
            tensors.push((name.to_string(), a.dtype(), shape, a.to_bytes()?));
            Ok(())
        };
        match &cache.store {
            None => {}
            Some(Store::Dense(x)) => {
                let n = x.len as i32;
                put("keys", ops::slice(&x.keys, &[0, 0, 0, 0], &[b, h, n, d], s)?)?;
                put("values", ops::slice(&x.values, &[0, 0, 0, 0], &[b, h, n, d], s)?)?;
            }
            Some(Store::Compressed(x)) => {
                let n = x.len as i32;
                let kr = cache.key_row_bytes() as i32;
                let vr = cache.value_row_bytes() as i32;
                if let Some(mean) = &x.k_mean {
                    put("k_mean", mean.clone())?;
                }
                put("k_codes", ops::slice(&x.k_codes, &[0, 0, 0, 0], &[b, h, n, kr], s)?)?;
                put("v_codes", ops::slice(&x.v_codes, &[0, 0, 0, 0], &[b, h, n, vr], s)?)?;
                put("k_norms", ops::slice(&x.k_norms, &[0, 0, 0], &[b, h, n], s)?)?;
                put("v_norms", ops::slice(&x.v_norms, &[0, 0, 0], &[b, h, n], s)?)?;
                let used = (c.sinks + x.n_recent) as i32;
                // Sinks then recent tokens, as stored.
                let (ns, nr) = (x.n_sink as i32, x.n_recent as i32);
                let w0 = c.sinks as i32;
                let take = |w: &Array| -> Result<Array> {
                    let sink = ops::slice(w, &[0, 0, 0, 0], &[b, h, ns, d], s)?;
                    let recent = ops::slice(w, &[0, 0, w0, 0], &[b, h, w0 + nr, d], s)?;
                    ops::concatenate(&[sink, recent], 2, s)
                };
                let _ = used;
                put("win_k", take(&x.win_k)?)?;
                put("win_v", take(&x.win_v)?)?;
                meta.insert("n_sink".into(), x.n_sink.to_string());
                meta.insert("n_recent".into(), x.n_recent.to_string());
                meta.insert("compressed".into(), x.len.to_string());
            }
        }
        let views: Vec<crate::safetensors_io::TensorBytes<'_>> = tensors
            .iter()
            .map(|(n, dt, shape, bytes)| crate::safetensors_io::TensorBytes {
                name: n,
                dtype: st_name(*dt),
                shape,
                data: bytes,
            })
            .collect();
        Ok(crate::safetensors_io::write(&meta, &views))
    }

    fn field<T: std::str::FromStr>(meta: &HashMap<String, String>, key: &str) -> Result<T> {
        meta.get(key)
            .ok_or_else(|| corrupt(format!("missing field {key:?}")))?
            .parse()
            .map_err(|_| corrupt(format!("field {key:?} is not valid")))
    }

    pub(super) fn load(bytes: &[u8], stream: Option<Stream>) -> Result<LayerCache> {
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
        let meta = header.metadata().clone().ok_or_else(|| corrupt("no metadata"))?;
        if meta.get("format").map(String::as_str) != Some(STATE_FORMAT) {
            return Err(corrupt(format!("format is {:?}, expected {STATE_FORMAT:?}", meta.get("format"))));
        }
        if meta.get("version").map(String::as_str) != Some(STATE_VERSION) {
            return Err(corrupt(format!("version {:?} is not supported (expected {STATE_VERSION})", meta.get("version"))));
        }
        let st = SafeTensors::deserialize(bytes).map_err(|e| corrupt(format!("not a cache state: {e}")))?;
        let mut cfg = CacheConfig::new(field(&meta, "head_dim")?, field(&meta, "kv_heads")?);
        cfg.key_method = meta.get("key_method").ok_or_else(|| corrupt("missing key_method"))?.parse()?;
        cfg.value_method = meta.get("value_method").ok_or_else(|| corrupt("missing value_method"))?.parse()?;
        cfg.key_bits = field(&meta, "key_bits")?;
        cfg.value_bits = field(&meta, "value_bits")?;
        cfg.window = field(&meta, "window")?;
        cfg.sinks = field(&meta, "sinks")?;
        cfg.seed = field(&meta, "seed")?;
        let mut cache = LayerCache::new(cfg, stream).map_err(|e| corrupt(e.to_string()))?;
        let batch: usize = field(&meta, "batch")?;
        if st.names().is_empty() {
            return Ok(cache);
        }
        let dtype = match meta.get("dtype").map(String::as_str) {
            Some("float16") => Dtype::F16,
            Some("bfloat16") => Dtype::BF16,
            Some("float32") => Dtype::F32,
            other => return Err(corrupt(format!("dtype {other:?}"))),
        };
        let (b, h, d) = (batch as i32, cache.cfg.kv_heads as i32, cache.cfg.head_dim as i32);
        let tensor = |name: &str, dt: Dtype, shape: &[i32]| -> Result<Array> {
            let t = st.tensor(name).map_err(|e| corrupt(format!("{name}: {e}")))?;
            let want: Vec<usize> = shape.iter().map(|&v| v as usize).collect();
            if t.dtype() != st_dtype(dt) || t.shape() != want.as_slice() {
                return Err(corrupt(format!("{name}: {:?} {:?}, expected {:?} {want:?}", t.dtype(), t.shape(), st_dtype(dt))));
            }
            Array::from_bytes(t.data(), shape, dt)
        };
        cache.init(batch, dtype)?;
        let s = cache.stream.clone();
        match cache.cfg.key_method {
            Method::Fp16 => {
                let n = st.tensor("keys").map_err(|e| corrupt(e.to_string()))?.shape().get(2).copied().unwrap_or(0);
                let k = tensor("keys", dtype, &[b, h, n as i32, d])?;
                let v = tensor("values", dtype, &[b, h, n as i32, d])?;
                cache.append(&k, &v)?;
            }
            Method::TurboQuantMse => {
                let n: usize = field(&meta, "compressed")?;
                let ns: usize = field(&meta, "n_sink")?;
                let nr: usize = field(&meta, "n_recent")?;
                if ns > cache.cfg.sinks || nr > 2 * cache.cfg.window || (ns < cache.cfg.sinks && n + nr > 0) {
                    return Err(corrupt(format!("inconsistent counts: {ns} sinks, {n} compressed, {nr} recent")));
                }
                let kr = cache.key_row_bytes() as i32;
                let vr = cache.value_row_bytes() as i32;
                let (kc, vc) = (tensor("k_codes", Dtype::U8, &[b, h, n as i32, kr])?, tensor("v_codes", Dtype::U8, &[b, h, n as i32, vr])?);
                let (kn, vn) = (tensor("k_norms", Dtype::F16, &[b, h, n as i32])?, tensor("v_norms", Dtype::F16, &[b, h, n as i32])?);
                let wk = tensor("win_k", dtype, &[b, h, (ns + nr) as i32, d])?;
                let wv = tensor("win_v", dtype, &[b, h, (ns + nr) as i32, d])?;
                let mean = match st.tensor("k_mean") {
                    Ok(_) => Some(tensor("k_mean", Dtype::F32, &[b, h, 1, d])?),
                    Err(_) if n + ns + nr == 0 => None,
                    Err(_) => return Err(corrupt("k_mean: missing")),
                };
                let Some(Store::Compressed(c)) = &mut cache.store else { unreachable!() };
                c.k_mean = mean;
                let mut cap = c.capacity;
                grow(&mut [&mut c.k_codes, &mut c.k_norms, &mut c.v_codes, &mut c.v_norms], &mut cap, n, &s)?;
                c.capacity = cap;
                let ni = n as i32;
                c.k_codes = ops::slice_update(&c.k_codes, &kc, &[0, 0, 0, 0], &[b, h, ni, kr], &s)?;
                c.v_codes = ops::slice_update(&c.v_codes, &vc, &[0, 0, 0, 0], &[b, h, ni, vr], &s)?;
                c.k_norms = ops::slice_update(&c.k_norms, &kn, &[0, 0, 0], &[b, h, ni], &s)?;
                c.v_norms = ops::slice_update(&c.v_norms, &vn, &[0, 0, 0], &[b, h, ni], &s)?;
                let w0 = cache.cfg.sinks as i32;
                let place = |win: &Array, saved: &Array| -> Result<Array> {
                    let sink = ops::slice(saved, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
                    let recent = ops::slice(saved, &[0, 0, ns as i32, 0], &[b, h, (ns + nr) as i32, d], &s)?;
                    let w = ops::slice_update(win, &sink, &[0, 0, 0, 0], &[b, h, ns as i32, d], &s)?;
                    ops::slice_update(&w, &recent, &[0, 0, w0, 0], &[b, h, w0 + nr as i32, d], &s)
                };
                c.win_k = place(&c.win_k, &wk)?;
                c.win_v = place(&c.win_v, &wv)?;
                c.len = n;
                c.n_sink = ns;
                c.n_recent = nr;
            }
        }
        Ok(cache)
    }
}
