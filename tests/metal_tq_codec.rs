//! The TurboQuant-Prod and -RVQ Metal bodies (metal/tq_prod_*.metal,
//! metal/tq_rvq_*.metal) on the emulator, launched exactly as
//! `src/kernels/tq_codec.rs` launches them (kernel names, input and output
//! names and order, the 1-element placeholders, params, template arguments,
//! the tq_common.h + tq_norm.h header, one threadgroup of D threads per vector), against
//! `veloxquant::cpu::turboquant`: codes, signs, norms and decoded values bit
//! for bit in every dtype (both sides convert to float32 first; the Metal norm
//! emulates the CPU's float64 sum). Inputs include a zero vector and, in
//! float32, one whose norm saturates float16.

mod metal_emulator;

use half::{bf16, f16};
use veloxquant::kernels::Kernel;
use metal_emulator::{Dtype, Element, HostArray, MetalKernel, TemplateArg};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::cpu::turboquant as tq;
use veloxquant::cpu::Float;
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::ScalarCodebook;

fn read(rel: &str) -> String {
    metal_emulator::kernel_source(rel)
}

/// The header the TurboQuant-Prod and -RVQ kernels are declared with.
fn header() -> String {
    read("metal/tq_common.h") + &read("metal/tq_norm.h")
}

fn input(n: usize, d: usize, seed: u64, big: bool) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x: Vec<f32> = (0..n * d).map(|_| StandardNormal.sample(&mut rng)).collect();
    if n > 3 {
        x[3 * d..4 * d].iter_mut().for_each(|v| *v = 0.0);
    }
    if n > 7 && big {
        x[7 * d..8 * d].iter_mut().for_each(|v| *v *= 1.0e4);
    }
    x
}

fn conv<T: Float>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn rotation(d: usize, seed: u64) -> Vec<f32> {
    veloxquant::cache::rotation_matrix(d, seed).unwrap()
}

fn bits_of(v: &[f16]) -> Vec<u16> {
    v.iter().map(|h| h.to_bits()).collect()
}

fn maybe_rotation(rot: Option<&[f32]>, d: usize) -> HostArray {
    match rot {
        // A Hadamard rotation's signs (encoders only).
        Some(r) if r.len() == d => HostArray::new(&[d], r),
        Some(r) => HostArray::new(&[d, d], r),
        None => HostArray::new(&[1], &[0.0f32]),
    }
}

/// The rotation both directions take: a Hadamard rotation's signs, or a
/// dense matrix.
fn rotations(d: usize, seed: u64, hadamard: bool) -> (Vec<f32>, Vec<f32>) {
    let r = if hadamard { veloxquant::quant::Rotation::hadamard(d, seed).unwrap().signs().to_vec() } else { rotation(d, seed) };
    (r.clone(), r)
}

