//! Lloyd–Max scalar codebooks for one coordinate of a random unit vector.
//!
//! A coordinate `x` of a uniformly random unit vector in dimension `d` has
//! density ∝ (1 - x²)^((d-3)/2) on [-1, 1] (close to N(0, 1/d)). Writing
//! `x = sin θ` turns it into ∝ cos^(d-2) θ on [-π/2, π/2], which is smooth
//! for every `d >= 2`; cumulative tables of the mass and of the first and
//! second moments over a uniform θ grid (2^17 trapezoids) give the integral
//! of any interval by interpolation. The Lloyd algorithm (centroid = mean of
//! its cell, boundary = midpoint of neighbours) starts from the quantiles
//! and runs until no centroid moves by more than 1e-12 (or 50,000
//! iterations), all in f64, so the codebook is a deterministic function of
//! `(d, bits)`. Codebooks live in the unit-sphere scale (`≈ c/√d`).
//!
//! The residual codebook of TurboQuant-RVQ is fitted the same way to the
//! exact distribution of `x - c(x)`, a sum of shifted pieces of the density.

use super::{QuantError, Result};
use std::collections::HashMap;
use std::f64::consts::FRAC_PI_2;
use std::sync::{Arc, Mutex, OnceLock};

const GRID: usize = 1 << 17;

/// Sorted reconstruction values and the midpoints between them.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalarCodebook {
    centroids: Vec<f32>,
    boundaries: Vec<f32>,
}

impl ScalarCodebook {
    /// A codebook from sorted values; the count must be 2^b, b in 1..=8.
    pub fn new(centroids: Vec<f32>) -> Result<Self> {
        let k = centroids.len();
        if !(2..=256).contains(&k) || !k.is_power_of_two() {
            return Err(QuantError::arg("codebook", format!("{k} entries, need 2^b with b in 1..=8")));
        }
        if centroids.iter().any(|c| !c.is_finite()) || centroids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(QuantError::arg("codebook", "values must be finite and strictly increasing"));
        }
        let boundaries = centroids.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        Ok(ScalarCodebook { centroids, boundaries })
    }

    /// Lloyd–Max codebook of `bits` bits for a coordinate of a random unit
    /// vector of dimension `dim` (cached per `(dim, bits)`).
    pub fn sphere(dim: usize, bits: u32) -> Result<Arc<Self>> {
        check(dim, bits)?;
        cached((dim, bits, 0, 0), || {
            let t = SphereTables::new(dim);
            let c = lloyd(&t, &[(-1.0, 1.0, 0.0)], 1 << bits);
            ScalarCodebook::new(c.iter().map(|&v| v as f32).collect())
        })
    }

    /// Lloyd–Max codebook for the residual `x - first(x)` of the coordinate
    /// distribution after quantizing it with `first` (must be
    /// `sphere(dim, b1)`).
    pub fn sphere_residual(dim: usize, first_bits: u32, bits: u32) -> Result<Arc<Self>> {
        check(dim, bits)?;
        let first = Self::sphere(dim, first_bits)?;
        cached((dim, first_bits, bits, 1), || {
            let t = SphereTables::new(dim);
            let pieces = first.pieces();
            let c = lloyd(&t, &pieces, 1 << bits);
            ScalarCodebook::new(c.iter().map(|&v| v as f32).collect())
        })
    }

    pub fn bits(&self) -> u32 {
        self.centroids.len().trailing_zeros()
    }

    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    /// Index of the nearest centroid (a value on a boundary goes down).
    #[inline]
    pub fn quantize(&self, v: f32) -> u8 {
        self.boundaries.partition_point(|&t| t < v) as u8
    }

    #[inline]
    pub fn value(&self, code: u8) -> f32 {
        self.centroids[code as usize]
    }

    /// Cells of the density as `(lo, hi, centroid)`, used to describe the
    /// residual distribution.
    fn pieces(&self) -> Vec<(f64, f64, f64)> {
        let k = self.centroids.len();
        (0..k)
            .map(|i| {
                let lo = if i == 0 { -1.0 } else { self.boundaries[i - 1] as f64 };
                let hi = if i + 1 == k { 1.0 } else { self.boundaries[i] as f64 };
                (lo, hi, self.centroids[i] as f64)
            })
            .collect()
    }

    /// Expected squared error of one coordinate of a random unit vector of
    /// `dim` quantized with this codebook (by integration).
    pub fn sphere_distortion(&self, dim: usize) -> f64 {
        let t = SphereTables::new(dim);
        self.pieces()
            .iter()
            .map(|&(lo, hi, c)| {
                let (m0, m1, m2) = t.moments(lo, hi);
                m2 - 2.0 * c * m1 + c * c * m0
            })
            .sum()
    }
}

