//! The kernels on MLX's CPU stream: the CPU primitive and the reference graph
//! against the plain Rust functions, laziness, the policy, and bad input.

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::kernels::{self, bit_pack, bit_unpack, vq_quantize, Implementation, Kernel};
use veloxquant::{cpu, Array, Dtype, Error, Options, Policy, Stream};

fn opts(policy: Policy) -> Options {
    Options::on(Stream::cpu(), policy)
}

fn random_codes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.random::<u8>()).collect()
}

#[test]
fn bit_pack_matches_rust_for_every_width_and_tail() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for &bits in &cpu::SUPPORTED_BITS {
        for &(rows, n) in &[(1usize, 1usize), (3, 5), (2, 8), (4, 13), (7, 64), (3, 1001)] {
            // Codes carry garbage above the low `bits` bits: it must be ignored.
            let codes = random_codes(&mut rng, rows * n);
            let mut want = vec![0u8; rows * cpu::packed_len(n, bits)];
            cpu::bit_pack(&codes, rows, n, bits, &mut want);
            let a = Array::from_slice(&codes, &[rows as i32, n as i32]).unwrap();
            for policy in [Policy::Require, Policy::Off] {
                let packed = bit_pack(&a, bits, &opts(policy)).unwrap();
                assert_eq!(packed.shape(), vec![rows as i32, cpu::packed_len(n, bits) as i32]);
                assert_eq!(packed.to_vec::<u8>().unwrap(), want, "bits={bits} rows={rows} n={n} {policy}");
                let back = bit_unpack(&packed, bits, n, &opts(policy)).unwrap();
                let masked: Vec<u8> = codes.iter().map(|&c| (u32::from(c) & ((1 << bits) - 1)) as u8).collect();
                assert_eq!(back.to_vec::<u8>().unwrap(), masked, "unpack bits={bits} n={n} {policy}");
            }
        }
    }
}

#[test]
fn bit_pack_keeps_leading_dimensions_and_handles_empty() {
    let codes: Vec<u8> = (0..2 * 3 * 10).map(|i| (i % 8) as u8).collect();
    let a = Array::from_slice(&codes, &[2, 3, 10]).unwrap();
    let p = bit_pack(&a, 3, &opts(Policy::Auto)).unwrap();
    assert_eq!(p.shape(), vec![2, 3, 4]);
    let empty = Array::from_slice::<u8>(&[], &[0, 7]).unwrap();
    let p = bit_pack(&empty, 2, &opts(Policy::Require)).unwrap();
    assert_eq!(p.shape(), vec![0, 2]);
    assert!(p.to_vec::<u8>().unwrap().is_empty());
}

fn vq_case<T: veloxquant::Element + cpu::VqElement>(conv: fn(f32) -> T, d: usize, k: usize, n: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<T> = (0..n * d).map(|_| conv(rng.random::<f32>() * 2.0 - 1.0)).collect();
    let cb: Vec<T> = (0..k * d).map(|_| conv(rng.random::<f32>() * 2.0 - 1.0)).collect();
    let mut want = vec![0u32; n];
    cpu::vq_quantize(&x, &cb, n, k, d, &mut want);
    let xa = Array::from_slice(&x, &[n as i32, d as i32]).unwrap();
    let ca = Array::from_slice(&cb, &[k as i32, d as i32]).unwrap();
    let fused = vq_quantize(&xa, &ca, &opts(Policy::Require)).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(fused, want, "CPU primitive, d={d} k={k}");
    // The reference graph sums in its own order: indices may differ only at
    // near-ties, where the two distances agree to rounding.
    let reference = vq_quantize(&xa, &ca, &opts(Policy::Off)).unwrap().to_vec::<u32>().unwrap();
    let dist = |i: usize, c: u32| -> f32 {
        (0..d).map(|j| {
            let diff = x[i * d + j].to_f32() - cb[c as usize * d + j].to_f32();
            diff * diff
        }).sum()
    };
    let mut differ = 0;
    for i in 0..n {
        if reference[i] != want[i] {
            differ += 1;
            let (a, b) = (dist(i, reference[i]), dist(i, want[i]));
            assert!((a - b).abs() <= 1e-5 * a.max(b).max(1e-6), "vector {i}: {a} vs {b}");
        }
    }
    assert!(differ * 1000 <= n.max(1000), "{differ} of {n} indices differ");
}

