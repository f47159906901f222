//! A layer's attention over what it holds: the fused kernels for decode,
//! MLX's SDPA over a framed transient buffer for a prefill chunk.

use super::*;

/// MLX's SDPA of dense keys and values under a prepared additive mask (see
/// `kv_attention::prepare_mask`), or causal (for more than one query), or none.
fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: Option<&Array>, causal: bool, s: &Stream) -> Result<Array> {
    match mask {
        // MLX takes an additive mask in the queries' dtype.
        Some(m) => ops::scaled_dot_product_attention_masked(q, k, v, scale, &ops::astype(m, q.dtype(), s)?, s),
        None => ops::scaled_dot_product_attention(q, k, v, scale, causal && q.shape()[2] > 1, s),
    }
}

/// The scores' scale must be a finite number: a NaN or an infinity would
/// make every output NaN without a word.
fn check_scale(scale: f32) -> Result<()> {
    if scale.is_finite() {
        Ok(())
    } else {
        Err(Error::invalid("scale", format!("{scale} is not a finite number (the scores' factor, usually 1/sqrt(head_dim))")))
    }
}

impl LayerCache {
    /// Attention of `queries` `[B, Hq, L, D]` over the cache. With `causal`,
    /// query `l` sits at position `offset - L + l` and sees tokens up to it.
    pub fn attention(&self, queries: &Array, scale: f32, causal: bool) -> Result<Array> {
        self.attention_with_mask(queries, scale, if causal { AttentionMask::Causal } else { AttentionMask::None })
    }

