//! Helpers shared by the GPU cache tests.

use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::{ops, Array, Dtype, Stream};

/// Standard normal values of `shape` in `dtype`, made on the CPU.
pub fn normal(rng: &mut ChaCha8Rng, shape: &[i32], dtype: Dtype) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
    ops::astype(&Array::from_slice(&v, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
}

pub fn f32s(a: &Array) -> Vec<f32> {
    ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap()
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}
