//! The quantizer kernels on the GPU stream (CUDA on the NVIDIA machine, Metal
//! on a Mac) against the CPU kernels: codes, signs and decoded values exact
//! (same arithmetic, no fma), norms and scores to float rounding. Ignored where
//! MLX has no GPU back-end; run with `--ignored` on the GPU machine.

mod common;

use common::{assert_scores_close, offset_view};
use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::{self, Float};
use veloxquant::kernels::{
    kivi_dequantize, kivi_quantize, pq_decode, pq_encode, pq_tensor_cores, qjl_encode, qjl_score, qjl_tensor_cores, scalar_dequantize,
    scalar_quantize, KiviMode,
};
use veloxquant::{ops, Array, Backend, Element, Options, Policy, Stream};

fn gpu() -> Options {
    let s = Stream::gpu().expect("this test needs MLX with a GPU back-end");
    Options::on(s, Policy::Require)
}

fn data<T: Float>(seed: u64, len: usize, scale: f32) -> Vec<T> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| T::from_f32((rng.random::<f32>() - 0.5) * 3.4 * scale)).collect()
}

fn arr<T: Element>(v: &[T], shape: &[usize]) -> Array {
    let s: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(v, &s).unwrap()
}

fn f32s<T: Float + Element>(a: &Array) -> Vec<f32> {
    a.to_vec::<T>().unwrap().iter().map(|v| v.to_f32()).collect()
}

fn scalar<T: Float + Element>(n: usize, d: usize, bits: u32) {
    let x: Vec<T> = data(n as u64, n * d, 0.2);
    let mut cb: Vec<f32> = data(bits as u64, 1 << bits, 0.2);
    cb.sort_by(f32::total_cmp);
    let mut want = vec![0u8; n * cpu::packed_len(d, bits)];
    cpu::scalar_quantize(&x, n, d, &cb, bits, &mut want);
    let c = arr(&cb, &[1 << bits]);
    let p = scalar_quantize(&arr(&x, &[n, d]), &c, bits, &gpu()).unwrap();
    assert_eq!(p.to_vec::<u8>().unwrap(), want, "{} n={n} d={d} bits={bits}", T::DTYPE);
    let mut y = vec![T::default(); n * d];
    cpu::scalar_dequantize(&want, n, d, &cb, bits, &mut y);
    let got = scalar_dequantize(&p, &c, bits, d, T::DTYPE, &gpu()).unwrap();
    assert_eq!(f32s::<T>(&got), y.iter().map(|v| v.to_f32()).collect::<Vec<_>>());
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_scalar_matches_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        scalar::<f32>(100_003, 128, bits);
        scalar::<f16>(5_000, 13, bits);
        scalar::<bf16>(1, 7, bits);
    }
    scalar::<f32>(4, 65_536, 8);
    // The wide paths (D a multiple of 8), float16 and bfloat16 pairs among
    // them, with rows that do not fill the last thread's items.
    for &bits in &cpu::SUPPORTED_BITS {
        scalar::<f16>(10_007, 128, bits);
        scalar::<bf16>(3_001, 64, bits);
    }
}

/// Float16 and bfloat16 inputs on, next to and between the decision
/// boundaries (each boundary rounded both ways and a few ulps around), with
/// signed zeros, subnormals, infinities and NaN: the paired search compares
/// each input with the smallest value of its type above a boundary, which
/// must pick the CPU's code for every one of them.
fn scalar_boundaries<T: Float + Element>(bits: u32, cb: &[f32]) {
    let k = 1usize << bits;
    let mut v: Vec<f32> = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 6e-8, -6e-8, 1e-40, 65504.0, -65504.0];
    for i in 0..k - 1 {
        let b = 0.5 * (cb[i] + cb[i + 1]);
        let t = T::from_f32(b).to_f32();
        v.extend([b, t]);
        // Neighbours in T's own grid: a few ulps of T either side.
        for ulps in 1..=3i32 {
            let step = (t.abs().max(1e-6) * 2f32.powi(-10)) * ulps as f32;
            v.extend([t + step, t - step, T::from_f32(t + step * 0.25).to_f32(), T::from_f32(t - step * 0.25).to_f32()]);
        }
    }
    let d = 64;
    let n = v.len().div_ceil(d) * 3;
    let x: Vec<T> = (0..n * d).map(|i| T::from_f32(v[(i * 7) % v.len()])).collect();
    let mut want = vec![0u8; n * cpu::packed_len(d, bits)];
    cpu::scalar_quantize(&x, n, d, cb, bits, &mut want);
    let p = scalar_quantize(&arr(&x, &[n, d]), &arr(cb, &[k]), bits, &gpu()).unwrap();
    assert_eq!(p.to_vec::<u8>().unwrap(), want, "{} bits={bits} codebook {cb:?}", T::DTYPE);
}