fn check(dim: usize, bits: u32) -> Result<()> {
    if dim < 2 {
        return Err(QuantError::UnsupportedDim {
            method: "lloyd-max codebook",
            dim,
            reason: "needs dim >= 2".into(),
        });
    }
    if !(1..=8).contains(&bits) {
        return Err(QuantError::UnsupportedBits {
            method: "lloyd-max codebook",
            bits,
            supported: "1..=8",
        });
    }
    Ok(())
}

type Key = (usize, u32, u32, u32);

fn cached(key: Key, make: impl FnOnce() -> Result<ScalarCodebook>) -> Result<Arc<ScalarCodebook>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<ScalarCodebook>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache.lock().unwrap().get(&key) {
        return Ok(c.clone());
    }
    let c = Arc::new(make()?);
    cache.lock().unwrap().insert(key, c.clone());
    Ok(c)
}

/// Cumulative integrals of the coordinate density on a uniform θ grid.
struct SphereTables {
    f: Vec<f64>,
    g: Vec<f64>,
    h: Vec<f64>,
}

impl SphereTables {
    fn new(dim: usize) -> Self {
        let step = 2.0 * FRAC_PI_2 / GRID as f64;
        let w = |j: usize| {
            let th = -FRAC_PI_2 + j as f64 * step;
            let c = th.cos().max(0.0);
            let p = if dim == 2 { 1.0 } else { c.powi(dim as i32 - 2) };
            let s = th.sin();
            (p, s * p, s * s * p)
        };
        let (mut f, mut g, mut h) = (vec![0.0; GRID + 1], vec![0.0; GRID + 1], vec![0.0; GRID + 1]);
        let mut prev = w(0);
        for j in 1..=GRID {
            let cur = w(j);
            f[j] = f[j - 1] + 0.5 * step * (prev.0 + cur.0);
            g[j] = g[j - 1] + 0.5 * step * (prev.1 + cur.1);
            h[j] = h[j - 1] + 0.5 * step * (prev.2 + cur.2);
            prev = cur;
        }
        let z = f[GRID];
        for v in f.iter_mut().chain(g.iter_mut()).chain(h.iter_mut()) {
            *v /= z;
        }
        SphereTables { f, g, h }
    }

    /// (mass, ∫x, ∫x²) of the density over (-1, x].
    fn cumulative(&self, x: f64) -> (f64, f64, f64) {
        let th = x.clamp(-1.0, 1.0).asin();
        let pos = (th + FRAC_PI_2) / (2.0 * FRAC_PI_2) * GRID as f64;
        let j = (pos.floor() as usize).min(GRID - 1);
        let t = pos - j as f64;
        let lerp = |a: &[f64]| a[j] + t * (a[j + 1] - a[j]);
        (lerp(&self.f), lerp(&self.g), lerp(&self.h))
    }

    fn moments(&self, lo: f64, hi: f64) -> (f64, f64, f64) {
        if hi <= lo {
            return (0.0, 0.0, 0.0);
        }
        let a = self.cumulative(lo);
        let b = self.cumulative(hi);
        (b.0 - a.0, b.1 - a.1, b.2 - a.2)
    }
}

/// (mass, first moment) of `e = x - s` over `e ∈ [u, v)`, where `x` ranges
/// over the pieces `(lo, hi, s)`.
fn cell(t: &SphereTables, pieces: &[(f64, f64, f64)], u: f64, v: f64) -> (f64, f64) {
    let mut m0 = 0.0;
    let mut m1 = 0.0;
    for &(lo, hi, s) in pieces {
        let a = lo.max(u + s);
        let b = hi.min(v + s);
        if a < b {
            let (f, g, _) = t.moments(a, b);
            m0 += f;
            m1 += g - s * f;
        }
    }
    (m0, m1)
}

