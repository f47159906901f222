//! QJL (Zandieh et al. 2024): a 1-bit Johnson–Lindenstrauss sketch.
//!
//! `S` is an `m × d` seeded Gaussian matrix. A key `k` is stored as the
//! packed signs of `S k` (`m` bits, bit = 1 for `≥ 0`) and `‖k‖` in float16.
//! The estimate of `⟨q, k⟩` is `√(π/2)/m · ‖k‖ · ⟨S q, sign(S k)⟩`, unbiased
//! because `E[(s·q) sign(s·k)] = √(2/π) ⟨q, k⟩/‖k‖` for a Gaussian row `s`.
//! `decode` returns `√(π/2)/m · ‖k‖ · Sᵀ sign(S k)`, whose inner product with
//! any `q` is that estimate.
//!
//! With `orthogonal`, each block of `d` rows is orthonormalized and every
//! row rescaled to the length of its Gaussian original: rows keep their
//! N(0, I) marginals (the estimate stays unbiased) but are no longer
//! independent within a block, which lowers the variance.

use super::*;
use rand::RngExt;
use rand_distr::StandardNormal;

pub const METHOD: &str = "qjl";

/// A seeded `m × d` sketch, row-major f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Sketch {
    pub m: usize,
    pub d: usize,
    pub s: Vec<f32>,
}

impl Sketch {
    pub fn new(m: usize, d: usize, orthogonal: bool, seed: u64) -> Self {
        let mut r = rng(seed);
        let g: Vec<f64> = (0..m * d).map(|_| r.sample::<f64, _>(StandardNormal)).collect();
        let s = if orthogonal {
            let mut out = Vec::with_capacity(m * d);
            for block in g.chunks(d * d) {
                let rows = block.len() / d;
                let q = rotation::orthonormalize_rows(block.to_vec(), rows, d);
                for (qr, gr) in q.chunks(d).zip(block.chunks(d)) {
                    let len = gr.iter().map(|v| v * v).sum::<f64>().sqrt();
                    out.extend(qr.iter().map(|v| (v * len) as f32));
                }
            }
            out
        } else {
            g.iter().map(|&v| v as f32).collect()
        };
        Sketch { m, d, s }
    }

    /// Sign bits (1 for `≥ 0`) of `S v`, one per row.
    pub fn signs(&self, v: &[f32], out: &mut [u8]) {
        for (o, row) in out.iter_mut().zip(self.s.chunks_exact(self.d)) {
            *o = u8::from(dot(row, v) >= 0.0);
        }
    }

    /// `out += scale · Sᵀ z`, `z` the ±1 vector of the sign bits.
    pub fn add_transpose(&self, bits: &[u8], scale: f32, out: &mut [f32]) {
        for (&b, row) in bits.iter().zip(self.s.chunks_exact(self.d)) {
            let z = if b != 0 { scale } else { -scale };
            out.iter_mut().zip(row).for_each(|(o, &s)| *o += z * s);
        }
    }
}

#[derive(Clone, Debug)]
pub struct Qjl {
    dim: usize,
    orthogonal: bool,
    sketch: Sketch,
}

impl Qjl {
    /// A sketch of `m` rows for keys of `dim`.
    pub fn new(dim: usize, m: usize, orthogonal: bool, seed: u64) -> Result<Self> {
        if dim == 0 {
            return Err(QuantError::UnsupportedDim { method: METHOD, dim, reason: "must be positive".into() });
        }
        if m == 0 {
            return Err(QuantError::arg("m", "sketch size must be positive"));
        }
        Ok(Qjl { dim, orthogonal, sketch: Sketch::new(m, dim, orthogonal, seed) })
    }

    pub fn sketch_rows(&self) -> usize {
        self.sketch.m
    }

    fn scale(&self) -> f32 {
        (std::f32::consts::FRAC_PI_2).sqrt() / self.sketch.m as f32
    }

    /// The QJL estimate of `⟨q, k_row⟩` from the stored signs and norm.
    pub fn estimate(&self, q: &[f32], enc: &Encoded, row: usize) -> Result<f32> {
        enc.check(METHOD, self.dim)?;
        if q.len() != self.dim {
            return Err(QuantError::arg("q", format!("length {} is not dim {}", q.len(), self.dim)));
        }
        let m = self.sketch.m;
        let nb = crate::cpu::packed_len(m, 1);
        let signs = enc.buffer("signs", enc.rows * nb)?;
        let norms = f16_from_bytes(enc.buffer("norms", enc.rows * 2)?);
        if row >= enc.rows {
            return Err(QuantError::arg("row", format!("{row} is not below {}", enc.rows)));
        }
        let bits = unpack(&signs[row * nb..(row + 1) * nb], 1, m, 1);
        let mut acc = 0.0f32;
        for (&b, srow) in bits.iter().zip(self.sketch.s.chunks_exact(self.dim)) {
            let sq = dot(srow, q);
            acc += if b != 0 { sq } else { -sq };
        }
        Ok(self.scale() * norms[row] * acc)
    }

    pub fn from_artifact(a: &Artifact) -> Result<Self> {
        a.expect_method(METHOD)?;
        let dim: usize = a.get("dim")?;
        let m: usize = a.get("m")?;
        let s = a.f32s("sketch", &[m, dim])?;
        Ok(Qjl { dim, orthogonal: a.get("orthogonal")?, sketch: Sketch { m, d: dim, s } })
    }
}

