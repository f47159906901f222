//! The TurboQuant-Prod and -RVQ kernels on the GPU against the CPU kernels:
//! codes, signs, norms and decoded values bit for bit for the same input (same
//! arithmetic; CUDA sums the norms in float64 like the CPU), in float32,
//! float16 and bfloat16, with and without a rotation; CUDA's tensor-core
//! decoders (Prod, and RVQ with a dense rotation, float16 and bfloat16
//! outputs) to the output's rounding. CUDA's Prod encoder sums its products
//! by fma for float16 and bfloat16 inputs, and its RVQ encoder rotates them
//! on the tensor cores (d = 64 or 128): there their codes and signs are held
//! to float64 truth, differing only at near-ties. Ignored where MLX has
//! no GPU back-end; run on the GPU machine with `--ignored`.

mod common;

use common::{f32s, normal, offset_view};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cpu::turboquant::code_at;
use veloxquant::kernels::{
    encode_tensor_core_parts, prod_decode_tensor_cores, prod_encode_tensor_core_parts, rvq_decode_path, tq_prod_decode, tq_prod_encode, tq_rvq_decode,
    tq_rvq_encode, CudaDecodePath, ProdCodes, RotationInput, RvqCodes, PROD_BITS,
};
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::ScalarCodebook;
use half::f16;
use veloxquant::{ops, Array, Backend, Dtype, Element, Options, Policy, Stream};

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
    let (g, c) = (f32s(yg), f32s(yc));
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

/// Float16 values (little-endian bytes, positive) at most one step apart.
fn assert_within_one_f16_step(a: &[u8], b: &[u8], what: &str) {
    let halves = |x: &[u8]| x.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<_>>();
    let (ha, hb) = (halves(a), halves(b));
    assert_eq!(ha.len(), hb.len(), "{what}: lengths");
    assert!(ha.iter().zip(&hb).all(|(x, y)| x.abs_diff(*y) <= 1), "{what}: more than one float16 step apart");
}

fn count_differing(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// y = Π u in float64, as the parity checks take it.
type RotateF64<'a> = dyn Fn(&[f64]) -> Vec<f64> + 'a;

/// How CUDA's Prod encoder computes an encoding, against the CPU's.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ProdParity {
    /// The CPU's arithmetic: bit for bit.
    Exact,
    /// Sums by fma: codes and signs may differ at near-ties.
    Fused,
    /// Both products on the tensor cores (float16 residual and sketch).
    TensorCores,
}

impl ProdParity {
    /// Within how much of a midpoint a code may differ from float64 truth,
    /// and within how much of ‖S_i‖ ‖r‖ of zero a sign may.
    fn tolerances(self) -> (f64, f64) {
        match self {
            ProdParity::TensorCores => (2e-4, 2e-4),
            _ => (1e-5, 1e-5),
        }
    }
}

/// How CUDA's Prod encoder takes `dtype` inputs (bit for bit elsewhere).
fn prod_parity(dtype: Dtype, d: usize, rotate: bool, bits: u32) -> ProdParity {
    if Stream::gpu().unwrap().backend().unwrap() != Backend::Cuda || dtype == Dtype::F32 {
        ProdParity::Exact
    } else if prod_encode_tensor_core_parts(dtype, d, rotate, bits - 1) > 0 {
        ProdParity::TensorCores
    } else {
        ProdParity::Fused
    }
}

