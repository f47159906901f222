//! Quantizer math in plain Rust: rotations, Lloyd–Max codebooks,
//! TurboQuant (MSE, Prod, RVQ, outlier split), QJL, VecInfer-style product
//! quantization and KIVI, behind one [`Quantizer`] trait.
//!
//! Conventions shared by every method (see `docs/QUANTIZERS.md`):
//! - input is `n` row vectors of `dim` `f32`s, row-major;
//! - codes are packed densely along each row with [`crate::cpu::bit_pack`];
//! - norms, scales and zero points are stored as IEEE float16, little endian,
//!   so the byte counts of [`Encoded`] are the bytes a cache really stores;
//! - calibration state (codebooks, rotation signs, sketches, smoothing
//!   factors, outlier channels) is shared by all rows and saved with
//!   [`artifact`]; its bytes are amortized in [`Quantizer::bits_per_element`].

pub mod artifact;
pub mod codebook;
pub mod error;
pub mod kivi;
pub mod outlier;
pub mod pq;
pub mod qjl;
pub mod rotation;
pub mod turboquant;


pub use artifact::{load_quantizer, Artifact};
pub use codebook::ScalarCodebook;
pub use error::{QuantError, Result};
pub use kivi::{KiviKeys, KiviValues};
pub use outlier::OutlierSplit;
pub use pq::{PqConfig, ProductQuantizer};




pub use qjl::Qjl;
pub use rotation::{Rotation, RotationKind};
pub use turboquant::{TurboQuantMse, TurboQuantProd, TurboQuantRvq};


use half::f16;

/// One named byte buffer of an encoding ("codes", "norms", ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// The stored form of `rows` vectors: every byte a cache would keep for them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    pub method: String,
    pub rows: usize,
    pub dim: usize,
    pub buffers: Vec<Buffer>,
}

impl Encoded {
    pub(crate) fn new(method: &str, rows: usize, dim: usize) -> Self {
        Encoded { method: method.to_string(), rows, dim, buffers: Vec::new() }
    }

    pub(crate) fn push(&mut self, name: impl Into<String>, bytes: Vec<u8>) {
        self.buffers.push(Buffer { name: name.into(), bytes });
    }

    /// Total bytes of all buffers.
    pub fn stored_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.bytes.len()).sum()
    }

    /// The buffer `name`, checked to hold exactly `len` bytes.
    pub fn buffer(&self, name: &str, len: usize) -> Result<&[u8]> {
        let b = self
            .buffers
            .iter()
            .find(|b| b.name == name)
            .ok_or_else(|| QuantError::Encoded(format!("buffer {name} is missing")))?;
        if b.bytes.len() != len {
            return Err(QuantError::Encoded(format!(
                "buffer {name} has {} bytes, expected {len}",
                b.bytes.len()
            )));
        }
        Ok(&b.bytes)
    }

    /// Checks that this encoding was made by `method` for vectors of `dim`.
    pub(crate) fn check(&self, method: &str, dim: usize) -> Result<()> {
        if self.method != method {
            return Err(QuantError::Encoded(format!(
                "made by {}, cannot be decoded by {method}",
                self.method
            )));
        }
        if self.dim != dim {
            return Err(QuantError::Encoded(format!("dim {} does not match {dim}", self.dim)));
        }
        Ok(())
    }

    /// The sub-encoding whose buffers carry `prefix` (used by composite
    /// quantizers such as the outlier split).
    pub(crate) fn sub(&self, prefix: &str, method: &str, dim: usize) -> Encoded {
        let mut e = Encoded::new(method, self.rows, dim);
        for b in &self.buffers {
            if let Some(rest) = b.name.strip_prefix(prefix) {
                e.push(rest, b.bytes.clone());
            }
        }
        e
    }
}

/// One quantization scheme for vectors of a fixed dimension.
pub trait Quantizer: Send + Sync {
    /// Method name, as written in artifacts and encodings.
    fn method(&self) -> &'static str;

    /// Length of the vectors this quantizer takes.
    fn dim(&self) -> usize;

    /// Encodes `x` (`n * dim` floats, `n >= 0`).
    fn encode(&self, x: &[f32]) -> Result<Encoded>;

    /// Reconstructs `rows * dim` floats from an encoding of this quantizer.
    fn decode(&self, enc: &Encoded) -> Result<Vec<f32>>;

