//! CPU implementations of the kernels: plain Rust on slices, no MLX.
//!
//! These are the bodies that the CPU custom primitive runs, and the
//! references that the Metal emulator and the CUDA parity tests compare with.
//! Each function spreads its rows over the machine's cores.

mod bitpack;
pub mod framed_dequantize;
pub mod key_mean;
pub mod kv_attention;
mod parallel;
mod quant;
mod split_attention;
pub mod store_write;
pub mod turboquant;
mod vq;
pub mod window;

pub use bitpack::{bit_pack, bit_unpack, code_planes, packed_len, SUPPORTED_BITS};
pub use parallel::{for_each_chunk, map_row_ranges, min_rows_for_work};
pub use quant::{
    kivi_code, kivi_dequantize, kivi_params, kivi_quantize, pq_decode, pq_encode, PQ_BITS, qjl_encode, qjl_score,
    scalar_boundaries, scalar_dequantize, scalar_quantize, Float,
};
pub use vq::{vq_quantize, VqElement};