/// The GPU's Prod encoding `g` of `x` `[n, d]` against the CPU's `c`: bit
/// for bit, or where CUDA sums the products by fma or on the tensor cores
/// (`parity`; a float16 or bfloat16 input) against float64 truth, `rotate`
/// giving y = Π u of a unit u: each code the nearest centroid's but where y
/// lies near the boundary; each sign that of (S r), r = y − c[code] with the
/// kernel's own codes, but near zero ([`ProdParity::tolerances`]); each
/// residual norm ‖r‖ to float16 rounding; the norms identical (within one
/// float16 step on the tensor cores, whose norm sums in float32); and at
/// most 1% of the codes', signs' and norms' bytes differing from the CPU's
/// (the signs' of the vectors whose codes are the CPU's).
#[allow(clippy::too_many_arguments)]
fn assert_prod_encodings_match(
    parity: ProdParity,
    x: &Array,
    rotate: &RotateF64<'_>,
    centroids: Option<&Array>,
    sketch: &[f32],
    bits: u32,
    g: &ProdCodes,
    c: &ProdCodes,
    tag: &str,
) {
    let norms = (bytes(&g.norms), bytes(&c.norms));
    if parity == ProdParity::TensorCores {
        assert_within_one_f16_step(&norms.0, &norms.1, &format!("norms {tag}"));
    } else {
        assert_eq!(count_differing(&norms.0, &norms.1), 0, "norms {tag}");
    }
    let pairs = |a: &Option<Array>, b: &Option<Array>| a.as_ref().map(|a| (bytes(a), bytes(b.as_ref().unwrap())));
    let codes = pairs(&g.codes, &c.codes);
    let residual_norms = pairs(&g.residual_norms, &c.residual_norms);
    let signs = (bytes(&g.signs), bytes(&c.signs));
    if parity == ProdParity::Exact {
        assert_eq!(count_differing(&signs.0, &signs.1), 0, "signs {tag}");
        if let (Some((gc, cc)), Some((gr, cr))) = (&codes, &residual_norms) {
            assert_eq!(count_differing(gc, cc), 0, "codes {tag}");
            assert_eq!(count_differing(gr, cr), 0, "residual norms {tag}");
        }
        return;
    }
    let (code_tol, sign_tol) = parity.tolerances();
    let d = *x.shape().last().unwrap() as usize;
    let xs = f32s(x);
    let n = xs.len() / d;
    let cent = centroids.map(f32s).unwrap_or_default();
    let bounds = veloxquant::cpu::scalar_boundaries(&cent);
    let mb = bits - 1;
    let rn = g.residual_norms.as_ref().map(f32s);
    for v in 0..n {
        let xv: Vec<f64> = xs[v * d..(v + 1) * d].iter().map(|&a| f64::from(a)).collect();
        let s = xv.iter().map(|a| a * a).sum::<f64>().sqrt();
        let u: Vec<f64> = xv.iter().map(|a| if s > 0.0 { a / s } else { 0.0 }).collect();
        let mut r = rotate(&u);
        if let Some((gc, _)) = &codes {
            let row = &gc[v * d * mb as usize / 8..(v + 1) * d * mb as usize / 8];
            for (j, rj) in r.iter_mut().enumerate() {
                let got = code_at(row, j, mb);
                let want = bounds.iter().filter(|&&b| f64::from(b) < *rj).count();
                if got != want {
                    let b = f64::from(bounds[got.min(want)]);
                    assert!(got.abs_diff(want) == 1 && (*rj - b).abs() <= code_tol, "codes {tag}: vector {v} coordinate {j}: {got} for y = {rj}");
                }
                *rj -= f64::from(cent[got]);
            }
        }
        let norm_r = r.iter().map(|a| a * a).sum::<f64>().sqrt();
        if let Some(rn) = &rn {
            assert!((f64::from(rn[v]) - norm_r).abs() <= 2f64.powi(-10) * norm_r + 1e-6, "residual norms {tag}: vector {v}: {} vs {norm_r}", rn[v]);
        }
        for i in 0..d {
            let row = &sketch[i * d..(i + 1) * d];
            let dot: f64 = row.iter().zip(&r).map(|(a, b)| f64::from(*a) * b).sum();
            let got = signs.0[v * d / 8 + i / 8] >> (i % 8) & 1 == 1;
            if got != (dot >= 0.0) {
                let scale = row.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt() * norm_r;
                assert!(dot.abs() <= sign_tol * scale, "signs {tag}: vector {v} row {i}: (S r) = {dot} of {scale}");
            }
        }
    }
    // A code that differs from the CPU's moves r by a centroid gap and so
    // flips many of its vector's signs; those were checked above against the
    // kernel's own codes, so the signs' count covers the other vectors.
    let signs = match &codes {
        Some((gc, cc)) => {
            let (code_row, sign_row) = (d * mb as usize / 8, d / 8);
            let same: Vec<usize> = (0..n).filter(|&v| gc[v * code_row..(v + 1) * code_row] == cc[v * code_row..(v + 1) * code_row]).collect();
            let rows = |s: &[u8]| same.iter().flat_map(|&v| &s[v * sign_row..(v + 1) * sign_row]).copied().collect::<Vec<u8>>();
            (rows(&signs.0), rows(&signs.1))
        }
        None => signs,
    };
    for (name, (a, b)) in [("codes", codes.unwrap_or_default()), ("signs", signs), ("norms", norms)] {
        let differ = count_differing(&a, &b);
        eprintln!("{tag}: {differ} of {} {name} bytes differ from the CPU's at near-ties", a.len());
        assert!(differ * 100 <= a.len(), "{name} {tag}: {differ} of {} bytes differ", a.len());
    }
}

