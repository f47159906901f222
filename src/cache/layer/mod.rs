//! `LayerCache`: the stored arrays of one layer and the operations on them:
//! appending (here), attending (`attention`), the arrays (`store`), what
//! layers share (`tables`) and the byte form (`state_io`).

mod attention;
mod state_io;
mod store;
mod tables;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::config::{AttentionMask, CacheConfig};
use crate::array::Array;
use crate::codec::graphs::{self, CodecGraphs};
use crate::codec::{kivi_bit_offsets, Codec, Encoded, SideCodec, SideLayout};
use crate::cpu::kv_attention::KvShape;
use crate::cpu::turboquant::AttentionShape;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::kernels::kv_attention::{self, KvLayer, KvSideArrays};
use crate::kernels::turboquant::{self, TqLayer};
use crate::kernels::window::{self, WindowAppend};
use crate::kernels::{self, KeyMean, Options, Policy};
use crate::ops;
use crate::quant::{Rotation, RotationKind};
use crate::stream::{Device, Stream};

use store::*;
use tables::*;
pub use tables::rotation_matrix;

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
            // Several queries run the attention kernel of every codec on a
            // GPU; TurboQuant has its own for one query (and on the CPU).
            let cpu = stream.backend()? == crate::stream::Backend::Cpu;
            let attention = match (Self::turboquant_only(&cfg), cpu) {
                (true, true) => &[kernels::Kernel::TqAttention][..],
                (true, false) => &[kernels::Kernel::TqDecode, kernels::Kernel::KvAttention],
                (false, _) => &[kernels::Kernel::KvAttention],
            };
            for &kernel in attention {
                kernels::select(kernel, Policy::Require, &stream)?;
            }
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

    /// TurboQuant-MSE keys and values: TurboQuant's own attention (`tq_attention`).
    fn turboquant_only(cfg: &CacheConfig) -> bool {
        cfg.key_codec().codec.turboquant_mse() && cfg.value_codec().codec.turboquant_mse()
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
                    + c.decode_counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner).nbytes()
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
        sc.table(self.cfg.head_dim, self.cfg.seed)?.map(|t| Array::from_slice(&t, &[t.len() as i32])).transpose()
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
            let (rotation, rotation_t, rotation_back) = if kc.codec.rotated() || vc.codec.rotated() {
                let dim = self.cfg.head_dim;
                let rot = rotation_matrix(dim, self.cfg.seed)?;
                let f = frame_scale(dim);
                // Powers of two: exact in float32.
                let scaled: Vec<f32> = rot.iter().map(|v| v * f).collect();
                let inverse: Vec<f32> = (0..dim * dim).map(|i| rot[(i % dim) * dim + i / dim] / f).collect();
                let inverse = ops::astype(&Array::from_slice(&inverse, &[d, d])?, dtype, s)?;
                let f2 = ops::astype(&Array::scalar_f32(f * f)?, dtype, s)?;
                let back = ops::multiply(&ops::transpose(&inverse, &[1, 0], s)?, &f2, s)?;
                (Some(Array::from_slice(&scaled, &[d, d])?), Some(inverse), Some(back))
            } else {
                (None, None, None)
            };
            let key_frame = if kc.codec.rotated() {
                None
            } else {
                let dim = self.cfg.head_dim;
                let f = frame_scale(dim);
                let diag: Vec<f32> = (0..dim * dim).map(|i| if i % (dim + 1) == 0 { 1.0 / f } else { 0.0 }).collect();
                Some(ops::astype(&Array::from_slice(&diag, &[d, d])?, dtype, s)?)
            };
            Ok(Shared { rotation, rotation_t, rotation_back, key_frame, k_table: self.table(&kc)?, v_table: self.table(&vc)? })
        })?);
        // No compressed token yet: one slot (the kernels take no empty
        // array), grown at the first flush. The windows hold what the first
        // chunk puts in them. The one-slot arrays are zeros given as data:
        // the first flush reads none of their bytes, and on a GPU a fill
        // would be one launch an array (four a layer) in the prompt's first chunk.
        let cap = 1;
        let zeros_data = |shape: &[i32], dtype: Dtype| -> Result<Array> {
            let n: usize = shape.iter().map(|&x| x as usize).product();
            Array::from_bytes(&vec![0u8; n * dtype.size()], shape, dtype)
        };
        let wslots = tokens.clamp(1, self.cfg.window_capacity());
        let wcap = wslots as i32;
        let side = |codec: SideCodec| -> Result<Side> {
            let codes_dtype = if codec.codec == Codec::Dense { dtype } else { Dtype::U8 };
            let mut side = Side {
                codec,
                codes: zeros_data(&[b, h, cap as i32, codec.row_len(d as usize) as i32], codes_dtype)?,
                scales: None,
                zeros: None,
                window: ops::zeros(&[b, h, wcap, d], dtype, s)?,
                widths: None,
                layout: None,
            };
            if let (Codec::KiviPerChannel, Some(widths)) = (codec.codec, &self.cfg.key_widths) {
                let offsets = kivi_bit_offsets(Some(widths), d as usize, codec.bits);
                side.layout = Some(Array::from_slice(&offsets, &[offsets.len() as i32])?);
                side.widths = Some(widths.clone());
            }
            if codec.param_cols(d as usize) > 0 {
                let shape = side.param_shape(b, h, codec.param_rows(cap), d as usize);
                side.scales = Some(zeros_data(&shape, Dtype::F16)?);
                if codec.has_zeros() {
                    side.zeros = Some(zeros_data(&shape, Dtype::F16)?);
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
            decode_counters: Mutex::new(kernels::turboquant::decode_counters(batch, self.cfg.kv_heads)?),
        }));
        Ok(())
    }

    /// Appends `keys` and `values` `[B, Hkv, T, D]` (a prefill chunk or one token).
    pub fn append(&mut self, keys: &Array, values: &Array) -> Result<()> {
        self.append_framed(keys, values, None)
    }

    /// `append`, given the chunk already in the frames it would compute
    /// (`into_frames`), or `None`.
    pub(super) fn append_framed(&mut self, keys: &Array, values: &Array, frames: Option<(Array, Array)>) -> Result<()> {
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
        self.append_compressed(keys, values, &shape, frames)
    }

    /// Where a decode step's `t` tokens go when they join the windows in one
    /// operation: the window slot of the first (the windows reserved for
    /// them), or `None` when the step takes the general path (sinks still
    /// filling, a flush due).
    fn window_slot(cfg: &CacheConfig, c: &mut Compressed, t: usize, s: &Stream) -> Result<Option<usize>> {
        if c.n_sink < cfg.sinks || c.n_recent + t > cfg.recent_capacity() || c.k_offset.is_none() {
            return Ok(None);
        }
        let held = c.n_sink + c.len + c.n_recent + t;
        c.reserve_window(cfg.sinks + c.n_recent + t, held, cfg.window_capacity(), s)?;
        Ok(Some(cfg.sinks + c.n_recent))
    }

    /// A decode step of a batch whose sequences each have their own cache:
    /// row `b` of `keys` and `values` `[B, Hkv, T, D]` appended to
    /// `caches[b]` (batch 1 each). The compressed caches of one
    /// configuration whose tokens join their windows take them in one
    /// operation (`window::window_append_each`: on CUDA a launch per run of
    /// up to `APPEND_EACH_MAX`, on Metal one per cache); the others (a flush due, sinks still
    /// filling, another back-end) are appended one by one, so that one
    /// sequence's flush does not send the whole batch that way.
    pub fn append_each(caches: &mut [&mut LayerCache], keys: &Array, values: &Array) -> Result<()> {
        if caches.is_empty() {
            return Err(Error::invalid("caches", "no cache given"));
        }
        let ks = keys.shape();
        if ks.len() != 4 || ks[0] as usize != caches.len() {
            return Err(Error::invalid(
                "keys",
                format!("shape {ks:?}, expected [{}, kv_heads, tokens, head_dim]: a row per cache", caches.len()),
            ));
        }
        let s = caches[0].stream()?;
        let (cfg, device, dtype) = (caches[0].cfg.clone(), caches[0].device, caches[0].dtype);
        let t = ks[2] as usize;
        // (cache, window slot of its first new token) for the one operation.
        let mut fused = Vec::with_capacity(caches.len());
        let together = keys.dtype() == dtype
            && values.dtype() == dtype
            && caches.iter().all(|c| c.batch == 1 && c.cfg == cfg && c.device == device && c.dtype == dtype);
        if together {
            for (b, c) in caches.iter_mut().enumerate() {
                let Some(Store::Compressed(cc)) = &mut c.store else { continue };
                if cc.partial_group() != 0 {
                    continue; // reopened by the general path
                }
                if let Some(at) = Self::window_slot(&cfg, cc, t, &s)? {
                    fused.push((b, at));
                }
            }
        }
        if fused.len() < 2 {
            fused.clear(); // one operation for one sequence is its own append
        }
        let (h, d) = (ks[1], ks[3]);
        let mut next = fused.iter().map(|&(b, _)| b).peekable();
        for (b, c) in caches.iter_mut().enumerate() {
            if next.peek() == Some(&b) {
                next.next();
                continue;
            }
            let row = |x: &Array| ops::slice(x, &[b as i32, 0, 0, 0], &[b as i32 + 1, h, t as i32, d], &s);
            c.append(&row(keys)?, &row(values)?)?;
        }
        let Some(&(b0, _)) = fused.first() else { return Ok(()) };
        let written = {
            let first = &caches[b0];
            let shared = first.shared.as_ref().expect("initialised with the store");
            let Some(Store::Compressed(c0)) = &first.store else { unreachable!() };
            let rows = fused
                .iter()
                .map(|&(b, at)| {
                    let Some(Store::Compressed(cc)) = &caches[b].store else { unreachable!() };
                    window::WindowRow { row: b, win_k: &cc.keys.window, win_v: &cc.values.window, key_offset: cc.k_offset.as_ref(), at }
                })
                .collect::<Vec<_>>();
            window::window_append_each(keys, values, key_frame(shared, c0), value_frame(shared, c0), &rows, &first.opts(&s))?
        };
        for (&(b, _), (win_k, win_v)) in fused.iter().zip(written) {
            let Some(Store::Compressed(cc)) = &mut caches[b].store else { unreachable!() };
            cc.windows_written(win_k, win_v, t);
        }
        Ok(())
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

    fn append_compressed(&mut self, keys: &Array, values: &Array, shape: &[i32], frames: Option<(Array, Array)>) -> Result<()> {
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
            // The first chunk's mean, over its finite entries, and its offset
            // in the keys' frame, in one operation.
            let rotation = shared.rotation.as_ref().filter(|_| c.keys.codec.codec.rotated());
            let (mean, offset) =
                kernels::key_mean(&KeyMean { keys, rotation, frame: frame_scale(self.cfg.head_dim) }, &opts)?;
            c.k_mean = Some(mean);
            c.k_offset = Some(offset);
        }
        let max_slots = self.cfg.window_capacity();
        let held = c.n_sink + c.len + c.n_recent + t;
        if reopened.is_none() && keys.dtype() == dtype && values.dtype() == dtype {
            if let Some(at) = Self::window_slot(&self.cfg, c, t, &s)? {
                // A decode step: the tokens go into the windows, in one operation.
                let (win_k, win_v) = window::window_append(
                    &WindowAppend {
                        keys,
                        values,
                        key_frame: key_frame(shared, c),
                        key_offset: c.k_offset.as_ref(),
                        value_frame: value_frame(shared, c),
                        win_k: &c.keys.window,
                        win_v: &c.values.window,
                        at,
                    },
                    &opts,
                )?;
                c.windows_written(win_k, win_v, t);
                return Ok(());
            }
        }
        let (rk, rv) = match frames {
            Some(f) => f,
            None => into_frames(shared, c, keys, values, &s)?,
        };
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
        // The tokens to compress (`[B, Hkv, m, D]`, contiguous for the
        // encoder) and those the window keeps: where the chunk alone holds
        // the kept ones, the join makes just the compressed rows and the kept
        // rows stay a view of the chunk (no copy of a sliced join).
        let held_rows = reopen + c.n_recent;
        let gather = |side: &Side, new: &Array, reopened: Option<&Array>| -> Result<(Array, Array)> {
            let mut parts = Vec::new();
            if let Some(r) = reopened {
                parts.push(ops::astype(r, dtype, &s)?);
            }
            if c.n_recent > 0 {
                parts.push(ops::slice(&side.window, &[0, 0, w0, 0], &[b, h, w0 + c.n_recent as i32, d], &s)?);
            }
            let rows = |a: &Array, lo: usize, hi: usize| ops::slice(a, &[0, 0, lo as i32, 0], &[b, h, hi as i32, d], &s);
            if m > held_rows && !parts.is_empty() {
                parts.push(rows(new, 0, m - held_rows)?);
                return Ok((ops::concatenate(&parts, 2, &s)?, rows(new, m - held_rows, rest)?));
            }
            parts.push(new.clone());
            let p = if parts.len() == 1 { parts.remove(0) } else { ops::concatenate(&parts, 2, &s)? };
            Ok((rows(&p, 0, m)?, rows(&p, m, pending)?))
        };
        let (ck, keep_k) = gather(&c.keys, &new_k, reopened.as_ref().map(|r| &r.0))?;
        let (cv, keep_v) = gather(&c.values, &new_v, reopened.as_ref().map(|r| &r.1))?;
        let needed = first + m;
        // A store that must grow (every prefill chunk) takes its tokens in
        // the same pass where the codec allows; else in place after growing.
        let grown = (needed > c.capacity).then(|| store_capacity(c.capacity, needed));
        let in_one = grown.is_some() && c.keys.writes_grown() && c.values.writes_grown();
        let ek = c.keys.encode(&ck, shared.k_table.as_ref(), dtype, !in_one, &opts)?;
        let ev = c.values.encode(&cv, shared.v_table.as_ref(), dtype, !in_one, &opts)?;
        match grown {
            Some(cap) if in_one => {
                write_grown(&mut c.keys, &mut c.values, ek, ev, first, cap, &opts)?;
                c.capacity = cap;
            }
            _ => {
                if let Some(cap) = grown {
                    // Slots before `first` hold compressed tokens to keep.
                    c.keys.grow(cap, first > 0, &s)?;
                    c.values.grow(cap, first > 0, &s)?;
                    c.capacity = cap;
                }
                c.keys.write(ek, first, &s)?;
                c.values.write(ev, first, &s)?;
            }
        }
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
        let partial = c.partial_group();
        if partial == 0 {
            return Ok(None);
        }
        let layer = self.kv_layer(self.cfg.kv_heads, 1, false)?;
        let s = &self.stream()?;
        let sh = &layer.shape;
        let (b, h, d) = (self.batch as i32, self.cfg.kv_heads as i32, self.cfg.head_dim as i32);
        let tail = |side: &KvSideArrays<'_>, sc: &SideLayout| -> Result<Array> {
            let all = graphs::decode_compressed(side, sc, sh, s)?;
            ops::slice(&all, &[0, 0, (c.len - partial) as i32, 0], &[b, h, c.len as i32, d], s)
        };
        Ok(Some((tail(&layer.keys, &sh.key)?, tail(&layer.values, &sh.value)?)))
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
                let mut keys = graphs::decode(&layer, false, s)?;
                if !c.keys.codec.codec.rotated() {
                    // Held as `k/F` (the rotation's `F·Π` undoes rotated ones).
                    keys = ops::multiply(&keys, &Array::scalar_f32(frame_scale(self.cfg.head_dim))?, s)?;
                }
                if let Some(mean) = &c.k_mean {
                    keys = ops::add(&keys, mean, s)?;
                }
                let values = graphs::decode(&layer, true, s)?;
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
