//! The quantizer kernels on MLX's CPU stream: the CPU primitive (`require`)
//! and the reference graph (`off`) against `veloxquant::quant`, the pure-Rust
//! quantizers, plus edge cases and argument errors.

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::kernels::{
    kivi_dequantize, kivi_quantize, pq_decode, pq_encode, pq_tensor_cores, qjl_encode, qjl_score, scalar_dequantize,
    scalar_quantize, KiviMode, PqCodes,
};
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::{KiviKeys, KiviValues, PqConfig, ProductQuantizer, Qjl, Quantizer, ScalarCodebook};
use veloxquant::{cpu, ops, Array, Dtype, Element, Error, Options, Policy, Stream};

fn opts(policy: Policy) -> Options {
    Options::on(Stream::cpu(), policy)
}

fn gaussian(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| (rng.random::<f32>() - 0.5) * 3.4 * scale).collect()
}

fn arr<T: Element>(v: &[T], shape: &[usize]) -> Array {
    let s: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(v, &s).unwrap()
}

/// The values as they are after rounding to `T`.
fn rounded<T: cpu::Float>(x: &[f32]) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let f = t.iter().map(|v| v.to_f32()).collect();
    (t, f)
}

fn scalar_case<T: cpu::Float + Element>(n: usize, d: usize, bits: u32, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cb = ScalarCodebook::sphere(128, bits).unwrap();
    let (xt, xf) = rounded::<T>(&gaussian(&mut rng, n * d, 0.1));
    let codes: Vec<u8> = xf.iter().map(|&v| cb.quantize(v)).collect();
    let mut want = vec![0u8; n * cpu::packed_len(d, bits)];
    cpu::bit_pack(&codes, n, d, bits, &mut want);
    let x = arr(&xt, &[n, d]);
    let c = arr(cb.centroids(), &[1 << bits]);
    for policy in [Policy::Require, Policy::Off] {
        let p = scalar_quantize(&x, &c, bits, &opts(policy)).unwrap();
        assert_eq!(p.shape(), vec![n as i32, cpu::packed_len(d, bits) as i32]);
        assert_eq!(p.to_vec::<u8>().unwrap(), want, "{} n={n} d={d} bits={bits} {policy}", T::DTYPE);
        let y = scalar_dequantize(&p, &c, bits, d, T::DTYPE, &opts(policy)).unwrap();
        let expect: Vec<f32> = codes.iter().map(|&k| T::from_f32(cb.value(k)).to_f32()).collect();
        let got: Vec<f32> = y.to_vec::<T>().unwrap().iter().map(|v| v.to_f32()).collect();
        assert_eq!(got, expect, "{} dequantize {policy}", T::DTYPE);
    }
}

#[test]
fn scalar_matches_codebook_quantize_exactly() {
    for &bits in &cpu::SUPPORTED_BITS {
        scalar_case::<f32>(300, 128, bits, bits as u64);
        scalar_case::<f16>(33, 13, bits, 10 + bits as u64);
        scalar_case::<bf16>(1, 7, bits, 20 + bits as u64);
    }
    scalar_case::<f32>(2, 4096, 3, 99);
}

