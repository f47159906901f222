//! Random rotations Π applied before scalar quantization.
//!
//! - [`RotationKind::Hadamard`]: `Π = H · D / √d`, `D` a seeded random ±1
//!   diagonal and `H` a Hadamard matrix of order `d`, applied in
//!   O(d log d). For `d = m · 2^k` with `m ∈ {12, 20}` (80 = 20·4, 96 = 12·8)
//!   `H = H_m ⊗ H_{2^k}`, the scheme of MLX's `hadamard_transform`: a fast
//!   Walsh–Hadamard transform on each of the `m` contiguous blocks of `2^k`,
//!   then the `m × m` Paley matrix across blocks. Unlike a block-diagonal
//!   split this mixes all coordinates, so every size behaves like a power of
//!   two. Other sizes are refused (use the dense rotation).
//! - [`RotationKind::Dense`]: a Haar-random orthogonal matrix, the
//!   orthonormalized rows (Gram–Schmidt, i.e. QR) of a seeded Gaussian
//!   matrix; any `d`, O(d²) per vector.

use super::{rng, QuantError, Result};
use crate::cpu::turboquant::fwht;
use rand::RngExt;
use rand_distr::StandardNormal;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotationKind {
    Hadamard,
    Dense,
}

impl RotationKind {
    pub fn name(self) -> &'static str {
        match self {
            RotationKind::Hadamard => "hadamard",
            RotationKind::Dense => "dense",
        }
    }

    pub fn from_name(s: &str) -> Result<Self> {
        match s {
            "hadamard" => Ok(RotationKind::Hadamard),
            "dense" => Ok(RotationKind::Dense),
            _ => Err(QuantError::arg("rotation", format!("unknown kind {s:?} (hadamard, dense)"))),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rotation {
    dim: usize,
    kind: RotationKind,
    /// Hadamard: the ±1 diagonal `D`.
    signs: Vec<f32>,
    /// Hadamard: order of the non-power-of-two factor (1, 12 or 20) and its
    /// ±1 matrix, row-major.
    m: usize,
    hm: Vec<f32>,
    /// Dense: `Π`, row-major `d × d`.
    matrix: Vec<f32>,
}

/// Paley construction I: a Hadamard matrix of order `q + 1` for a prime
/// `q ≡ 3 (mod 4)`: `H = I + [[0, 1ᵀ], [-1, Q]]`, `Q` the Jacobsthal matrix.
fn paley(q: usize) -> Vec<f32> {
    let n = q + 1;
    let mut chi = vec![-1.0f32; q];
    chi[0] = 0.0;
    for a in 1..q {
        chi[a * a % q] = 1.0;
    }
    let mut h = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let s = match (i, j) {
                (0, 0) => 0.0,
                (0, _) => 1.0,
                (_, 0) => -1.0,
                _ => chi[(j + q - i) % q],
            };
            h[i * n + j] = s + if i == j { 1.0 } else { 0.0 };
        }
    }
    h
}

/// The unnormalized Sylvester Hadamard matrix of a power-of-two size `n`,
/// row-major: `H[i][j] = (-1)^popcount(i & j)`, the matrix `fwht` applies.
pub fn sylvester_hadamard(n: usize) -> Vec<f32> {
    debug_assert!(n.is_power_of_two());
    (0..n * n).map(|e| if ((e / n) & (e % n)).count_ones() % 2 == 0 { 1.0 } else { -1.0 }).collect()
}

/// The `m` of `d = m · 2^k` that the Hadamard rotation uses, if any.
pub fn hadamard_factor(dim: usize) -> Option<usize> {
    if dim == 0 {
        return None;
    }
    [1usize, 12, 20]
        .into_iter()
        .find(|&m| dim % m == 0 && (dim / m).is_power_of_two())
}

impl Rotation {
    pub fn new(kind: RotationKind, dim: usize, seed: u64) -> Result<Self> {
        match kind {
            RotationKind::Hadamard => Self::hadamard(dim, seed),
            RotationKind::Dense => Self::dense(dim, seed),
        }
    }

    pub fn hadamard(dim: usize, seed: u64) -> Result<Self> {
        let mut r = rng(seed);
        let signs = (0..dim).map(|_| if r.random::<bool>() { 1.0 } else { -1.0 }).collect();
        Self::from_signs(dim, signs)
    }

