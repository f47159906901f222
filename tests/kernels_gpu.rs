//! The kernels on the GPU stream (CUDA on the NVIDIA machine, Metal on a Mac)
//! against the CPU kernels. Ignored where MLX has no GPU back-end; run them on
//! the GPU machine with `--ignored` (`CHECKS=tests bash scripts/gpu/device-checks.sh`; results are kept
//! in docs/results/).

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::kernels::{self, bit_pack, bit_unpack, vq_quantize};
use veloxquant::{cpu, Array, Dtype, Element, Options, Policy, Stream};

fn gpu() -> Options {
    let s = Stream::gpu().expect("this test needs MLX with a GPU back-end");
    Options::on(s, Policy::Require)
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_bit_pack_and_unpack_match_cpu() {
    let o = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for &bits in &cpu::SUPPORTED_BITS {
        for &(rows, n) in &[(1usize, 1usize), (3, 5), (2, 8), (5, 13), (300, 129), (1, 100_003), (4096, 128)] {
            let codes: Vec<u8> = (0..rows * n).map(|_| rng.random::<u8>()).collect();
            let mut want = vec![0u8; rows * cpu::packed_len(n, bits)];
            cpu::bit_pack(&codes, rows, n, bits, &mut want);
            let a = Array::from_slice(&codes, &[rows as i32, n as i32]).unwrap();
            let packed = bit_pack(&a, bits, &o).unwrap();
            assert_eq!(packed.to_vec::<u8>().unwrap(), want, "pack bits={bits} rows={rows} n={n}");
            let mut back = vec![0u8; rows * n];
            cpu::bit_unpack(&want, rows, n, bits, &mut back);
            let got = bit_unpack(&packed, bits, n, &o).unwrap().to_vec::<u8>().unwrap();
            assert_eq!(got, back, "unpack bits={bits} rows={rows} n={n}");
        }
    }
}

fn vq_case<T: Element + cpu::VqElement>(conv: fn(f32) -> T, d: usize, k: usize, n: usize, seed: u64) -> usize {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<T> = (0..n * d).map(|_| conv(rng.random::<f32>() * 2.0 - 1.0)).collect();
    let cb: Vec<T> = (0..k * d).map(|_| conv(rng.random::<f32>() * 2.0 - 1.0)).collect();
    let mut want = vec![0u32; n];
    cpu::vq_quantize(&x, &cb, n, k, d, &mut want);
    let xa = Array::from_slice(&x, &[n as i32, d as i32]).unwrap();
    let ca = Array::from_slice(&cb, &[k as i32, d as i32]).unwrap();
    let got = vq_quantize(&xa, &ca, &gpu()).unwrap().to_vec::<u32>().unwrap();
    // Same arithmetic in the same order without fma: indices agree exactly.
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} of {n} indices differ (d={d} k={k} {})", T::DTYPE);
    n
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_vq_quantize_matches_cpu_exactly() {
    for &d in &kernels::VQ_DIMS {
        vq_case::<f32>(|v| v, d, 256, 100_001, d as u64);
        vq_case::<f16>(f16::from_f32, d, 256, 50_000, 10 + d as u64);
        vq_case::<bf16>(bf16::from_f32, d, 64, 50_000, 20 + d as u64);
    }
    vq_case::<f32>(|v| v, 8, kernels::MAX_CODEBOOK_SIZE, 20_000, 31);
    vq_case::<f32>(|v| v, 2, 1, 1, 32);
}

mod common;

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_window_append_matches_the_reference_graph() {
    for (dtype, tol) in [(veloxquant::Dtype::F32, 1e-5), (veloxquant::Dtype::F16, 2e-3), (veloxquant::Dtype::BF16, 1.6e-2)] {
        for d in [64, 128, 96] {
            for t in [1, 3] {
                for (offset, rotate_v) in [(true, true), (false, false), (true, false)] {
                    common::check_window_append(&gpu(), dtype, d, t, offset, rotate_v, tol);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_framed_dequantize_matches_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let cpu_opts = Options::on(Stream::cpu(), Policy::Require);
    for &(d, bits) in &[(128usize, 4u32), (128, 3), (64, 2), (96, 4)] {
        for dtype in [Dtype::F16, Dtype::BF16, Dtype::F32] {
            let (w, cap, nb) = (20i32, 300i32, cpu::packed_len(d, bits) as i32);
            let mut uniform = |n: i32| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect() };
            let di = d as i32;
            let f = |x: Vec<f32>, shape: &[i32]| veloxquant::ops::astype(&Array::from_slice(&x, shape).unwrap(), dtype, &Stream::cpu()).unwrap();
            let window = f(uniform(2 * 8 * w * di), &[2, 8, w, di]);
            let chunk = f(uniform(2 * 8 * 33 * di), &[2, 8, 33, di]);
            let table = Array::from_slice(&uniform(1 << bits), &[1 << bits]).unwrap();
            let norms: Vec<f16> = uniform(2 * 8 * cap).into_iter().map(|x| f16::from_f32(x.abs() * 4.0)).collect();
            let norms = Array::from_slice(&norms, &[2, 8, cap]).unwrap();
            let codes: Vec<u8> = (0..2 * 8 * cap * nb).map(|_| rng.random::<u8>()).collect();
            let codes = Array::from_slice(&codes, &[2, 8, cap, nb]).unwrap();
            let side = kernels::FramedSide {
                window: &window,
                codes: &codes,
                norms: &norms,
                table: &table,
                chunk: &chunk,
                bits,
                sinks: 4,
                compressed: 257,
                recent: 11,
                recent_at: 4,
            };
            let want = kernels::framed_dequantize(&side, &cpu_opts).unwrap();
            let got = kernels::framed_dequantize(&side, &gpu()).unwrap();
            let as_f32 = |a: &Array| veloxquant::ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(as_f32(&got), as_f32(&want), "d={d} bits={bits} {dtype}");
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_key_mean_matches_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let cpu_opts = Options::on(Stream::cpu(), Policy::Require);
    let gpu_opts = gpu();
    let s = gpu_opts.stream.clone().expect("a stream");
    // (batch, heads, tokens, head size): llama-8b's and llama-1b's first
    // chunks, a short odd one, a head of 40 (five loads a token).
    for &(b, h, t, d) in &[(1i32, 8i32, 2048i32, 128i32), (1, 8, 2048, 64), (2, 3, 37, 96), (1, 2, 5, 40)] {
        let mut x: Vec<f32> = (0..b * t * h * d).map(|_| rng.random::<f32>() * 4.0 - 1.0).collect();
        let n = x.len();
        for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY].into_iter().enumerate() {
            x[(i * 7919 + 3) % n] = v;
        }
        let rot: Vec<f32> = (0..d * d).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
        let rotation = Array::from_slice(&rot, &[d, d]).unwrap();
        let raw = Array::from_slice(&x, &[b, t, h, d]).unwrap();
        for dtype in [Dtype::F16, Dtype::BF16, Dtype::F32] {
            // [B, T, H, D] viewed as [B, H, T, D], as a model hands keys over.
            let keys = veloxquant::ops::transpose(&veloxquant::ops::astype(&raw, dtype, &s).unwrap(), &[0, 2, 1, 3], &s).unwrap();
            for rotated in [true, false] {
                let a = kernels::KeyMean { keys: &keys, rotation: rotated.then_some(&rotation), frame: 32.0 };
                let tag = format!("{dtype} b={b} h={h} t={t} d={d} rotated={rotated}");
                let (wm, wo) = kernels::key_mean(&a, &cpu_opts).unwrap();
                let (gm, go) = kernels::key_mean(&a, &gpu_opts).unwrap();
                let (wm, gm) = (wm.to_vec::<f32>().unwrap(), gm.to_vec::<f32>().unwrap());
                for (g, w) in gm.iter().zip(&wm) {
                    assert!(g.is_finite() && (g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{tag} mean {g} vs {w}");
                }
                let up = |a: &Array| veloxquant::ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap();
                let (wo, go) = (up(&wo), up(&go));
                let largest = wo.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let tol = if dtype == Dtype::F32 { 1e-5 } else { 8e-3 };
                for (g, w) in go.iter().zip(&wo) {
                    assert!((g - w).abs() <= tol * largest, "{tag} offset {g} vs {w}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_store_write_matches_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let cpu_opts = Options::on(Stream::cpu(), Policy::Require);
    // (old slots, first, new tokens, new slots, the keys' and the values'
    // code bytes): heads of 128 (K4, V3), of 64, and of 80 (40 and 30 bytes a
    // row, not a whole number of words for the values).
    for &(cap0, first, m, cap, kb, vb) in
        &[(300i32, 260usize, 1900i32, 2240usize, 64i32, 48i32), (300, 300, 77, 400, 32, 24), (64, 0, 40, 64, 32, 32), (90, 31, 50, 128, 40, 30)]
    {
        let mut side = |nb: i32| -> [Array; 4] {
            let codes: Vec<u8> = (0..2 * 8 * cap0 * nb).map(|_| rng.random::<u8>()).collect();
            let new_codes: Vec<u8> = (0..2 * 8 * m * nb).map(|_| rng.random::<u8>()).collect();
            let mut norm = |i: i32| if i % 7 == 3 { [f16::MAX, f16::NAN, f16::INFINITY][(i as usize / 7) % 3] } else { f16::from_f32(rng.random::<f32>() * 9.0) };
            // Kept slots hold marked tokens too: their NaN must come through bit for bit.
            let norms: Vec<f16> = (0..2 * 8 * cap0).map(|i| if i % 11 == 5 { f16::NAN } else { f16::from_f32(1.5) }).collect();
            let new_norms: Vec<f16> = (0..2 * 8 * m).map(&mut norm).collect();
            [
                Array::from_slice(&codes, &[2, 8, cap0, nb]).unwrap(),
                Array::from_slice(&norms, &[2, 8, cap0]).unwrap(),
                Array::from_slice(&new_codes, &[2, 8, m, nb]).unwrap(),
                Array::from_slice(&new_norms, &[2, 8, m]).unwrap(),
            ]
        };
        let ([kc, kn, knc, knn], [vc, vn, vnc, vnn]) = (side(kb), side(vb));
        let k = kernels::StoreWrite { codes: &kc, norms: &kn, new_codes: &knc, new_norms: &knn, first, capacity: cap };
        let v = kernels::StoreWrite { codes: &vc, norms: &vn, new_codes: &vnc, new_norms: &vnn, first, capacity: cap };
        let want = kernels::store_write([&k, &v], &cpu_opts).unwrap();
        let got = kernels::store_write([&k, &v], &gpu()).unwrap();
        let bits = |a: &Array| a.to_vec::<f16>().unwrap().iter().map(|n| n.to_bits()).collect::<Vec<_>>();
        for ((gc, gn), (wc, wn)) in got.iter().zip(&want) {
            let tag = format!("cap0={cap0} first={first} m={m} nb={}", wc.shape()[3]);
            assert_eq!(gc.to_vec::<u8>().unwrap(), wc.to_vec::<u8>().unwrap(), "codes {tag}");
            assert_eq!(bits(gn), bits(wn), "norms {tag}");
        }
    }
}