#[test]
fn scalar_edge_cases() {
    let s = Stream::cpu();
    let cb = ScalarCodebook::sphere(64, 2).unwrap();
    let c = arr(cb.centroids(), &[4]);
    // Values on a boundary go to the lower entry; beyond the ends clamp.
    let b = cpu::scalar_boundaries(cb.centroids());
    let x = vec![b[0], b[1], b[2], -9.0, 9.0, f32::NAN];
    for policy in [Policy::Require, Policy::Off] {
        let p = scalar_quantize(&arr(&x, &[1, 6]), &c, 2, &opts(policy)).unwrap();
        let mut codes = vec![0u8; 6];
        cpu::bit_unpack(&p.to_vec::<u8>().unwrap(), 1, 6, 2, &mut codes);
        assert_eq!(codes, [0, 1, 2, 0, 3, 0], "{policy}");
    }
    // A transposed (non-contiguous) input and leading dimensions.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let v = gaussian(&mut rng, 2 * 3 * 10, 0.2);
    let xt = ops::transpose(&arr(&v, &[10, 6]), &[1, 0], &s).unwrap();
    let mut col = vec![0.0f32; 60];
    for i in 0..10 {
        for j in 0..6 {
            col[j * 10 + i] = v[i * 6 + j];
        }
    }
    let want = scalar_quantize(&arr(&col, &[6, 10]), &c, 2, &opts(Policy::Require)).unwrap().to_vec::<u8>().unwrap();
    for policy in [Policy::Require, Policy::Off] {
        assert_eq!(scalar_quantize(&xt, &c, 2, &opts(policy)).unwrap().to_vec::<u8>().unwrap(), want);
        let x3 = ops::reshape(&arr(&col, &[6, 10]), &[2, 3, 10], &s).unwrap();
        let p = scalar_quantize(&x3, &c, 2, &opts(policy)).unwrap();
        assert_eq!(p.shape(), vec![2, 3, 3]);
        let y = scalar_dequantize(&p, &c, 2, 10, Dtype::F32, &opts(policy)).unwrap();
        assert_eq!(y.shape(), vec![2, 3, 10]);
    }
    // N = 0.
    let e = scalar_quantize(&arr::<f32>(&[], &[0, 128]), &c, 2, &opts(Policy::Require)).unwrap();
    assert_eq!(e.shape(), vec![0, 32]);
    let e = scalar_dequantize(&e, &c, 2, 128, Dtype::BF16, &opts(Policy::Require)).unwrap();
    assert_eq!((e.shape(), e.dtype()), (vec![0, 128], Dtype::BF16));
}

fn kivi_case(mode: KiviMode, n: usize, d: usize, bits: u32, group: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut xf = gaussian(&mut rng, n * d, 1.0);
    // An outlier channel and a constant channel.
    for r in 0..n {
        xf[r * d + 1] = xf[r * d + 1] * 0.1 + 20.0;
        xf[r * d + d - 1] = 0.75;
    }
    let q: Box<dyn Quantizer> = match mode {
        KiviMode::Keys => Box::new(KiviKeys::new(d, bits, group).unwrap()),
        KiviMode::Values => Box::new(KiviValues::new(d, bits, group).unwrap()),
    };
    let enc = q.encode(&xf).unwrap();
    let buf = |name: &str| enc.buffers.iter().find(|b| b.name == name).unwrap().bytes.clone();
    let dec = q.decode(&enc).unwrap();
    let x = arr(&xf, &[n, d]);
    for policy in [Policy::Require, Policy::Off] {
        let (c, s, z) = kivi_quantize(&x, bits, group, mode, &opts(policy)).unwrap();
        let tag = format!("{mode:?} n={n} d={d} bits={bits} G={group} {policy}");
        let f16_bytes = |a: &Array| -> Vec<u8> { bytemuck::cast_slice(&a.to_vec::<f16>().unwrap()).to_vec() };
        assert_eq!(f16_bytes(&s), buf("scales"), "scales {tag}");
        assert_eq!(f16_bytes(&z), buf("zeros"), "zeros {tag}");
        let got = c.to_vec::<u8>().unwrap();
        let want = buf("codes");
        if policy == Policy::Require {
            assert_eq!(got, want, "codes {tag}");
        } else {
            // MLX rounds half to even, Rust away from zero: only exact .5 ties differ, by one.
            let (mut a, mut b) = (vec![0u8; n * d], vec![0u8; n * d]);
            cpu::bit_unpack(&got, n, d, bits, &mut a);
            cpu::bit_unpack(&want, n, d, bits, &mut b);
            let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
            assert!(a.iter().zip(&b).all(|(p, q)| p.abs_diff(*q) <= 1) && differ * 1000 <= n * d, "codes {tag}: {differ}");
        }
        let y = kivi_dequantize(&c, &s, &z, bits, group, mode, d, Dtype::F32, &opts(policy)).unwrap();
        let y = y.to_vec::<f32>().unwrap();
        if policy == Policy::Require {
            assert_eq!(y, dec, "dequantize {tag}");
        } else {
            let bad = y.iter().zip(&dec).filter(|(a, b)| (*a - *b).abs() > 1e-5 * b.abs().max(1.0)).count();
            assert!(bad * 1000 <= n * d, "dequantize {tag}: {bad}");
        }
    }
}

