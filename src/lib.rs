//! veloxquant: compressed key/value caches for MLX.
//!
//! The crate binds MLX through its own C ABI (`mlx-c/`), registers every hot
//! operation as a kernel with Metal, CUDA, CPU and reference implementations
//! ([`kernels`]), and keeps the quantizer math in plain Rust ([`cpu`]).

pub mod array;
pub mod cache;
pub mod codec;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod graph;
mod ffi;
pub mod kernels;
pub mod ops;
pub mod quant;
mod safetensors_io;
#[cfg(feature = "python")]
mod python;
pub mod stream;

pub use array::{eval, Array};
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use kernels::{Implementation, Options, Policy};
pub use stream::{Backend, Device, Stream};