/// Sorted codebooks of 2^bits entries: one whose boundaries float16 and
/// bfloat16 hold exactly, and a random one (seeded by bits + seed).
fn exact_and_random_codebooks(bits: u32, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let k = 1usize << bits;
    let exact: Vec<f32> = (0..k).map(|i| (i as f32 - (k as f32 - 1.0) / 2.0) / k as f32).collect();
    let mut random: Vec<f32> = data(bits as u64 + seed, k, 0.5);
    random.sort_by(f32::total_cmp);
    (exact, random)
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_scalar_codes_at_boundaries_match_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        let (exact, random) = exact_and_random_codebooks(bits, 40);
        for cb in [&exact, &random] {
            scalar_boundaries::<f16>(bits, cb);
            scalar_boundaries::<bf16>(bits, cb);
        }
    }
}

/// Every one of the 65536 values of a 16-bit type, eight times each in a
/// scrambled order, in rows of `d`: enough elements for CUDA's code-table path
/// (which codes by a table of all 65536 values, built per block by runs), so
/// each entry of the table is checked against the CPU, NaNs, infinities,
/// signed zeros and subnormals included.
fn scalar_every_value<T: Float + Element>(from_bits: fn(u16) -> T, d: usize, bits: u32, cb: &[f32]) {
    let n = (8 * 65536usize).div_ceil(d);
    let x: Vec<T> = (0..n * d).map(|i| from_bits(((i as u64 * 40503) % 65536) as u16)).collect();
    let x = &x[..];
    let mut want = vec![0u8; n * cpu::packed_len(d, bits)];
    cpu::scalar_quantize(x, n, d, cb, bits, &mut want);
    let p = scalar_quantize(&arr(x, &[n, d]), &arr(cb, &[1 << bits]), bits, &gpu()).unwrap();
    let got = p.to_vec::<u8>().unwrap();
    let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{} d={d} bits={bits}: {differ} of {} code bytes differ, codebook {cb:?}", T::DTYPE, want.len());
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_scalar_codes_every_16_bit_value_as_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        let k = 1usize << bits;
        let (exact, random) = exact_and_random_codebooks(bits, 70);
        // Centroids that reach float16's largest values and its infinities.
        let mut wide: Vec<f32> = (0..k).map(|i| 70000.0 * (i as f32 / (k - 1).max(1) as f32 * 2.0 - 1.0)).collect();
        wide[0] = f32::NEG_INFINITY;
        for cb in [&exact, &random, &wide] {
            // D = 128 takes the wide loads, D = 13 the element-by-element path.
            for d in [128, 13] {
                scalar_every_value::<f16>(f16::from_bits, d, bits, cb);
                scalar_every_value::<bf16>(bf16::from_bits, d, bits, cb);
            }
        }
    }
}

fn kivi<T: Float + Element>(mode: KiviMode, n: usize, d: usize, bits: u32, group: usize) {
    let x: Vec<T> = data(n as u64 + 3, n * d, 1.0);
    let per_channel = mode == KiviMode::Keys;
    let np = if per_channel { n.div_ceil(group) * d } else { n * d / group };
    let (mut c, mut s, mut z) = (vec![0u8; n * cpu::packed_len(d, bits)], vec![f16::ZERO; np], vec![f16::ZERO; np]);
    cpu::kivi_quantize(&x, n, d, bits, group, per_channel, &mut c, &mut s, &mut z);
    let tag = format!("{} {mode:?} n={n} d={d} bits={bits} G={group}", T::DTYPE);
    let (gc, gs, gz) = kivi_quantize(&arr(&x, &[n, d]), bits, group, mode, &gpu()).unwrap();
    assert_eq!(gs.to_vec::<f16>().unwrap(), s, "scales {tag}");
    assert_eq!(gz.to_vec::<f16>().unwrap(), z, "zeros {tag}");
    assert_eq!(gc.to_vec::<u8>().unwrap(), c, "codes {tag}");
    let mut y = vec![T::default(); n * d];
    cpu::kivi_dequantize(&c, &s, &z, n, d, bits, group, per_channel, &mut y);
    let got = kivi_dequantize(&gc, &gs, &gz, bits, group, mode, d, T::DTYPE, &gpu()).unwrap();
    assert_eq!(f32s::<T>(&got), y.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "dequantize {tag}");
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kivi_matches_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        kivi::<f32>(KiviMode::Keys, 100_001, 128, bits, 32);
        kivi::<f32>(KiviMode::Values, 100_001, 128, bits, 32);
    }
    kivi::<f16>(KiviMode::Keys, 1, 13, 3, 4);
    kivi::<bf16>(KiviMode::Values, 333, 24, 2, 8);
    // The CUDA keys layouts: groups held in registers (G <= 32, D a multiple
    // of 8; full, short and ragged last groups) and the two-pass one (G > 32).
    kivi::<f16>(KiviMode::Keys, 10_007, 128, 2, 32);
    kivi::<bf16>(KiviMode::Keys, 999, 64, 4, 16);
    kivi::<f16>(KiviMode::Keys, 1_001, 96, 3, 5);
    kivi::<f32>(KiviMode::Keys, 1_001, 64, 2, 64);
    // Columns at 1 and 8 bits of 16-bit types (16 and 2 rows a word), and a
    // row length whose groups do not fill a block (codes stored directly).
    kivi::<bf16>(KiviMode::Keys, 2_001, 64, 1, 32);
    kivi::<f16>(KiviMode::Keys, 3_001, 128, 8, 32);
    kivi::<f16>(KiviMode::Keys, 2_001, 96, 2, 32);
    // Values groups in registers (G <= 32) and streamed twice (G > 32).
    kivi::<f16>(KiviMode::Values, 10_007, 128, 2, 32);
    kivi::<f16>(KiviMode::Values, 1_003, 128, 4, 64);
}