/// Whether CUDA's encoders rotate `dtype` inputs on the tensor cores.
fn tensor_core_encode(dtype: Dtype, d: usize, rotate: bool, bits: (u32, u32)) -> bool {
    Stream::gpu().unwrap().backend().unwrap() == Backend::Cuda && encode_tensor_core_parts(dtype, d, rotate, bits.0 + bits.1) > 0
}

/// The GPU's RVQ encoding `g` of `x` `[n, d]` against the CPU's `c`: bit for
/// bit, or on the tensor cores (`tensor_cores`) against float64 truth,
/// `rotate` giving y = Π u of a unit u: each first code the nearest
/// centroid's but where y lies within 2e-4 of a midpoint, each second code
/// the residual's (y less the kernel's own first centroid) likewise; norms
/// within one float16 step; at most 1% of the codes' and norms' bytes
/// differing from the CPU's.
#[allow(clippy::too_many_arguments)]
fn assert_rvq_encodings_match(
    tensor_cores: bool,
    x: &Array,
    rotate: &RotateF64<'_>,
    centroids: (&Array, &Array),
    bits: (u32, u32),
    g: &RvqCodes,
    c: &RvqCodes,
    tag: &str,
) {
    let (g1, g2, gn) = (bytes(&g.codes1), bytes(&g.codes2), bytes(&g.norms));
    let (c1, c2, cn) = (bytes(&c.codes1), bytes(&c.codes2), bytes(&c.norms));
    if !tensor_cores {
        assert_eq!(count_differing(&g1, &c1), 0, "codes1 {tag}");
        assert_eq!(count_differing(&g2, &c2), 0, "codes2 {tag}");
        assert_eq!(count_differing(&gn, &cn), 0, "norms {tag}");
        return;
    }
    let d = *x.shape().last().unwrap() as usize;
    let xs = f32s(x);
    let n = xs.len() / d;
    let (cent1, cent2) = (f32s(centroids.0), f32s(centroids.1));
    let (bounds1, bounds2) = (veloxquant::cpu::scalar_boundaries(&cent1), veloxquant::cpu::scalar_boundaries(&cent2));
    let check = |row: &[u8], j: usize, b: u32, bounds: &[f32], y: f64, what: &str, v: usize| {
        let got = code_at(row, j, b);
        let want = bounds.iter().filter(|&&m| f64::from(m) < y).count();
        if got != want {
            let m = f64::from(bounds[got.min(want)]);
            assert!(got.abs_diff(want) == 1 && (y - m).abs() <= 2e-4, "{what} {tag}: vector {v} coordinate {j}: {got} for {y}");
        }
        got
    };
    let (w1, w2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
    for v in 0..n {
        let xv: Vec<f64> = xs[v * d..(v + 1) * d].iter().map(|&a| f64::from(a)).collect();
        let s = xv.iter().map(|a| a * a).sum::<f64>().sqrt();
        let u: Vec<f64> = xv.iter().map(|a| if s > 0.0 { a / s } else { 0.0 }).collect();
        for (j, y) in rotate(&u).into_iter().enumerate() {
            let a = check(&g1[v * w1..(v + 1) * w1], j, bits.0, &bounds1, y, "codes1", v);
            check(&g2[v * w2..(v + 1) * w2], j, bits.1, &bounds2, y - f64::from(cent1[a]), "codes2", v);
        }
    }
    assert_within_one_f16_step(&gn, &cn, &format!("norms {tag}"));
    for (name, a, b) in [("codes1", &g1, &c1), ("codes2", &g2, &c2), ("norms", &gn, &cn)] {
        let differ = count_differing(a, b);
        eprintln!("{tag}: {differ} of {} {name} bytes differ from the CPU's at near-ties", a.len());
        assert!(differ * 100 <= a.len(), "{name} {tag}: {differ} of {} bytes differ", a.len());
    }
}

/// y = Π u for a row-major `[d, d]` Π, in float64.
fn dense_rotate(m: &[f32]) -> impl Fn(&[f64]) -> Vec<f64> + '_ {
    move |u: &[f64]| m.chunks(u.len()).map(|row| row.iter().zip(u).map(|(a, b)| f64::from(*a) * b).sum()).collect()
}

