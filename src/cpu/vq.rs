//! Nearest-centroid search: x[N, d] against codebook[K, d] → u32 indices.
//!
//! The squared distance of one vector to one centroid is accumulated in
//! `f32` registers coordinate by coordinate, as `acc += diff * diff` (no fused
//! multiply-add), in the same order as the GPU kernels, and a strictly smaller
//! distance wins, so ties go to the lowest index. No [N, K, d] difference
//! tensor exists.

use half::{bf16, f16};

/// Element types the kernels read: converted to `f32` for the arithmetic.
pub trait VqElement: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// `dst[i] = src[i]` as `f32` (equal lengths): for half types the
    /// `half` crate's slice conversion, several lanes an instruction where
    /// each element's `to_f32` is a call of its own (a fifth of a short
    /// decode's attention went to those calls).
    #[inline]
    fn row_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

impl VqElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl VqElement for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn row_to_f32(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}
impl VqElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn row_to_f32(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

#[inline(always)]
fn nearest<const D: usize>(v: &[f32; D], centroids: &[f32]) -> u32 {
    let mut best = f32::INFINITY;
    let mut best_i = 0u32;
    for (k, c) in centroids.chunks_exact(D).enumerate() {
        let mut acc = 0.0f32;
        for j in 0..D {
            let diff = v[j] - c[j];
            acc += diff * diff;
        }
        if acc < best {
            best = acc;
            best_i = k as u32;
        }
    }
    best_i
}

fn run<T: VqElement, const D: usize>(x: &[T], centroids: &[f32], out: &mut [u32]) {
    super::for_each_chunk(out, 1, 1024, |row0, chunk| {
        for (i, o) in chunk.iter_mut().enumerate() {
            let base = (row0 + i) * D;
            let mut v = [0.0f32; D];
            for j in 0..D {
                v[j] = x[base + j].to_f32();
            }
            *o = nearest::<D>(&v, centroids);
        }
    });
}

/// Writes into `out[i]` the index of the centroid nearest to `x[i]`.
///
/// `x` holds `n * d` elements, `codebook` `k * d`; `d` is 2, 4 or 8 (other
/// sizes are handled by a generic loop with the same arithmetic).
pub fn vq_quantize<T: VqElement>(x: &[T], codebook: &[T], n: usize, k: usize, d: usize, out: &mut [u32]) {
    assert_eq!(x.len(), n * d, "x length");
    assert_eq!(codebook.len(), k * d, "codebook length");
    assert_eq!(out.len(), n, "indices length");
    assert!(k > 0 || n == 0, "empty codebook");
    let centroids: Vec<f32> = codebook.iter().map(|c| c.to_f32()).collect();
    match d {
        2 => run::<T, 2>(x, &centroids, out),
        4 => run::<T, 4>(x, &centroids, out),
        8 => run::<T, 8>(x, &centroids, out),
        _ => super::for_each_chunk(out, 1, 1024, |row0, chunk| {
            for (i, o) in chunk.iter_mut().enumerate() {
                let v = &x[(row0 + i) * d..(row0 + i + 1) * d];
                let mut best = f32::INFINITY;
                let mut best_i = 0u32;
                for (kk, c) in centroids.chunks_exact(d).enumerate() {
                    let mut acc = 0.0f32;
                    for j in 0..d {
                        let diff = v[j].to_f32() - c[j];
                        acc += diff * diff;
                    }
                    if acc < best {
                        best = acc;
                        best_i = kk as u32;
                    }
                }
                *o = best_i;
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_nearest_and_lowest_on_tie() {
        let cb = [0.0f32, 0.0, 1.0, 1.0, 1.0, 1.0];
        let x = [0.9f32, 0.8, 0.1, 0.0, 0.5, 0.5];
        let mut out = [9u32; 3];
        vq_quantize(&x, &cb, 3, 3, 2, &mut out);
        assert_eq!(out, [1, 0, 0]);
    }
}
