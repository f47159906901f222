//! VecInfer-style product quantization of keys and values.
//!
//! Keys are first smoothed per channel by `λ_i = √(max_t |K_t,i|)` from the
//! calibration keys (`k_i / λ_i`; queries take `q_i · λ_i`, so `⟨q, k⟩` is
//! unchanged), then rotated by the randomized Hadamard transform, which
//! spreads the remaining outliers over all channels. The result is cut into
//! `dim / s` sub-vectors of `s ∈ {2, 4, 8}` elements, and each is replaced by
//! the index of its nearest entry in one codebook of `K = 2^c` entries
//! (`c ≤ 12`) shared by all sub-vector positions (after the rotation the
//! positions are alike, and one `[K, s]` table is what the `vq_quantize`
//! kernel searches). Values skip the smoothing.
//!
//! Codes (`c` bits per sub-vector) are packed along each row with
//! `bit_pack`: `c ∈ {1, 2, 3, 4, 8}` in one buffer `codes`; other widths
//! split into a low plane (4 bits for c < 8, 8 bits for c > 8) in `codes`
//! and the high bits in `codes_hi`. Nothing else is stored per row, so
//! bits/element = c / s plus the amortized codebook (f32) and λ (f32).
//!
//! Training is k-means: k-means++ seeding on a seeded subsample of at most
//! max(16384, 8K) sub-vectors, then Lloyd iterations over all of them
//! (parallel assignment with `crate::cpu::vq_quantize`, sums in f64) until
//! the distortion improves by less than `tol` (relative) or `max_iters`.
//! An empty cluster is re-seeded at the sub-vector with the largest error.

use super::*;
use crate::cpu::code_planes;
use rand::RngExt;

pub const METHOD: &str = "pq";

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PqConfig {
    /// Elements per sub-vector: 2, 4 or 8.
    pub sub_dim: usize,
    /// Bits per code: the codebook has 2^bits entries, 1..=12.
    pub bits: u32,
    /// Per-channel smoothing λ (keys).
    pub smooth: bool,
    /// Randomized Hadamard rotation before splitting.
    pub rotate: bool,
    pub seed: u64,
    pub max_iters: usize,
    pub tol: f64,
}

impl PqConfig {
    /// VecInfer's key setup: smoothing and Hadamard.
    pub fn keys(sub_dim: usize, bits: u32) -> Self {
        PqConfig { sub_dim, bits, smooth: true, rotate: true, seed: 0, max_iters: 25, tol: 1e-4 }
    }

    /// Values: Hadamard, no smoothing.
    pub fn values(sub_dim: usize, bits: u32) -> Self {
        PqConfig { smooth: false, ..Self::keys(sub_dim, bits) }
    }
}

#[derive(Clone, Debug)]
pub struct ProductQuantizer {
    dim: usize,
    sub_dim: usize,
    bits: u32,
    /// λ per channel (all ones without smoothing).
    lambda: Option<Vec<f32>>,
    rotation: Option<Rotation>,
    /// `[K, sub_dim]`, row-major.
    codebook: Vec<f32>,
}

/// Per-iteration record of a k-means run.
#[derive(Clone, Debug, Default)]
pub struct KmeansReport {
    /// Mean squared distance to the assigned centroid after each assignment.
    pub distortion: Vec<f64>,
    pub reseeded: usize,
}

fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// k-means of `n = data.len() / s` points of `s` dims into `k` centroids.
pub fn kmeans(
    data: &[f32],
    s: usize,
    k: usize,
    seed: u64,
    max_iters: usize,
    tol: f64,
) -> Result<(Vec<f32>, KmeansReport)> {
    let n = data.len() / s;
    if n < k {
        return Err(QuantError::Calibration(format!("k-means needs at least {k} sub-vectors, got {n}")));
    }
    let mut r = rng(seed);
    // k-means++ on a subsample.
    let m = n.min(16384.max(8 * k));
    let sample: Vec<usize> = if m == n {
        (0..n).collect()
    } else {
        rand::seq::index::sample(&mut r, n, m).into_iter().collect()
    };
    let pt = |i: usize| &data[i * s..(i + 1) * s];
    let mut cb = Vec::with_capacity(k * s);
    cb.extend_from_slice(pt(sample[r.random_range(0..m)]));
    let mut best: Vec<f64> = sample.iter().map(|&i| sq_dist(pt(i), &cb[..s]) as f64).collect();
    for _ in 1..k {
        let total: f64 = best.iter().sum();
        let pick = if total > 0.0 {
            let mut t = r.random::<f64>() * total;
            let mut j = 0;
            while j + 1 < m && t >= best[j] {
                t -= best[j];
                j += 1;
            }
            j
        } else {
            r.random_range(0..m)
        };
        let c = pt(sample[pick]).to_vec();
        for (b, &i) in best.iter_mut().zip(&sample) {
            *b = b.min(sq_dist(pt(i), &c) as f64);
        }
        cb.extend_from_slice(&c);
    }
    // Lloyd iterations.
    let mut report = KmeansReport::default();
    let mut assign = vec![0u32; n];
    for it in 0..max_iters.max(1) {
        crate::cpu::vq_quantize(data, &cb, n, k, s, &mut assign);
        let errs: Vec<f32> = (0..n).map(|i| sq_dist(pt(i), &cb[assign[i] as usize * s..][..s])).collect();
        let dist = errs.iter().map(|&e| e as f64).sum::<f64>() / n as f64;
        let prev = report.distortion.last().copied();
        report.distortion.push(dist);
        if it + 1 == max_iters.max(1) || prev.is_some_and(|p| p - dist <= tol * p) {
            break;
        }
        let mut sum = vec![0.0f64; k * s];
        let mut cnt = vec![0usize; k];
        for i in 0..n {
            let a = assign[i] as usize;
            cnt[a] += 1;
            for (acc, &v) in sum[a * s..(a + 1) * s].iter_mut().zip(pt(i)) {
                *acc += v as f64;
            }
        }
        let empty: Vec<usize> = (0..k).filter(|&c| cnt[c] == 0).collect();
        for c in 0..k {
            if cnt[c] > 0 {
                for j in 0..s {
                    cb[c * s + j] = (sum[c * s + j] / cnt[c] as f64) as f32;
                }
            }
        }
        if !empty.is_empty() {
            // Largest errors first (ties by index): each empty centroid takes
            // one of those points, which can only lower the distortion.
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| errs[b].total_cmp(&errs[a]).then(a.cmp(&b)));
            for (&c, &i) in empty.iter().zip(&order) {
                cb[c * s..(c + 1) * s].copy_from_slice(pt(i));
            }
            report.reseeded += empty.len();
        }
    }
    Ok((cb, report))
}

impl ProductQuantizer {
    /// Calibrates λ (if `smooth`) and trains the codebook on `calib`
    /// (rows of `dim`).
    pub fn train(calib: &[f32], dim: usize, cfg: PqConfig) -> Result<(Self, KmeansReport)> {
        if ![2, 4, 8].contains(&cfg.sub_dim) {
            return Err(QuantError::arg("sub_dim", format!("{} is not 2, 4 or 8", cfg.sub_dim)));
        }
        if !(1..=12).contains(&cfg.bits) {
            return Err(QuantError::UnsupportedBits { method: METHOD, bits: cfg.bits, supported: "1..=12" });
        }
        if dim == 0 || dim % cfg.sub_dim != 0 {
            return Err(QuantError::UnsupportedDim {
                method: METHOD,
                dim,
                reason: format!("must be a positive multiple of sub_dim {}", cfg.sub_dim),
            });
        }
        let n = check_rows(calib, dim)?;
        if n == 0 {
            return Err(QuantError::Calibration("pq needs at least one calibration row".into()));
        }
        let lambda = cfg.smooth.then(|| {
            let mut mx = vec![0.0f32; dim];
            for row in calib.chunks(dim) {
                for (m, &v) in mx.iter_mut().zip(row) {
                    *m = m.max(v.abs());
                }
            }
            // A channel that is zero everywhere keeps λ = 1.
            mx.iter().map(|&m| if m > 0.0 { m.sqrt() } else { 1.0 }).collect()
        });
        let rotation = if cfg.rotate { Some(Rotation::hadamard(dim, cfg.seed)?) } else { None };
        let mut pq = ProductQuantizer { dim, sub_dim: cfg.sub_dim, bits: cfg.bits, lambda, rotation, codebook: Vec::new() };
        let t = pq.transform_keys(calib);
        let (cb, report) = kmeans(&t, cfg.sub_dim, 1 << cfg.bits, cfg.seed, cfg.max_iters, cfg.tol)?;
        pq.codebook = cb;
        Ok((pq, report))
    }