/// KIVI of inputs with infinities, NaN and magnitudes beyond float16 (a
/// scale or zero that is infinite divides; NaN is left out of min and max),
/// every CUDA layout: the CPU kernel's codes, scales and zeros, bit for bit.
fn kivi_special<T: Float + Element>(specials: &[f32]) {
    let (n, d) = (203usize, 128usize);
    let mut x: Vec<T> = data(29, n * d, 1.0);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for &v in specials {
        for _ in 0..40 {
            x[rng.random_range(0..n * d)] = T::from_f32(v);
        }
    }
    let bits16 = |v: Vec<f16>| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
    for mode in [KiviMode::Keys, KiviMode::Values] {
        for bits in [2u32, 3, 8] {
            let per_channel = mode == KiviMode::Keys;
            let np = if per_channel { n.div_ceil(32) * d } else { n * d / 32 };
            let (mut c, mut s, mut z) = (vec![0u8; n * cpu::packed_len(d, bits)], vec![f16::ZERO; np], vec![f16::ZERO; np]);
            cpu::kivi_quantize(&x, n, d, bits, 32, per_channel, &mut c, &mut s, &mut z);
            let tag = format!("{} {mode:?} bits={bits}", T::DTYPE);
            let (gc, gs, gz) = kivi_quantize(&arr(&x, &[n, d]), bits, 32, mode, &gpu()).unwrap();
            assert_eq!(bits16(gs.to_vec::<f16>().unwrap()), bits16(s), "scales {tag}");
            assert_eq!(bits16(gz.to_vec::<f16>().unwrap()), bits16(z), "zeros {tag}");
            assert_eq!(gc.to_vec::<u8>().unwrap(), c, "codes {tag}");
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kivi_special_values_match_cpu() {
    kivi_special::<f32>(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3e38, -3e38, 65520.0]);
    kivi_special::<f16>(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, -65504.0]);
}

/// Rows of KIVI values (one group of 32 per row: minimum 0, maximum
/// `s * levels`, so the scale is the float16 `s`) whose other elements sit a
/// few ulps around the rounding boundaries `(k + 0.5) s`, chosen where a
/// quotient through the reciprocal of `s` rounds to another code than the
/// divided one. The CUDA kernel divides only near a boundary; this is where
/// that matters.
fn kivi_boundary_rows(bits: u32) -> (Vec<f32>, usize) {
    let levels = ((1u32 << bits) - 1) as f32;
    let mut rng = ChaCha8Rng::seed_from_u64(bits as u64);
    let (mut rows, mut row, mut differ) = (Vec::new(), Vec::new(), 0);
    while rows.len() < 64 * 32 {
        let s = f16::from_f32(rng.random::<f32>() * 4.0 + 1e-3).to_f32();
        if f16::from_f32(s * levels / levels).to_f32() != s {
            continue;
        }
        for k in 0..levels as u32 {
            let edge = (k as f32 + 0.5) * s;
            for ulps in -3i32..=3 {
                let a = f32::from_bits((edge.to_bits() as i32 + ulps) as u32);
                if !(0.0..s * levels).contains(&a) {
                    continue;
                }
                if (a / s).round() != (a * (1.0 / s)).round() {
                    differ += 1;
                }
                if row.is_empty() {
                    row.extend([0.0, s * levels]);
                }
                row.push(a);
                if row.len() == 32 {
                    rows.append(&mut row);
                    break;
                }
            }
            if row.is_empty() {
                break; // a fresh row wants a fresh scale
            }
        }
        if !row.is_empty() {
            // Finish the row with its scale's boundary values repeated.
            let fill = row[2];
            row.resize(32, fill);
            rows.append(&mut row);
        }
    }
    (rows, differ)
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kivi_codes_at_rounding_boundaries_match_cpu() {
    for bits in [2u32, 4, 8] {
        let (x, differ) = kivi_boundary_rows(bits);
        assert!(differ > 0, "bits={bits}: no element where the reciprocal rounds otherwise; the test would prove nothing");
        let n = x.len() / 32;
        let (mut c, mut s, mut z) = (vec![0u8; n * cpu::packed_len(32, bits)], vec![f16::ZERO; n], vec![f16::ZERO; n]);
        cpu::kivi_quantize(&x, n, 32, bits, 32, false, &mut c, &mut s, &mut z);
        let (gc, gs, _) = kivi_quantize(&arr(&x, &[n, 32]), bits, 32, KiviMode::Values, &gpu()).unwrap();
        assert_eq!(gs.to_vec::<f16>().unwrap(), s, "scales bits={bits}");
        assert_eq!(gc.to_vec::<u8>().unwrap(), c, "codes bits={bits} ({differ} elements where the reciprocal rounds otherwise)");
        // The same elements as keys: a group of 32 tokens per channel.
        let xt: Vec<f32> = (0..n * 32).map(|i| x[(i % n) * 32 + i / n]).collect();
        let (mut c, mut s, mut z) = (vec![0u8; 32 * cpu::packed_len(n, bits)], vec![f16::ZERO; n], vec![f16::ZERO; n]);
        cpu::kivi_quantize(&xt, 32, n, bits, 32, true, &mut c, &mut s, &mut z);
        let (gc, _, _) = kivi_quantize(&arr(&xt, &[32, n]), bits, 32, KiviMode::Keys, &gpu()).unwrap();
        assert_eq!(gc.to_vec::<u8>().unwrap(), c, "key codes bits={bits}");
    }
}

fn qjl<T: Float + Element>(n: usize, d: usize, m: usize, nq: usize) {
    let k: Vec<T> = data(n as u64, n * d, 1.0);
    let q: Vec<T> = data(7, nq * d, 1.0);
    let s: Vec<f32> = data(m as u64, m * d, 1.0);
    let nb = cpu::packed_len(m, 1);
    let (mut sg, mut nm) = (vec![0u8; n * nb], vec![f16::ZERO; n]);
    cpu::qjl_encode(&k, n, d, &s, m, &mut sg, &mut nm);
    let sk = arr(&s, &[m, d]);
    let tag = format!("{} n={n} d={d} m={m}", T::DTYPE);
    let (gs, gn) = qjl_encode(&arr(&k, &[n, d]), &sk, &gpu()).unwrap();
    let cuda = Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda;
    let got_signs = gs.to_vec::<u8>().unwrap();
    if cuda && qjl_tensor_cores(T::DTYPE, d, m) {
        let differ = near_tie_signs(&got_signs, &sg, &k, &s, d, m, &tag);
        eprintln!("{tag}: {differ} of {} signs differ at near-ties", n * m);
    } else {
        assert_eq!(got_signs, sg, "signs {tag}");
    }
    assert_eq!(gn.to_vec::<f16>().unwrap(), nm, "norms {tag}");
    // Scores of the GPU's signs (checked above).
    let mut want = vec![0.0f32; nq * n];
    cpu::qjl_score(&q, nq, d, &s, m, &got_signs, &nm, n, &mut want);
    let got = qjl_score(&arr(&q, &[nq, d]), &sk, &gs, &gn, &gpu()).unwrap().to_vec::<f32>().unwrap();
    assert_scores_close(&got, &want, &tag);
}


/// The tensor-core signs against the exact ones: a bit may differ only where
/// `(S k)_r`, in float64, is within 1e-5 of `‖S_r‖ ‖k‖` of zero (the parity
/// rule's near-ties); returns how many differ.
fn near_tie_signs<T: Float>(got: &[u8], want: &[u8], k: &[T], s: &[f32], d: usize, m: usize, tag: &str) -> usize {
    let nb = cpu::packed_len(m, 1);
    let mut differ = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        let (key, byte) = (i / nb, i % nb);
        let kv = &k[key * d..(key + 1) * d];
        for bit in (0..8).filter(|b| (g ^ w) >> b & 1 == 1) {
            let row = &s[(byte * 8 + bit) * d..(byte * 8 + bit + 1) * d];
            let dot: f64 = row.iter().zip(kv).map(|(a, b)| *a as f64 * b.to_f32() as f64).sum();
            let scale = row.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt()
                * kv.iter().map(|b| (b.to_f32() as f64).powi(2)).sum::<f64>().sqrt();
            assert!(dot.abs() <= 1e-5 * scale, "signs {tag}: key {key} row {} differs at (S k) = {dot} of {scale}", byte * 8 + bit);
            differ += 1;
        }
    }
    differ
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_qjl_matches_cpu() {
    qjl::<f32>(100_000, 128, 256, 4);
    qjl::<f16>(1, 64, 13, 1);
    qjl::<bf16>(1_000, 128, 1024, 4);
    // Tiles cut by N, m and D; signs read as words with bits past m (m = 60),
    // bytewise (m = 36; m = 30, not a multiple of 4), and more queries than
    // the registers hold (Q = 9).
    qjl::<f16>(1_001, 100, 60, 3);
    qjl::<f32>(77, 72, 36, 9);
    qjl::<f16>(4_097, 128, 128, 8);
    qjl::<bf16>(300, 64, 30, 2);
    // The tensor-core path (float16, D and m multiples of 16): tiles cut by
    // N, every block walking several tiles, D = 96 and m = 160.
    qjl::<f16>(200_003, 128, 256, 4);
    qjl::<f16>(70_001, 64, 64, 2);
    qjl::<f16>(5_000, 96, 160, 1);
    qjl::<f16>(63, 16, 64, 1);
    // The tables at 8 query slots (Q = 5, 7), a grid of fewer threads than a
    // warp (N = 17), and m = 512 walked bit by bit (4 m slots > 4096).
    qjl::<f32>(1_003, 64, 512, 2);
    qjl::<bf16>(17, 32, 128, 5);
    qjl::<f16>(33_333, 128, 128, 7);
}

/// Keys built so that one `(S k)_r` each lies within about 1e-4 of
/// `‖S_r‖ ‖k‖` of zero, where a sketch rounded to float16 alone would flip
/// signs: the tensor-core signs still agree wherever the margin exceeds
/// float32 rounding.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_qjl_tensor_core_signs_at_ties() {
    let (n, d, m) = (4_096usize, 128usize, 256usize);
    let s: Vec<f32> = data(3, m * d, 1.0);
    let mut k: Vec<f16> = data(4, n * d, 1.0);
    // Key i: its first two coordinates make (S k)_{i % m} tiny.
    for i in 0..n {
        let r = i % m;
        let row = &s[r * d..(r + 1) * d];
        if row[0].abs() < 0.1 {
            continue; // the first coordinate would leave float16's range
        }
        let rest: f64 = (2..d).map(|j| row[j] as f64 * k[i * d + j].to_f32() as f64).sum();
        k[i * d] = f16::from_f64(-rest / row[0] as f64);
        k[i * d + 1] = f16::ZERO;
    }
    let close = (0..n)
        .filter(|&i| {
            let (row, kv) = (&s[(i % m) * d..(i % m + 1) * d], &k[i * d..(i + 1) * d]);
            let dot: f64 = row.iter().zip(kv).map(|(a, b)| *a as f64 * b.to_f32() as f64).sum();
            let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
            dot.abs() < 1e-3 * norm(&mut row.iter().map(|a| *a as f64)) * norm(&mut kv.iter().map(|b| b.to_f32() as f64))
        })
        .count();
    assert!(close > n / 2, "only {close} of {n} projections built close to zero");
    let nb = cpu::packed_len(m, 1);
    let (mut sg, mut nm) = (vec![0u8; n * nb], vec![f16::ZERO; n]);
    cpu::qjl_encode(&k, n, d, &s, m, &mut sg, &mut nm);
    let (gs, gn) = qjl_encode(&arr(&k, &[n, d]), &arr(&s, &[m, d]), &gpu()).unwrap();
    let got = gs.to_vec::<u8>().unwrap();
    if Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda {
        let differ = near_tie_signs(&got, &sg, &k, &s, d, m, "ties");
        eprintln!("tensor-core signs differing at near-ties: {differ} of {}", n * m);
    } else {
        assert_eq!(got, sg);
    }
    assert_eq!(gn.to_vec::<f16>().unwrap(), nm);
}

/// The codes of `n` rows of `per` sub-vectors from both planes.
fn pq_indices(codes: &[u8], codes_hi: &[u8], n: usize, per: usize, bits: u32) -> Vec<u32> {
    let (lo, hi) = veloxquant::cpu::code_planes(bits);
    let mut low = vec![0u8; n * per];
    cpu::bit_unpack(codes, n, per, lo, &mut low);
    let mut high = vec![0u8; n * per];
    if hi > 0 {
        cpu::bit_unpack(codes_hi, n, per, hi, &mut high);
    }
    low.iter().zip(&high).map(|(&l, &h)| u32::from(l) | u32::from(h) << lo).collect()
}

/// Codes of the tensor-core search against the exact search's: where they
/// differ, the entry chosen must be as near (in float64) as the exact one
/// within the search's resolution (2^-16 of the distance, module comment of
/// cuda/pq_encode_tensor_cores.cuh) and the products' rounding (float32
/// sums of terms up to ‖v‖² + ‖c‖²). Returns how many differ.
fn pq_near_ties<T: Float>(got: &[u32], want: &[u32], x: &[T], cb: &[f32], s: usize, tag: &str) -> usize {
    let dist = |v: &[T], c: u32| -> f64 {
        v.iter().zip(&cb[c as usize * s..(c as usize + 1) * s]).map(|(a, b)| (a.to_f32() as f64 - *b as f64).powi(2)).sum()
    };
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|a| a * a).sum::<f64>();
    let max_c = cb.chunks(s).map(|c| norm(&mut c.iter().map(|&a| a as f64))).fold(0.0, f64::max);
    let mut differ = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let v = &x[i * s..(i + 1) * s];
        if g == w || !v.iter().all(|a| a.to_f32().is_finite()) {
            assert_eq!(g, w, "{tag}: sub-vector {i} (not finite) has code {g}, the exact search {w}");
            continue;
        }
        assert!((g as usize) < cb.len() / s, "{tag}: sub-vector {i} has code {g} past the codebook");
        let (dg, dw) = (dist(v, g), dist(v, w));
        let tol = 4e-5 * dw + 1e-6 * (norm(&mut v.iter().map(|a| a.to_f32() as f64)) + max_c);
        assert!(dg <= dw + tol, "{tag}: sub-vector {i} has code {g} at {dg}, the exact search {w} at {dw}");
        differ += 1;
    }
    differ
}

