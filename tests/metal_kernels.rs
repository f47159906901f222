//! The Metal bodies in metal/ run on the emulator and match the CPU kernels
//! (docs/KERNELS.md): bit_pack / bit_unpack byte for byte, vq_quantize with
//! the contract's rule (f32 indices exact; f16/bf16 reconstruction error within
//! 1% relative, since a near-tie may round either way on a GPU).

mod metal_emulator;

use half::{bf16, f16};
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, MetalKernel, TemplateArg};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::{self, VqElement};


fn bit_pack_kernel() -> MetalKernel {
    metal_emulator::declared(Kernel::BitPack)
}

fn bit_unpack_kernel() -> MetalKernel {
    metal_emulator::declared(Kernel::BitUnpack)
}

fn vq_kernel() -> MetalKernel {
    metal_emulator::declared(Kernel::VqQuantize)
}

/// (rows, n, threadgroup): empty rows, a single code, rows whose last byte is
/// partly used, and grids whose last threadgroup is partial.
const PACK_SHAPES: &[(usize, usize, u32)] = &[
    (3, 0, 32),
    (1, 1, 32),
    (1, 5, 32),
    (2, 8, 32),
    (3, 13, 32),
    (5, 100, 64),
    (7, 333, 256),
    (64, 129, 1024),
];

/// The grid MLX needs for `work` threads; with `round_up`, whole threadgroups,
/// as a caller that rounds the grid would launch: the bodies must then ignore
/// the threads past the work.
fn grid_for(work: usize, tg: u32, round_up: bool) -> u32 {
    let work = work as u32;
    if round_up {
        work.div_ceil(tg) * tg
    } else {
        work
    }
}

fn launch_pack(rows: usize, n: usize, bits: u32, tg: u32, codes: &[u8]) -> Vec<u8> {
    launch_pack_grid(rows, n, bits, tg, false, codes)
}

fn launch_pack_grid(rows: usize, n: usize, bits: u32, tg: u32, round_up: bool, codes: &[u8]) -> Vec<u8> {
    let nbytes = cpu::packed_len(n, bits);
    let groups = n.div_ceil(8);
    let out = bit_pack_kernel()
        .launch()
        .input(HostArray::new(&[rows, n], codes))
        .input(HostArray::new(&[3], &[rows as u32, n as u32, nbytes as u32]))
        .output(&[rows, nbytes], Dtype::U8)
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .grid(grid_for(rows * groups, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("bit_pack bits={bits} rows={rows} n={n}: {e}"));
    out[0].to_vec()
}

fn launch_unpack(rows: usize, n: usize, bits: u32, tg: u32, packed: &[u8]) -> Vec<u8> {
    launch_unpack_grid(rows, n, bits, tg, false, packed)
}

fn launch_unpack_grid(rows: usize, n: usize, bits: u32, tg: u32, round_up: bool, packed: &[u8]) -> Vec<u8> {
    let nbytes = cpu::packed_len(n, bits);
    let groups = n.div_ceil(8);
    let out = bit_unpack_kernel()
        .launch()
        .input(HostArray::new(&[rows, nbytes], packed))
        .input(HostArray::new(&[3], &[rows as u32, n as u32, nbytes as u32]))
        .output(&[rows, n], Dtype::U8)
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .grid(grid_for(rows * groups, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("bit_unpack bits={bits} rows={rows} n={n}: {e}"));
    out[0].to_vec()
}

#[test]
fn bit_pack_matches_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for &bits in &cpu::SUPPORTED_BITS {
        for &(rows, n, tg) in PACK_SHAPES {
            // Full bytes: the kernel must drop the bits above B_BITS.
            let codes: Vec<u8> = (0..rows * n).map(|_| rng.random()).collect();
            let mut expect = vec![0u8; rows * cpu::packed_len(n, bits)];
            cpu::bit_pack(&codes, rows, n, bits, &mut expect);
            let got = launch_pack(rows, n, bits, tg, &codes);
            assert_eq!(got, expect, "bit_pack bits={bits} rows={rows} n={n}");
        }
    }
}

#[test]
fn bit_unpack_matches_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for &bits in &cpu::SUPPORTED_BITS {
        for &(rows, n, tg) in PACK_SHAPES {
            let codes: Vec<u8> = (0..rows * n).map(|_| rng.random::<u8>() & ((1u16 << bits) - 1) as u8).collect();
            let mut packed = vec![0u8; rows * cpu::packed_len(n, bits)];
            cpu::bit_pack(&codes, rows, n, bits, &mut packed);
            let mut expect = vec![0u8; rows * n];
            cpu::bit_unpack(&packed, rows, n, bits, &mut expect);
            assert_eq!(expect, codes);
            let got = launch_unpack(rows, n, bits, tg, &packed);
            assert_eq!(got, expect, "bit_unpack bits={bits} rows={rows} n={n}");
        }
    }
}

fn launch_vq<T: Element>(x: &[T], cb: &[T], n: usize, k: usize, d: usize, tg: u32) -> Vec<u32> {
    launch_vq_grid(x, cb, n, k, d, tg, false)
}

