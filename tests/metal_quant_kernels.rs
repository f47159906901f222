//! The quantizer Metal bodies on the emulator against the CPU kernels in
//! `veloxquant::cpu` (which tests/quant_kernels_cpu.rs ties to
//! `veloxquant::quant`): codes and signs byte for byte, decoded values
//! exactly, norms and scores to float rounding. Grids are MLX's (threads, the
//! last threadgroup partial) and, where noted, rounded up to whole
//! threadgroups.

mod common;
mod metal_emulator;

use half::{bf16, f16};
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::{self, Float};

fn data(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| (rng.random::<f32>() - 0.5) * 3.4 * scale).collect()
}

fn conv<T: Float>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn grid(work: usize, tg: u32, round_up: bool) -> u32 {
    if round_up {
        (work as u32).div_ceil(tg) * tg
    } else {
        work as u32
    }
}

/// A sorted codebook of 2^bits entries.
fn codebook(bits: u32, seed: u64) -> Vec<f32> {
    let mut c = data(seed, 1 << bits, 0.2);
    c.sort_by(f32::total_cmp);
    c
}

fn scalar<T: Float + Element>(n: usize, d: usize, bits: u32, tg: u32, round_up: bool) {
    let x: Vec<T> = conv(&data(n as u64 + d as u64, n * d, 0.2));
    let cb = codebook(bits, bits as u64);
    let nbytes = cpu::packed_len(d, bits);
    let mut want = vec![0u8; n * nbytes];
    cpu::scalar_quantize(&x, n, d, &cb, bits, &mut want);
    let groups = n * d.div_ceil(8);
    let tag = format!("{:?} n={n} d={d} bits={bits} tg={tg}", T::DTYPE);
    let out = metal_emulator::declared(Kernel::ScalarQuantize)
        .launch()
        .input(HostArray::new(&[n, d], &x))
        .input(HostArray::new(&[1 << bits], &cb))
        .input(HostArray::new(&[3], &[n as u32, d as u32, nbytes as u32]))
        .output(&[n, nbytes], Dtype::U8)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .grid(grid(groups, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("scalar_quantize {tag}: {e}"));
    assert_eq!(out[0].to_vec::<u8>(), want, "scalar_quantize {tag}");
    let mut expect = vec![T::default(); n * d];
    cpu::scalar_dequantize(&want, n, d, &cb, bits, &mut expect);
    let out = metal_emulator::declared(Kernel::ScalarDequantize)
        .launch()
        .input(HostArray::new(&[n, nbytes], &want))
        .input(HostArray::new(&[1 << bits], &cb))
        .input(HostArray::new(&[3], &[n as u32, d as u32, nbytes as u32]))
        .output(&[n, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .grid(grid(groups, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("scalar_dequantize {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = expect.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "scalar_dequantize {tag}");
}

#[test]
fn scalar_quantize_and_dequantize_match_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        scalar::<f32>(37, 128, bits, 256, false);
        scalar::<f16>(5, 13, bits, 32, true);
        scalar::<bf16>(1, 3, bits, 32, false);
    }
    scalar::<f32>(0, 128, 4, 32, false);
    scalar::<f32>(3, 4096, 8, 1024, true);
}

fn kivi<T: Float + Element>(per_channel: bool, n: usize, d: usize, bits: u32, group: usize, tg: u32, round_up: bool) {
    let x: Vec<T> = conv(&data(7 + n as u64, n * d, 1.0));
    let nbytes = cpu::packed_len(d, bits);
    let np = if per_channel { n.div_ceil(group) * d } else { n * d / group };
    let (mut codes, mut scales, mut zeros) = (vec![0u8; n * nbytes], vec![f16::ZERO; np], vec![f16::ZERO; np]);
    cpu::kivi_quantize(&x, n, d, bits, group, per_channel, &mut codes, &mut scales, &mut zeros);
    let pshape = if per_channel { [n.div_ceil(group), d] } else { [n, d / group] };
    let items = if per_channel { n.div_ceil(group) * d.div_ceil(8) } else { n * d / group };
    let params = [n as u32, d as u32, nbytes as u32, group as u32];
    let tag = format!("{:?} per_channel={per_channel} n={n} d={d} bits={bits} G={group}", T::DTYPE);
    let out = metal_emulator::declared(Kernel::KiviQuantize)
        .launch()
        .input(HostArray::new(&[n, d], &x))
        .input(HostArray::new(&[4], &params))
        .output(&[n, nbytes], Dtype::U8)
        .output(&pshape, Dtype::F16)
        .output(&pshape, Dtype::F16)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .template("PER_CHANNEL", TemplateArg::Bool(per_channel))
        .grid(grid(items, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("kivi_quantize {tag}: {e}"));
    assert_eq!(out[1].to_vec::<f16>(), scales, "scales {tag}");
    assert_eq!(out[2].to_vec::<f16>(), zeros, "zeros {tag}");
    assert_eq!(out[0].to_vec::<u8>(), codes, "codes {tag}");
    let mut expect = vec![T::default(); n * d];
    cpu::kivi_dequantize(&codes, &scales, &zeros, n, d, bits, group, per_channel, &mut expect);
    let out = metal_emulator::declared(Kernel::KiviDequantize)
        .launch()
        .input(HostArray::new(&[n, nbytes], &codes))
        .input(HostArray::new(&pshape, &scales))
        .input(HostArray::new(&pshape, &zeros))
        .input(HostArray::new(&[4], &params))
        .output(&[n, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .template("PER_CHANNEL", TemplateArg::Bool(per_channel))
        .grid(grid(n * d.div_ceil(8), tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("kivi_dequantize {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = expect.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "kivi_dequantize {tag}");
}

#[test]
fn kivi_matches_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        kivi::<f32>(true, 70, 64, bits, 32, 64, false);
        kivi::<f32>(false, 70, 64, bits, 32, 64, true);
    }
    kivi::<f16>(true, 1, 13, 3, 4, 32, true);
    kivi::<bf16>(false, 3, 24, 2, 8, 32, false);
    kivi::<f16>(false, 33, 128, 4, 128, 32, false);
    kivi::<bf16>(true, 129, 128, 2, 128, 256, true);
}

fn qjl<T: Float + Element>(n: usize, d: usize, m: usize, nq: usize) {
    let k: Vec<T> = conv(&data(n as u64, n * d, 1.0));
    let q: Vec<T> = conv(&data(99, nq * d, 1.0));
    let s = data(m as u64 * 3, m * d, 1.0);
    let nb = cpu::packed_len(m, 1);
    let (mut signs, mut norms) = (vec![0u8; n * nb], vec![f16::ZERO; n]);
    cpu::qjl_encode(&k, n, d, &s, m, &mut signs, &mut norms);
    let tag = format!("{:?} n={n} d={d} m={m} Q={nq}", T::DTYPE);
    let threads = (n * 32) as u32;
    let out = metal_emulator::declared(Kernel::QjlEncode)
        .launch()
        .input(HostArray::new(&[n, d], &k))
        .input(HostArray::new(&[m, d], &s))
        .input(HostArray::new(&[4], &[n as u32, d as u32, m as u32, nb as u32]))
        .output(&[n, nb], Dtype::U8)
        .output(&[n], Dtype::F16)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .grid(threads, 1, 1)
        .threadgroup(256.min(threads.max(32)), 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("qjl_encode {tag}: {e}"));
    assert_eq!(out[0].to_vec::<u8>(), signs, "signs {tag}");
    assert_eq!(out[1].to_vec::<f16>(), norms, "norms {tag}");
    let mut want = vec![0.0f32; nq * n];
    cpu::qjl_score(&q, nq, d, &s, m, &signs, &norms, n, &mut want);
    let sq = metal_emulator::declared(Kernel::QjlSketchQuery)
        .launch()
        .input(HostArray::new(&[nq, d], &q))
        .input(HostArray::new(&[m, d], &s))
        .input(HostArray::new(&[3], &[nq as u32, d as u32, m as u32]))
        .output(&[nq, m], Dtype::F32)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .grid(grid(nq * m, 32, false), 1, 1)
        .threadgroup(32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("qjl_sketch_query {tag}: {e}"))
        .remove(0)
        .to_vec::<f32>();
    // S q row by row, each sum over the columns in order: crate::cpu's.
    for i in 0..nq {
        for r in 0..m {
            let dot = (0..d).fold(0.0f32, |acc, j| acc + s[r * d + j] * q[i * d + j].to_f32());
            assert_eq!(sq[i * m + r], dot, "S q {tag} query {i} row {r}");
        }
    }
    for (tg, round_up) in [(64u32, false), (32, true)] {
        let out = metal_emulator::declared(Kernel::QjlScore)
            .launch()
            .input(HostArray::new(&[nq, m], &sq))
            .input(HostArray::new(&[n, nb], &signs))
            .input(HostArray::new(&[n], &norms))
            .input(HostArray::new(&[4], &[n as u32, m as u32, nb as u32, nq as u32]))
            .output(&[nq, n], Dtype::F32)
            .grid(grid(n, tg, round_up), 1, 1)
            .threadgroup(tg, 1, 1)
            .run()
            .unwrap_or_else(|e| panic!("qjl_score {tag}: {e}"));
        // The body sums row by row.
        common::assert_scores_close(&out[0].to_vec::<f32>(), &want, &tag);
    }
}

#[test]
fn qjl_encode_and_score_match_cpu() {
    qjl::<f32>(70, 128, 256, 2);
    qjl::<f16>(1, 64, 13, 1);
    qjl::<bf16>(9, 32, 40, 3);
    qjl::<f32>(3, 16, 1024, 4);
}

/// The host's `STAGED` choice (`kernels::PQ_STAGE_FLOATS`).
const PQ_STAGE_FLOATS: usize = 4096;

fn pq<T: Float + Element>(n: usize, d: usize, s: usize, k: usize, bits: u32, tg: u32, round_up: bool) {
    let x: Vec<T> = conv(&data(n as u64 + 5, n * d, 1.0));
    let mut cb = data(k as u64 + s as u64, k * s, 1.0);
    if k >= 4 {
        // A duplicated entry: ties go to the lowest index.
        let first = cb[..s].to_vec();
        cb[3 * s..4 * s].copy_from_slice(&first);
    }
    let per = d / s;
    let (lo, hi) = veloxquant::cpu::code_planes(bits);
    let nbytes = cpu::packed_len(per, lo);
    let nbytes_hi = if hi > 0 { cpu::packed_len(per, hi) } else { 0 };
    let hi_shape = if hi > 0 { vec![n, nbytes_hi] } else { vec![1] };
    let mut want = vec![0u8; n * nbytes];
    let mut want_hi = vec![0u8; n * nbytes_hi];
    cpu::pq_encode(&x, n, d, &cb, s, bits, &mut want, &mut want_hi);
    let params = [n as u32, d as u32, k as u32, nbytes as u32, nbytes_hi as u32];
    let staged = k * s <= PQ_STAGE_FLOATS;
    let tag = format!("{:?} n={n} d={d} s={s} K={k} bits={bits} staged={staged}", T::DTYPE);
    let items = n * per.div_ceil(8);
    let out = metal_emulator::declared(Kernel::PqEncode)
        .launch()
        .input(HostArray::new(&[n, d], &x))
        .input(HostArray::new(&[k, s], &cb))
        .input(HostArray::new(&[5], &params))
        .output(&[n, nbytes], Dtype::U8)
        .output(&hi_shape, Dtype::U8)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("S", TemplateArg::Int(s as i32))
        .template("C_BITS", TemplateArg::Int(bits as i32))
        .template("STAGED", TemplateArg::Bool(staged))
        .grid(grid(items, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("pq_encode {tag}: {e}"));
    assert_eq!(out[0].to_vec::<u8>(), want, "pq_encode {tag}");
    if hi > 0 {
        assert_eq!(out[1].to_vec::<u8>(), want_hi, "pq_encode high plane {tag}");
    }
    let mut expect = vec![T::default(); n * d];
    cpu::pq_decode(&want, &want_hi, n, d, &cb, s, bits, &mut expect);
    let hi_input = if hi > 0 { HostArray::new(&[n, nbytes_hi], &want_hi) } else { HostArray::new(&[1], &[0u8]) };
    let out = metal_emulator::declared(Kernel::PqDecode)
        .launch()
        .input(HostArray::new(&[n, nbytes], &want))
        .input(hi_input)
        .input(HostArray::new(&[k, s], &cb))
        .input(HostArray::new(&[5], &params))
        .output(&[n, d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("S", TemplateArg::Int(s as i32))
        .template("C_BITS", TemplateArg::Int(bits as i32))
        .grid(grid(items, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("pq_decode {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = expect.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "pq_decode {tag}");
}

#[test]
fn pq_encode_and_decode_match_cpu() {
    for &s in &[2usize, 4, 8] {
        pq::<f32>(41, 64, s, 256, 8, 128, false);
        pq::<f16>(7, 8 * s + s, s, 16, 4, 32, true);
    }
    pq::<bf16>(1, 8, 8, 1, 1, 32, false);
    pq::<f32>(300, 128, 4, 5, 3, 256, true);
}

/// Widths above 8 bits and the two-plane layout, codebooks staged in
/// threadgroup memory (K·s ≤ 4096 floats) and read from device memory
/// (up to K = 4096, s = 8: 128 KiB), ragged last bytes of both planes.
#[test]
fn pq_wide_codebooks_match_cpu() {
    pq::<f32>(37, 26, 2, 32, 5, 64, false);
    pq::<f16>(9, 24, 2, 100, 7, 32, true);
    pq::<f32>(21, 64, 8, 512, 9, 64, true);
    pq::<bf16>(5, 52, 4, 1024, 10, 32, false);
    pq::<f32>(13, 32, 2, 2048, 11, 64, false);
    pq::<f32>(11, 256, 8, 4096, 12, 32, true);
    pq::<f32>(0, 64, 8, 4096, 12, 32, false);
}

fn framed<T: Float + Element>(d: usize, bits: u32, parts: [usize; 5], tg: u32, round_up: bool) {
    use veloxquant::cpu::framed_dequantize::{framed_dequantize, FramedShape};
    let [sinks, compressed, recent, recent_at, chunk] = parts;
    let (rows, w, cap) = (3usize, 12usize, compressed + 3);
    let sh = FramedShape { rows, dim: d, bits, sinks, compressed, recent, recent_at, window_slots: w, capacity: cap, chunk };
    let window: Vec<T> = conv(&data(1 + d as u64, rows * w * d, 1.0));
    let chunk_v: Vec<T> = conv(&data(2 + d as u64, rows * chunk * d, 1.0));
    let codes: Vec<u8> = data(3, rows * cap * sh.row_bytes(), 1.0).iter().map(|x| (x.to_bits() >> 7) as u8).collect();
    let norms: Vec<f16> = data(4, rows * cap, 4.0).iter().map(|x| f16::from_f32(x.abs())).collect();
    let table = codebook(bits, 5);
    let mut want = vec![T::default(); rows * sh.total() * d];
    framed_dequantize(&window, &codes, &norms, &table, &chunk_v, &sh, &mut want);
    let tag = format!("{:?} d={d} bits={bits} {parts:?} tg={tg}", T::DTYPE);
    let sizes = [rows, sinks, compressed, recent, recent_at, w, cap, chunk].map(|v| v as u32);
    let out = metal_emulator::declared(Kernel::FramedDequantize)
        .launch()
        .input(HostArray::new(&[rows, w, d], &window))
        .input(HostArray::new(&[rows, cap, sh.row_bytes()], &codes))
        .input(HostArray::new(&[rows, cap], &norms))
        .input(HostArray::new(&[1 << bits], &table))
        .input(HostArray::new(&[rows, chunk, d], &chunk_v))
        .input(HostArray::new(&[8], &sizes))
        .output(&[rows, sh.total(), d], T::DTYPE)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .grid(grid(rows * sh.total() * d / 8, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("framed_dequantize {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "framed_dequantize {tag}");
}

#[test]
fn framed_dequantize_matches_cpu() {
    for &bits in &cpu::SUPPORTED_BITS {
        framed::<f16>(64, bits, [4, 9, 5, 4, 3], 256, true);
    }
    framed::<f32>(128, 4, [2, 17, 0, 2, 1], 64, false);
    framed::<bf16>(96, 3, [0, 0, 7, 0, 2], 32, true);
    framed::<f16>(8, 2, [1, 1, 1, 1, 0], 32, false);
}

/// One side's store and new tokens, and what `store_write` makes of them.
struct StoreSide {
    codes: Vec<u8>,
    norms: Vec<f16>,
    new_codes: Vec<u8>,
    new_norms: Vec<f16>,
    want_codes: Vec<u8>,
    want_norms: Vec<f16>,
}

fn store_side(seed: u64, sh: &veloxquant::cpu::store_write::StoreShape) -> StoreSide {
    let (rows, cap0, m, nb) = (sh.rows, sh.capacity, sh.tokens, sh.row_bytes);
    let byte = |x: &f32| (x.to_bits() >> 9) as u8;
    let codes: Vec<u8> = data(seed, rows * cap0 * nb, 1.0).iter().map(byte).collect();
    let new_codes: Vec<u8> = data(seed + 1, rows * m * nb, 1.0).iter().map(byte).collect();
    let norms: Vec<f16> = data(seed + 2, rows * cap0, 4.0).iter().map(|x| f16::from_f32(x.abs())).collect();
    // Every fourth new norm saturated, NaN or infinite: stored as NaN.
    let specials = [f16::MAX, f16::NAN, f16::INFINITY];
    let new_norms: Vec<f16> = data(seed + 3, rows * m, 4.0)
        .iter()
        .enumerate()
        .map(|(i, x)| if i % 4 == 3 { specials[(i / 4) % 3] } else { f16::from_f32(x.abs()) })
        .collect();
    let (mut want_codes, mut want_norms) = (vec![0u8; rows * sh.new_capacity * nb], vec![f16::ZERO; rows * sh.new_capacity]);
    veloxquant::cpu::store_write::store_write(&codes, &norms, &new_codes, &new_norms, sh, &mut want_codes, &mut want_norms);
    StoreSide { codes, norms, new_codes, new_norms, want_codes, want_norms }
}

fn store_write(rows: usize, cap0: usize, first: usize, m: usize, cap: usize, (kb, vb): (usize, usize), tg: u32, round_up: bool) {
    use veloxquant::cpu::store_write::StoreShape;
    let shape = |nb| StoreShape { rows, capacity: cap0, new_capacity: cap, first, tokens: m, row_bytes: nb };
    let (k, v) = (store_side(11, &shape(kb)), store_side(21, &shape(vb)));
    let tag = format!("rows={rows} cap0={cap0} first={first} m={m} cap={cap} kb={kb} vb={vb} tg={tg}");
    let sizes = [rows, cap0, first, m, cap, kb, vb].map(|v| v as u32);
    let kernel = metal_emulator::declared(Kernel::StoreWrite);
    let mut launch = kernel.launch();
    for (s, nb) in [(&k, kb), (&v, vb)] {
        launch = launch
            .input(HostArray::new(&[rows, cap0, nb], &s.codes))
            .input(HostArray::new(&[rows, cap0], &s.norms))
            .input(HostArray::new(&[rows, m, nb], &s.new_codes))
            .input(HostArray::new(&[rows, m], &s.new_norms));
    }
    let items = rows * cap * (kb.div_ceil(4) + vb.div_ceil(4));
    let out = launch
        .input(HostArray::new(&[7], &sizes))
        .output(&[rows, cap, kb], Dtype::U8)
        .output(&[rows, cap], Dtype::F16)
        .output(&[rows, cap, vb], Dtype::U8)
        .output(&[rows, cap], Dtype::F16)
        .grid(grid(items, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("store_write {tag}: {e}"));
    let bits = |v: &[f16]| v.iter().map(|n| n.to_bits()).collect::<Vec<_>>();
    for (i, (s, side)) in [(&k, "keys"), (&v, "values")].into_iter().enumerate() {
        assert_eq!(out[2 * i].to_vec::<u8>(), s.want_codes, "store_write {side} codes {tag}");
        assert_eq!(bits(&out[2 * i + 1].to_vec::<f16>()), bits(&s.want_norms), "store_write {side} norms {tag}");
    }
}

#[test]
fn store_write_matches_cpu() {
    store_write(4, 40, 33, 70, 128, (64, 48), 256, true);
    store_write(3, 17, 5, 11, 20, (30, 40), 64, false);
    store_write(2, 0, 0, 25, 64, (24, 24), 32, true);
    store_write(2, 50, 10, 12, 22, (12, 30), 128, false);
}