    /// `queries`' shape `qs` is `[batch, heads, queries, head_dim]` with
    /// heads a multiple of the cache's KV heads.
    pub(super) fn check_query_heads(&self, qs: &[i32]) -> Result<()> {
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
        check_scale(scale)?;
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
                kv_attention::kv_attention(queries, &layer, scale, &self.opts(s), &CodecGraphs)
            }
            // TurboQuant's own attention: the CPU's, and its decode on a GPU;
            // several queries on a GPU take the kernel of every codec.
            Store::Compressed(_) if Self::turboquant_only(&self.cfg) && (l == 1 || self.device == Device::Cpu) => {
                let layer = self.tq_layer(qs[1] as usize, qs[2] as usize, causal)?;
                turboquant::tq_attention(queries, &layer, scale, &self.opts(s))
            }
            Store::Compressed(_) => {
                let layer = self.kv_layer(qs[1] as usize, qs[2] as usize, causal)?;
                kv_attention::kv_attention(queries, &layer, scale, &self.opts(s), &CodecGraphs)
            }
        }
    }

    /// Decode attention of a batch whose sequences each have their own
    /// cache: `queries` `[B, Hq, 1, D]`, row `b` over `caches[b]` (batch 1
    /// each, any lengths), `[B, Hq, 1, D]` out. Caches holding TurboQuant-MSE
    /// codes with one configuration attend as one operation on the CPU, and
    /// on CUDA as one launch per run of up to
    /// [`turboquant::DECODE_EACH_MAX`] caches that share their rotation
    /// ([`turboquant::tq_attention_each`]); any other set sequence by
    /// sequence, concatenated.
    pub fn attention_each(caches: &[&LayerCache], queries: &Array, scale: f32) -> Result<Array> {
        let Some(first) = caches.first() else {
            return Err(Error::invalid("caches", "no cache given"));
        };
        check_scale(scale)?;
        let qs = queries.shape();
        if qs.len() != 4 || qs[0] as usize != caches.len() || qs[2] != 1 {
            return Err(Error::invalid(
                "queries",
                format!("shape {qs:?}, expected [{}, heads, 1, head_dim]: one decode query per cache", caches.len()),
            ));
        }
        let s = &first.stream()?;
        // CUDA's decode over several caches reads the first one's rotation
        // and codebooks for all: the caches must share them. Metal attends
        // cache by cache (`turboquant::tq_attention_each` says why).
        let backend = s.backend()?;
        let fused = backend != crate::stream::Backend::Metal
            && caches.iter().all(|c| {
                c.batch == 1
                    && c.cfg == first.cfg
                    && c.device == first.device
                    && Self::turboquant_only(&c.cfg)
                    && matches!(c.store, Some(Store::Compressed(_)))
                    && (backend == crate::stream::Backend::Cpu || c.shared_id() == first.shared_id())
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
        Ok(self.framed_with_frames(keys, values)?.0)
    }

    /// [`framed_with`](Self::framed_with), then [`append`](Self::append) of
    /// the same chunk: the chunk enters the cache's frame once for both (a
    /// prefill chunk's path).
    pub fn framed_append(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (framed, frames) = self.framed_with_frames(keys, values)?;
        self.append_framed(keys, values, frames)?;
        Ok(framed)
    }

    /// `framed_with`'s buffers, and the chunk in the frames `append` puts it
    /// in where they are the buffers' (the keys' offset is known: not the
    /// first chunk).
    fn framed_with_frames(&mut self, keys: &Array, values: &Array) -> Result<((Array, Array), Option<(Array, Array)>)> {
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
                Ok(((join(held(&x.keys)?, keys)?, join(held(&x.values)?, values)?), None))
            }
            Store::Compressed(c) => {
                let shared = self.shared.as_ref().expect("initialised with the store");
                let (rk, rv) = into_frames(shared, c, keys, values, &s)?;
                let frames = c.k_offset.is_some().then(|| (rk.clone(), rv.clone()));
                let layer = self.kv_layer(self.cfg.kv_heads, 1, false)?;
                let opts = self.opts(&s);
                let sh = &layer.shape;
                // TurboQuant-MSE sides in one pass; the other codecs as parts joined.
                let framed = |side: &kv_attention::KvSideArrays<'_>, sc: &SideLayout, chunk: &Array| -> Result<Array> {
                    if sh.sinks + sh.compressed + sh.recent == 0 {
                        return Ok(chunk.clone());
                    }
                    let one_pass = sc.codec.turboquant_mse()
                        && sh.dim % 8 == 0
                        && [side.window.dtype(), chunk.dtype()] == [self.dtype; 2];
                    match (side.table, side.scales) {
                        (Some(table), Some(norms)) if one_pass => kernels::framed_dequantize(
                            &kernels::FramedSide {
                                window: side.window,
                                codes: side.codes,
                                norms,
                                table,
                                chunk,
                                bits: sc.bits,
                                sinks: sh.sinks,
                                compressed: sh.compressed,
                                recent: sh.recent,
                                recent_at: sh.sinks,
                            },
                            &opts,
                        ),
                        _ => join(graphs::framed_parts(side, sc, sh, self.dtype, &opts)?, chunk),
                    }
                };
                Ok(((framed(&layer.keys, &sh.key, &rk)?, framed(&layer.values, &sh.value, &rv)?), frames))
            }
        }
    }

    /// Attention of `queries` `[B, Hq, L, D]` over `keys`/`values` from
    /// [`framed_with`](Self::framed_with), with MLX's SDPA: the queries enter
    /// the keys' frame and the output leaves the values' frame, one matmul of
    /// `L` rows each. Query `l` sits at position `total - L + l` (`Causal`).
    /// With `float32` the products run in float32 and the output returns to
    /// the cache's dtype: on the CPU, where MLX's half-precision matmuls and
    /// SDPA loop without a BLAS.
    pub fn attend_framed(
        &self,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        mask: AttentionMask<'_>,
        float32: bool,
    ) -> Result<Array> {
        let qs = queries.shape();
        let ks = keys.shape();
        check_scale(scale)?;
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
        // rotated values as `v·Πᵀ/F`. Either the queries enter the rotated
        // key frame the same way (scores back with `scale·F²`) and the output
        // leaves the value frame as `out·Π·F`, or the buffer's rotated sides
        // return to the model's frame through `Π·F` (the keys less their
        // mean, which no score's softmax sees): whichever multiplies fewer
        // rows. A chunk of L queries over a buffer of N tokens takes the
        // buffer's way while N·Hkv < L·Hq (with llama-8b's 2048-token chunks,
        // up to 8K tokens); that also holds fewer transients, which MLX's
        // CUDA back-end keeps until the GPU has run their layer.
        // Unrotated keys: `scale·F` either way.
        let dtype = if float32 { Dtype::F32 } else { self.dtype };
        let up = |a: &Array| -> Result<Array> { if a.dtype() == dtype { Ok(a.clone()) } else { ops::astype(a, dtype, s) } };
        let shared = self.shared.as_ref();
        let rotation_t = shared.and_then(|x| x.rotation_t.as_ref());
        // `Π·F`: `F²` (a power of two: the same rounding) scales the D x D
        // matrix rather than the rows it multiplies.
        let back = || -> Result<Array> { up(shared.and_then(|x| x.rotation_back.as_ref()).expect("made with rotation_t")) };
        let (queries, keys, values) = (&up(queries)?, &up(keys)?, &up(values)?);
        let f = frame_scale(self.cfg.head_dim);
        let buffer_rows = ks[1] as usize * ks[2] as usize;
        let query_rows = qs[1] as usize * qs[2] as usize;
        let prepared = match mask {
            AttentionMask::Array(m) => Some(kv_attention::prepare_mask(m, self.batch, qs[1] as usize, qs[2] as usize, ks[2] as usize, s)?.0),
            _ => None,
        };
        let causal = matches!(mask, AttentionMask::Causal);
        let out = match rotation_t.filter(|_| key_rotated || value_rotated) {
            Some(_) if buffer_rows < query_rows => {
                let pi_f = back()?;
                let keys = if key_rotated { ops::matmul(keys, &pi_f, s)? } else { keys.clone() };
                let values = if value_rotated { ops::matmul(values, &pi_f, s)? } else { values.clone() };
                let scale = if key_rotated { scale } else { scale * f };
                sdpa(queries, &keys, &values, scale, prepared.as_ref(), causal, s)?
            }
            _ => {
                let q = match rotation_t.filter(|_| key_rotated) {
                    Some(r) => ops::matmul(queries, &up(r)?, s)?,
                    None => queries.clone(),
                };
                let scale = match (compressed, key_rotated) {
                    (true, true) => scale * f * f,
                    (true, false) => scale * f,
                    _ => scale,
                };
                let out = sdpa(&q, keys, values, scale, prepared.as_ref(), causal, s)?;
                match rotation_t.filter(|_| value_rotated) {
                    Some(_) => ops::matmul(&out, &back()?, s)?,
                    None => out,
                }
            }
        };
        if out.dtype() == self.dtype { Ok(out) } else { ops::astype(&out, self.dtype, s) }
    }

    pub(super) fn tq_layer(&self, q_heads: usize, queries: usize, causal: bool) -> Result<TqLayer<'_>> {
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
            values_uniform: c.values.codec.codec == Codec::TurboQuantUniform,
            win_k: &c.keys.window,
            win_v: &c.values.window,
            counters: &c.decode_counters,
        })
    }

    pub(super) fn kv_layer(&self, q_heads: usize, queries: usize, causal: bool) -> Result<KvLayer<'_>> {
        let Some(Store::Compressed(c)) = &self.store else {
            return Err(Error::invalid("method", "not a compressed cache"));
        };
        let sh = self.shared.as_ref().expect("initialised");
        let dim = self.cfg.head_dim;
        Ok(KvLayer {
            shape: KvShape {
                batch: self.batch,
                q_heads,
                kv_heads: self.cfg.kv_heads,
                queries,
                dim: self.cfg.head_dim,
                key: c.keys.codec.layout(dim),
                value: c.values.codec.layout(dim),
                query_features: c.keys.codec.query_features(dim),
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
}