/// Prod encode and decode on the GPU against the CPU: D = 64 to 256 (96 not
/// a power of two), float32, float16 and bfloat16, every bit width, with
/// and without a dense rotation.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_prod_matches_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16), (96, Dtype::F32)] {
        for &bits in &PROD_BITS {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 10 + u64::from(bits));
            let x = normal(&mut rng, &[3, 171, d as i32], dtype);
            let rot_m = veloxquant::cache::rotation_matrix(d, 1).unwrap();
            let rot = f32_array(&rot_m, &[d as i32, d as i32]);
            let sk_m = Sketch::new(d, d, true, 2).s;
            let sk = f32_array(&sk_m, &[d as i32, d as i32]);
            let cb = (bits > 1).then(|| {
                let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
                f32_array(&c, &[c.len() as i32])
            });
            for rotation in [Some(&rot), None] {
                let tag = format!("d={d} {dtype} bits={bits} rotate={}", rotation.is_some());
                let g = tq_prod_encode(&x, rotation, cb.as_ref(), &sk, bits, &on(&gpu)).unwrap();
                let c = tq_prod_encode(&x, rotation, cb.as_ref(), &sk, bits, &on(&Stream::cpu())).unwrap();
                let identity = |u: &[f64]| u.to_vec();
                let dense = dense_rotate(&rot_m);
                let rotate: &RotateF64<'_> = if rotation.is_some() { &dense } else { &identity };
                let parity = prod_parity(dtype, d, rotation.is_some(), bits);
                assert_prod_encodings_match(parity, &x, rotate, cb.as_ref(), &sk_m, bits, &g, &c, &tag);
                let yg = tq_prod_decode(&c, rotation, cb.as_ref(), &sk, bits, dtype, &on(&gpu)).unwrap();
                let yc = tq_prod_decode(&c, rotation, cb.as_ref(), &sk, bits, dtype, &on(&Stream::cpu())).unwrap();
                assert_decode_matches(&yg, &yc, dtype, d, prod_decode_tensor_cores(dtype, d), &tag);
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_rvq_matches_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16)] {
        for &bits in &[(1u32, 1u32), (2, 2), (4, 3), (1, 8), (8, 4)] {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 100 + u64::from(bits.0 * 10 + bits.1));
            let x = normal(&mut rng, &[517, d as i32], dtype);
            let rot_m = veloxquant::cache::rotation_matrix(d, 3).unwrap();
            let rot = f32_array(&rot_m, &[d as i32, d as i32]);
            let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
            let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
            let (c1, c2) = (f32_array(&c1, &[c1.len() as i32]), f32_array(&c2, &[c2.len() as i32]));
            for rotation in [Some(&rot), None] {
                let tag = format!("d={d} {dtype} bits={bits:?} rotate={}", rotation.is_some());
                let g = tq_rvq_encode(&x, rotation, &c1, &c2, bits, &on(&gpu)).unwrap();
                let c = tq_rvq_encode(&x, rotation, &c1, &c2, bits, &on(&Stream::cpu())).unwrap();
                let identity = |u: &[f64]| u.to_vec();
                let dense = dense_rotate(&rot_m);
                let rotate: &RotateF64<'_> = if rotation.is_some() { &dense } else { &identity };
                let tc = tensor_core_encode(dtype, d, rotation.is_some(), bits);
                assert_rvq_encodings_match(tc, &x, rotate, (&c1, &c2), bits, &g, &c, &tag);
                let yg = tq_rvq_decode(&c, rotation, &c1, &c2, bits, d, dtype, &on(&gpu)).unwrap();
                let yc = tq_rvq_decode(&c, rotation, &c1, &c2, bits, d, dtype, &on(&Stream::cpu())).unwrap();
                let kind = if rotation.is_some() { RotationInput::Dense } else { RotationInput::None };
                let tensor_cores = rvq_decode_path(dtype, d, kind) == CudaDecodePath::TensorCores;
                assert_decode_matches(&yg, &yc, dtype, d, tensor_cores, &tag);
            }
        }
    }
}

