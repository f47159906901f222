//! Helpers shared by the integration tests (CPU and GPU). Each test crate
//! uses a part of them.
#![allow(dead_code)]

use rand::RngExt;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::{ops, Array, Dtype, Element, Stream};

/// Standard normal values of `shape` in `dtype`, made on the CPU.
pub fn normal(rng: &mut ChaCha8Rng, shape: &[i32], dtype: Dtype) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
    ops::astype(&Array::from_slice(&v, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
}

pub fn f32s(a: &Array) -> Vec<f32> {
    ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap()
}

/// A row-contiguous `shape` view of `v` on the GPU stream that starts
/// `offset` elements into its buffer: MLX hands it to a kernel as is, so
/// wide accesses must check alignment.
pub fn offset_view<T: Element + Default + Copy>(v: &[T], shape: &[usize], offset: usize) -> Array {
    let s = Stream::gpu().unwrap();
    let mut padded = vec![T::default(); offset];
    padded.extend_from_slice(v);
    let all = Array::from_slice(&padded, &[padded.len() as i32]).unwrap();
    let view = ops::slice(&all, &[offset as i32], &[padded.len() as i32], &s).unwrap();
    ops::reshape(&view, &shape.iter().map(|&d| d as i32).collect::<Vec<_>>(), &s).unwrap()
}

/// QJL scores against the CPU kernel's, which sums through per-byte tables:
/// equal up to float32 rounding of the sums, relative to the largest score.
pub fn assert_scores_close(got: &[f32], want: &[f32], tag: &str) {
    let largest = want.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
    for (a, b) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-5 * largest, "score {tag}: {a} vs {b}");
    }
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

/// A boolean mask `[B, 1, L, T]` that hides about a third of the tokens (the
/// newest always seen, so no row is empty), and an additive `[B, Hq, L, T]`
/// bias with the same hidden tokens at `-inf`.
pub fn attention_masks(rng: &mut ChaCha8Rng, b: i32, hq: i32, l: i32, t: i32) -> (Array, Array) {
    let keep: Vec<bool> = (0..b * l * t).map(|i| i % t == t - 1 || rng.random::<f32>() >= 0.35).collect();
    let keep_u8: Vec<u8> = keep.iter().map(|&k| u8::from(k)).collect();
    let boolean = ops::astype(&Array::from_slice(&keep_u8, &[b, 1, l, t]).unwrap(), Dtype::Bool, &Stream::cpu()).unwrap();
    let additive: Vec<f32> = (0..b * hq * l * t)
        .map(|i| {
            let (bi, rest) = (i / (hq * l * t), i % (l * t));
            if keep[(bi * l * t + rest) as usize] { -rng.random::<f32>() } else { f32::NEG_INFINITY }
        })
        .collect();
    (boolean, Array::from_slice(&additive, &[b, hq, l, t]).unwrap())
}