#[test]
fn vq_quantize_cpu_primitive_and_reference_agree_with_rust() {
    for (i, &d) in kernels::VQ_DIMS.iter().enumerate() {
        vq_case::<f32>(|v| v, d, 256, 3001, i as u64);
        vq_case::<f16>(f16::from_f32, d, 16, 1000, 10 + i as u64);
        vq_case::<bf16>(bf16::from_f32, d, 64, 777, 20 + i as u64);
    }
    vq_case::<f32>(|v| v, 4, kernels::MAX_CODEBOOK_SIZE, 300, 99);
    vq_case::<f32>(|v| v, 2, 1, 5, 98);
}

#[test]
fn vq_quantize_is_lazy_and_composes() {
    let x = Array::from_slice(&[0.0f32, 0.0, 1.0, 1.0, 0.9, 1.1], &[3, 2]).unwrap();
    let cb = Array::from_slice(&[0.0f32, 0.0, 1.0, 1.0], &[2, 2]).unwrap();
    let s = Stream::cpu();
    let idx = vq_quantize(&x, &cb, &opts(Policy::Require)).unwrap();
    // Feed the lazy result into further ops before anything is evaluated.
    let shifted = veloxquant::ops::left_shift(&idx, &idx, &s).unwrap();
    assert_eq!(shifted.to_vec::<u32>().unwrap(), vec![0, 2, 2]);
    assert_eq!(idx.to_vec::<u32>().unwrap(), vec![0, 1, 1]);
}

#[test]
fn bad_input_names_the_argument() {
    let o = opts(Policy::Auto);
    let f = Array::from_slice(&[1.0f32; 8], &[2, 4]).unwrap();
    let u = Array::from_slice(&[1u8; 8], &[2, 4]).unwrap();
    let msg = |e: Error| e.to_string();
    assert!(msg(bit_pack(&f, 2, &o).unwrap_err()).starts_with("codes: dtype float32"));
    assert!(msg(bit_pack(&u, 5, &o).unwrap_err()).starts_with("bits: 5"));
    assert!(msg(bit_unpack(&u, 3, 100, &o).unwrap_err()).starts_with("packed:"));
    assert!(msg(vq_quantize(&u, &u, &o).unwrap_err()).starts_with("x: dtype uint8"));
    let h = Array::from_slice(&[f16::ONE; 8], &[2, 4]).unwrap();
    assert!(msg(vq_quantize(&f, &h, &o).unwrap_err()).starts_with("codebook: dtype float16"));
    let x3 = Array::from_slice(&[1.0f32; 6], &[2, 3]).unwrap();
    assert!(msg(vq_quantize(&x3, &x3, &o).unwrap_err()).starts_with("x: vector size"));
    let cb8 = Array::from_slice(&[1.0f32; 16], &[2, 8]).unwrap();
    assert!(msg(vq_quantize(&f, &cb8, &o).unwrap_err()).starts_with("codebook: shape"));
    let big = Array::from_slice(&vec![0.0f32; 4097 * 2], &[4097, 2]).unwrap();
    let x2 = Array::from_slice(&[1.0f32; 4], &[2, 2]).unwrap();
    assert!(msg(vq_quantize(&x2, &big, &o).unwrap_err()).starts_with("codebook: 4097"));
    assert!(msg("fast".parse::<Policy>().unwrap_err()).starts_with("policy:"));
}

#[test]
fn policy_selects_and_require_refuses_a_missing_kernel() {
    let s = Stream::cpu();
    let full = Kernel::BitPack;
    // Declared with GPU bodies only.
    let gpu_only = Kernel::TqDecode;
    assert_eq!(kernels::select(full, Policy::Auto, &s).unwrap(), Implementation::Cpu);
    assert_eq!(kernels::select(full, Policy::Off, &s).unwrap(), Implementation::Reference);
    assert_eq!(kernels::select(gpu_only, Policy::Auto, &s).unwrap(), Implementation::Reference);
    let err = kernels::select(gpu_only, Policy::Require, &s).unwrap_err().to_string();
    assert!(err.contains("tq_decode") && err.contains("require") && err.contains("cpu"), "{err}");
}