    pub fn codebook(&self) -> &[f32] {
        &self.codebook
    }

    pub fn lambda(&self) -> Option<&[f32]> {
        self.lambda.as_deref()
    }

    /// Keys into the code domain: `H (k / λ)`, row by row.
    pub fn transform_keys(&self, x: &[f32]) -> Vec<f32> {
        self.transform(x, false)
    }

    /// Queries into the code domain: `H (q · λ)`, so that
    /// `⟨transform_query(q), transform_keys(k)⟩ = ⟨q, k⟩`.
    pub fn transform_queries(&self, q: &[f32]) -> Vec<f32> {
        self.transform(q, true)
    }

    fn transform(&self, x: &[f32], query: bool) -> Vec<f32> {
        let d = self.dim;
        let mut out = vec![0.0f32; x.len()];
        for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
            let mut t = row.to_vec();
            if let Some(l) = &self.lambda {
                for (v, &li) in t.iter_mut().zip(l) {
                    *v = if query { *v * li } else { *v / li };
                }
            }
            match &self.rotation {
                Some(r) => r.forward(&t, o),
                None => o.copy_from_slice(&t),
            }
        }
        out
    }

    pub fn from_artifact(a: &Artifact) -> Result<Self> {
        a.expect_method(METHOD)?;
        let dim: usize = a.get("dim")?;
        let sub_dim: usize = a.get("sub_dim")?;
        let bits: u32 = a.get("bits")?;
        if ![2, 4, 8].contains(&sub_dim) || !(1..=12).contains(&bits) || dim == 0 || dim % sub_dim != 0 {
            return Err(QuantError::Artifact(format!("invalid pq configuration dim={dim} sub_dim={sub_dim} bits={bits}")));
        }
        let lambda = if a.get::<bool>("smooth")? {
            let l = a.f32s("lambda", &[dim])?;
            if l.iter().any(|&v| v <= 0.0) {
                return Err(QuantError::Artifact("tensor lambda must be positive".into()));
            }
            Some(l)
        } else {
            None
        };
        let rotation = if a.get::<bool>("rotate")? { Some(artifact::get_rotation(a, "", dim)?) } else { None };
        Ok(ProductQuantizer {
            dim,
            sub_dim,
            bits,
            lambda,
            rotation,
            codebook: a.f32s("codebook", &[1 << bits, sub_dim])?,
        })
    }
}

impl Quantizer for ProductQuantizer {
    fn method(&self) -> &'static str {
        METHOD
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn encode(&self, x: &[f32]) -> Result<Encoded> {
        let n = check_rows(x, self.dim)?;
        let t = self.transform_keys(x);
        let per = self.dim / self.sub_dim;
        let mut idx = vec![0u32; n * per];
        crate::cpu::vq_quantize(&t, &self.codebook, n * per, 1 << self.bits, self.sub_dim, &mut idx);
        let (lo, hi) = code_planes(self.bits);
        let low: Vec<u8> = idx.iter().map(|&c| (c & ((1 << lo) - 1)) as u8).collect();
        let mut e = Encoded::new(METHOD, n, self.dim);
        e.push("codes", pack(&low, n, per, lo));
        if hi > 0 {
            let high: Vec<u8> = idx.iter().map(|&c| (c >> lo) as u8).collect();
            e.push("codes_hi", pack(&high, n, per, hi));
        }
        Ok(e)
    }

