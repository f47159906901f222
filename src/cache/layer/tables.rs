//! What every layer of a process with the same head size, seed, methods,
//! bits, dtype and device shares: the rotation, the codebooks and sketches,
//! made once and held while some layer holds them; and the frame scale.

use super::*;

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

/// Arrays shared by every layer with the same head size, seed, methods and
/// bits, dtype and device: one set per process, held while some layer
/// holds it. They are evaluated before any layer gets them, so that layers
/// on every thread can read them (MLX streams are per thread: a lazy array
/// can be evaluated only on the thread that built it).
pub(super) struct Shared {
    /// `F·Π` float32 (`frame_scale`), when either side's frame is rotated:
    /// what the kernels and decoding read as the rotation, so that a query
    /// enters the key frame, and an output or a decoded token leaves the
    /// value frame, scaled by `F`.
    pub(super) rotation: Option<Array>,
    /// `Πᵀ/F` in the cache's dtype, the inverse of `rotation`: new tokens
    /// enter the rotated frame with one matmul and no casts (its rounding is
    /// below the windows' own).
    pub(super) rotation_t: Option<Array>,
    /// `Π·F` in the cache's dtype (`rotation_t`'s transpose times `F²`,
    /// exact): an attention output, or a framed buffer's rotated side,
    /// leaves the rotated frame with one matmul, without a transpose and a
    /// scaling each prefill chunk.
    pub(super) rotation_back: Option<Array>,
    /// `I/F` in the cache's dtype, when the keys' frame is not rotated: new
    /// keys enter it with one `addmm` (the mean's offset added), as rotated
    /// ones do.
    pub(super) key_frame: Option<Array>,
    /// Codebooks of the key and value codecs that have one.
    pub(super) k_table: Option<Array>,
    pub(super) v_table: Option<Array>,
}

/// What makes two layers' shared arrays the same.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct SharedKey {
    pub(super) dim: usize,
    pub(super) seed: u64,
    pub(super) key: (Codec, u32, usize),
    pub(super) value: (Codec, u32, usize),
    pub(super) dtype: Dtype,
    pub(super) device: Device,
}

impl Shared {
    pub(super) fn arrays(&self) -> impl Iterator<Item = &Array> {
        [&self.rotation, &self.rotation_t, &self.rotation_back, &self.key_frame, &self.k_table, &self.v_table].into_iter().flatten()
    }
}

// SAFETY: a `Shared` is evaluated in `shared_for` before it is published and
// is never changed after; other threads only copy its handles (MLX arrays
// count references atomically) and read shapes and data, which no thread
// writes.
unsafe impl Sync for Shared {}

/// The live shared sets of the process. Weak: a set goes with its last layer.
pub(super) fn shared_sets() -> std::sync::MutexGuard<'static, HashMap<SharedKey, Weak<Shared>>> {
    static SHARED: OnceLock<Mutex<HashMap<SharedKey, Weak<Shared>>>> = OnceLock::new();
    // Nothing panics while holding the lock, but a poisoned map is still a
    // valid map: keep using it.
    SHARED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared arrays for `key`: the set a live layer already holds, else a
/// new one from `make`, evaluated.
pub(super) fn shared_for(key: SharedKey, make: impl FnOnce() -> Result<Shared>) -> Result<Arc<Shared>> {
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