#[test]
fn runtime_mlx_is_the_compiled_one() {
    veloxquant::array::check_mlx_version().unwrap();
    assert_eq!(veloxquant::array::mlx_compiled_version(), "0.32.4");
    assert_eq!(Array::from_slice(&[1u8], &[1]).unwrap().dtype(), Dtype::U8);
}

mod common;

#[test]
fn window_append_matches_the_reference_graph() {
    for (dtype, tol) in [(Dtype::F32, 1e-5), (Dtype::F16, 2e-3), (Dtype::BF16, 1.6e-2)] {
        for d in [64, 40] {
            for t in [1, 3] {
                for (offset, rotate_v) in [(true, true), (false, false), (true, false)] {
                    common::check_window_append(&opts(Policy::Require), dtype, d, t, offset, rotate_v, tol);
                }
            }
        }
    }
}

#[test]
fn window_append_refuses_bad_input_naming_the_argument() {
    use veloxquant::kernels::window::{window_append, WindowAppend};
    let s = Stream::cpu();
    let z = |shape: &[i32], dtype: Dtype| veloxquant::ops::zeros(shape, dtype, &s).unwrap();
    let (keys, frame, win) = (z(&[1, 2, 1, 8], Dtype::F16), z(&[8, 8], Dtype::F16), z(&[1, 2, 4, 8], Dtype::F16));
    let wide = z(&[1, 2, 1, 8], Dtype::F32);
    let call = |keys: &Array, at: usize| {
        window_append(
            &WindowAppend { keys, values: keys, key_frame: &frame, key_offset: None, value_frame: None, win_k: &win, win_v: &win, at },
            &opts(Policy::Auto),
        )
    };
    let err = call(&wide, 0).unwrap_err();
    assert!(matches!(err, Error::Dtype { argument: "keys", .. }), "{err}");
    let err = call(&keys, 4).unwrap_err();
    assert!(err.to_string().contains("at"), "{err}");
    assert!(call(&keys, 3).is_ok());
}

/// A side of `rows` (batch 2 × heads) as `framed_dequantize` reads it, and
/// the buffer it should give, computed here element by element.
struct FramedCase {
    window: Vec<f32>,
    codes: Vec<u8>,
    norms: Vec<f16>,
    table: Vec<f32>,
    chunk: Vec<f32>,
    want: Vec<f32>,
}

fn framed_case(rng: &mut ChaCha8Rng, d: usize, bits: u32, w: usize, cap: usize, parts: [usize; 5]) -> FramedCase {
    let [sinks, compressed, recent, recent_at, chunk] = parts;
    let (rows, nb) = (4usize, cpu::packed_len(d, bits));
    let mut uniform = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect() };
    let window = uniform(rows * w * d);
    let chunk_v = uniform(rows * chunk * d);
    let table = uniform(1 << bits);
    let norms: Vec<f16> = uniform(rows * cap).into_iter().map(|x| f16::from_f32(x.abs() * 8.0)).collect();
    let codes: Vec<u8> = (0..rows * cap * nb).map(|_| rng.random::<u8>()).collect();
    let mut want = Vec::new();
    for r in 0..rows {
        for t in 0..sinks {
            want.extend_from_slice(&window[(r * w + t) * d..][..d]);
        }
        for t in 0..compressed {
            let row = &codes[(r * cap + t) * nb..][..nb];
            want.extend((0..d).map(|j| table[cpu::turboquant::code_at(row, j, bits)] * norms[r * cap + t].to_f32()));
        }
        for t in 0..recent {
            want.extend_from_slice(&window[(r * w + recent_at + t) * d..][..d]);
        }
        want.extend_from_slice(&chunk_v[r * chunk * d..][..chunk * d]);
    }
    FramedCase { window, codes, norms, table, chunk: chunk_v, want }
}