impl Quantizer for Qjl {
    fn method(&self) -> &'static str {
        METHOD
    }

    fn dim(&self) -> usize {
        self.dim
    }

    fn encode(&self, x: &[f32]) -> Result<Encoded> {
        let d = self.dim;
        let n = check_rows(x, d)?;
        let m = self.sketch.m;
        let mut norms = Vec::with_capacity(n);
        for (i, row) in x.chunks(d).enumerate() {
            norms.push(to_f16("norm", i, norm(row))?);
        }
        let bits: Vec<Vec<u8>> = par_rows(n, |i| {
            let mut b = vec![0u8; m];
            self.sketch.signs(&x[i * d..(i + 1) * d], &mut b);
            b
        });
        let mut e = Encoded::new(METHOD, n, d);
        e.push("signs", pack(&bits.concat(), n, m, 1));
        e.push("norms", f16_bytes(&norms));
        Ok(e)
    }

    fn decode(&self, enc: &Encoded) -> Result<Vec<f32>> {
        enc.check(METHOD, self.dim)?;
        let (n, d, m) = (enc.rows, self.dim, self.sketch.m);
        let bits = unpack(enc.buffer("signs", packed_bytes(n, m, 1))?, n, m, 1);
        let norms = f16_from_bytes(enc.buffer("norms", n * 2)?);
        let mut out = vec![0.0f32; n * d];
        crate::cpu::for_each_chunk(&mut out, d, 256, |r0, chunk| {
            for (i, o) in chunk.chunks_mut(d).enumerate() {
                let r = r0 + i;
                self.sketch.add_transpose(&bits[r * m..(r + 1) * m], self.scale() * norms[r], o);
            }
        });
        Ok(out)
    }

    fn shared_bytes(&self) -> usize {
        self.sketch.s.len() * 4
    }

    fn to_artifact(&self) -> Artifact {
        let mut a = Artifact::new(METHOD);
        a.set("dim", self.dim);
        a.set("m", self.sketch.m);
        a.set("orthogonal", self.orthogonal);
        a.put_f32("sketch", &[self.sketch.m, self.dim], &self.sketch.s);
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::unit;

    /// Errors of the estimate over pairs (k, q) with ⟨q, k⟩ ≈ 0.5: returns
    /// (mean error, standard error of the mean, rms error).
    fn errors(m: usize, orthogonal: bool, n: usize) -> (f64, f64, f64) {
        let d = 64;
        let qjl = Qjl::new(d, m, orthogonal, 11).unwrap();
        let k = unit(n, d, 1);
        let z = unit(n, d, 2);
        let enc = qjl.encode(&k).unwrap();
        let kh = qjl.decode(&enc).unwrap();
        let mut errs = Vec::with_capacity(n);
        for i in 0..n {
            let kr = &k[i * d..(i + 1) * d];
            let q: Vec<f32> = kr.iter().zip(&z[i * d..]).map(|(a, b)| 0.5 * a + 0.8 * b).collect();
            let est = dot(&q, &kh[i * d..(i + 1) * d]) as f64;
            if i < 8 {
                let direct = qjl.estimate(&q, &enc, i).unwrap() as f64;
                assert!((direct - est).abs() < 1e-4, "{direct} vs {est}");
            }
            errs.push(est - dot(&q, kr) as f64);
        }
        let mean = errs.iter().sum::<f64>() / n as f64;
        let var = errs.iter().map(|e| (e - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let rms = (errs.iter().map(|e| e * e).sum::<f64>() / n as f64).sqrt();
        (mean, (var / n as f64).sqrt(), rms)
    }

    #[test]
    fn unbiased_and_error_falls_like_inverse_sqrt_m() {
        let mut prev_rms = None;
        for m in [64usize, 256, 1024] {
            let (mean, se, rms) = errors(m, false, 4000);
            // ⟨q, k⟩ ≈ 0.5: the bias is within 4 standard errors of zero
            // and below 1% of the true value.
            assert!(mean.abs() < 4.0 * se + 1e-4 && mean.abs() < 0.005, "m={m}: {mean} ± {se}");
            // Var = ‖k‖²(π/2‖q‖² - ⟨q,k⟩²)/m, ‖q‖² ≈ 0.89.
            let want = ((std::f64::consts::FRAC_PI_2 * 0.89 - 0.25) / m as f64).sqrt();
            assert!((rms / want - 1.0).abs() < 0.1, "m={m}: rms {rms} vs {want}");
            if let Some(p) = prev_rms {
                let ratio: f64 = p / rms;
                assert!((ratio - 2.0).abs() < 0.25, "m={m}: ratio {ratio}");
            }
            prev_rms = Some(rms);
        }
    }

    #[test]
    fn orthogonal_rows_unbiased_and_not_worse() {
        let (mean, se, rms_o) = errors(64, true, 4000);
        assert!(mean.abs() < 4.0 * se + 1e-4, "{mean} ± {se}");
        let (_, _, rms_g) = errors(64, false, 4000);
        assert!(rms_o < rms_g * 1.02, "orthogonal {rms_o} vs gaussian {rms_g}");
    }

    #[test]
    fn zero_vector_and_bad_input() {
        let qjl = Qjl::new(8, 16, false, 1).unwrap();
        let mut x = vec![0.0f32; 16];
        x[8..].iter_mut().for_each(|v| *v = 1.0);
        let e = qjl.encode(&x).unwrap();
        assert_eq!(e.stored_bytes(), 2 * (2 + 2));
        let y = qjl.decode(&e).unwrap();
        assert!(y[..8].iter().all(|&v| v == 0.0));
        x[3] = f32::NAN;
        let err = qjl.encode(&x).unwrap_err().to_string();
        assert!(err.contains("element 3"), "{err}");
        assert!(Qjl::new(8, 0, false, 1).is_err());
        assert!(qjl.encode(&[1.0; 7]).is_err());
    }
}