    fn decode(&self, enc: &Encoded) -> Result<Vec<f32>> {
        enc.check(METHOD, self.dim)?;
        let (n, d, s) = (enc.rows, self.dim, self.sub_dim);
        let per = d / s;
        let (lo, hi) = code_planes(self.bits);
        let low = unpack(enc.buffer("codes", packed_bytes(n, per, lo))?, n, per, lo);
        let high = if hi > 0 {
            unpack(enc.buffer("codes_hi", packed_bytes(n, per, hi))?, n, per, hi)
        } else {
            vec![0; n * per]
        };
        let mut out = vec![0.0f32; n * d];
        let mut y = vec![0.0f32; d];
        for r in 0..n {
            for p in 0..per {
                let c = (low[r * per + p] as usize) | ((high[r * per + p] as usize) << lo);
                y[p * s..(p + 1) * s].copy_from_slice(&self.codebook[c * s..(c + 1) * s]);
            }
            let o = &mut out[r * d..(r + 1) * d];
            match &self.rotation {
                Some(rot) => rot.inverse(&y, o),
                None => o.copy_from_slice(&y),
            }
            if let Some(l) = &self.lambda {
                o.iter_mut().zip(l).for_each(|(v, &li)| *v *= li);
            }
        }
        Ok(out)
    }

    fn shared_bytes(&self) -> usize {
        self.codebook.len() * 4
            + self.lambda.as_ref().map_or(0, |l| l.len() * 4)
            + self.rotation.as_ref().map_or(0, |r| r.shared_bytes())
    }