    /// A Hadamard rotation with the given ±1 diagonal (from an artifact).
    pub fn from_signs(dim: usize, signs: Vec<f32>) -> Result<Self> {
        let m = hadamard_factor(dim).ok_or_else(|| QuantError::UnsupportedDim {
            method: "hadamard rotation",
            dim,
            reason: "needs m·2^k with m in 1, 12, 20; use the dense rotation".into(),
        })?;
        if signs.len() != dim || signs.iter().any(|&s| s != 1.0 && s != -1.0) {
            return Err(QuantError::arg("signs", format!("need {dim} values of ±1")));
        }
        let hm = if m == 1 { vec![1.0] } else { paley(m - 1) };
        Ok(Rotation { dim, kind: RotationKind::Hadamard, signs, m, hm, matrix: Vec::new() })
    }

    pub fn dense(dim: usize, seed: u64) -> Result<Self> {
        if dim == 0 {
            return Err(QuantError::UnsupportedDim {
                method: "dense rotation",
                dim,
                reason: "must be positive".into(),
            });
        }
        let mut r = rng(seed);
        let g: Vec<f64> = (0..dim * dim).map(|_| r.sample::<f64, _>(StandardNormal)).collect();
        let q = orthonormalize_rows(g, dim, dim);
        Self::from_matrix(dim, q.iter().map(|&v| v as f32).collect())
    }

