//! `framed_dequantize` on the CPU: one side of a compressed layer as the
//! buffer a prefill chunk attends over, in one pass.

use super::turboquant::code_at;
use super::Float;
use half::f16;

/// Where each part of a side lies, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramedShape {
    /// Batch times KV heads.
    pub rows: usize,
    pub dim: usize,
    pub bits: u32,
    /// Sinks held (window slots `0..sinks`).
    pub sinks: usize,
    /// Compressed tokens (store slots `0..compressed`).
    pub compressed: usize,
    /// Recent tokens, from window slot `recent_at`.
    pub recent: usize,
    pub recent_at: usize,
    /// Slots of the window and of the stores per row, and chunk tokens.
    pub window_slots: usize,
    pub capacity: usize,
    pub chunk: usize,
}

impl FramedShape {
    /// Tokens of the output per row.
    pub fn total(&self) -> usize {
        self.sinks + self.compressed + self.recent + self.chunk
    }

    /// Bytes of one token's codes.
    pub fn row_bytes(&self) -> usize {
        super::packed_len(self.dim, self.bits)
    }
}

/// `out[r, t]` for `t` in order: window slot `t` (sinks), `table[code] ·
/// norm` of compressed token `t − sinks` (float32, rounded once), window slot
/// `recent_at + …` (recent), then the chunk's tokens.
pub fn framed_dequantize<T: Float>(
    window: &[T],
    codes: &[u8],
    norms: &[f16],
    table: &[f32],
    chunk: &[T],
    sh: &FramedShape,
    out: &mut [T],
) {
    let (d, total, nb) = (sh.dim, sh.total(), sh.row_bytes());
    assert_eq!(out.len(), sh.rows * total * d, "out length");
    assert_eq!(window.len(), sh.rows * sh.window_slots * d, "window length");
    assert_eq!(codes.len(), sh.rows * sh.capacity * nb, "codes length");
    assert_eq!(norms.len(), sh.rows * sh.capacity, "norms length");
    assert_eq!(chunk.len(), sh.rows * sh.chunk * d, "chunk length");
    assert_eq!(table.len(), 1 << sh.bits, "table length");
    // Where the compressed tokens end and the chunk's begin, in output tokens.
    let (mid, recent_end) = (sh.sinks + sh.compressed, sh.sinks + sh.compressed + sh.recent);
    super::for_each_chunk(out, d, 64, |row0, part| {
        for (i, o) in part.chunks_exact_mut(d).enumerate() {
            let (r, t) = ((row0 + i) / total, (row0 + i) % total);
            let (window_at, chunk_at) = (|slot: usize| (r * sh.window_slots + slot) * d, |slot: usize| (r * sh.chunk + slot) * d);
            if t < sh.sinks {
                o.copy_from_slice(&window[window_at(t)..][..d]);
            } else if t < mid {
                let slot = r * sh.capacity + t - sh.sinks;
                let (row, norm) = (&codes[slot * nb..][..nb], norms[slot].to_f32());
                for (j, v) in o.iter_mut().enumerate() {
                    *v = T::from_f32(table[code_at(row, j, sh.bits)] * norm);
                }
            } else if t < recent_end {
                o.copy_from_slice(&window[window_at(sh.recent_at + t - mid)..][..d]);
            } else {
                o.copy_from_slice(&chunk[chunk_at(t - recent_end)..][..d]);
            }
        }
    });
}