fn as_f32(a: &Array) -> Vec<f32> {
    veloxquant::ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn framed_dequantize_is_sinks_decoded_history_recent_then_chunk() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for &(d, bits) in &[(64usize, 4u32), (64, 3), (128, 2), (96, 4), (8, 1)] {
        for parts in [[4, 37, 9, 4, 5], [0, 0, 0, 0, 3], [4, 0, 2, 4, 1], [1, 64, 0, 1, 0], [2, 5, 7, 3, 2]] {
            let (w, cap) = (16usize, 70usize);
            let c = framed_case(&mut rng, d, bits, w, cap, parts);
            let nb = cpu::packed_len(d, bits) as i32;
            let [sinks, compressed, recent, recent_at, chunk] = parts;
            for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
                let f = |x: &[f32], shape: &[i32]| {
                    veloxquant::ops::astype(&Array::from_slice(x, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
                };
                let (window, chunk_a) = (f(&c.window, &[2, 2, w as i32, d as i32]), f(&c.chunk, &[2, 2, chunk as i32, d as i32]));
                let codes = Array::from_slice(&c.codes, &[2, 2, cap as i32, nb]).unwrap();
                let norms = Array::from_slice(&c.norms, &[2, 2, cap as i32]).unwrap();
                let table = Array::from_slice(&c.table, &[1 << bits]).unwrap();
                let side = kernels::FramedSide {
                    window: &window,
                    codes: &codes,
                    norms: &norms,
                    table: &table,
                    chunk: &chunk_a,
                    bits,
                    sinks,
                    compressed,
                    recent,
                    recent_at,
                };
                // Each element rounded once to the dtype from float32.
                let want: Vec<f32> = c.want.iter().map(|&x| as_f32(&f(&[x], &[1]))[0]).collect();
                for policy in [Policy::Require, Policy::Off] {
                    let out = kernels::framed_dequantize(&side, &opts(policy)).unwrap();
                    let total = (sinks + compressed + recent + chunk) as i32;
                    assert_eq!(out.shape(), vec![2, 2, total, d as i32]);
                    assert_eq!(out.dtype(), dtype);
                    assert_eq!(as_f32(&out), want, "d={d} bits={bits} {parts:?} {dtype} {policy}");
                }
            }
        }
    }
}

#[test]
fn framed_dequantize_names_the_argument_at_fault() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let c = framed_case(&mut rng, 64, 4, 16, 20, [4, 10, 3, 4, 2]);
    let window = Array::from_slice(&c.window, &[2, 2, 16, 64]).unwrap();
    let chunk = Array::from_slice(&c.chunk, &[2, 2, 2, 64]).unwrap();
    let codes = Array::from_slice(&c.codes, &[2, 2, 20, 32]).unwrap();
    let norms = Array::from_slice(&c.norms, &[2, 2, 20]).unwrap();
    let table = Array::from_slice(&c.table, &[16]).unwrap();
    let ok = kernels::FramedSide { window: &window, codes: &codes, norms: &norms, table: &table, chunk: &chunk, bits: 4, sinks: 4, compressed: 10, recent: 3, recent_at: 4 };
    assert!(kernels::framed_dequantize(&ok, &opts(Policy::Require)).is_ok());
    let half_chunk = veloxquant::ops::astype(&chunk, Dtype::F16, &Stream::cpu()).unwrap();
    let norms32 = veloxquant::ops::astype(&norms, Dtype::F32, &Stream::cpu()).unwrap();
    let bad: [(&str, kernels::FramedSide<'_>); 6] = [
        ("bits", kernels::FramedSide { bits: 5, ..ok }),
        ("chunk", kernels::FramedSide { chunk: &half_chunk, ..ok }),
        ("norms", kernels::FramedSide { norms: &norms32, ..ok }),
        ("compressed", kernels::FramedSide { compressed: 21, ..ok }),
        ("recent", kernels::FramedSide { recent: 13, ..ok }),
        ("table", kernels::FramedSide { bits: 3, codes: &codes, ..ok }),
    ];
    for (argument, side) in bad {
        match kernels::framed_dequantize(&side, &opts(Policy::Require)) {
            Err(Error::InvalidArgument { argument: a, .. }) | Err(Error::Dtype { argument: a, .. }) => assert!(
                a == argument || (argument == "table" && a == "codes"),
                "{argument}: the error names {a}"
            ),
            other => panic!("{argument}: expected an error, got {:?}", other.map(|a| a.shape())),
        }
    }
}

/// A side's store of `cap0` slots and `m` new tokens, with saturated, NaN,
/// huge and ordinary new norms, and the expected grown store built slot by slot.
struct StoreCase {
    codes: Vec<u8>,
    norms: Vec<f16>,
    new_codes: Vec<u8>,
    new_norms: Vec<f16>,
    want_codes: Vec<u8>,
    want_norms: Vec<u16>,
}

fn store_case(rng: &mut ChaCha8Rng, rows: usize, cap0: usize, first: usize, m: usize, cap: usize, nb: usize) -> StoreCase {
    let codes = random_codes(rng, rows * cap0 * nb);
    let norms: Vec<f16> = (0..rows * cap0).map(|_| f16::from_f32(rng.random::<f32>() * 8.0)).collect();
    let new_codes = random_codes(rng, rows * m * nb);
    let specials = [f16::MAX, f16::NAN, f16::INFINITY, f16::from_f32(65000.0)];
    let new_norms: Vec<f16> = (0..rows * m)
        .map(|i| if i % 5 == 1 { specials[(i / 5) % specials.len()] } else { f16::from_f32(rng.random::<f32>() * 8.0) })
        .collect();
    let (mut want_codes, mut want_norms) = (vec![0u8; rows * cap * nb], vec![0u16; rows * cap]);
    for r in 0..rows {
        for t in 0..first + m {
            let (src, n) = if t < first {
                (&codes[(r * cap0 + t) * nb..][..nb], norms[r * cap0 + t])
            } else {
                let n = new_norms[r * m + t - first];
                (&new_codes[(r * m + t - first) * nb..][..nb], if n.is_nan() || n.to_f32() >= 65504.0 { f16::NAN } else { n })
            };
            want_codes[(r * cap + t) * nb..][..nb].copy_from_slice(src);
            want_norms[r * cap + t] = n.to_bits();
        }
    }
    StoreCase { codes, norms, new_codes, new_norms, want_codes, want_norms }
}

/// A side's four arrays `[b, h, ...]` from a case.
fn store_arrays(c: &StoreCase, (b, h): (i32, i32), cap0: usize, m: usize, nb: usize) -> [Array; 4] {
    [
        Array::from_slice(&c.codes, &[b, h, cap0 as i32, nb as i32]).unwrap(),
        Array::from_slice(&c.norms, &[b, h, cap0 as i32]).unwrap(),
        Array::from_slice(&c.new_codes, &[b, h, m as i32, nb as i32]).unwrap(),
        Array::from_slice(&c.new_norms, &[b, h, m as i32]).unwrap(),
    ]
}

#[test]
fn store_write_keeps_the_old_slots_then_the_new_tokens_marked_then_zeros() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    // (rows, old slots, first, new tokens, new slots, the keys' and the
    // values' code bytes): 4-bit and 3-bit rows at heads of 128 and 64, a
    // 3-bit head of 80 (30 bytes, not a whole number of words), nothing
    // kept, nothing new, a store that shrinks.
    for &(rows, cap0, first, m, cap, kb, vb) in &[
        (6usize, 40usize, 33usize, 70usize, 128usize, 64usize, 48usize),
        (2, 64, 64, 9, 80, 32, 24),
        (3, 17, 5, 11, 20, 30, 40),
        (4, 0, 0, 25, 64, 24, 24),
        (2, 30, 30, 0, 64, 32, 48),
        (2, 50, 10, 12, 22, 12, 30),
    ] {
        let (ck, cv) = (store_case(&mut rng, rows, cap0, first, m, cap, kb), store_case(&mut rng, rows, cap0, first, m, cap, vb));
        let bh = if rows % 2 == 0 { (2, rows as i32 / 2) } else { (1, rows as i32) };
        let [kc, kn, knc, knn] = store_arrays(&ck, bh, cap0, m, kb);
        let [vc, vn, vnc, vnn] = store_arrays(&cv, bh, cap0, m, vb);
        let k = kernels::StoreWrite { codes: &kc, norms: &kn, new_codes: &knc, new_norms: &knn, first, capacity: cap };
        let v = kernels::StoreWrite { codes: &vc, norms: &vn, new_codes: &vnc, new_norms: &vnn, first, capacity: cap };
        for policy in [Policy::Require, Policy::Off] {
            let out = kernels::store_write([&k, &v], &opts(policy)).unwrap();
            for ((oc, on), (c, nb, side)) in out.iter().zip([(&ck, kb, "keys"), (&cv, vb, "values")]) {
                let tag = format!("{side} rows={rows} cap0={cap0} first={first} m={m} cap={cap} nb={nb} {policy}");
                assert_eq!(oc.shape(), vec![bh.0, bh.1, cap as i32, nb as i32], "{tag}");
                assert_eq!(on.shape(), vec![bh.0, bh.1, cap as i32], "{tag}");
                assert_eq!(oc.to_vec::<u8>().unwrap(), c.want_codes, "codes {tag}");
                let bits: Vec<u16> = on.to_vec::<f16>().unwrap().iter().map(|n| n.to_bits()).collect();
                assert_eq!(bits, c.want_norms, "norms {tag}");
            }
        }
    }
}