#[test]
fn kivi_matches_quant_reference() {
    for &bits in &cpu::SUPPORTED_BITS {
        kivi_case(KiviMode::Keys, 70, 64, bits, 32, bits as u64);
        kivi_case(KiviMode::Values, 70, 64, bits, 32, 10 + bits as u64);
    }
    kivi_case(KiviMode::Keys, 1, 13, 3, 4, 31);
    kivi_case(KiviMode::Keys, 5, 128, 2, 128, 32);
    kivi_case(KiviMode::Values, 1, 128, 4, 128, 33);
    kivi_case(KiviMode::Values, 3, 24, 3, 8, 34);
}

#[test]
fn kivi_half_inputs_reconstruct_like_f32() {
    // f16/bf16 inputs: the reconstruction error against the input agrees with
    // the float32 path within 1% relative.
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (n, d) = (96, 128);
    let xf = gaussian(&mut rng, n * d, 1.0);
    for mode in [KiviMode::Keys, KiviMode::Values] {
        let err = |dtype: Dtype| -> f64 {
            let x = ops::astype(&arr(&xf, &[n, d]), dtype, &Stream::cpu()).unwrap();
            let (c, s, z) = kivi_quantize(&x, 2, 32, mode, &opts(Policy::Require)).unwrap();
            let y = kivi_dequantize(&c, &s, &z, 2, 32, mode, d, Dtype::F32, &opts(Policy::Require)).unwrap();
            let y = y.to_vec::<f32>().unwrap();
            y.iter().zip(&xf).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>()
        };
        let base = err(Dtype::F32);
        for dt in [Dtype::F16, Dtype::BF16] {
            let e = err(dt);
            assert!((e / base - 1.0).abs() < 0.01, "{mode:?} {dt}: {e} vs {base}");
        }
    }
}