fn prod_case<T: Float + Element>(n: usize, d: usize, bits: u32, rotate: bool, hadamard: bool) {
    let mb = bits - 1;
    let (enc_v, dec_v) = rotations(d, 11 + d as u64, hadamard);
    let (rot, dec_rot) = (rotate.then_some(enc_v.as_slice()), rotate.then_some(dec_v.as_slice()));
    let cent: Vec<f32> = if mb > 0 { ScalarCodebook::sphere(d, mb).unwrap().centroids().to_vec() } else { Vec::new() };
    let sketch = Sketch::new(d, d, true, 5).s;
    let x: Vec<T> = conv(&input(n, d, (n * 10 + d) as u64 + u64::from(bits), T::DTYPE == Dtype::F32));
    let cb = d * mb as usize / 8;
    let (mut codes, mut signs) = (vec![0u8; n * cb], vec![0u8; n * d / 8]);
    let (mut norms, mut rnorms) = (vec![f16::ZERO; n], vec![f16::ZERO; if mb > 0 { n } else { 0 }]);
    tq::tq_prod_encode(&x, rot, &cent, &sketch, d, mb, &mut codes, &mut signs, &mut norms, &mut rnorms);
    let tag = format!("{:?} n={n} d={d} bits={bits} rotate={rotate} hadamard={hadamard}", T::DTYPE);
    if n == 0 {
        // The host launches nothing.
        return;
    }
    let cent_in = if mb > 0 { HostArray::new(&[1 << mb], &cent) } else { HostArray::new(&[1], &[0.0f32]) };
    let out = metal_emulator::declared(Kernel::TqProdEncode)
    .launch()
        .input(HostArray::new(&[n, d], &x))
        .input(maybe_rotation(rot, d))
        .input(cent_in.clone())
        .input(HostArray::new(&[d, d], &sketch))
        .input(HostArray::new(&[1], &[n as u32]))
        .output(&if mb > 0 { vec![n, cb] } else { vec![1] }, Dtype::U8)
        .output(&[n, d / 8], Dtype::U8)
        .output(&[n], Dtype::F16)
        .output(&if mb > 0 { vec![n] } else { vec![1] }, Dtype::F16)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("D", TemplateArg::Int(d as i32))
        .template("B_BITS", TemplateArg::Int(bits as i32))
        .template("ROTATE", TemplateArg::Bool(rotate))
        .template("HADAMARD", TemplateArg::Bool(hadamard))
        .grid((n * d) as u32, 1, 1)
        .threadgroup(d as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_prod_encode {tag}: {e}"));
    assert_eq!(out[1].to_vec::<u8>(), signs, "signs {tag}");
    assert_eq!(bits_of(&out[2].to_vec::<f16>()), bits_of(&norms), "norms {tag}");
    if mb > 0 {
        assert_eq!(out[0].to_vec::<u8>(), codes, "codes {tag}");
        assert_eq!(bits_of(&out[3].to_vec::<f16>()), bits_of(&rnorms), "residual norms {tag}");
    }
    if n > 3 {
        assert_eq!(norms[3].to_bits(), 0, "zero vector {tag}");
    }
    if n > 7 && T::DTYPE == Dtype::F32 {
        assert_eq!(norms[7].to_f32(), 65504.0, "saturated norm {tag}");
    }
    // Decode what the CPU stored, into T.
    let scale = tq::prod_scale(d);
    let mut want = vec![T::default(); n * d];
    tq::tq_prod_decode(&codes, &signs, &norms, &rnorms, dec_rot, &cent, &sketch, d, mb, scale, &mut want);
    let out = metal_emulator::declared(Kernel::TqProdDecode)
    .launch()
    .input(if mb > 0 { HostArray::new(&[n, cb], &codes) } else { HostArray::new(&[1], &[0u8]) })
    .input(HostArray::new(&[n, d / 8], &signs))
    .input(HostArray::new(&[n], &norms))
    .input(if mb > 0 { HostArray::new(&[n], &rnorms) } else { HostArray::new(&[1], &[f16::ZERO]) })
    .input(maybe_rotation(dec_rot, d))
    .input(cent_in)
    .input(HostArray::new(&[d, d], &sketch))
    .input(HostArray::new(&[2], &[n as u32, scale.to_bits()]))
    .output(&[n, d], T::DTYPE)
    .template("T", TemplateArg::Dtype(T::DTYPE))
    .template("D", TemplateArg::Int(d as i32))
    .template("B_BITS", TemplateArg::Int(bits as i32))
    .template("ROTATE", TemplateArg::Bool(rotate))
    .template("HADAMARD", TemplateArg::Bool(hadamard))
    .grid((n * d) as u32, 1, 1)
    .threadgroup(d as u32, 1, 1)
    .run()
    .unwrap_or_else(|e| panic!("tq_prod_decode {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "tq_prod_decode {tag}");
}

#[test]
fn tq_prod_matches_cpu() {
    for n in [0, 1, 37] {
        prod_case::<f32>(n, 64, 3, true, false);
    }
    prod_case::<f32>(37, 64, 1, true, false);
    prod_case::<f32>(37, 128, 2, true, false);
    prod_case::<f16>(37, 128, 4, true, false);
    prod_case::<bf16>(37, 64, 5, true, false);
    prod_case::<f32>(9, 256, 9, true, false);
    prod_case::<f32>(37, 96, 4, false, false);
    // A Hadamard rotation passed as its signs: butterflies both ways.
    prod_case::<f32>(37, 128, 4, true, true);
    prod_case::<f16>(37, 64, 2, true, true);
    prod_case::<bf16>(9, 256, 9, true, true);
}

fn rvq_case<T: Float + Element>(n: usize, d: usize, bits: (u32, u32), rotate: bool, hadamard: bool) {
    let (enc_v, dec_v) = rotations(d, 3 + d as u64, hadamard);
    let (rot, dec_rot) = (rotate.then_some(enc_v.as_slice()), rotate.then_some(dec_v.as_slice()));
    let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
    let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
    let x: Vec<T> = conv(&input(n, d, (n * 7 + d) as u64 + u64::from(bits.0 * 10 + bits.1), T::DTYPE == Dtype::F32));
    let (b1, b2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
    let (mut k1, mut k2, mut norms) = (vec![0u8; n * b1], vec![0u8; n * b2], vec![f16::ZERO; n]);
    tq::tq_rvq_encode(&x, rot, &c1, &c2, d, bits, &mut k1, &mut k2, &mut norms);
    let tag = format!("{:?} n={n} d={d} bits={bits:?} rotate={rotate} hadamard={hadamard}", T::DTYPE);
    if n == 0 {
        return;
    }
    let template = [
        ("D", TemplateArg::Int(d as i32)),
        ("B1_BITS", TemplateArg::Int(bits.0 as i32)),
        ("B2_BITS", TemplateArg::Int(bits.1 as i32)),
        ("ROTATE", TemplateArg::Bool(rotate)),
    ];
    let enc = metal_emulator::declared(Kernel::TqRvqEncode);
    let mut run = enc
        .launch()
        .input(HostArray::new(&[n, d], &x))
        .input(maybe_rotation(rot, d))
        .input(HostArray::new(&[c1.len()], &c1))
        .input(HostArray::new(&[c2.len()], &c2))
        .input(HostArray::new(&[1], &[n as u32]))
        .output(&[n, b1], Dtype::U8)
        .output(&[n, b2], Dtype::U8)
        .output(&[n], Dtype::F16)
        .template("T", TemplateArg::Dtype(T::DTYPE))
        .template("HADAMARD", TemplateArg::Bool(hadamard));
    for (name, arg) in template {
        run = run.template(name, arg);
    }
    let out = run
        .grid((n * d) as u32, 1, 1)
        .threadgroup(d as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_rvq_encode {tag}: {e}"));
    assert_eq!(out[0].to_vec::<u8>(), k1, "codes1 {tag}");
    assert_eq!(out[1].to_vec::<u8>(), k2, "codes2 {tag}");
    assert_eq!(bits_of(&out[2].to_vec::<f16>()), bits_of(&norms), "norms {tag}");
    let mut want = vec![T::default(); n * d];
    tq::tq_rvq_decode(&k1, &k2, &norms, dec_rot, &c1, &c2, d, bits, &mut want);
    let dec = metal_emulator::declared(Kernel::TqRvqDecode);
    let mut run = dec
        .launch()
    .input(HostArray::new(&[n, b1], &k1))
    .input(HostArray::new(&[n, b2], &k2))
    .input(HostArray::new(&[n], &norms))
    .input(maybe_rotation(dec_rot, d))
    .input(HostArray::new(&[c1.len()], &c1))
    .input(HostArray::new(&[c2.len()], &c2))
    .input(HostArray::new(&[1], &[n as u32]))
    .output(&[n, d], T::DTYPE)
    .template("T", TemplateArg::Dtype(T::DTYPE))
    .template("HADAMARD", TemplateArg::Bool(hadamard));
    for (name, arg) in template {
        run = run.template(name, arg);
    }
    let out = run
        .grid((n * d) as u32, 1, 1)
        .threadgroup(d as u32, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_rvq_decode {tag}: {e}"));
    let got: Vec<f32> = out[0].to_vec::<T>().iter().map(|v| v.to_f32()).collect();
    let exp: Vec<f32> = want.iter().map(|v| v.to_f32()).collect();
    assert_eq!(got, exp, "tq_rvq_decode {tag}");
}

#[test]
fn tq_rvq_matches_cpu() {
    for n in [0, 1, 37] {
        rvq_case::<f32>(n, 64, (2, 2), true, false);
    }
    rvq_case::<f32>(37, 64, (1, 1), true, false);
    rvq_case::<f32>(37, 128, (1, 8), true, false);
    rvq_case::<f16>(37, 128, (4, 3), true, false);
    rvq_case::<bf16>(37, 64, (3, 4), true, false);
    rvq_case::<f32>(9, 256, (8, 2), true, false);
    rvq_case::<f32>(37, 80, (2, 1), false, false);
    // A Hadamard rotation passed as its signs: butterflies both ways.
    rvq_case::<f32>(37, 128, (2, 2), true, true);
    rvq_case::<f16>(37, 64, (4, 3), true, true);
    rvq_case::<bf16>(9, 256, (1, 8), true, true);
}

/// tq_norm.h's `tq_norm` (float32 only) against crate::quant's float64
/// norm, bit for bit in float32, on vectors whose squares span many binades.
#[test]
fn tq_norm_matches_float64_norm() {
    const BODY: &str = "threadgroup float v[D];
const uint r = threadgroup_position_in_grid.x;
for (int j = 0; j < D; ++j) {
  v[j] = x[r * D + j];
}
out[r] = tq_norm(v, D);
";
    let (n, d) = (4000usize, 256usize);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let x: Vec<f32> = (0..n * d)
        .map(|i| {
            let g: f32 = StandardNormal.sample(&mut rng);
            // Rows of different scales, some with a few large entries.
            g * 10f32.powi((i / d % 9) as i32 - 4) * if i % 61 == 0 { 300.0 } else { 1.0 }
        })
        .collect();
    let out = MetalKernel::new("tq_norm_probe", &["x"], &["out"], BODY)
        .with_header(&header())
        .launch()
        .input(HostArray::new(&[n, d], &x))
        .output(&[n], Dtype::F32)
        .template("D", TemplateArg::Int(d as i32))
        .grid(n as u32, 1, 1)
        .threadgroup(1, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("tq_norm probe: {e}"));
    let got = out[0].to_vec::<f32>();
    let mismatches: Vec<usize> = (0..n)
        .filter(|&r| {
            let row = &x[r * d..(r + 1) * d];
            let want = (row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>()).sqrt() as f32;
            got[r].to_bits() != want.to_bits()
        })
        .collect();
    assert!(mismatches.is_empty(), "{} of {n} norms differ, first rows {:?}", mismatches.len(), &mismatches[..mismatches.len().min(5)]);
}
