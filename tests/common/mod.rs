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

/// `window_append` under `opts` against the reference graph on the CPU, for
/// windows `[2, 3, 12, d]` in `dtype` and `t` tokens from slot 5, the
/// tokens given as transposed views: slots outside the new ones must come
/// back bit for bit, the new ones within `tol` of the largest value.
pub fn check_window_append(opts: &veloxquant::Options, dtype: Dtype, d: i32, t: i32, offset: bool, rotate_v: bool, tol: f32) {
    use veloxquant::kernels::window::{window_append, WindowAppend};
    let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64((d * 16 + t) as u64);
    let (b, h, w, at) = (2, 3, 12, 5usize);
    let cpu = Stream::cpu();
    let tokens = |rng: &mut ChaCha8Rng| ops::transpose(&normal(rng, &[b, t, h, d], dtype), &[0, 2, 1, 3], &cpu).unwrap();
    let (keys, values) = (tokens(&mut rng), tokens(&mut rng));
    let key_frame = normal(&mut rng, &[d, d], dtype);
    let value_frame = normal(&mut rng, &[d, d], dtype);
    let key_offset = normal(&mut rng, &[b, h, 1, d], dtype);
    let (win_k, win_v) = (normal(&mut rng, &[b, h, w, d], dtype), normal(&mut rng, &[b, h, w, d], dtype));
    let args = WindowAppend {
        keys: &keys,
        values: &values,
        key_frame: &key_frame,
        key_offset: offset.then_some(&key_offset),
        value_frame: rotate_v.then_some(&value_frame),
        win_k: &win_k,
        win_v: &win_v,
        at,
    };
    let reference = veloxquant::Options::on(cpu.clone(), veloxquant::Policy::Off);
    let (want_k, want_v) = window_append(&args, &reference).unwrap();
    let (got_k, got_v) = window_append(&args, opts).unwrap();
    for (side, got, want) in [("keys", got_k, want_k), ("values", got_v, want_v)] {
        assert_eq!(got.shape(), vec![b, h, w, d]);
        assert_eq!(got.dtype(), dtype);
        let (got, want) = (f32s(&got), f32s(&want));
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            let slot = (i / d as usize) % w as usize;
            let tag = format!("{side} {dtype} d={d} t={t} offset={offset} rotate_v={rotate_v} slot {slot}");
            if slot < at || slot >= at + t as usize {
                assert_eq!(g.to_bits(), e.to_bits(), "{tag}: an untouched slot changed");
            } else {
                assert!((g - e).abs() <= tol * largest, "{tag}: {g} vs {e}");
            }
        }
    }
}