fn qjl_case(n: usize, d: usize, m: usize, nq: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let kf = gaussian(&mut rng, n * d, 1.0);
    let qf = gaussian(&mut rng, nq * d, 1.0);
    let qjl = Qjl::new(d, m, false, seed).unwrap();
    let sketch = Sketch::new(m, d, false, seed);
    let enc = qjl.encode(&kf).unwrap();
    let buf = |name: &str| enc.buffers.iter().find(|b| b.name == name).unwrap().bytes.clone();
    let sk = arr(&sketch.s, &[m, d]);
    let nb = cpu::packed_len(m, 1);
    for policy in [Policy::Require, Policy::Off] {
        let tag = format!("n={n} d={d} m={m} {policy}");
        let (signs, norms) = qjl_encode(&arr(&kf, &[n, d]), &sk, &opts(policy)).unwrap();
        assert_eq!(signs.shape(), vec![n as i32, nb as i32]);
        let got = signs.to_vec::<u8>().unwrap();
        let want = buf("signs");
        let differ: u32 = got.iter().zip(&want).map(|(a, b)| (a ^ b).count_ones()).sum();
        if policy == Policy::Require {
            assert_eq!(differ, 0, "signs {tag}");
        } else {
            // A matmul sums in its own order: only near-zero projections may flip.
            assert!(differ as usize * 1000 <= n * m, "signs {tag}: {differ}");
        }
        let want_norms: Vec<f32> = buf("norms").chunks(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        for (a, b) in norms.to_vec::<f16>().unwrap().iter().zip(&want_norms) {
            assert!((a.to_f32() - b).abs() <= 1e-3 * b.abs(), "norm {tag}: {a} vs {b}");
        }
        // Scores from the reference encoding equal Qjl::estimate.
        let sc = qjl_score(
            &arr(&qf, &[nq, d]),
            &sk,
            &arr(&want, &[n, nb]),
            &arr(&bytemuck::cast_slice::<u8, f16>(&buf("norms")).to_vec(), &[n]),
            &opts(policy),
        )
        .unwrap();
        assert_eq!(sc.shape(), vec![nq as i32, n as i32]);
        let sc = sc.to_vec::<f32>().unwrap();
        let scale: f32 = (0..n * nq).map(|i| sc[i].abs()).fold(0.0, f32::max).max(1e-6);
        for i in 0..nq {
            for t in 0..n {
                let e = qjl.estimate(&qf[i * d..(i + 1) * d], &enc, t).unwrap();
                // The fused kernel sums through per-byte tables, the
                // reference graph through a matmul: both differ from the
                // estimate's sequential sum by float32 rounding of the terms.
                let tol = if policy == Policy::Require { 1e-5 * scale } else { 1e-4 * scale };
                assert!((sc[i * n + t] - e).abs() <= tol, "score {tag} q{i} k{t}: {} vs {e}", sc[i * n + t]);
            }
        }
    }
}

#[test]
fn qjl_matches_quant_reference() {
    qjl_case(200, 128, 256, 2, 1);
    qjl_case(1, 64, 13, 1, 2);
    qjl_case(37, 32, 40, 4, 3);
    qjl_case(3, 128, 1024, 4, 4);
}

#[test]
fn qjl_score_beyond_the_fused_limit_falls_back() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (d, m, nq) = (16, 1024, 5);
    let sk = Sketch::new(m, d, false, 1);
    let sk = arr(&sk.s, &[m, d]);
    let (signs, norms) = qjl_encode(&arr(&gaussian(&mut rng, 3 * d, 1.0), &[3, d]), &sk, &opts(Policy::Auto)).unwrap();
    let q = arr(&gaussian(&mut rng, nq * d, 1.0), &[nq, d]);
    let a = qjl_score(&q, &sk, &signs, &norms, &opts(Policy::Auto)).unwrap();
    assert_eq!(a.shape(), vec![5, 3]);
    let e = qjl_score(&q, &sk, &signs, &norms, &opts(Policy::Require)).unwrap_err().to_string();
    assert!(e.starts_with("q:"), "{e}");
}

fn pq_case(sub: usize, bits: u32, n: usize, d: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let k = 1usize << bits;
    let calib = gaussian(&mut rng, 4096.max(n).max(2 * k * sub / d) * d, 1.0);
    let mut cfg = PqConfig::keys(sub, bits);
    cfg.max_iters = if bits > 8 { 1 } else { 4 };
    let (pq, _) = ProductQuantizer::train(&calib, d, cfg).unwrap();
    let xf = gaussian(&mut rng, n * d, 1.0);
    let t = pq.transform_keys(&xf);
    let enc = pq.encode(&xf).unwrap();
    let buf = |name: &str| enc.buffers.iter().find(|b| b.name == name).map(|b| b.bytes.clone());
    let (want, want_hi) = (buf("codes").unwrap(), buf("codes_hi"));
    let (lo, hi) = veloxquant::cpu::code_planes(bits);
    assert_eq!(want_hi.is_some(), hi > 0);
    let cb = arr(pq.codebook(), &[k, sub]);
    let per = d / sub;
    let (nb_lo, nb_hi) = (cpu::packed_len(per, lo), if hi > 0 { cpu::packed_len(per, hi) } else { 0 });
    let planes = |low: &[u8], high: Option<&[u8]>| -> Vec<usize> {
        let (mut a, mut b) = (vec![0u8; n * per], vec![0u8; n * per]);
        cpu::bit_unpack(low, n, per, lo, &mut a);
        if let Some(h) = high {
            cpu::bit_unpack(h, n, per, hi, &mut b);
        }
        a.iter().zip(&b).map(|(&l, &h)| usize::from(l) | usize::from(h) << lo).collect()
    };
    let codes = planes(&want, want_hi.as_deref());
    let decoded: Vec<f32> = codes.iter().flat_map(|&c| pq.codebook()[c * sub..][..sub].to_vec()).collect();
    let stored = PqCodes {
        codes: arr(&want, &[n, nb_lo]),
        codes_hi: want_hi.as_ref().map(|h| arr(h, &[n, nb_hi])),
    };
    for policy in [Policy::Require, Policy::Off] {
        let tag = format!("s={sub} bits={bits} n={n} {policy}");
        let p = pq_encode(&arr(&t, &[n, d]), &cb, bits, &opts(policy)).unwrap();
        assert_eq!(p.codes.shape(), vec![n as i32, nb_lo as i32], "{tag}");
        assert_eq!(p.codes_hi.as_ref().map(|h| h.shape()), (hi > 0).then(|| vec![n as i32, nb_hi as i32]), "{tag}");
        let got = p.codes.to_vec::<u8>().unwrap();
        let got_hi = p.codes_hi.as_ref().map(|h| h.to_vec::<u8>().unwrap());
        if policy == Policy::Require {
            assert_eq!(got, want, "{tag}");
            assert_eq!(got_hi, want_hi, "high plane {tag}");
        } else {
            let g = planes(&got, got_hi.as_deref());
            let differ = g.iter().zip(&codes).filter(|(a, b)| a != b).count();
            assert!(differ * 1000 <= n * per, "{tag}: {differ}");
        }
        let y = pq_decode(&stored, &cb, bits, d, Dtype::F32, &opts(policy)).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), decoded, "decode {tag}");
    }
}