/// The codecs given a Hadamard rotation's signs (butterflies on the GPU
/// tile, both ways) against the CPU kernels: bit-identical, but for CUDA's
/// Prod encoding of float16 and bfloat16 inputs (near-ties, as above).
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_hadamard_codecs_match_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, dtype) in &[(64usize, Dtype::F32), (128, Dtype::F16), (256, Dtype::BF16)] {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + 77);
        let x = normal(&mut rng, &[3, 171, d as i32], dtype);
        let r = veloxquant::quant::Rotation::hadamard(d, 6).unwrap();
        let signs = f32_array(r.signs(), &[d as i32]);
        let sk_m = Sketch::new(d, d, true, 2).s;
        let sk = f32_array(&sk_m, &[d as i32, d as i32]);
        let hadamard = |u: &[f64]| {
            let mut y = vec![0f32; d];
            r.forward(&u.iter().map(|&a| a as f32).collect::<Vec<_>>(), &mut y);
            y.into_iter().map(f64::from).collect::<Vec<_>>()
        };
        for &bits in &PROD_BITS {
            let tag = format!("prod d={d} {dtype} bits={bits}");
            let cb = (bits > 1).then(|| {
                let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
                f32_array(&c, &[c.len() as i32])
            });
            let g = tq_prod_encode(&x, Some(&signs), cb.as_ref(), &sk, bits, &on(&gpu)).unwrap();
            let c = tq_prod_encode(&x, Some(&signs), cb.as_ref(), &sk, bits, &on(&Stream::cpu())).unwrap();
            let parity = prod_parity(dtype, d, true, bits);
            assert_prod_encodings_match(parity, &x, &hadamard, cb.as_ref(), &sk_m, bits, &g, &c, &tag);
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
            assert_rvq_encodings_match(tensor_core_encode(dtype, d, true, bits), &x, &hadamard, (&c1, &c2), bits, &g, &c, &tag);
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

/// `a` moved `offset` elements into a larger buffer (common::offset_view).
fn moved<T: Element + Default + Copy>(a: &Array, offset: usize) -> Array {
    let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
    offset_view(&ops::contiguous(a, &Stream::cpu()).unwrap().to_vec::<T>().unwrap(), &shape, offset)
}

/// Prod decode of codes, signs and norms that start off their alignment
/// (1, 3, 1 and 5 elements into their buffers: the tensor-core decoders'
/// copies to shared memory fall back to bytewise reads), dense and
/// Hadamard, against the CPU on the aligned originals.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_prod_decode_reads_views_off_alignment() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let (n, d, bits) = (1_001i32, 128usize, 4u32);
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let x = normal(&mut rng, &[n, d as i32], Dtype::F32);
    let sk = f32_array(&Sketch::new(d, d, true, 4).s, &[d as i32, d as i32]);
    let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
    let cb = f32_array(&c, &[c.len() as i32]);
    let dense = f32_array(&veloxquant::cache::rotation_matrix(d, 2).unwrap(), &[d as i32, d as i32]);
    let hadamard = f32_array(veloxquant::quant::Rotation::hadamard(d, 2).unwrap().signs(), &[d as i32]);
    for (name, rotation) in [("dense", &dense), ("hadamard", &hadamard)] {
        let enc = tq_prod_encode(&x, Some(rotation), Some(&cb), &sk, bits, &on(&Stream::cpu())).unwrap();
        let moved = ProdCodes {
            codes: enc.codes.as_ref().map(|a| moved::<u8>(a, 1)),
            signs: moved::<u8>(&enc.signs, 3),
            norms: moved::<f16>(&enc.norms, 1),
            residual_norms: enc.residual_norms.as_ref().map(|a| moved::<f16>(a, 5)),
        };
        for dtype in [Dtype::F16, Dtype::BF16, Dtype::F32] {
            let tag = format!("{name} {dtype} off alignment");
            let yg = tq_prod_decode(&moved, Some(rotation), Some(&cb), &sk, bits, dtype, &on(&gpu)).unwrap();
            let yc = tq_prod_decode(&enc, Some(rotation), Some(&cb), &sk, bits, dtype, &on(&Stream::cpu())).unwrap();
            assert_decode_matches(&yg, &yc, dtype, d, prod_decode_tensor_cores(dtype, d), &tag);
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
            let tensor_cores = rvq_decode_path(dtype, d, RotationInput::Dense) == CudaDecodePath::TensorCores;
            assert_decode_matches(&yg, &yc, dtype, d, tensor_cores, &tag);
        }
    }
}