#[test]
fn store_write_names_the_argument_at_fault() {
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let c = store_case(&mut rng, 4, 20, 10, 6, 32, 32);
    let [codes, norms, new_codes, new_norms] = store_arrays(&c, (2, 2), 20, 6, 32);
    let ok = kernels::StoreWrite { codes: &codes, norms: &norms, new_codes: &new_codes, new_norms: &new_norms, first: 10, capacity: 32 };
    assert!(kernels::store_write([&ok, &ok], &opts(Policy::Require)).is_ok());
    let norms32 = veloxquant::ops::astype(&norms, Dtype::F32, &Stream::cpu()).unwrap();
    let short_rows = Array::from_slice(&c.new_codes[..2 * 2 * 6 * 16], &[2, 2, 6, 16]).unwrap();
    let wrong_tokens = Array::from_slice(&c.new_norms[..2 * 2 * 5], &[2, 2, 5]).unwrap();
    let bad: [(&str, kernels::StoreWrite<'_>); 5] = [
        ("norms", kernels::StoreWrite { norms: &norms32, ..ok }),
        ("new_codes", kernels::StoreWrite { new_codes: &short_rows, ..ok }),
        ("new_norms", kernels::StoreWrite { new_norms: &wrong_tokens, ..ok }),
        ("first", kernels::StoreWrite { first: 21, ..ok }),
        ("capacity", kernels::StoreWrite { capacity: 15, ..ok }),
    ];
    for (argument, a) in bad {
        for pair in [[&a, &ok], [&ok, &a]] {
            match kernels::store_write(pair, &opts(Policy::Require)) {
                Err(Error::InvalidArgument { argument: got, .. }) => assert_eq!(got, argument),
                other => panic!("{argument}: expected an error, got {:?}", other.map(|o| o[0].0.shape())),
            }
        }
    }
    // The two sides must share their rows, slots and tokens.
    let later = kernels::StoreWrite { first: 12, ..ok };
    match kernels::store_write([&ok, &later], &opts(Policy::Require)) {
        Err(Error::InvalidArgument { argument, .. }) => assert_eq!(argument, "sides"),
        other => panic!("sides: expected an error, got {:?}", other.map(|o| o[0].0.shape())),
    }
}

#[test]
fn key_mean_matches_the_reference_graph_and_skips_non_finite_keys() {
    let s = Stream::cpu();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (dtype, tol) in [(Dtype::F32, 1e-5f32), (Dtype::F16, 1e-3), (Dtype::BF16, 8e-3)] {
        for &(b, h, t, d) in &[(1usize, 2usize, 37usize, 64usize), (2, 3, 5, 40), (1, 1, 300, 128)] {
            // Laid out [B, T, H, D] and viewed as [B, H, T, D], as a model hands keys over.
            let mut x: Vec<f32> = (0..b * t * h * d).map(|_| rng.random::<f32>() * 4.0 - 1.0).collect();
            for (i, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY].into_iter().enumerate() {
                let n = x.len();
                x[(i * 7919) % n] = special;
            }
            let raw = Array::from_slice(&x, &[b as i32, t as i32, h as i32, d as i32]).unwrap();
            let keys = veloxquant::ops::transpose(&veloxquant::ops::astype(&raw, dtype, &s).unwrap(), &[0, 2, 1, 3], &s).unwrap();
            // The keys as the kernel reads them (rounded to `dtype`).
            let rounded = veloxquant::ops::astype(&keys, Dtype::F32, &s).unwrap().to_vec::<f32>().unwrap();
            let frame = 16.0f32;
            let rot: Vec<f32> = (0..d * d).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
            let rotation = Array::from_slice(&rot, &[d as i32, d as i32]).unwrap();
            for rotated in [true, false] {
                let a = kernels::KeyMean { keys: &keys, rotation: rotated.then_some(&rotation), frame };
                let tag = format!("{dtype} b={b} h={h} t={t} d={d} rotated={rotated}");
                let (m_ref, o_ref) = kernels::key_mean(&a, &opts(Policy::Off)).unwrap();
                let (m, o) = kernels::key_mean(&a, &opts(Policy::Require)).unwrap();
                assert_eq!((m.shape(), m.dtype()), (vec![b as i32, h as i32, 1, d as i32], Dtype::F32), "{tag}");
                assert_eq!((o.shape(), o.dtype()), (vec![b as i32, h as i32, 1, d as i32], dtype), "{tag}");
                let (m, m_ref) = (m.to_vec::<f32>().unwrap(), m_ref.to_vec::<f32>().unwrap());
                for row in 0..b * h {
                    for di in 0..d {
                        let col = (0..t).map(|ti| rounded[(row * t + ti) * d + di]).filter(|v| v.is_finite());
                        let want = col.sum::<f32>() / t as f32;
                        let got = m[row * d + di];
                        assert!(got.is_finite() && (got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{tag} mean {got} vs {want}");
                        assert!((got - m_ref[row * d + di]).abs() <= 1e-5 * (1.0 + want.abs()), "{tag} reference mean");
                    }
                }
                let up = |a: &Array| veloxquant::ops::astype(a, Dtype::F32, &s).unwrap().to_vec::<f32>().unwrap();
                let (o, o_ref) = (up(&o), up(&o_ref));
                let largest = o_ref.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (g, e) in o.iter().zip(&o_ref) {
                    assert!((g - e).abs() <= tol * largest.max(1e-3), "{tag} offset {g} vs {e}");
                }
            }
        }
    }
}

#[test]
fn key_mean_refuses_bad_input_naming_the_argument() {
    let s = Stream::cpu();
    let z = |shape: &[i32], dtype: Dtype| veloxquant::ops::zeros(shape, dtype, &s).unwrap();
    let (keys, rot) = (z(&[1, 2, 4, 64], Dtype::F16), z(&[64, 64], Dtype::F32));
    let call = |keys: &Array, rotation: Option<&Array>, frame: f32| {
        kernels::key_mean(&kernels::KeyMean { keys, rotation, frame }, &opts(Policy::Auto))
    };
    let err = call(&z(&[1, 2, 4, 64], Dtype::U8), None, 16.0).unwrap_err();
    assert!(matches!(err, Error::Dtype { argument: "keys", .. }), "{err}");
    let err = call(&z(&[1, 2, 0, 64], Dtype::F16), None, 16.0).unwrap_err();
    assert!(err.to_string().contains("keys"), "{err}");
    let err = call(&z(&[1, 2, 4, 60], Dtype::F16), None, 16.0).unwrap_err();
    assert!(err.to_string().contains("keys"), "{err}");
    let err = call(&keys, Some(&z(&[32, 32], Dtype::F32)), 16.0).unwrap_err();
    assert!(err.to_string().contains("rotation"), "{err}");
    let err = call(&keys, Some(&z(&[64, 64], Dtype::F16)), 16.0).unwrap_err();
    assert!(err.to_string().contains("rotation"), "{err}");
    let err = call(&keys, Some(&rot), 12.0).unwrap_err();
    assert!(err.to_string().contains("frame"), "{err}");
    assert!(call(&keys, Some(&rot), 16.0).is_ok());
}