#[test]
fn pq_matches_quant_reference() {
    for &sub in &[2usize, 4, 8] {
        for bits in [4u32, 8] {
            pq_case(sub, bits, 300, 64, sub as u64 * 10 + bits as u64);
        }
    }
    pq_case(4, 3, 1, 96, 5);
}

#[test]
fn pq_every_width_up_to_twelve_bits() {
    // Two-plane widths (5..7: 4 + hi bits, 9..12: 8 + hi bits), one-plane 1, 2;
    // ragged last bytes (12 codes of odd widths) and, at 12 bits, the largest codebook.
    for (i, bits) in [1u32, 2, 5, 6, 7, 9, 10, 11].into_iter().enumerate() {
        pq_case(2, bits, 37, 24, 40 + i as u64);
    }
    pq_case(8, 12, 20, 32, 60);
    pq_case(4, 12, 1, 256, 61);
}

/// Which pq_encode calls CUDA searches on the tensor cores: 16-bit inputs,
/// sub-vectors of 2, 4 or 8, rows of at most 512 sub-vectors, and codes of at
/// most 10 bits (9 for sub-vectors of 8, whose entries take two k-steps).
#[test]
fn pq_tensor_core_search_takes_16_bit_inputs_and_small_codebooks() {
    for dt in [Dtype::F16, Dtype::BF16] {
        for (d, s, bits) in [(128, 4, 8), (128, 4, 10), (1024, 2, 10), (64, 8, 9), (8, 8, 1), (16, 2, 5), (4096, 8, 8)] {
            assert!(pq_tensor_cores(dt, d, s, bits), "{dt} d={d} s={s} bits={bits}");
        }
        for (d, s, bits) in [(128, 4, 11), (64, 8, 10), (1026, 2, 6), (4104, 8, 8), (128, 4, 12)] {
            assert!(!pq_tensor_cores(dt, d, s, bits), "{dt} d={d} s={s} bits={bits}");
        }
    }
    assert!(!pq_tensor_cores(Dtype::F32, 128, 4, 8));
    // Out-of-range arguments answer false instead of dividing by zero or
    // shifting past the word.
    assert!(!pq_tensor_cores(Dtype::F16, 128, 0, 8));
    assert!(!pq_tensor_cores(Dtype::F16, 128, 4, 64));
}

