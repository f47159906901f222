//! The TurboQuant-Prod and -RVQ kernels on the GPU against the CPU kernels:
//! codes, signs, norms and decoded values bit for bit for the same input (same
//! arithmetic; CUDA sums the norms in float64 like the CPU), in float32,
//! float16 and bfloat16, with and without a rotation; CUDA's tensor-core
//! decoders (Prod, and RVQ with a dense rotation, float16 and bfloat16
//! outputs) to the output's rounding. Ignored where MLX has no GPU back-end;
//! run on the GPU machine with `--ignored`.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::kernels::{
    prod_decode_tensor_cores, rvq_decode_tensor_cores, tq_prod_decode, tq_prod_encode, tq_rvq_decode, tq_rvq_encode, PROD_BITS,
};
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::ScalarCodebook;
use veloxquant::{ops, Array, Backend, Dtype, Options, Policy, Stream};

fn normal(rng: &mut ChaCha8Rng, shape: &[i32], dtype: Dtype) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
    ops::astype(&Array::from_slice(&v, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
}

fn f32_array(v: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

fn bytes(a: &Array) -> Vec<u8> {
    ops::contiguous(a, &Stream::cpu()).unwrap().to_bytes().unwrap()
}

fn on(s: &Stream) -> Options {
    Options::on(s.clone(), Policy::Require)
}

/// Decoded vectors `[.., d]` of the GPU against the CPU's: bit for bit, or
/// where CUDA's tensor cores sum a product in their own order
/// (`tensor_cores`: a float16 or bfloat16 output), at least 99% bit for bit
/// and the rest one rounding of the output type apart (plus 1e-5 of the
/// vector's RMS).
fn assert_decode_matches(yg: &Array, yc: &Array, dtype: Dtype, d: usize, tensor_cores: bool, tag: &str) {
    let cuda = Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda;
    if !(cuda && tensor_cores) {
        assert_eq!(count_differing(&bytes(yg), &bytes(yc)), 0, "decode {tag}");
        return;
    }
    let f = |a: &Array| ops::astype(a, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap();
    let (g, c) = (f(yg), f(yc));
    let rel = if dtype == Dtype::F16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
    let mut differ = 0;
    for (gv, cv) in g.chunks(d).zip(c.chunks(d)) {
        let rms = (cv.iter().map(|v| v * v).sum::<f32>() / d as f32).sqrt();
        for (a, b) in gv.iter().zip(cv) {
            if a.to_bits() != b.to_bits() {
                differ += 1;
                assert!((a - b).abs() <= rel * a.abs().max(b.abs()) + 1e-5 * rms, "decode {tag}: {a} vs {b}");
            }
        }
    }
    assert!(differ * 100 <= g.len(), "decode {tag}: {differ} of {} values differ", g.len());
}

fn count_differing(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_prod_is_bit_identical_to_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16), (96, Dtype::F32)] {
        for &bits in &PROD_BITS {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 10 + u64::from(bits));
            let x = normal(&mut rng, &[3, 171, d as i32], dtype);
            let rot = f32_array(&veloxquant::cache::rotation_matrix(d, 1).unwrap(), &[d as i32, d as i32]);
            let sk = f32_array(&Sketch::new(d, d, true, 2).s, &[d as i32, d as i32]);
            let cb = (bits > 1).then(|| {
                let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
                f32_array(&c, &[c.len() as i32])
            });
            for rotation in [Some(&rot), None] {
                let tag = format!("d={d} {dtype} bits={bits} rotate={}", rotation.is_some());
                let g = tq_prod_encode(&x, rotation, cb.as_ref(), &sk, bits, &on(&gpu)).unwrap();
                let c = tq_prod_encode(&x, rotation, cb.as_ref(), &sk, bits, &on(&Stream::cpu())).unwrap();
                assert_eq!(count_differing(&bytes(&g.signs), &bytes(&c.signs)), 0, "signs {tag}");
                assert_eq!(count_differing(&bytes(&g.norms), &bytes(&c.norms)), 0, "norms {tag}");
                if bits > 1 {
                    let (gc, cc) = (g.codes.as_ref().unwrap(), c.codes.as_ref().unwrap());
                    assert_eq!(count_differing(&bytes(gc), &bytes(cc)), 0, "codes {tag}");
                    let (gr, cr) = (g.residual_norms.as_ref().unwrap(), c.residual_norms.as_ref().unwrap());
                    assert_eq!(count_differing(&bytes(gr), &bytes(cr)), 0, "residual norms {tag}");
                }
                let yg = tq_prod_decode(&c, rotation, cb.as_ref(), &sk, bits, dtype, &on(&gpu)).unwrap();
                let yc = tq_prod_decode(&c, rotation, cb.as_ref(), &sk, bits, dtype, &on(&Stream::cpu())).unwrap();
                assert_decode_matches(&yg, &yc, dtype, d, prod_decode_tensor_cores(dtype, d), &tag);
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_rvq_is_bit_identical_to_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16)] {
        for &bits in &[(1u32, 1u32), (2, 2), (4, 3), (1, 8), (8, 4)] {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 100 + u64::from(bits.0 * 10 + bits.1));
            let x = normal(&mut rng, &[517, d as i32], dtype);
            let rot = f32_array(&veloxquant::cache::rotation_matrix(d, 3).unwrap(), &[d as i32, d as i32]);
            let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
            let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
            let (c1, c2) = (f32_array(&c1, &[c1.len() as i32]), f32_array(&c2, &[c2.len() as i32]));
            for rotation in [Some(&rot), None] {
                let tag = format!("d={d} {dtype} bits={bits:?} rotate={}", rotation.is_some());
                let g = tq_rvq_encode(&x, rotation, &c1, &c2, bits, &on(&gpu)).unwrap();
                let c = tq_rvq_encode(&x, rotation, &c1, &c2, bits, &on(&Stream::cpu())).unwrap();
                assert_eq!(count_differing(&bytes(&g.codes1), &bytes(&c.codes1)), 0, "codes1 {tag}");
                assert_eq!(count_differing(&bytes(&g.codes2), &bytes(&c.codes2)), 0, "codes2 {tag}");
                assert_eq!(count_differing(&bytes(&g.norms), &bytes(&c.norms)), 0, "norms {tag}");
                let yg = tq_rvq_decode(&c, rotation, &c1, &c2, bits, d, dtype, &on(&gpu)).unwrap();
                let yc = tq_rvq_decode(&c, rotation, &c1, &c2, bits, d, dtype, &on(&Stream::cpu())).unwrap();
                let tensor_cores = rvq_decode_tensor_cores(dtype, d, rotation.is_some());
                assert_decode_matches(&yg, &yc, dtype, d, tensor_cores, &tag);
            }
        }
    }
}

