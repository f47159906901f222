//! CPU implementations of the kernels: plain Rust on slices, no MLX.
//!
//! These are the bodies that the CPU custom primitive runs, and the
//! references that the Metal emulator and the CUDA parity tests compare with.
//! Each function spreads its rows over the machine's cores.

mod bitpack;
mod parallel;
pub mod turboquant;
mod vq;

pub use bitpack::{bit_pack, bit_unpack, packed_len, SUPPORTED_BITS};
pub use parallel::for_each_chunk;
pub use vq::{vq_quantize, VqElement};