#[test]
fn pq_half_inputs_and_small_codebooks() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (n, d, s, k) = (257, 24, 8, 5);
    let cb = gaussian(&mut rng, k * s, 1.0);
    let xf = gaussian(&mut rng, n * d, 1.0);
    let c = arr(&cb, &[k, s]);
    let err = |dtype: Dtype, policy: Policy, bits: u32| -> f64 {
        let x = ops::astype(&arr(&xf, &[n, d]), dtype, &Stream::cpu()).unwrap();
        let p = pq_encode(&x, &c, bits, &opts(policy)).unwrap();
        let y = pq_decode(&p, &c, bits, d, dtype, &opts(policy)).unwrap();
        let y = ops::astype(&y, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap();
        y.iter().zip(&xf).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>()
    };
    let base = err(Dtype::F32, Policy::Require, 3);
    for dt in [Dtype::F16, Dtype::BF16] {
        for policy in [Policy::Require, Policy::Off] {
            for bits in [3, 10] {
                let e = err(dt, policy, bits);
                assert!((e / base - 1.0).abs() < 0.01, "{dt} {policy} bits={bits}: {e} vs {base}");
            }
        }
    }
}

#[test]
fn bad_input_names_the_argument() {
    let o = opts(Policy::Auto);
    let msg = |e: Error| e.to_string();
    let x = arr(&[0.5f32; 16], &[2, 8]);
    let u = arr(&[1u8; 16], &[2, 8]);
    let cb4 = arr(&[-1.0f32, 0.0, 0.5, 1.0], &[4]);
    let cb4h = arr(&[f16::ONE; 4], &[4]);
    assert!(msg(scalar_quantize(&u, &cb4, 2, &o).unwrap_err()).starts_with("x: dtype uint8"));
    assert!(msg(scalar_quantize(&x, &cb4h, 2, &o).unwrap_err()).starts_with("codebook: dtype float16"));
    assert!(msg(scalar_quantize(&x, &cb4, 3, &o).unwrap_err()).starts_with("codebook: shape [4]"));
    assert!(msg(scalar_quantize(&x, &cb4, 5, &o).unwrap_err()).starts_with("bits: 5"));
    assert!(msg(scalar_dequantize(&u, &cb4, 2, 9, Dtype::F32, &o).unwrap_err()).starts_with("packed:"));
    assert!(msg(scalar_dequantize(&u, &cb4, 2, 32, Dtype::U8, &o).unwrap_err()).starts_with("dtype: dtype uint8"));
    assert!(msg(kivi_quantize(&x, 2, 3, KiviMode::Values, &o).unwrap_err()).starts_with("group:"));
    assert!(msg(kivi_quantize(&x, 2, 0, KiviMode::Keys, &o).unwrap_err()).starts_with("group:"));
    let (c, s, z) = kivi_quantize(&x, 2, 1, KiviMode::Keys, &o).unwrap();
    assert!(msg(kivi_dequantize(&c, &z, &x, 2, 1, KiviMode::Keys, 8, Dtype::F32, &o).unwrap_err()).starts_with("zeros: dtype float32"));
    assert!(msg(kivi_dequantize(&c, &s, &z, 2, 2, KiviMode::Keys, 8, Dtype::F32, &o).unwrap_err()).starts_with("scales: shape"));
    let sk = arr(&[1.0f32; 32], &[4, 8]);
    let skh = arr(&[f16::ONE; 32], &[4, 8]);
    assert!(msg(qjl_encode(&x, &skh, &o).unwrap_err()).starts_with("sketch: dtype float16"));
    assert!(msg(qjl_encode(&x, &arr(&[1.0f32; 12], &[4, 3]), &o).unwrap_err()).starts_with("sketch: shape"));
    let (sg, nm) = qjl_encode(&x, &sk, &o).unwrap();
    assert!(msg(qjl_score(&x, &sk, &sg, &sg, &o).unwrap_err()).starts_with("norms: dtype uint8"));
    assert!(msg(qjl_score(&u, &sk, &sg, &nm, &o).unwrap_err()).starts_with("q: dtype uint8"));
    let pcb = arr(&[0.0f32; 8], &[2, 4]);
    assert!(msg(pq_encode(&arr(&[0.5f32; 12], &[2, 6]), &pcb, 1, &o).unwrap_err()).starts_with("x: vector size 6"));
    assert!(msg(pq_encode(&x, &arr(&[0.0f32; 12], &[4, 3]), 2, &o).unwrap_err()).starts_with("codebook: shape"));
    assert!(msg(pq_encode(&x, &arr(&[0.0f32; 12], &[3, 4]), 1, &o).unwrap_err()).starts_with("codebook: shape"));
    let one_plane = |c: &Array| PqCodes { codes: c.clone(), codes_hi: None };
    assert!(msg(pq_decode(&one_plane(&u), &pcb, 1, 8, Dtype::F16, &o).unwrap_err()).starts_with("codes:"));
    assert!(msg(pq_encode(&x, &pcb, 13, &o).unwrap_err()).starts_with("bits: 13"));
    assert!(msg(pq_encode(&x, &pcb, 0, &o).unwrap_err()).starts_with("bits: 0"));
    let two = pq_encode(&x, &pcb, 5, &o).unwrap();
    assert!(msg(pq_decode(&one_plane(&two.codes), &pcb, 5, 8, Dtype::F32, &o).unwrap_err()).starts_with("codes_hi:"));
    assert!(msg(pq_decode(&two, &pcb, 4, 8, Dtype::F32, &o).unwrap_err()).starts_with("codes_hi:"));
    let wrong_hi = PqCodes { codes: two.codes.clone(), codes_hi: Some(arr(&[0.0f32; 2], &[2, 1])) };
    assert!(msg(pq_decode(&wrong_hi, &pcb, 5, 8, Dtype::F32, &o).unwrap_err()).starts_with("codes_hi: dtype float32"));
}

