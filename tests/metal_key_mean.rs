//! metal/key_mean.metal on the emulator, launched as `src/kernels/key_mean.rs`
//! launches it (keys as a view of heads-transposed data, a threadgroup of 512
//! threads per (batch, head) row, a float32 stand-in without a rotation), against
//! `veloxquant::cpu::key_mean::key_mean`: the mean within float32 rounding of
//! the sums (the lanes add in another order), non-finite keys skipped, the
//! offset within one rounding step of its type.

mod metal_emulator;

use half::f16;
use metal_emulator::{Element, HostArray, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::key_mean::{key_mean, KeyMeanShape};
use veloxquant::cpu::{Float, VqElement};
use veloxquant::kernels::Kernel;

fn case<T: Element + Float + VqElement>(d: usize, t: usize, rotate: bool, tol: f32) {
    let mut rng = ChaCha8Rng::seed_from_u64((d * 1000 + t) as u64);
    let (b, h, frame) = (2usize, 3usize, 16.0f32);
    let mut x: Vec<T> = (0..b * h * t * d).map(|_| T::from_f32(rng.random::<f32>() * 4.0 - 1.0)).collect();
    let n = x.len();
    for (i, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY].into_iter().enumerate() {
        x[(i * 7919 + 3) % n] = T::from_f32(special);
    }
    let rot: Vec<f32> = (0..d * d).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let sh = KeyMeanShape { rows: b * h, tokens: t, dim: d, frame };
    let (mut want_mean, mut want_offset) = (vec![0.0f32; b * h * d], vec![T::from_f32(0.0); b * h * d]);
    key_mean(&x, rotate.then_some(&rot[..]), &sh, &mut want_mean, &mut want_offset);
    let rotation = if rotate { HostArray::new(&[d, d], &rot) } else { HostArray::new(&[1], &[0.0f32]) };
    let out = metal_emulator::declared(Kernel::KeyMean)
        .launch()
        .input(HostArray::heads_transposed([b, h, t, d], &x))
        .input(rotation)
        .output(&[b, h, 1, d], f32::DTYPE)
        .output(&[b, h, 1, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("ROTATE", TemplateArg::Bool(rotate))
        .template("FRAME", TemplateArg::Int(frame as i32))
        .template("TG", TemplateArg::Int(512))
        .grid((b * h * 512) as u32, 1, 1)
        .threadgroup(512, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("key_mean: {e}"));
    let tag = format!("{:?} d={d} t={t} rotate={rotate}", T::DTYPE);
    for (i, (g, e)) in out[0].to_vec::<f32>().iter().zip(&want_mean).enumerate() {
        assert!(g.is_finite() && (g - e).abs() <= 1e-5 * (1.0 + e.abs()), "{tag} mean {i}: {g} vs {e}");
    }
    let got = out[1].to_vec::<T>();
    let largest = want_offset.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
    for (i, (g, e)) in got.iter().zip(&want_offset).enumerate() {
        let (g, e) = (g.to_f32(), e.to_f32());
        assert!((g - e).abs() <= tol * largest, "{tag} offset {i}: {g} vs {e}");
    }
}

#[test]
fn key_mean_matches_the_cpu_kernel() {
    for rotate in [true, false] {
        case::<f32>(64, 37, rotate, 1e-5);
        case::<f16>(128, 9, rotate, 2e-3);
        case::<f32>(40, 3, rotate, 1e-5);
        case::<f16>(256, 5, rotate, 2e-3);
    }
}