fn pq<T: Float + Element>(n: usize, d: usize, s: usize, k: usize, bits: u32) {
    let x: Vec<T> = data(n as u64 + 5, n * d, 1.0);
    let cb: Vec<f32> = data(k as u64, k * s, 1.0);
    pq_with(&x, &arr(&x, &[n, d]), n, d, s, &cb, bits);
}

/// pq_encode of `xa` (`x` as an array, maybe a view) against the CPU's:
/// codes equal, or (the tensor-core search) equal but at near-ties, fewer
/// than 1% of them; then pq_decode of the codes equal to the CPU's.
fn pq_with<T: Float + Element>(x: &[T], xa: &Array, n: usize, d: usize, s: usize, cb: &[f32], bits: u32) -> usize {
    let k = cb.len() / s;
    let per = d / s;
    let (lo, hi) = veloxquant::cpu::code_planes(bits);
    let mut want = vec![0u8; n * cpu::packed_len(per, lo)];
    let mut want_hi = vec![0u8; if hi > 0 { n * cpu::packed_len(per, hi) } else { 0 }];
    cpu::pq_encode(x, n, d, cb, s, bits, &mut want, &mut want_hi);
    let c = arr(cb, &[k, s]);
    let p = pq_encode(xa, &c, bits, &gpu()).unwrap();
    let tag = format!("{} n={n} d={d} s={s} K={k} bits={bits}", T::DTYPE);
    let codes = p.codes.to_vec::<u8>().unwrap();
    let codes_hi = p.codes_hi.as_ref().map(|h| h.to_vec::<u8>().unwrap());
    assert_eq!(codes_hi.is_some(), hi > 0, "high plane {tag}");
    let codes_hi = codes_hi.unwrap_or_default();
    let tensor_cores = Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda && pq_tensor_cores(T::DTYPE, d, s, bits);
    let differ = if tensor_cores {
        let got = pq_indices(&codes, &codes_hi, n, per, bits);
        let differ = pq_near_ties(&got, &pq_indices(&want, &want_hi, n, per, bits), x, cb, s, &tag);
        assert!(differ * 100 <= n * per, "{tag}: {differ} of {} codes differ", n * per);
        eprintln!("{tag}: tensor-core codes differing at near-ties: {differ} of {}", n * per);
        differ
    } else {
        assert_eq!(codes, want, "{tag}");
        assert_eq!(codes_hi, want_hi, "high plane {tag}");
        0
    };
    let mut y = vec![T::default(); n * d];
    cpu::pq_decode(&codes, &codes_hi, n, d, cb, s, bits, &mut y);
    let got = pq_decode(&p, &c, bits, d, T::DTYPE, &gpu()).unwrap();
    assert_eq!(f32s::<T>(&got), y.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "decode {tag}");
    differ
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_pq_matches_cpu() {
    for &s in &[2usize, 4, 8] {
        pq::<f32>(50_000, 128, s, 256, 8);
        pq::<f16>(1_000, 8 * s + s, s, 16, 4);
    }
    pq::<bf16>(1, 8, 8, 1, 1);
    // Two planes; codebooks copied per block of items (up to 4 KiB in the
    // output type), once per block of a capped grid of quads (up to 16 KiB),
    // and read through the L1 cache, up to K = 4096.
    pq::<f32>(3_001, 26, 2, 32, 5);
    pq::<f16>(2_000, 64, 8, 512, 9);
    pq::<bf16>(777, 52, 4, 1024, 10);
    pq::<f32>(10_000, 128, 4, 4096, 12);
    pq::<f32>(1_000, 256, 8, 4096, 12);
    // Quads (4 sub-vectors) whose codes are whole bytes of both planes: 10
    // bits as the benchmark's; 6 bits (4 + 2) with a small codebook.
    pq::<f16>(4_097, 128, 4, 1024, 10);
    pq::<bf16>(999, 64, 2, 64, 6);
}

/// The tensor-core search of float16 and bfloat16 inputs where it must keep
/// the exact search's answer: entries repeated 128 entries on (equal
/// distances: the lower index wins), sub-vectors holding NaN, infinities or
/// values whose ‖v‖² leaves float32 (searched exactly), a codebook whose
/// ‖c‖² is past 2^100 (every row searched exactly), codebooks far below and
/// above 1 (one power-of-two scale), an input view off 4-byte alignment, K
/// not a multiple of 16, and rows of 512 sub-vectors (one a chunk). Rows of
/// 513 sub-vectors take the exact kernel.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_pq_tensor_core_edges() {
    let cuda = Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda;
    // Twins: entry c + 128 repeats entry c.
    let (n, d, s, k) = (5_000usize, 128usize, 4usize, 256usize);
    let mut cb: Vec<f32> = data(21, k * s, 1.0);
    cb.copy_within(0..128 * s, 128 * s);
    for t in [0u64, 1] {
        let tag = format!("twins {t}");
        let run = |x: &[f16], xb: &[bf16]| {
            pq_with(x, &arr(x, &[n, d]), n, d, s, &cb, 8);
            pq_with(xb, &arr(xb, &[n, d]), n, d, s, &cb, 8);
            for (name, codes) in [
                ("f16", pq_encode(&arr(x, &[n, d]), &arr(&cb, &[k, s]), 8, &gpu()).unwrap().codes),
                ("bf16", pq_encode(&arr(xb, &[n, d]), &arr(&cb, &[k, s]), 8, &gpu()).unwrap().codes),
            ] {
                let high = codes.to_vec::<u8>().unwrap().iter().filter(|&&c| c >= 128).count();
                assert_eq!(high, 0, "{tag} {name}: {high} codes chose the later of two equal entries");
            }
        };
        let x: Vec<f16> = data(22 + t, n * d, 1.0);
        let xb: Vec<bf16> = data(22 + t, n * d, 1.0);
        run(&x, &xb);
    }
    // Sub-vectors that are not finite, or whose ‖v‖² is not (bfloat16).
    let (n, d, s, k) = (2_000usize, 64usize, 8usize, 512usize);
    let cb: Vec<f32> = data(31, k * s, 1.0);
    let mut x: Vec<f16> = data(32, n * d, 1.0);
    let mut xb: Vec<bf16> = data(32, n * d, 1.0);
    for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 65504.0, -65504.0].iter().enumerate() {
        x[i * 97 * s + 3] = f16::from_f32(*v);
        xb[i * 97 * s + 3] = bf16::from_f32(*v);
        xb[(i * 97 + 11) * s] = bf16::from_f32(3e38 * (1.0 - 2.0 * (i % 2) as f32));
    }
    pq_with(&x, &arr(&x, &[n, d]), n, d, s, &cb, 9);
    pq_with(&xb, &arr(&xb, &[n, d]), n, d, s, &cb, 9);
    // An entry at 1e30: ‖c‖² past 2^100 sends every row to the exact search.
    let mut cb: Vec<f32> = data(41, 64 * 4, 1.0);
    cb[7 * 4..8 * 4].fill(bf16::from_f32(1e30).to_f32());
    let mut xb: Vec<bf16> = data(42, 1_000 * 32, 1.0);
    for i in (0..1_000 * 8).step_by(37) {
        xb[i * 4..(i + 1) * 4].fill(bf16::from_f32(1e30));
    }
    assert_eq!(pq_with(&xb, &arr(&xb, &[1_000, 32]), 1_000, 32, 4, &cb, 6), 0, "codebook past 2^100");
    // Scales: codebooks and inputs near 1e-3 and near 1e3.
    for scale in [1e-3f32, 1e3] {
        let cb: Vec<f32> = data(51, 1024 * 2, scale);
        let x: Vec<f16> = data(52, 3_000 * 96, scale);
        pq_with(&x, &arr(&x, &[3_000, 96]), 3_000, 96, 2, &cb, 10);
    }
    // Off alignment (one element in), K = 13 of 4 bits, one row, a chunk a row.
    let cb: Vec<f32> = data(61, 13 * 4, 1.0);
    let x: Vec<f16> = data(62, 3_001 * 128, 1.0);
    pq_with(&x, &offset_view(&x, &[3_001, 128], 1), 3_001, 128, 4, &cb, 4);
    pq::<bf16>(1, 16, 4, 13, 4);
    pq::<f16>(3, 1024, 2, 1024, 10);
    pq::<bf16>(70_001, 128, 4, 256, 8);
    assert!(!pq_tensor_cores(f16::DTYPE, 1026, 2, 6));
    pq::<f16>(10, 1026, 2, 64, 6);
    if cuda {
        assert!(pq_tensor_cores(f16::DTYPE, 128, 4, 8) && pq_tensor_cores(bf16::DTYPE, 1024, 2, 10));
    }
}