/// RVQ decode in warp rows (Hadamard signs or no rotation, d a multiple of
/// 32 up to 128) against the CPU, bit for bit: over more tiles than the
/// launch has blocks (the last one partial) and a single vector; codes of 1
/// to 8 bits, whose lane bits cross code words at 3 bits; d = 32 and 96;
/// every output type; code views off 4-byte alignment; and d = 256 and 72,
/// which stay on the tiles.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_rvq_decode_rows_match_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let cases: &[(usize, (u32, u32), bool, i32)] = &[
        (128, (2, 2), true, 100_003),
        (64, (3, 3), true, 70_001),
        (32, (8, 1), true, 40_000),
        (128, (4, 8), false, 50_001),
        (96, (3, 2), false, 33_793),
        (128, (1, 4), true, 1),
        (256, (2, 2), true, 517),
        (72, (2, 3), false, 517),
    ];
    for &(d, bits, hadamard, n) in cases {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 31 + u64::from(bits.0 * 10 + bits.1));
        let x = normal(&mut rng, &[n, d as i32], Dtype::F32);
        let r = hadamard.then(|| veloxquant::quant::Rotation::hadamard(d, 9).unwrap());
        let signs = r.as_ref().map(|r| f32_array(r.signs(), &[d as i32]));
        let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
        let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
        let (c1, c2) = (f32_array(&c1, &[c1.len() as i32]), f32_array(&c2, &[c2.len() as i32]));
        let enc = tq_rvq_encode(&x, signs.as_ref(), &c1, &c2, bits, &on(&gpu)).unwrap();
        let kind = if hadamard { RotationInput::Hadamard } else { RotationInput::None };
        let rows = d % 32 == 0 && d <= 128;
        assert_eq!(rvq_decode_path(Dtype::F16, d, kind) == CudaDecodePath::Rows, rows, "path d={d}");
        for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            let tag = format!("d={d} bits={bits:?} hadamard={hadamard} n={n} {dtype}");
            let yg = tq_rvq_decode(&enc, signs.as_ref(), &c1, &c2, bits, d, dtype, &on(&gpu)).unwrap();
            let yc = tq_rvq_decode(&enc, signs.as_ref(), &c1, &c2, bits, d, dtype, &on(&Stream::cpu())).unwrap();
            assert_eq!(yg.shape(), vec![n, d as i32], "{tag}");
            assert_eq!(count_differing(&bytes(&yg), &bytes(&yc)), 0, "decode {tag}");
        }
        // The same codes as views one and two bytes into their buffers.
        let (b1, b2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
        let shifted = RvqCodes {
            codes1: offset_view(&bytes(&enc.codes1), &[n as usize, b1], 1),
            codes2: offset_view(&bytes(&enc.codes2), &[n as usize, b2], 2),
            norms: enc.norms.clone(),
        };
        let yg = tq_rvq_decode(&shifted, signs.as_ref(), &c1, &c2, bits, d, Dtype::F16, &on(&gpu)).unwrap();
        let yc = tq_rvq_decode(&enc, signs.as_ref(), &c1, &c2, bits, d, Dtype::F16, &on(&Stream::cpu())).unwrap();
        assert_eq!(count_differing(&bytes(&yg), &bytes(&yc)), 0, "decode of unaligned code views d={d} bits={bits:?}");
    }
}