fn launch_vq_grid<T: Element>(x: &[T], cb: &[T], n: usize, k: usize, d: usize, tg: u32, round_up: bool) -> Vec<u32> {
    let out = vq_kernel()
        .launch()
        .input(HostArray::new(&[n, d], x))
        .input(HostArray::new(&[k, d], cb))
        .input(HostArray::new(&[2], &[n as u32, k as u32]))
        .output(&[n], Dtype::U32)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .grid(grid_for(n, tg, round_up), 1, 1)
        .threadgroup(tg, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("vq_quantize {:?} n={n} k={k} d={d}: {e}", T::DTYPE));
    out[0].to_vec()
}

fn sq_dist<T: VqElement>(x: &[T], c: &[T]) -> f32 {
    x.iter().zip(c).map(|(a, b)| (a.to_f32() - b.to_f32()).powi(2)).sum()
}

/// A codebook with a duplicated centroid and inputs that sit exactly on
/// centroids, so ties occur and must go to the lowest index.
fn vq_data<T: Copy>(rng: &mut ChaCha8Rng, n: usize, k: usize, d: usize, conv: fn(f32) -> T) -> (Vec<T>, Vec<T>) {
    let mut cb: Vec<f32> = (0..k * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    if k >= 4 {
        let first: Vec<f32> = cb[..d].to_vec();
        cb[3 * d..4 * d].copy_from_slice(&first);
    }
    let mut x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.2f32..1.2)).collect();
    for i in (0..n).step_by(7) {
        let c = rng.random_range(0..k);
        x[i * d..(i + 1) * d].copy_from_slice(&cb[c * d..(c + 1) * d]);
    }
    (x.into_iter().map(conv).collect(), cb.into_iter().map(conv).collect())
}

fn check_vq<T: Element + VqElement>(conv: fn(f32) -> T, exact: bool, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for d in [2usize, 4, 8] {
        for &(n, k, tg) in &[(37usize, 5usize, 32u32), (300, 256, 128), (1000, 16, 1024)] {
            let (x, cb) = vq_data(&mut rng, n, k, d, conv);
            let mut expect = vec![0u32; n];
            cpu::vq_quantize(&x, &cb, n, k, d, &mut expect);
            let got = launch_vq(&x, &cb, n, k, d, tg);
            if exact {
                assert_eq!(got, expect, "{:?} n={n} k={k} d={d}", T::DTYPE);
                continue;
            }
            for i in 0..n {
                let xi = &x[i * d..(i + 1) * d];
                let want = sq_dist(xi, &cb[expect[i] as usize * d..][..d]);
                let have = sq_dist(xi, &cb[got[i] as usize * d..][..d]);
                assert!(
                    (got[i] as usize) < k && (have - want).abs() <= 0.01 * want.abs().max(f32::MIN_POSITIVE),
                    "{:?} n={n} k={k} d={d} row {i}: index {} (error {have}) vs CPU {} (error {want})",
                    T::DTYPE,
                    got[i],
                    expect[i]
                );
            }
        }
    }
}

#[test]
fn vq_quantize_f32_matches_cpu_exactly() {
    check_vq::<f32>(|v| v, true, 3);
}

#[test]
fn vq_quantize_f16_matches_cpu() {
    check_vq::<f16>(f16::from_f32, false, 4);
}

#[test]
fn vq_quantize_bf16_matches_cpu() {
    check_vq::<bf16>(bf16::from_f32, false, 5);
}

#[test]
fn vq_quantize_tiny_and_empty() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    // N = 1 and K = 1: inputs of fewer than 8 elements live in `constant` memory.
    for d in [2usize, 4, 8] {
        for k in [1usize, 3] {
            let (x, cb) = vq_data(&mut rng, 1, k, d, |v| v);
            let mut expect = vec![0u32; 1];
            cpu::vq_quantize(&x, &cb, 1, k, d, &mut expect);
            assert_eq!(launch_vq(&x, &cb, 1, k, d, 32), expect, "n=1 k={k} d={d}");
        }
    }
    // N = 0 launches nothing, and the kernel still compiles for it.
    let (_, cb) = vq_data::<f32>(&mut rng, 0, 4, 4, |v| v);
    assert!(launch_vq::<f32>(&[], &cb, 0, 4, 4, 32).is_empty());
}

#[test]
fn bodies_ignore_threads_past_the_work() {
    // Out-of-range threads that wrote would corrupt the next row or land past
    // the buffer, which the emulator's guard bytes catch.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for &bits in &cpu::SUPPORTED_BITS {
        let (rows, n, tg) = (5, 100, 64);
        let codes: Vec<u8> = (0..rows * n).map(|_| rng.random()).collect();
        let mut packed = vec![0u8; rows * cpu::packed_len(n, bits)];
        cpu::bit_pack(&codes, rows, n, bits, &mut packed);
        assert_eq!(launch_pack_grid(rows, n, bits, tg, true, &codes), packed, "bit_pack bits={bits}");
        let mut codes_back = vec![0u8; rows * n];
        cpu::bit_unpack(&packed, rows, n, bits, &mut codes_back);
        assert_eq!(launch_unpack_grid(rows, n, bits, tg, true, &packed), codes_back, "bit_unpack bits={bits}");
    }
    let (x, cb) = vq_data::<f32>(&mut rng, 37, 5, 4, |v| v);
    let mut expect = vec![0u32; 37];
    cpu::vq_quantize(&x, &cb, 37, 5, 4, &mut expect);
    assert_eq!(launch_vq_grid(&x, &cb, 37, 5, 4, 32, true), expect);
}
