//! The compressed key/value cache of one attention layer, and attention over it.
//!
//! Keys and values each have their own method and bits. Compressed tokens are
//! kept only as packed codes and their side data (norms, scales, zeros) in
//! stores sized by need, plus two float16 windows: the first `sinks`
//! tokens (attention sinks) and the most recent `window` tokens (up to
//! `window + window` before the oldest of them are compressed in one batch).
//! No float16 copy of a compressed token is kept. `fp16` for both keys and
//! values is the uncompressed control: dense buffers and MLX's fused attention.

mod config;
mod layer;

pub use crate::codec::{pq_codebook, qjl_sketch, PQ_CODE_BITS};
pub use config::*;
pub use layer::{rotation_matrix, total_nbytes, LayerCache};