/// The codecs given a Hadamard rotation's signs (butterflies on the GPU
/// tile, both ways) against the CPU kernels: bit-identical.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_hadamard_codecs_are_bit_identical_to_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16)] {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + 77);
        let x = normal(&mut rng, &[3, 171, d as i32], dtype);
        let r = veloxquant::quant::Rotation::hadamard(d, 6).unwrap();
        let signs = f32_array(r.signs(), &[d as i32]);
        let sk = f32_array(&Sketch::new(d, d, true, 2).s, &[d as i32, d as i32]);
        for &bits in &PROD_BITS {
            let tag = format!("prod d={d} {dtype} bits={bits}");
            let cb = (bits > 1).then(|| {
                let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
                f32_array(&c, &[c.len() as i32])
            });
            let g = tq_prod_encode(&x, Some(&signs), cb.as_ref(), &sk, bits, &on(&gpu)).unwrap();
            let c = tq_prod_encode(&x, Some(&signs), cb.as_ref(), &sk, bits, &on(&Stream::cpu())).unwrap();
            assert_eq!(count_differing(&bytes(&g.signs), &bytes(&c.signs)), 0, "signs {tag}");
            assert_eq!(count_differing(&bytes(&g.norms), &bytes(&c.norms)), 0, "norms {tag}");
            if let (Some(gc), Some(cc)) = (&g.codes, &c.codes) {
                assert_eq!(count_differing(&bytes(gc), &bytes(cc)), 0, "codes {tag}");
            }
            let yg = tq_prod_decode(&c, Some(&signs), cb.as_ref(), &sk, bits, dtype, &on(&gpu)).unwrap();
            let yc = tq_prod_decode(&c, Some(&signs), cb.as_ref(), &sk, bits, dtype, &on(&Stream::cpu())).unwrap();
            assert_decode_matches(&yg, &yc, dtype, d, prod_decode_tensor_cores(dtype, d), &tag);
        }
        for &bits in &[(2u32, 2u32), (4, 3), (1, 8)] {
            let tag = format!("rvq d={d} {dtype} bits={bits:?}");
            let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
            let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
            let (c1, c2) = (f32_array(&c1, &[c1.len() as i32]), f32_array(&c2, &[c2.len() as i32]));
            let g = tq_rvq_encode(&x, Some(&signs), &c1, &c2, bits, &on(&gpu)).unwrap();
            let c = tq_rvq_encode(&x, Some(&signs), &c1, &c2, bits, &on(&Stream::cpu())).unwrap();
            assert_eq!(count_differing(&bytes(&g.codes1), &bytes(&c.codes1)), 0, "codes1 {tag}");
            assert_eq!(count_differing(&bytes(&g.codes2), &bytes(&c.codes2)), 0, "codes2 {tag}");
            assert_eq!(count_differing(&bytes(&g.norms), &bytes(&c.norms)), 0, "norms {tag}");
            let yg = tq_rvq_decode(&c, Some(&signs), &c1, &c2, bits, d, dtype, &on(&gpu)).unwrap();
            let yc = tq_rvq_decode(&c, Some(&signs), &c1, &c2, bits, d, dtype, &on(&Stream::cpu())).unwrap();
            assert_eq!(count_differing(&bytes(&yg), &bytes(&yc)), 0, "decode {tag}");
        }
    }
}

