//! metal/window_append.metal on the emulator, launched as
//! `src/kernels/window.rs` launches it (names, inputs in order, the slot as
//! the length of a window view, grid in threads), against
//! `veloxquant::cpu::window::window_append`: untouched slots bit for bit,
//! new ones within float32 rounding of the sums (relative 1e-5 in float32,
//! one rounding step in float16).

mod metal_emulator;

use half::f16;
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, TemplateArg};
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

/// `kernels::window::each_on_gpu` on Metal: one launch over three
/// sequences' own windows (batch 1 each, their slots 5, 1 and 9), four row
/// slots (the last repeating the first's arrays), the grid's `y` index the
/// row; each row's outputs against the CPU kernel on that row alone.
#[test]
fn window_append_over_sequences_matches_each_row_on_the_cpu() {
    let (h, w, d, t) = (3usize, 12usize, 64usize, 1usize);
    let ats = [5usize, 1, 9];
    let n = ats.len();
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let mut rand = |n: usize| -> Vec<f16> { (0..n).map(|_| f16::from_f32(rng.random::<f32>() * 2.0 - 1.0)).collect() };
    let (key_frame, value_frame) = (rand(d * d), rand(d * d));
    let rows: Vec<_> = ats.iter().map(|_| (rand(h * t * d), rand(h * t * d), rand(h * d), rand(h * w * d), rand(h * w * d))).collect();
    let slots = 4;
    let (inputs, outputs, body) =
        Kernel::WindowAppend.signature(veloxquant::Backend::Metal, &[("EACH", veloxquant::kernels::TemplateArg::Int(slots))]);
    let (inputs, outputs): (Vec<&str>, Vec<&str>) = (inputs.iter().map(String::as_str).collect(), outputs.iter().map(String::as_str).collect());
    let header = Kernel::WindowAppend.header(veloxquant::Backend::Metal, &[]);
    let kernel = metal_emulator::MetalKernel::new(Kernel::WindowAppend.name(), &inputs, &outputs, &veloxquant::kernels::compact_source(&body.unwrap()))
        .with_header(&veloxquant::kernels::compact_source(&header));
    let mut launch = kernel.launch().input(HostArray::new(&[d, d], &key_frame)).input(HostArray::new(&[d, d], &value_frame));
    for i in 0..slots as usize {
        let b = if i < n { i } else { 0 };
        let (keys, values, offset, win_k, win_v) = &rows[b];
        let wk = HostArray::new(&[1, h, w, d], win_k);
        let filled = HostArray::leading_slice(&wk, &[1, h, ats[b], d]);
        launch = launch
            .input(HostArray::heads_transposed([1, h, t, d], keys))
            .input(HostArray::heads_transposed([1, h, t, d], values))
            .input(HostArray::new(&[1, h, 1, d], offset))
            .input(wk)
            .input(HostArray::new(&[1, h, w, d], win_v))
            .input(filled)
            .output(&[1, h, w, d], Dtype::F16)
            .output(&[1, h, w, d], Dtype::F16);
    }
    let items = 2 * h * w * (d / 8);
    let out = launch
        .template("T", TemplateArg::Dtype(Dtype::F16))
        .template("D", TemplateArg::Int(d as i32))
        .template("OFFSET", TemplateArg::Bool(true))
        .template("ROTATE_V", TemplateArg::Bool(true))
        .template("EACH", TemplateArg::Int(slots))
        .grid(items as u32, n as u32, 1)
        .threadgroup(256.min(items) as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("window_append over sequences: {e}"));
    for (b, (keys, values, offset, win_k, win_v)) in rows.iter().enumerate() {
        let sh = WindowShape { batch: 1, heads: h, slots: w, dim: d, tokens: t, at: ats[b] };
        let mut want_k = vec![f16::from_f32(0.0); win_k.len()];
        let mut want_v = want_k.clone();
        window_append(keys, Some(&key_frame), Some(&offset[..]), win_k, &sh, &mut want_k);
        window_append(values, Some(&value_frame), None, win_v, &sh, &mut want_v);
        for (side, got, want) in [("keys", &out[2 * b], &want_k), ("values", &out[2 * b + 1], &want_v)] {
            let got = got.to_vec::<f16>();
            let largest = want.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
            for (i, (g, e)) in got.iter().zip(want.iter()).enumerate() {
                let slot = (i / d) % w;
                let (g, e) = (g.to_f32(), e.to_f32());
                if slot == ats[b] {
                    assert!((g - e).abs() <= 2e-3 * largest.max(1.0), "row {b} {side} slot {slot}: {g} vs {e}");
                } else {
                    assert_eq!(g.to_bits(), e.to_bits(), "row {b} {side} slot {slot}: an untouched slot changed");
                }
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