    /// Bytes of the state shared by all rows (codebooks, rotation signs,
    /// sketch, smoothing factors, channel masks), as stored in the artifact.
    fn shared_bytes(&self) -> usize;

    /// Calibration state, ready to be saved with [`Artifact::to_bytes`].
    fn to_artifact(&self) -> Artifact;

    /// Bits per element counting every stored byte: the encoding's buffers
    /// plus the shared state spread over `amortize_rows` rows.
    fn bits_per_element(&self, enc: &Encoded, amortize_rows: usize) -> f64 {
        let elems = (enc.rows * enc.dim).max(1) as f64;
        let shared = self.shared_bytes() as f64 * 8.0 / (amortize_rows.max(1) * self.dim()) as f64;
        enc.stored_bytes() as f64 * 8.0 / elems + shared
    }
}

// ---------------------------------------------------------------- helpers

/// Number of rows in `x`, after checking its length and that it is finite.
pub(crate) fn check_rows(x: &[f32], dim: usize) -> Result<usize> {
    if dim == 0 {
        return Err(QuantError::arg("dim", "must be positive"));
    }
    if x.len() % dim != 0 {
        return Err(QuantError::arg(
            "x",
            format!("length {} is not a multiple of dim {dim}", x.len()),
        ));
    }
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFinite { arg: "x", index, value });
    }
    Ok(x.len() / dim)
}

/// Rounds to float16, failing if the value overflows.
pub(crate) fn to_f16(arg: &'static str, row: usize, v: f32) -> Result<f16> {
    let h = f16::from_f32(v);
    if !h.is_finite() {
        return Err(QuantError::F16Overflow { arg, row, value: v });
    }
    Ok(h)
}

pub(crate) fn f16_bytes(v: &[f16]) -> Vec<u8> {
    bytemuck::cast_slice::<f16, u8>(v).to_vec()
}

pub(crate) fn f16_from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
}

/// Packs `rows` rows of `n` codes of `bits` bits (0 bits: nothing stored).
pub(crate) fn pack(codes: &[u8], rows: usize, n: usize, bits: u32) -> Vec<u8> {
    if bits == 0 {
        return Vec::new();
    }
    let mut out = vec![0u8; rows * crate::cpu::packed_len(n, bits)];
    crate::cpu::bit_pack(codes, rows, n, bits, &mut out);
    out
}

pub(crate) fn unpack(packed: &[u8], rows: usize, n: usize, bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; rows * n];
    if bits > 0 {
        crate::cpu::bit_unpack(packed, rows, n, bits, &mut out);
    }
    out
}

pub(crate) fn packed_bytes(rows: usize, n: usize, bits: u32) -> usize {
    if bits == 0 {
        0
    } else {
        rows * crate::cpu::packed_len(n, bits)
    }
}

/// Computes `f(row)` for every row, spread over the cores.
pub(crate) fn par_rows<T, F>(rows: usize, f: F) -> Vec<T>
where
    T: Default + Send,
    F: Fn(usize) -> T + Sync,
{
    let mut out: Vec<T> = (0..rows).map(|_| T::default()).collect();
    crate::cpu::for_each_chunk(&mut out, 1, 256, |row0, chunk| {
        for (i, o) in chunk.iter_mut().enumerate() {
            *o = f(row0 + i);
        }
    });
    out
}

/// Deterministic seeded generator used by every method.
pub(crate) fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(crate) use crate::cpu::turboquant::norm;

#[cfg(test)]
pub(crate) mod testutil {
    use rand::RngExt;
    use rand_distr::StandardNormal;

    /// `n` Gaussian vectors of `dim` (seeded).
    pub fn gaussian(n: usize, dim: usize, seed: u64) -> Vec<f32> {
        let mut r = super::rng(seed);
        (0..n * dim).map(|_| r.sample::<f32, _>(StandardNormal)).collect()
    }

    /// `n` uniformly random unit vectors of `dim` (seeded).
    pub fn unit(n: usize, dim: usize, seed: u64) -> Vec<f32> {
        let mut x = gaussian(n, dim, seed);
        for row in x.chunks_mut(dim) {
            let s = super::norm(row);
            row.iter_mut().for_each(|v| *v /= s);
        }
        x
    }

    /// Mean over rows of the squared error ‖x - y‖².
    pub fn mse(x: &[f32], y: &[f32], dim: usize) -> f64 {
        let n = x.len() / dim;
        x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / n as f64
    }
}
