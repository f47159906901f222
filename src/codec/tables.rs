//! The tables codecs read, each made once per process: TurboQuant's
//! centroids, the product-quantization codebook, the QJL sketch, and the bit
//! offsets of KIVI keys' channels.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::quant::ScalarCodebook;

/// Bits of a product-quantization code (a codebook of 256 entries).
pub const PQ_CODE_BITS: u32 = 8;

/// The Lloyd–Max centroids of `bits`-bit codes of a rotated unit vector
/// of size `dim`.
pub fn centroids(dim: usize, bits: u32) -> Result<Vec<f32>> {
    Ok(ScalarCodebook::sphere(dim, bits).map_err(|e| Error::invalid("bits", e.to_string()))?.centroids().to_vec())
}

/// Steps of the uniform quantizer of least mean squared error for a unit
/// Gaussian at 1 to 4 bits (Max, 1960).
const UNIFORM_GAUSS_STEP: [f32; 4] = [1.5958, 0.9957, 0.5860, 0.3352];

/// A uniform grid of `2^bits` points for the coordinates of a rotated unit
/// vector of size `dim` (close to Gaussians of variance `1/dim`): `(i −
/// (2^bits − 1)/2) · step / √dim`, the step of least error for a Gaussian.
/// Symmetric and evenly spaced, so that a kernel may read a code as its
/// value's place on the grid instead of looking it up.
pub fn uniform_grid(dim: usize, bits: u32) -> Result<Vec<f32>> {
    let step = UNIFORM_GAUSS_STEP
        .get((bits as usize).wrapping_sub(1))
        .ok_or_else(|| Error::invalid("bits", format!("{bits}: a uniform grid has 1 to 4 bits")))?
        / (dim as f32).sqrt();
    let n = 1u32 << bits;
    Ok((0..n).map(|i| (i as f32 - (n - 1) as f32 / 2.0) * step).collect())
}

/// The product-quantization codebook `[2^PQ_CODE_BITS, sub]` (row-major) for
/// rotated unit vectors of size `dim`: k-means over seeded Gaussian
/// sub-vectors of variance `1/dim` (what a rotated unit vector's coordinates
/// are close to). Trained once per process.
pub fn pq_codebook(dim: usize, sub: usize) -> Result<Vec<f32>> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};
    static CACHE: OnceLock<Mutex<HashMap<(usize, usize), Vec<f32>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache.lock().expect("codebook cache").get(&(dim, sub)) {
        return Ok(c.clone());
    }
    let entries = 1usize << PQ_CODE_BITS;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_0f_c0de);
    let sd = 1.0 / (dim as f32).sqrt();
    let samples: Vec<f32> = (0..64 * entries * sub).map(|_| { let g: f32 = StandardNormal.sample(&mut rng); sd * g }).collect();
    let (codebook, _) = crate::quant::pq::kmeans(&samples, sub, entries, 0, 25, 1e-4)
        .map_err(|e| Error::invalid("bits", e.to_string()))?;
    cache.lock().expect("codebook cache").insert((dim, sub), codebook.clone());
    Ok(codebook)
}

/// The Gaussian sketch `[rows, dim]` (row-major) of the QJL and
/// TurboQuant-Prod keys: blocks of `dim` rows orthogonalized, each row keeping
/// its Gaussian length (`crate::quant::qjl::Sketch`), seeded by `seed + 1` as
/// `TurboQuantProd` seeds it. Built once per process.
pub fn qjl_sketch(rows: usize, dim: usize, seed: u64) -> Vec<f32> {
    static CACHE: OnceLock<Mutex<HashMap<(usize, usize, u64), Vec<f32>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(m) = cache.lock().expect("sketch cache").get(&(rows, dim, seed)) {
        return m.clone();
    }
    let m = crate::quant::qjl::Sketch::new(rows, dim, true, seed.wrapping_add(1)).s;
    cache.lock().expect("sketch cache").insert((rows, dim, seed), m.clone());
    m
}

/// The largest finite float8 e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Every finite float8 e4m3 value (OCP FP8: bias 7, subnormals, no
/// infinities, S.1111.111 NaN), sorted, zero once, then `E4M3_MAX` again up
/// to 256 entries: the codebook of the FP8 codec, which `scalar_quantize`
/// takes as 8-bit codes (an index into it, not the e4m3 bit pattern).
pub fn e4m3_grid() -> Vec<f32> {
    let positive: Vec<f32> = (1u32..0x7f)
        .map(|b| {
            let (e, m) = ((b >> 3) as i32, (b & 7) as f32);
            if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
        })
        .collect();
    let mut grid: Vec<f32> = positive.iter().rev().map(|v| -v).chain(std::iter::once(0.0)).chain(positive.iter().copied()).collect();
    grid.resize(256, E4M3_MAX);
    grid
}

/// Bit offsets of KIVI keys' channels within a code row: what the kernels
/// read as the KIVI-per-channel table. Element 0 is the stride between the
/// heads' rows, then the rows of `dim + 1` offsets (exact integers in
/// float32), channel `c` spanning bits `[o[c], o[c + 1])`. `widths` `[kv_heads,
/// dim]` gives each KV head its own row (stride `dim + 1`; every batch row
/// shares them); `None` gives one row of `bits` per channel, stride 0, which
/// every head reads.
pub fn kivi_bit_offsets(widths: Option<&[u8]>, dim: usize, bits: u32) -> Vec<f32> {
    let Some(widths) = widths else {
        return std::iter::once(0.0).chain((0..=dim).map(|c| (c * bits as usize) as f32)).collect();
    };
    let mut out = vec![(dim + 1) as f32];
    for head in widths.chunks(dim) {
        let mut o = 0u32;
        out.push(0.0);
        for &w in head {
            o += u32::from(w);
            out.push(o as f32);
        }
    }
    out
}

