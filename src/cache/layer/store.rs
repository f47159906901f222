//! The arrays one layer holds (a dense store, or each side's codes, side
//! data and float16 window) and how they grow and take new tokens.

use super::*;

/// `−mean` in the keys' frame (`−mean·Πᵀ/F` when `rotation`, the shared
/// `F·Π`, is given, else `−mean/F`), in `dtype`: what every new key gets
/// added.
pub(super) fn key_offset(mean: &Array, rotation: Option<&Array>, dtype: Dtype, s: &Stream) -> Result<Array> {
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

/// Token slots of a float16 cache's allocation step (mlx_lm's `KVCache`
/// grows by 256 tokens): a window grows no further than keeps the cache
/// within what such a cache holds for the same tokens.
pub(super) const FP16_STEP: usize = 256;
/// Stores grow to a multiple of this many slots (a multiple of KIVI's key
/// group, so that parameter rows are whole).
pub(super) const STORE_ROUND: usize = 64;
/// A store grows by at least this fraction (1/n) of what it holds.
const STORE_GROWTH: usize = 128;

/// Slots a store (the codes and side data of compressed tokens, or the
/// dense control's tokens) grows to when it must hold `needed`: what is
/// needed, or `1/STORE_GROWTH` more than it holds when that is more,
/// rounded up to `STORE_ROUND`. The growth bounds the memory held beyond the
/// tokens (the point of the cache) to ~0.8%; the copies it costs add up to
/// about `STORE_GROWTH` times the final store over a generation (by HBM
/// bandwidth ~0.1 s for the Llama-8B shape's 128K tokens on an H200).
pub(super) fn store_capacity(current: usize, needed: usize) -> usize {
    if needed <= current {
        return current;
    }
    needed.max(current + current / STORE_GROWTH).div_ceil(STORE_ROUND) * STORE_ROUND
}

/// Slots a window grows to when it must hold `needed` (at most `max`, the
/// configuration's `window_capacity`): double what it holds, but not below
/// `needed` nor above `limit` (where the layer would outgrow a float16
/// cache of its tokens) unless `needed` is.
pub(super) fn window_slots(current: usize, needed: usize, max: usize, limit: usize) -> usize {
    if needed <= current {
        return current;
    }
    (2 * current).clamp(needed, limit.max(needed)).min(max)
}

pub(super) struct Dense {
    pub(super) keys: Array,
    pub(super) values: Array,
    pub(super) len: usize,
    pub(super) capacity: usize,
}

/// One side's (keys' or values') compressed tokens and window.
pub(super) struct Side {
    pub(super) codec: SideCodec,
    /// `[B, Hkv, capacity, row_len]`: uint8 codes, or the tokens in the
    /// cache's dtype for the dense codec.
    pub(super) codes: Array,
    /// Norms (TurboQuant-MSE and -RVQ, product quantization, QJL: `[B, Hkv,
    /// capacity]`; TurboQuant-Prod: norm and residual norm, `[B, Hkv,
    /// capacity, 2]`) or KIVI scales (`[B, Hkv, param_rows, param_cols]`), float16.
    pub(super) scales: Option<Array>,
    /// KIVI zeros, float16, shaped as the scales.
    pub(super) zeros: Option<Array>,
    /// Float16 window `[B, Hkv, window_capacity, D]` in the side's frame
    /// (rotated for the rotating codecs): sinks first.
    pub(super) window: Array,
    /// KIVI keys' bits per channel `[Hkv, D]` (`CacheConfig::key_widths`),
    /// when unequal.
    pub(super) widths: Option<Vec<u8>>,
    /// KIVI keys' bit offsets for unequal widths (`kivi_bit_offsets`),
    /// float32: the table the kernels read for them in place of the shared
    /// uniform one.
    pub(super) layout: Option<Array>,
}

/// A compressed side's new tokens, encoded.
pub(super) struct Encoded {
    pub(super) codes: Array,
    pub(super) scales: Option<Array>,
    pub(super) zeros: Option<Array>,
}

impl Side {
    /// Shape of the scale and zero arrays for `rows` parameter rows.
    pub(super) fn param_shape(&self, b: i32, h: i32, rows: usize, dim: usize) -> Vec<i32> {
        match self.codec.codec {
            // Norms keep the layout `tq_attention` reads.
            Codec::TurboQuantMse | Codec::ProductQuantized | Codec::Qjl | Codec::TurboQuantRvq => vec![b, h, rows as i32],
            _ => vec![b, h, rows as i32, self.codec.param_cols(dim) as i32],
        }
    }

    /// Name of the scale array in the state (what it holds).
    pub(super) fn scales_name(&self) -> &'static str {
        match self.codec.codec {
            Codec::KiviPerChannel | Codec::KiviPerToken => "scales",
            _ => "norms",
        }
    }

    pub(super) fn arrays(&self) -> impl Iterator<Item = &Array> {
        [Some(&self.codes), self.scales.as_ref(), self.zeros.as_ref(), Some(&self.window), self.layout.as_ref()].into_iter().flatten()
    }

    pub(super) fn nbytes(&self) -> usize {
        self.arrays().map(Array::nbytes).sum()
    }

    /// Bytes of what this side stores for `len` compressed tokens and
    /// `window` window tokens (codes, norms or scales and zeros, float16
    /// rows); the rest of its arrays is allocated capacity.
    pub(super) fn data_nbytes(&self, len: usize, window: usize) -> usize {
        // Bytes of `used` of an array's `shape[2]` token (or parameter) rows.
        let rows = |a: &Array, used: usize| match a.shape().get(2) {
            Some(&n) if n > 0 => a.nbytes() / n as usize * used,
            _ => 0,
        };
        let params = self.codec.param_rows(len);
        // Unequal widths are data (held as float32 offsets; the uniform
        // ones are a shared table).
        let layout = self.layout.as_ref().map_or(0, Array::nbytes);
        rows(&self.codes, len)
            + [self.scales.as_ref(), self.zeros.as_ref()].into_iter().flatten().map(|a| rows(a, params)).sum::<usize>()
            + rows(&self.window, window)
            + layout
    }

    /// Grows the stores to `new` token slots: zeros appended, or with `keep`
    /// false (no compressed token held) fresh zeros, one launch an array
    /// instead of a join.
    pub(super) fn grow(&mut self, new: usize, keep: bool, s: &Stream) -> Result<()> {
        let resize = |a: &mut Array, slots: usize| -> Result<()> {
            if keep {
                return extend_slots(a, slots, s);
            }
            let mut shape = a.shape();
            shape[2] = slots as i32;
            *a = ops::zeros(&shape, a.dtype(), s)?;
            Ok(())
        };
        resize(&mut self.codes, new)?;
        let rows = self.codec.param_rows(new);
        for a in [self.scales.as_mut(), self.zeros.as_mut()].into_iter().flatten() {
            resize(a, rows)?;
        }
        Ok(())
    }

    /// Encodes `x` `[B, Hkv, m, D]` (in the side's frame; `m` a whole number
    /// of the codec's token groups). A token holding a NaN or an infinity
    /// gets a NaN norm or scale (see [`non_finite`]; TurboQuant-MSE, from the
    /// norms it stores: also a norm of 65504 or more), whatever the encoder
    /// made of it, so that it decodes to NaN and makes every query that sees
    /// it NaN: no non-finite input becomes a finite value.
    pub(super) fn encode(&self, x: &Array, table: Option<&Array>, dtype: Dtype, opts: &Options) -> Result<Encoded> {
        let mut e = self.encode_values(x, table, dtype, opts)?;
        if let Some(scales) = e.scales.take() {
            let s = opts.resolve_stream()?;
            e.scales = Some(if self.codec.codec == Codec::TurboQuantMse {
                // `tq_encode` holds a norm at float16's largest (65504) for a
                // token with a NaN or an infinity or a norm past that range
                // (NaN where a back-end's min keeps NaN): one pass over the
                // norms instead of computing them again from `x`.
                // Float16 constants: the norms compare and select without casts
                // (two launches a side and flush, not four).
                let limit = Array::from_slice(&[half::f16::from_f32(crate::cpu::turboquant::MAX_NORM)], &[])?;
                let nan = Array::from_slice(&[half::f16::NAN], &[])?;
                ops::where_(&ops::greater_equal(&scales, &limit, &s)?, &nan, &scales, &s)?
            } else {
                let bad = self.non_finite(x, &s)?;
                ops::add(&scales, &ops::astype(&bad, Dtype::F16, &s)?, &s)?
            });
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
    pub(super) fn non_finite(&self, x: &Array, s: &Stream) -> Result<Array> {
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

    pub(super) fn encode_values(&self, x: &Array, table: Option<&Array>, dtype: Dtype, opts: &Options) -> Result<Encoded> {
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
            Codec::KiviPerChannel if self.widths.is_some() => {
                let widths = self.widths.as_deref().expect("matched");
                let (codes, scales, zeros) = kernels::kivi_quantize_widths(x, widths, sc.bits, sc.group, &s)?;
                Encoded { codes, scales: Some(scales), zeros: Some(zeros) }
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
    pub(super) fn write(&mut self, e: Encoded, lo: usize, s: &Stream) -> Result<()> {
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

    pub(super) fn arrays_for_kernel<'a>(&'a self, table: Option<&'a Array>) -> KvSideArrays<'a> {
        let table = self.layout.as_ref().or(table);
        KvSideArrays { codes: &self.codes, scales: self.scales.as_ref(), zeros: self.zeros.as_ref(), table, window: &self.window }
    }
}

pub(super) struct Compressed {
    /// Per-channel mean of the keys of the first append `[B, Hkv, 1, D]`
    /// (float32), subtracted from every key before it is stored. Softmax is
    /// unchanged by it (it shifts a query's scores by one constant), and it
    /// takes the channel offsets of real keys out of what the codes must hold.
    pub(super) k_mean: Option<Array>,
    /// `−k_mean` in the keys' frame and the cache's dtype, added to every new
    /// key (derived from `k_mean`, not stored in the state).
    pub(super) k_offset: Option<Array>,
    pub(super) keys: Side,
    pub(super) values: Side,
    /// Token slots of the stores.
    pub(super) capacity: usize,
    /// Token slots of the windows (at most the configuration's
    /// `window_capacity`).
    pub(super) window_slots: usize,
    pub(super) len: usize,
    pub(super) n_sink: usize,
    pub(super) n_recent: usize,
    /// Scratch of the decode kernel (`turboquant::decode_counters`): not
    /// data; each CUDA decode puts the next one's here (`TqLayer::counters`).
    pub(super) decode_counters: Mutex<Array>,
}

impl Compressed {
    /// The windows after `t` new tokens were written into their recent slots.
    pub(super) fn windows_written(&mut self, win_k: Array, win_v: Array, t: usize) {
        self.keys.window = win_k;
        self.values.window = win_v;
        self.n_recent += t;
    }

    /// Grows both windows so that they hold at least `needed` slots, when the
    /// layer holds `tokens` tokens: by doubling, within the bytes of a
    /// float16 cache of those tokens (the stores and the key mean counted).
    pub(super) fn reserve_window(&mut self, needed: usize, tokens: usize, max: usize, s: &Stream) -> Result<()> {
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

    /// Compressed tokens after the last whole token group (a trim cut into
    /// it): the next append decodes and compresses them again.
    pub(super) fn partial_group(&self) -> usize {
        self.len % self.token_group()
    }

    /// Tokens both sides compress together: a flush starts and ends on a
    /// multiple of it.
    pub(super) fn token_group(&self) -> usize {
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

/// The matrix new keys enter their frame through: `Πᵀ/F` when their codec
/// rotates, else `I/F`.
pub(super) fn key_frame<'a>(shared: &'a Shared, c: &Compressed) -> &'a Array {
    let frame = if c.keys.codec.codec.rotated() { &shared.rotation_t } else { &shared.key_frame };
    frame.as_ref().expect("the keys' frame is made with the shared arrays")
}

/// The matrix new values enter their frame through, when their codec rotates.
pub(super) fn value_frame<'a>(shared: &'a Shared, c: &Compressed) -> Option<&'a Array> {
    shared.rotation_t.as_ref().filter(|_| c.values.codec.codec.rotated())
}

/// New tokens in each side's frame (the windows hold them so, and attention
/// works in those frames): keys rotated when their codec rotates and shifted
/// by `−mean` once the mean is known, in one matmul or one add; values
/// rotated when theirs does.
pub(super) fn into_frames(shared: &Shared, c: &Compressed, keys: &Array, values: &Array, s: &Stream) -> Result<(Array, Array)> {
    Ok((
        window::into_frame(keys, Some(key_frame(shared, c)), c.k_offset.as_ref(), s)?,
        window::into_frame(values, value_frame(shared, c), None, s)?,
    ))
}

pub(super) enum Store {
    Dense(Dense),
    Compressed(Compressed),
}


/// Grows the token axis (2) of `arrays` to at least `needed` slots
/// (`store_capacity`).
pub(super) fn grow(arrays: &mut [&mut Array], capacity: &mut usize, needed: usize, s: &Stream) -> Result<()> {
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
pub(super) fn extend_slots(a: &mut Array, slots: usize, s: &Stream) -> Result<()> {
    let mut shape = a.shape();
    let extra = slots.saturating_sub(shape[2] as usize);
    if extra > 0 {
        shape[2] = extra as i32;
        *a = ops::concatenate(&[a.clone(), ops::zeros(&shape, a.dtype(), s)?], 2, s)?;
    }
    Ok(())
}