/// A codebook of 8 KiB in float16 is decoded in quads by a capped grid whose
/// blocks stride over rounds: more quads than one round holds. The codes
/// are random bytes (decoding needs no encoder).
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_pq_decode_strides_over_rounds() {
    let (n, d, s, k, bits) = (140_001usize, 128usize, 4usize, 1024usize, 10u32);
    let per = d / s;
    let (lo, hi) = veloxquant::cpu::code_planes(bits);
    let (nb, nb_hi) = (cpu::packed_len(per, lo), cpu::packed_len(per, hi));
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let codes: Vec<u8> = (0..n * nb).map(|_| rng.random()).collect();
    let codes_hi: Vec<u8> = (0..n * nb_hi).map(|_| rng.random()).collect();
    let cb: Vec<f32> = data(9, k * s, 1.0);
    let mut want = vec![f16::ZERO; n * d];
    cpu::pq_decode(&codes, &codes_hi, n, d, &cb, s, bits, &mut want);
    let packed = veloxquant::kernels::PqCodes { codes: arr(&codes, &[n, nb]), codes_hi: Some(arr(&codes_hi, &[n, nb_hi])) };
    let got = pq_decode(&packed, &arr(&cb, &[k, s]), bits, d, f16::DTYPE, &gpu()).unwrap();
    assert_eq!(got.to_vec::<f16>().unwrap(), want);
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_unaligned_views_match_cpu() {
    let (n, d) = (1_001usize, 128usize);
    let x: Vec<f16> = data(11, n * d, 1.0);
    let cb: Vec<f32> = vec![-0.9, -0.3, 0.3, 0.9];
    let c = arr(&cb, &[4]);
    let nb = cpu::packed_len(d, 2);
    let mut want = vec![0u8; n * nb];
    cpu::scalar_quantize(&x, n, d, &cb, 2, &mut want);
    let got = scalar_quantize(&offset_view(&x, &[n, d], 3), &c, 2, &gpu()).unwrap();
    assert_eq!(got.to_vec::<u8>().unwrap(), want, "scalar_quantize, x 3 elements in");
    let mut y = vec![f16::ZERO; n * d];
    cpu::scalar_dequantize(&want, n, d, &cb, 2, &mut y);
    let got = scalar_dequantize(&offset_view(&want, &[n, nb], 1), &c, 2, d, f16::DTYPE, &gpu()).unwrap();
    assert_eq!(got.to_vec::<f16>().unwrap(), y, "scalar_dequantize, codes 1 byte in");
    for mode in [KiviMode::Keys, KiviMode::Values] {
        let per_channel = mode == KiviMode::Keys;
        let np = if per_channel { n.div_ceil(32) * d } else { n * d / 32 };
        let (mut c, mut s, mut z) = (vec![0u8; n * nb], vec![f16::ZERO; np], vec![f16::ZERO; np]);
        cpu::kivi_quantize(&x, n, d, 2, 32, per_channel, &mut c, &mut s, &mut z);
        let (gc, gs, gz) = kivi_quantize(&offset_view(&x, &[n, d], 5), 2, 32, mode, &gpu()).unwrap();
        assert_eq!(
            (gc.to_vec::<u8>().unwrap(), gs.to_vec::<f16>().unwrap(), gz.to_vec::<f16>().unwrap()),
            (c.clone(), s.clone(), z.clone()),
            "kivi_quantize {mode:?}, x 5 elements in"
        );
        let mut y = vec![f16::ZERO; n * d];
        cpu::kivi_dequantize(&c, &s, &z, n, d, 2, 32, per_channel, &mut y);
        let shape = if per_channel { [n.div_ceil(32), d] } else { [n, d / 32] };
        let got = kivi_dequantize(
            &offset_view(&c, &[n, nb], 1),
            &offset_view(&s, &shape, 1),
            &offset_view(&z, &shape, 3),
            2,
            32,
            mode,
            d,
            f16::DTYPE,
            &gpu(),
        )
        .unwrap();
        assert_eq!(got.to_vec::<f16>().unwrap(), y, "kivi_dequantize {mode:?}, every input off alignment");
    }
    let pcb: Vec<f32> = data(3, 256 * 4, 1.0);
    let per = d / 4;
    let mut codes = vec![0u8; n * per];
    cpu::pq_encode(&x, n, d, &pcb, 4, 8, &mut codes, &mut []);
    let mut y = vec![f16::ZERO; n * d];
    cpu::pq_decode(&codes, &[], n, d, &pcb, 4, 8, &mut y);
    let packed = veloxquant::kernels::PqCodes { codes: offset_view(&codes, &[n, per], 1), codes_hi: None };
    let got = pq_decode(&packed, &arr(&pcb, &[256, 4]), 8, d, f16::DTYPE, &gpu()).unwrap();
    assert_eq!(got.to_vec::<f16>().unwrap(), y, "pq_decode, codes 1 byte in");
    // qjl_score with signs 1 byte off alignment (read bytewise).
    let (m, nq) = (256usize, 4usize);
    let sk: Vec<f32> = data(5, m * d, 1.0);
    let q: Vec<f16> = data(6, nq * d, 1.0);
    let (mut sg, mut nm) = (vec![0u8; n * m / 8], vec![f16::ZERO; n]);
    cpu::qjl_encode(&x, n, d, &sk, m, &mut sg, &mut nm);
    let mut want = vec![0.0f32; nq * n];
    cpu::qjl_score(&q, nq, d, &sk, m, &sg, &nm, n, &mut want);
    let got = qjl_score(&arr(&q, &[nq, d]), &arr(&sk, &[m, d]), &offset_view(&sg, &[n, m / 8], 1), &arr(&nm, &[n]), &gpu())
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_scores_close(&got, &want, "qjl_score, signs 1 byte in");
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_transposed_input_is_made_contiguous() {
    let o = gpu();
    let s = o.stream.clone().unwrap();
    let x: Vec<f32> = data(1, 128 * 64, 0.2);
    let xt = ops::transpose(&arr(&x, &[128, 64]), &[1, 0], &s).unwrap();
    let c = arr(&[-0.2f32, -0.05, 0.05, 0.2], &[4]);
    let a = scalar_quantize(&xt, &c, 2, &o).unwrap().to_vec::<u8>().unwrap();
    let cpu_o = Options::on(Stream::cpu(), Policy::Require);
    let xt_cpu = ops::transpose(&arr(&x, &[128, 64]), &[1, 0], &Stream::cpu()).unwrap();
    assert_eq!(a, scalar_quantize(&xt_cpu, &c, 2, &cpu_o).unwrap().to_vec::<u8>().unwrap());
}
