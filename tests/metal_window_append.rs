//! metal/window_append.metal on the emulator, launched as
//! `src/kernels/window.rs` launches it (names, inputs in order, the slot as
//! the length of a window view, grid in threads), against
//! `veloxquant::cpu::window::window_append`: untouched slots bit for bit,
//! new ones within float32 rounding of the sums (relative 1e-5 in float32,
//! one rounding step in float16).

mod metal_emulator;

use half::f16;
use veloxquant::kernels::Kernel;
use metal_emulator::{Element, HostArray, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::window::{window_append, WindowShape};
use veloxquant::cpu::{Float, VqElement};

fn case<T: Element + Float + VqElement>(d: usize, t: usize, offset: bool, rotate_v: bool, tol: f32) {
    let mut rng = ChaCha8Rng::seed_from_u64((d * 8 + t) as u64);
    let (b, h, w, at) = (2usize, 3usize, 12usize, 5usize);
    let mut rand = |n: usize| -> Vec<T> { (0..n).map(|_| T::from_f32(rng.random::<f32>() * 2.0 - 1.0)).collect() };
    let (keys, values) = (rand(b * h * t * d), rand(b * h * t * d));
    let (key_frame, value_frame, key_offset) = (rand(d * d), rand(d * d), rand(b * h * d));
    let (win_k, win_v) = (rand(b * h * w * d), rand(b * h * w * d));
    let sh = WindowShape { batch: b, heads: h, slots: w, dim: d, tokens: t, at };
    let mut want_k = vec![T::from_f32(0.0); win_k.len()];
    let mut want_v = want_k.clone();
    window_append(&keys, Some(&key_frame), offset.then_some(&key_offset[..]), &win_k, &sh, &mut want_k);
    window_append(&values, rotate_v.then_some(&value_frame[..]), None, &win_v, &sh, &mut want_v);
    let wk = HostArray::new(&[b, h, w, d], &win_k);
    let filled = HostArray::leading_slice(&wk, &[b, h, at, d]);
    let items = 2 * b * h * w * (d / 8);
    let out = metal_emulator::declared(Kernel::WindowAppend)
        .launch()
        .input(HostArray::heads_transposed([b, h, t, d], &keys))
        .input(HostArray::heads_transposed([b, h, t, d], &values))
        .input(HostArray::new(&[d, d], &key_frame))
        .input(HostArray::new(&[d, d], &value_frame))
        .input(HostArray::new(&[b, h, 1, d], &key_offset))
        .input(wk)
        .input(HostArray::new(&[b, h, w, d], &win_v))
        .input(filled)
        .output(&[b, h, w, d], T::DTYPE)
        .output(&[b, h, w, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("OFFSET", TemplateArg::Bool(offset))
        .template("ROTATE_V", TemplateArg::Bool(rotate_v))
        .grid(items as u32, 1, 1)
        .threadgroup(256.min(items) as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("window_append: {e}"));
    for (side, got, want) in [("keys", &out[0], &want_k), ("values", &out[1], &want_v)] {
        let got = got.to_vec::<T>();
        let largest = want.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
        for (i, (g, e)) in got.iter().zip(want.iter()).enumerate() {
            let slot = (i / d) % w;
            let (g, e) = (g.to_f32(), e.to_f32());
            let tag = format!("{side} {:?} d={d} t={t} offset={offset} rotate_v={rotate_v} slot {slot}", T::DTYPE);
            if slot < at || slot >= at + t {
                assert_eq!(g.to_bits(), e.to_bits(), "{tag}: an untouched slot changed");
            } else {
                assert!((g - e).abs() <= tol * largest, "{tag}: {g} vs {e}");
            }
        }
    }
}

#[test]
fn window_append_matches_the_cpu_kernel() {
    for (offset, rotate_v) in [(true, true), (false, false), (true, false)] {
        case::<f32>(64, 1, offset, rotate_v, 1e-5);
        case::<f16>(64, 3, offset, rotate_v, 2e-3);
    }
    case::<f32>(96, 2, true, true, 1e-5);
}
