//! The arrays one layer holds (a dense store, or each side's codes, side
//! data and float16 window) and how they grow and take new tokens.

use super::*;

/// `−mean` in the keys' frame (`−mean·Πᵀ/F` when `rotation`, the shared
/// `F·Π`, is given, else `−mean/F`), in `dtype`: what every new key gets
/// added (a loaded state's mean; a first chunk's comes with its mean,
/// `kernels::key_mean`).
pub(super) fn key_offset(mean: &Array, rotation: Option<&Array>, dtype: Dtype, s: &Stream) -> Result<Array> {
    crate::kernels::mean_offset(mean, rotation, frame_scale(mean.shape()[3] as usize), dtype, s)
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

impl Side {
    /// Shape of the scale and zero arrays for `rows` parameter rows.
    pub(super) fn param_shape(&self, b: i32, h: i32, rows: usize, dim: usize) -> Vec<i32> {
        if self.codec.codec.def().flat_norms() {
            vec![b, h, rows as i32]
        } else {
            vec![b, h, rows as i32, self.codec.param_cols(dim) as i32]
        }
    }

    /// Name of the scale array in the state (what it holds).
    pub(super) fn scales_name(&self) -> &'static str {
        self.codec.codec.def().scales_name()
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
    /// gets a NaN norm or scale (`CodecDef::mark_non_finite`), whatever the
    /// encoder made of it, so that it decodes to NaN and makes every query
    /// that sees it NaN: no non-finite input becomes a finite value.
    /// With `mark` false the scales are the encoder's: for a side that
    /// [`write_grown`](Self::write_grown) will mark.
    pub(super) fn encode(&self, x: &Array, table: Option<&Array>, dtype: Dtype, mark: bool, opts: &Options) -> Result<Encoded> {
        let def = self.codec.codec.def();
        let l = self.codec.layout(x.shape()[3] as usize);
        let mut e = def.encode(&l, x, table, self.widths.as_deref(), dtype, opts)?;
        match e.scales.take() {
            Some(scales) if mark => e.scales = Some(def.mark_non_finite(&l, x, &scales, &opts.resolve_stream()?)?),
            scales => e.scales = scales,
        }
        Ok(e)
    }

    /// Whether [`write_grown`] takes this side: its codec keeps codes and
    /// one norm a token (TurboQuant-MSE).
    pub(super) fn writes_grown(&self) -> bool {
        self.codec.codec.turboquant_mse()
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
        let group = |sc: &SideCodec| sc.codec.def().tokens_per_param_row(sc);
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

/// A layer's keys' and values' stores grown to `capacity` slots with `ek`
/// and `ev` (unmarked, see [`Side::encode`]) written at slot `first`, the
/// slots from `first` on not kept: one operation (`kernels::store_write`) for
/// both sides in place of [`Side::grow`], [`Side::write`] and the non-finite
/// mark of each.
pub(super) fn write_grown(keys: &mut Side, values: &mut Side, ek: Encoded, ev: Encoded, first: usize, capacity: usize, opts: &Options) -> Result<()> {
    let [(k_codes, k_norms), (v_codes, v_norms)] =
        kernels::store_write([&grown_write(keys, &ek, first, capacity)?, &grown_write(values, &ev, first, capacity)?], opts)?;
    (keys.codes, keys.scales) = (k_codes, Some(k_norms));
    (values.codes, values.scales) = (v_codes, Some(v_norms));
    Ok(())
}

/// [`write_grown`]'s write of one side.
fn grown_write<'a>(x: &'a Side, e: &'a Encoded, first: usize, capacity: usize) -> Result<kernels::StoreWrite<'a>> {
    let (Some(norms), Some(new_norms)) = (&x.scales, &e.scales) else {
        return Err(Error::invalid("method", "write_grown needs a codec with norms"));
    };
    Ok(kernels::StoreWrite { codes: &x.codes, norms, new_codes: &e.codes, new_norms, first, capacity })
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