    /// A dense rotation with the given row-major matrix (from an artifact).
    pub fn from_matrix(dim: usize, matrix: Vec<f32>) -> Result<Self> {
        if matrix.len() != dim * dim || matrix.iter().any(|v| !v.is_finite()) {
            return Err(QuantError::arg("matrix", format!("need {dim}×{dim} finite values")));
        }
        Ok(Rotation {
            dim,
            kind: RotationKind::Dense,
            signs: Vec::new(),
            m: 1,
            hm: Vec::new(),
            matrix,
        })
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn kind(&self) -> RotationKind {
        self.kind
    }

    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    pub fn matrix(&self) -> &[f32] {
        &self.matrix
    }

    /// Bytes a cache keeps for it: the signs as a bitmask, or the f32 matrix.
    pub fn shared_bytes(&self) -> usize {
        match self.kind {
            RotationKind::Hadamard => self.dim.div_ceil(8),
            RotationKind::Dense => self.dim * self.dim * 4,
        }
    }

    /// `Π` as a dense row-major `[d, d]` matrix (column `j` is `Π e_j`).
    pub fn to_dense(&self) -> Vec<f32> {
        let d = self.dim;
        let mut m = vec![0.0f32; d * d];
        let mut e = vec![0.0f32; d];
        let mut col = vec![0.0f32; d];
        for j in 0..d {
            e.iter_mut().for_each(|v| *v = 0.0);
            e[j] = 1.0;
            self.forward(&e, &mut col);
            for i in 0..d {
                m[i * d + j] = col[i];
            }
        }
        m
    }

    /// `out = Π x`.
    pub fn forward(&self, x: &[f32], out: &mut [f32]) {
        let d = self.dim;
        match self.kind {
            RotationKind::Hadamard => {
                for i in 0..d {
                    out[i] = x[i] * self.signs[i];
                }
                self.hadamard_in_place(out, false);
            }
            RotationKind::Dense => {
                for (o, row) in out.iter_mut().zip(self.matrix.chunks_exact(d)) {
                    *o = super::dot(row, x);
                }
            }
        }
    }

    /// `out = Πᵀ y`.
    pub fn inverse(&self, y: &[f32], out: &mut [f32]) {
        let d = self.dim;
        match self.kind {
            RotationKind::Hadamard => {
                out.copy_from_slice(&y[..d]);
                self.hadamard_in_place(out, true);
                for i in 0..d {
                    out[i] *= self.signs[i];
                }
            }
            RotationKind::Dense => {
                out.iter_mut().for_each(|o| *o = 0.0);
                for (row, &yi) in self.matrix.chunks_exact(d).zip(y) {
                    for (o, &r) in out.iter_mut().zip(row) {
                        *o += r * yi;
                    }
                }
            }
        }
    }

    /// `x ← (H_m ⊗ H_p) x / √d`, or with `H_mᵀ` when `transpose`.
    fn hadamard_in_place(&self, x: &mut [f32], transpose: bool) {
        let d = self.dim;
        let m = self.m;
        let p = d / m;
        for block in x.chunks_exact_mut(p) {
            fwht(block);
        }
        if m > 1 {
            let mut col = [0.0f32; 20];
            for r in 0..p {
                for a in 0..m {
                    col[a] = x[a * p + r];
                }
                for a in 0..m {
                    let mut acc = 0.0;
                    for b in 0..m {
                        let h = if transpose { self.hm[b * m + a] } else { self.hm[a * m + b] };
                        acc += h * col[b];
                    }
                    x[a * p + r] = acc;
                }
            }
        }
        let s = 1.0 / (d as f32).sqrt();
        x.iter_mut().for_each(|v| *v *= s);
    }
}

/// Orthonormalizes the `rows` rows of `g` (`rows <= cols`) by modified
/// Gram–Schmidt, run twice for accuracy; keeps each row's direction, which
/// for a Gaussian `g` makes the result Haar distributed (QR with a positive
/// diagonal of R).
pub(crate) fn orthonormalize_rows(mut g: Vec<f64>, rows: usize, cols: usize) -> Vec<f64> {
    assert!(rows <= cols);
    for i in 0..rows {
        for _pass in 0..2 {
            for j in 0..i {
                let (done, rest) = g.split_at_mut(i * cols);
                let qj = &done[j * cols..(j + 1) * cols];
                let gi = &mut rest[..cols];
                let p: f64 = qj.iter().zip(gi.iter()).map(|(a, b)| a * b).sum();
                gi.iter_mut().zip(qj).for_each(|(v, q)| *v -= p * q);
            }
        }
        let row = &mut g[i * cols..(i + 1) * cols];
        let n = row.iter().map(|v| v * v).sum::<f64>().sqrt();
        row.iter_mut().for_each(|v| *v /= n);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::gaussian;

    #[test]
    fn paley_is_hadamard() {
        for q in [11usize, 19] {
            let n = q + 1;
            let h = paley(q);
            for i in 0..n {
                for j in 0..n {
                    let s: f32 = (0..n).map(|k| h[i * n + k] * h[j * n + k]).sum();
                    assert_eq!(s, if i == j { n as f32 } else { 0.0 }, "q={q} i={i} j={j}");
                }
            }
        }
    }

    /// Columns Π e_i must be orthonormal and the inverse must undo Π, for
    /// every head size and both kinds.
    #[test]
    fn orthonormal_and_invertible() {
        for kind in [RotationKind::Hadamard, RotationKind::Dense] {
            for d in [12usize, 64, 80, 96, 128, 256] {
                let r = Rotation::new(kind, d, 7).unwrap();
                let mut cols = vec![0.0f32; d * d];
                let mut e = vec![0.0f32; d];
                for i in 0..d {
                    e.iter_mut().for_each(|v| *v = 0.0);
                    e[i] = 1.0;
                    r.forward(&e, &mut cols[i * d..(i + 1) * d]);
                }
                let mut worst = 0.0f32;
                for i in 0..d {
                    for j in 0..d {
                        let s = super::super::dot(&cols[i * d..(i + 1) * d], &cols[j * d..(j + 1) * d]);
                        let want = if i == j { 1.0 } else { 0.0 };
                        worst = worst.max((s - want).abs());
                    }
                }
                assert!(worst < 1e-5, "{kind:?} d={d}: |ΠᵀΠ - I| = {worst}");
                let x = gaussian(4, d, 3);
                for row in x.chunks(d) {
                    let mut y = vec![0.0; d];
                    let mut back = vec![0.0; d];
                    r.forward(row, &mut y);
                    r.inverse(&y, &mut back);
                    let err = row.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                    assert!(err < 1e-5, "{kind:?} d={d}: inverse error {err}");
                }
            }
        }
    }

    #[test]
    fn hadamard_mixes_every_coordinate() {
        // A basis vector must spread over all d outputs with magnitude 1/√d:
        // a block-diagonal scheme would leave most outputs at zero.
        for d in [80usize, 96] {
            let r = Rotation::hadamard(d, 1).unwrap();
            let mut e = vec![0.0f32; d];
            e[d - 1] = 1.0;
            let mut y = vec![0.0; d];
            r.forward(&e, &mut y);
            let want = 1.0 / (d as f32).sqrt();
            assert!(y.iter().all(|v| (v.abs() - want).abs() < 1e-6), "d={d}");
        }
    }

    #[test]
    fn seeded_and_unsupported() {
        assert_eq!(Rotation::hadamard(128, 5).unwrap(), Rotation::hadamard(128, 5).unwrap());
        assert_ne!(Rotation::hadamard(128, 5).unwrap(), Rotation::hadamard(128, 6).unwrap());
        assert_eq!(Rotation::dense(64, 5).unwrap(), Rotation::dense(64, 5).unwrap());
        let e = Rotation::hadamard(100, 1).unwrap_err();
        assert!(e.to_string().starts_with("dim: 100 is not supported"), "{e}");
        assert!(Rotation::dense(100, 1).is_ok());
        assert!(Rotation::dense(0, 1).is_err());
    }
}