#[test]
fn empty_inputs_give_empty_outputs() {
    // N = 0 for the KIVI, QJL and PQ kernels: empty outputs of the right
    // shapes and dtypes, on the fused path and the reference graph alike.
    let d = 64;
    let x = arr::<f32>(&[], &[0, d]);
    for policy in [Policy::Require, Policy::Off] {
        let o = opts(policy);
        for (mode, params) in [(KiviMode::Keys, vec![0, 64]), (KiviMode::Values, vec![0, 2])] {
            let (c, s, z) = kivi_quantize(&x, 2, 32, mode, &o).unwrap();
            assert_eq!((c.shape(), c.dtype()), (vec![0, 16], Dtype::U8), "{policy} {mode:?}");
            assert_eq!((s.shape(), z.shape(), s.dtype()), (params.clone(), params, Dtype::F16), "{policy} {mode:?}");
            let y = kivi_dequantize(&c, &s, &z, 2, 32, mode, d as usize, Dtype::BF16, &o).unwrap();
            assert_eq!((y.shape(), y.dtype()), (vec![0, 64], Dtype::BF16), "{policy} {mode:?}");
        }
        let sk = arr(&Sketch::new(40, d, false, 1).s, &[40, d]);
        let (signs, norms) = qjl_encode(&x, &sk, &o).unwrap();
        assert_eq!((signs.shape(), norms.shape()), (vec![0, 5], vec![0]), "{policy}");
        let q = arr(&vec![0.5f32; 2 * d], &[2, d]);
        let scores = qjl_score(&q, &sk, &signs, &norms, &o).unwrap();
        assert_eq!((scores.shape(), scores.dtype()), (vec![2, 0], Dtype::F32), "{policy}");
        let cb = arr(&vec![0.25f32; 16 * 4], &[16, 4]);
        let codes = pq_encode(&x, &cb, 4, &o).unwrap();
        assert_eq!(codes.codes.shape(), vec![0, 8], "{policy}");
        let y = pq_decode(&codes, &cb, 4, d as usize, Dtype::F16, &o).unwrap();
        assert_eq!((y.shape(), y.dtype()), (vec![0, 64], Dtype::F16), "{policy}");
    }
}