/// CUDA's Prod encoder on the tensor cores (float16 and bfloat16 inputs, a
/// dense or Hadamard rotation, d = 64 and 128, 2 to 9 bits) against float64
/// truth at near-ties (`assert_prod_encodings_match`), rows of zeros and a
/// NaN among them; over more tiles than the launch has blocks; 1, 63 and 65
/// vectors; an input view off 16-byte alignment; and rows holding an
/// infinity (every coordinate NaN) bit for bit the CPU's.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_tensor_core_prod_encode_matches_cpu_at_near_ties() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let cases: &[(usize, Dtype, u32, i32)] = &[
        (128, Dtype::F16, 4, 70_001),
        (128, Dtype::F16, 2, 517),
        (128, Dtype::F16, 3, 517),
        (128, Dtype::F16, 5, 517),
        (128, Dtype::F16, 9, 517),
        (64, Dtype::F16, 4, 517),
        (128, Dtype::BF16, 4, 517),
        (64, Dtype::BF16, 3, 517),
        (128, Dtype::F16, 4, 1),
        (64, Dtype::F16, 2, 63),
        (128, Dtype::BF16, 5, 65),
    ];
    for &(d, dtype, bits, n) in cases {
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 1000 + u64::from(bits) * 10 + n as u64);
        let mut xv = f32s(&normal(&mut rng, &[n, d as i32], Dtype::F32));
        if n > 8 {
            xv[3 * d..4 * d].iter_mut().for_each(|a| *a = 0.0);
            xv[7 * d + 5] = f32::NAN;
        }
        let x = ops::astype(&f32_array(&xv, &[n, d as i32]), dtype, &Stream::cpu()).unwrap();
        let rot_m = veloxquant::cache::rotation_matrix(d, 4).unwrap();
        let dense = f32_array(&rot_m, &[d as i32, d as i32]);
        let had = veloxquant::quant::Rotation::hadamard(d, 8).unwrap();
        let signs = f32_array(had.signs(), &[d as i32]);
        let sk_m = Sketch::new(d, d, true, 5).s;
        let sk = f32_array(&sk_m, &[d as i32, d as i32]);
        let c = ScalarCodebook::sphere(d, bits - 1).unwrap().centroids().to_vec();
        let cb = f32_array(&c, &[c.len() as i32]);
        let hadamard = |u: &[f64]| {
            let mut y = vec![0f32; d];
            had.forward(&u.iter().map(|&a| a as f32).collect::<Vec<_>>(), &mut y);
            y.into_iter().map(f64::from).collect::<Vec<_>>()
        };
        let dense_y = dense_rotate(&rot_m);
        let rotations: [(&Array, &RotateF64<'_>, &str); 2] = [(&dense, &dense_y, "dense"), (&signs, &hadamard, "hadamard")];
        for (rotation, rotate, name) in rotations {
            let tag = format!("d={d} {dtype} bits={bits} n={n} {name}");
            assert_eq!(prod_parity(dtype, d, true, bits), ProdParity::TensorCores, "{tag}");
            let g = tq_prod_encode(&x, Some(rotation), Some(&cb), &sk, bits, &on(&gpu)).unwrap();
            let cpu = tq_prod_encode(&x, Some(rotation), Some(&cb), &sk, bits, &on(&Stream::cpu())).unwrap();
            assert_prod_encodings_match(ProdParity::TensorCores, &x, rotate, Some(&cb), &sk_m, bits, &g, &cpu, &tag);
            if n == 517 && dtype == Dtype::F16 {
                // The same rows as a view one element into its buffer.
                let xh: Vec<f16> = xv.iter().map(|&a| f16::from_f32(a)).collect();
                let view = offset_view(&xh, &[n as usize, d], 1);
                let gv = tq_prod_encode(&view, Some(rotation), Some(&cb), &sk, bits, &on(&gpu)).unwrap();
                for (what, a, b) in [
                    ("codes", gv.codes.as_ref().unwrap(), g.codes.as_ref().unwrap()),
                    ("signs", &gv.signs, &g.signs),
                    ("norms", &gv.norms, &g.norms),
                    ("residual norms", gv.residual_norms.as_ref().unwrap(), g.residual_norms.as_ref().unwrap()),
                ] {
                    assert_eq!(count_differing(&bytes(a), &bytes(b)), 0, "{what} of an unaligned view {tag}");
                }
            }
        }
        // Rows holding an infinity: u and y are NaN throughout, as on the CPU.
        let mut inf = f32s(&normal(&mut rng, &[3, d as i32], Dtype::F32));
        inf[2] = f32::INFINITY;
        inf[d + 9] = f32::NEG_INFINITY;
        inf[2 * d..].iter_mut().for_each(|a| *a = f32::INFINITY);
        let xi = ops::astype(&f32_array(&inf, &[3, d as i32]), dtype, &Stream::cpu()).unwrap();
        for rotation in [&dense, &signs] {
            let g = tq_prod_encode(&xi, Some(rotation), Some(&cb), &sk, bits, &on(&gpu)).unwrap();
            let cpu = tq_prod_encode(&xi, Some(rotation), Some(&cb), &sk, bits, &on(&Stream::cpu())).unwrap();
            let tag = format!("infinities d={d} {dtype} bits={bits}");
            assert_eq!(count_differing(&bytes(g.codes.as_ref().unwrap()), &bytes(cpu.codes.as_ref().unwrap())), 0, "codes {tag}");
            assert_eq!(count_differing(&bytes(&g.signs), &bytes(&cpu.signs)), 0, "signs {tag}");
            assert_eq!(count_differing(&bytes(&g.norms), &bytes(&cpu.norms)), 0, "norms {tag}");
            let (gr, cr) = (bytes(g.residual_norms.as_ref().unwrap()), bytes(cpu.residual_norms.as_ref().unwrap()));
            assert_eq!(count_differing(&gr, &cr), 0, "residual norms {tag}");
        }
    }
}