/// Prod decode over more tiles than a tensor-core launch has blocks (each
/// block walks several; the last tile is partial): D = 128 and 64, with and
/// without a first stage (1 bit), float16 and bfloat16, a dense rotation and
/// a Hadamard one, against the CPU.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_prod_decode_walks_many_tiles() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let n = 100_003i32;
    for &(d, bits) in &[(128usize, 4u32), (64, 2), (128, 1)] {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + u64::from(bits));
        let x = normal(&mut rng, &[n, d as i32], Dtype::F32);
        let sk = f32_array(&Sketch::new(d, d, true, 4).s, &[d as i32, d as i32]);
        let cb = (bits > 1).then(|| {
            let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
            f32_array(&c, &[c.len() as i32])
        });
        let dense = f32_array(&veloxquant::cache::rotation_matrix(d, 2).unwrap(), &[d as i32, d as i32]);
        let hadamard = f32_array(veloxquant::quant::Rotation::hadamard(d, 2).unwrap().signs(), &[d as i32]);
        for (name, rotation) in [("dense", &dense), ("hadamard", &hadamard)] {
            let enc = tq_prod_encode(&x, Some(rotation), cb.as_ref(), &sk, bits, &on(&gpu)).unwrap();
            for dtype in [Dtype::F16, Dtype::BF16] {
                let tag = format!("{name} d={d} bits={bits} {dtype} n={n}");
                let yg = tq_prod_decode(&enc, Some(rotation), cb.as_ref(), &sk, bits, dtype, &on(&gpu)).unwrap();
                let yc = tq_prod_decode(&enc, Some(rotation), cb.as_ref(), &sk, bits, dtype, &on(&Stream::cpu())).unwrap();
                assert_decode_matches(&yg, &yc, dtype, d, prod_decode_tensor_cores(dtype, d), &tag);
            }
        }
    }
}

/// RVQ decode with a dense rotation over more tiles than a tensor-core
/// launch has blocks (the last tile partial): D = 128 and 64, 1- to 8-bit
/// stages, float16 and bfloat16, against the CPU.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_rvq_decode_walks_many_tiles() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let n = 100_003i32;
    for &(d, bits) in &[(128usize, (2u32, 2u32)), (64, (4, 3)), (128, (1, 8))] {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + u64::from(bits.0 * 10 + bits.1));
        let x = normal(&mut rng, &[n, d as i32], Dtype::F32);
        let rot = f32_array(&veloxquant::cache::rotation_matrix(d, 5).unwrap(), &[d as i32, d as i32]);
        let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
        let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
        let (c1, c2) = (f32_array(&c1, &[c1.len() as i32]), f32_array(&c2, &[c2.len() as i32]));
        let enc = tq_rvq_encode(&x, Some(&rot), &c1, &c2, bits, &on(&gpu)).unwrap();
        for dtype in [Dtype::F16, Dtype::BF16] {
            let tag = format!("d={d} bits={bits:?} {dtype} n={n}");
            let yg = tq_rvq_decode(&enc, Some(&rot), &c1, &c2, bits, d, dtype, &on(&gpu)).unwrap();
            let yc = tq_rvq_decode(&enc, Some(&rot), &c1, &c2, bits, d, dtype, &on(&Stream::cpu())).unwrap();
            assert_decode_matches(&yg, &yc, dtype, d, rvq_decode_tensor_cores(dtype, d, true), &tag);
        }
    }
}