    fn to_artifact(&self) -> Artifact {
        let mut a = Artifact::new(METHOD);
        a.set("dim", self.dim);
        a.set("sub_dim", self.sub_dim);
        a.set("bits", self.bits);
        a.set("smooth", self.lambda.is_some());
        a.set("rotate", self.rotation.is_some());
        a.put_f32("codebook", &[1 << self.bits, self.sub_dim], &self.codebook);
        if let Some(l) = &self.lambda {
            a.put_f32("lambda", &[self.dim], l);
        }
        if let Some(r) = &self.rotation {
            artifact::put_rotation(&mut a, "", r);
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::{gaussian, mse};

    /// Gaussian rows with AR(1) correlation ρ between neighbouring channels
    /// (unit variance per channel).
    fn correlated(n: usize, d: usize, rho: f32, seed: u64) -> Vec<f32> {
        let mut x = gaussian(n, d, seed);
        let c = (1.0 - rho * rho).sqrt();
        for row in x.chunks_mut(d) {
            for j in 1..d {
                row[j] = rho * row[j - 1] + c * row[j];
            }
        }
        x
    }

    #[test]
    fn kmeans_never_rises_and_is_deterministic() {
        let data = gaussian(6000, 4, 3);
        let (cb, rep) = kmeans(&data, 4, 64, 9, 30, 0.0).unwrap();
        assert!(rep.distortion.len() > 3);
        for w in rep.distortion.windows(2) {
            assert!(w[1] <= w[0] * (1.0 + 1e-6), "{:?}", rep.distortion);
        }
        assert!(rep.distortion.last().unwrap() < &(rep.distortion[0] * 0.98));
        let (cb2, _) = kmeans(&data, 4, 64, 9, 30, 0.0).unwrap();
        assert_eq!(cb, cb2);
        let (cb3, _) = kmeans(&data, 4, 64, 10, 30, 0.0).unwrap();
        assert_ne!(cb, cb3);
    }

    #[test]
    fn empty_clusters_are_reseeded() {
        // 40 points on 8 distinct locations, 16 centroids: k-means++ must
        // pick duplicates, which stay empty until re-seeded.
        let data: Vec<f32> = (0..40).flat_map(|i| [(i % 8) as f32, 0.0]).collect();
        let (cb, rep) = kmeans(&data, 2, 16, 1, 10, 0.0).unwrap();
        assert!(rep.reseeded > 0);
        assert!(*rep.distortion.last().unwrap() < 1e-12, "{:?}", rep.distortion);
        assert!(cb.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn beats_scalar_two_bits_on_correlated_channels() {
        let d = 64;
        let train = correlated(4000, d, 0.9, 1);
        let x = correlated(2000, d, 0.9, 2);
        // 4 elements per 8-bit code: 2 bits per element.
        let cfg = PqConfig { smooth: false, rotate: false, max_iters: 15, ..PqConfig::keys(4, 8) };
        let (pq, _) = ProductQuantizer::train(&train, d, cfg).unwrap();
        let e = pq.encode(&x).unwrap();
        assert_eq!(e.stored_bytes(), 2000 * d * 2 / 8);
        let got = mse(&x, &pq.decode(&e).unwrap(), d) / d as f64;
        // Best scalar 2-bit quantizer for unit-variance Gaussian channels
        // (Lloyd–Max, 0.1175 per element) and TurboQuant-MSE at 2 bits.
        let lm = ScalarCodebook::sphere(4096, 2).unwrap();
        let s = 64.0f32;
        let scalar: Vec<f32> = x.iter().map(|&v| lm.value(lm.quantize(v / s)) * s).collect();
        let sc = mse(&x, &scalar, d) / d as f64;
        let tq = TurboQuantMse::new(d, 2, RotationKind::Hadamard, 1).unwrap();
        let tm = mse(&x, &tq.decode(&tq.encode(&x).unwrap()).unwrap(), d) / d as f64;
        assert!(got < 0.7 * sc && got < 0.7 * tm, "pq {got}, scalar {sc}, turboquant {tm}");
    }

    #[test]
    fn smoothing_preserves_inner_products_and_wide_codes_round_trip() {
        let d = 32;
        let mut k = gaussian(600, d, 4);
        for row in k.chunks_mut(d) {
            row[5] *= 30.0;
        }
        let (pq, _) = ProductQuantizer::train(&k, d, PqConfig { max_iters: 3, ..PqConfig::keys(2, 9) }).unwrap();
        let l = pq.lambda().unwrap();
        assert!(l[5] > 3.0 * l[0]);
        let q = gaussian(3, d, 5);
        let (tq, tk) = (pq.transform_queries(&q), pq.transform_keys(&k[..3 * d]));
        for i in 0..3 {
            let a = dot(&q[i * d..(i + 1) * d], &k[i * d..(i + 1) * d]);
            let b = dot(&tq[i * d..(i + 1) * d], &tk[i * d..(i + 1) * d]);
            assert!((a - b).abs() < 1e-3 * (1.0 + a.abs()), "{a} vs {b}");
        }
        // 9-bit codes: an 8-bit plane and a 1-bit plane; decoding the codes
        // gives back exactly the chosen centroids.
        let e = pq.encode(&k).unwrap();
        assert_eq!(e.stored_bytes(), 600 * (16 + 2));
        let y = pq.decode(&e).unwrap();
        let ty = pq.transform_keys(&y);
        let cb = pq.codebook();
        for sub in ty.chunks(2).take(500) {
            assert!(cb.chunks(2).any(|c| (c[0] - sub[0]).abs() < 1e-3 && (c[1] - sub[1]).abs() < 1e-3));
        }
    }

    #[test]
    fn errors() {
        let d = 16;
        let x = gaussian(10, d, 1);
        assert!(matches!(ProductQuantizer::train(&[], d, PqConfig::keys(4, 4)), Err(QuantError::Calibration(_))));
        // 40 sub-vectors for 256 centroids.
        assert!(matches!(ProductQuantizer::train(&x, d, PqConfig::keys(4, 8)), Err(QuantError::Calibration(_))));
        assert!(ProductQuantizer::train(&x, d, PqConfig::keys(3, 2)).is_err());
        assert!(ProductQuantizer::train(&x, d, PqConfig::keys(4, 13)).is_err());
        assert!(ProductQuantizer::train(&x, 12, PqConfig::keys(8, 2)).is_err());
        let mut bad = x.clone();
        bad[3] = f32::NAN;
        assert!(ProductQuantizer::train(&bad, d, PqConfig::keys(4, 2)).is_err());
    }
}