fn lloyd(t: &SphereTables, pieces: &[(f64, f64, f64)], k: usize) -> Vec<f64> {
    let emin = pieces.iter().map(|p| p.0 - p.2).fold(f64::INFINITY, f64::min);
    let emax = pieces.iter().map(|p| p.1 - p.2).fold(f64::NEG_INFINITY, f64::max);
    // Quantile start: centroid i at the (i + 1/2)/k quantile, by bisection.
    let mut c: Vec<f64> = (0..k)
        .map(|i| {
            let target = (i as f64 + 0.5) / k as f64;
            let (mut lo, mut hi) = (emin, emax);
            for _ in 0..100 {
                let mid = 0.5 * (lo + hi);
                if cell(t, pieces, emin, mid).0 < target {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            0.5 * (lo + hi)
        })
        .collect();
    for _ in 0..50_000 {
        let mut moved = 0.0f64;
        let mut next = c.clone();
        for i in 0..k {
            let u = if i == 0 { emin } else { 0.5 * (c[i - 1] + c[i]) };
            let v = if i + 1 == k { emax } else { 0.5 * (c[i] + c[i + 1]) };
            let (m0, m1) = cell(t, pieces, u, v);
            if m0 > 1e-300 {
                next[i] = m1 / m0;
            }
            moved = moved.max((next[i] - c[i]).abs());
        }
        c = next;
        if moved < 1e-12 {
            break;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bit_is_mean_abs() {
        // b = 1: ±E|x| = ±√(2/π)/√d for large d; exact for the sphere is
        // Γ(d/2)/(√π Γ((d+1)/2)), within 1% of the Gaussian value at d=128.
        for d in [64usize, 128, 256] {
            let cb = ScalarCodebook::sphere(d, 1).unwrap();
            let want = (2.0 / std::f64::consts::PI).sqrt() / (d as f64).sqrt();
            let c = cb.centroids();
            assert!((c[1] as f64 / want - 1.0).abs() < 0.01, "d={d} {c:?} vs {want}");
            assert_eq!(c[0], -c[1]);
        }
        // At d = 3 the coordinate is uniform on [-1, 1]: centroids ±1/2.
        let c = ScalarCodebook::sphere(3, 1).unwrap();
        assert!((c.centroids()[1] - 0.5).abs() < 1e-5, "{:?}", c.centroids());
    }

    #[test]
    fn two_bits_match_gaussian_lloyd_max() {
        let d = 4096;
        let cb = ScalarCodebook::sphere(d, 2).unwrap();
        let s = (d as f32).sqrt();
        let c: Vec<f32> = cb.centroids().iter().map(|v| v * s).collect();
        for (got, want) in c.iter().zip([-1.510f32, -0.4528, 0.4528, 1.510]) {
            assert!((got - want).abs() < 0.005, "{c:?}");
        }
    }

    #[test]
    fn distortion_matches_known_values_and_falls() {
        // Gaussian Lloyd–Max distortions (Max 1960) times d: the sphere
        // values at d = 128 are within 2%.
        let d = 128;
        let known = [0.3634, 0.1175, 0.03454, 0.009497];
        let mut prev = f64::INFINITY;
        for (b, &k) in (1..=4).zip(&known) {
            let cb = ScalarCodebook::sphere(d, b).unwrap();
            let dist = cb.sphere_distortion(d) * d as f64;
            assert!((dist / k - 1.0).abs() < 0.02, "b={b}: {dist} vs {k}");
            assert!(dist < prev && dist > 0.25f64.powi(b as i32));
            prev = dist;
        }
        let cb8 = ScalarCodebook::sphere(d, 8).unwrap();
        let d8 = cb8.sphere_distortion(d) * d as f64;
        assert!(d8 < prev / 100.0 && d8 > 0.25f64.powi(8), "b=8: {d8}");
    }

    #[test]
    fn residual_codebook_fits_residual() {
        let d = 128;
        let r = ScalarCodebook::sphere_residual(d, 2, 2).unwrap();
        let c = r.centroids();
        // The residual lives inside one cell (about ±0.5/√d), much narrower
        // than the coordinate itself, and is symmetric.
        let w = c[3] * (d as f32).sqrt();
        assert!(w > 0.1 && w < 0.6, "{c:?}");
        assert!((c[0] + c[3]).abs() < 1e-6 && (c[1] + c[2]).abs() < 1e-6);
    }

    #[test]
    fn deterministic_and_errors() {
        let a = ScalarCodebook::sphere(96, 3).unwrap();
        let t = SphereTables::new(96);
        let again = lloyd(&t, &[(-1.0, 1.0, 0.0)], 8);
        let again: Vec<f32> = again.iter().map(|&v| v as f32).collect();
        assert_eq!(a.centroids(), &again[..]);
        assert!(ScalarCodebook::sphere(1, 2).is_err());
        let e = ScalarCodebook::sphere(64, 9).unwrap_err();
        assert!(e.to_string().starts_with("bits: 9"), "{e}");
        assert!(ScalarCodebook::new(vec![1.0, 0.0]).is_err());
        assert!(ScalarCodebook::new(vec![0.0, 1.0, 2.0]).is_err());
    }

    #[test]
    fn quantize_picks_nearest() {
        let cb = ScalarCodebook::new(vec![-1.0, 0.0, 0.5, 2.0]).unwrap();
        for (v, want) in [(-5.0, 0u8), (-0.6, 0), (-0.4, 1), (0.3, 2), (1.2, 2), (1.3, 3), (9.0, 3)] {
            assert_eq!(cb.quantize(v), want, "v={v}");
        }
    }
}
