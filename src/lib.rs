//! veloxquant: compressed KV caches for MLX.
pub mod cpu;
