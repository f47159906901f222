//! The TurboQuant-Prod and -RVQ kernels on MLX's CPU stream: the CPU primitive
//! (`require`) byte for byte against `veloxquant::quant`'s TurboQuantProd and
//! TurboQuantRvq (float32 input, dense rotation), the reference graph (`off`)
//! to rounding, float16/bfloat16 inputs, edge cases and argument errors.

use half::f16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::kernels::{tq_prod_decode, tq_prod_encode, tq_rvq_decode, tq_rvq_encode, ProdCodes, RvqCodes, PROD_BITS};
use veloxquant::quant::{Encoded, Quantizer, Rotation, RotationKind, ScalarCodebook, TurboQuantProd, TurboQuantRvq};
use veloxquant::{ops, Array, Dtype, Element, Error, Options, Policy, Stream};

fn opts(policy: Policy) -> Options {
    Options::on(Stream::cpu(), policy)
}

fn gaussian(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x: Vec<f32> = (0..n * d).map(|_| StandardNormal.sample(&mut rng)).collect();
    if n > 2 {
        // A zero vector: norm 0, decodes to zeros.
        x[2 * d..3 * d].iter_mut().for_each(|v| *v = 0.0);
    }
    x
}

fn arr<T: Element>(v: &[T], shape: &[usize]) -> Array {
    let s: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(v, &s).unwrap()
}

fn buffer<'a>(e: &'a Encoded, name: &str) -> &'a [u8] {
    &e.buffers.iter().find(|b| b.name == name).unwrap_or_else(|| panic!("buffer {name}")).bytes
}

fn f16s(bytes: &[u8]) -> Vec<f16> {
    bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()
}

fn bytes_f16(a: &Array) -> Vec<u8> {
    bytemuck::cast_slice::<f16, u8>(&a.to_vec::<f16>().unwrap()).to_vec()
}

/// The quantizer's state as kernel inputs: (Π, first codebook, second codebook or sketch).
fn dense_rotation(d: usize, seed: u64) -> Array {
    arr(&Rotation::new(RotationKind::Dense, d, seed).unwrap().to_dense(), &[d, d])
}

fn prod_state(q: &TurboQuantProd, d: usize, bits: u32) -> (Option<Array>, Array) {
    let a = q.to_artifact();
    let cb = (bits > 1).then(|| arr(&a.f32s("codebook", &[1 << (bits - 1)]).unwrap(), &[1 << (bits - 1)]));
    (cb, arr(&a.f32s("sketch", &[d, d]).unwrap(), &[d, d]))
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn differing_bits(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

fn prod_case(n: usize, d: usize, bits: u32, seed: u64) {
    let q = TurboQuantProd::new(d, bits, RotationKind::Dense, seed).unwrap();
    let xf = gaussian(n, d, seed + 100);
    let enc = q.encode(&xf).unwrap();
    let want = q.decode(&enc).unwrap();
    let rot = dense_rotation(d, seed);
    let (cb, sk) = prod_state(&q, d, bits);
    let x = arr(&xf, &[n, d]);
    let mb = bits - 1;
    for policy in [Policy::Require, Policy::Off] {
        let tag = format!("n={n} d={d} bits={bits} {policy}");
        let got = tq_prod_encode(&x, Some(&rot), cb.as_ref(), &sk, bits, &opts(policy)).unwrap();
        assert_eq!(got.signs.shape(), vec![n as i32, d as i32 / 8], "{tag}");
        assert_eq!(got.codes.is_some(), mb > 0, "{tag}");
        assert_eq!(got.residual_norms.is_some(), mb > 0, "{tag}");
        let signs = got.signs.to_vec::<u8>().unwrap();
        if policy == Policy::Require {
            assert_eq!(signs, buffer(&enc, "signs"), "signs {tag}");
            assert_eq!(bytes_f16(&got.norms), buffer(&enc, "norms"), "norms {tag}");
            if mb > 0 {
                assert_eq!(got.codes.as_ref().unwrap().to_vec::<u8>().unwrap(), buffer(&enc, "codes"), "codes {tag}");
                assert_eq!(bytes_f16(got.residual_norms.as_ref().unwrap()), buffer(&enc, "residual_norms"), "rnorms {tag}");
            }
        } else {
            // The reference graph rotates with a matmul: a sign may flip at a near-zero projection.
            assert!(differing_bits(&signs, buffer(&enc, "signs")) as usize * 100 <= n * d, "signs {tag}");
        }
        // Decode the quantizer's own buffers.
        let stored = ProdCodes {
            codes: (mb > 0).then(|| arr(buffer(&enc, "codes"), &[n, d * mb as usize / 8])),
            signs: arr(buffer(&enc, "signs"), &[n, d / 8]),
            norms: arr(&f16s(buffer(&enc, "norms")), &[n]),
            residual_norms: (mb > 0).then(|| arr(&f16s(buffer(&enc, "residual_norms")), &[n])),
        };
        let y = tq_prod_decode(&stored, Some(&rot), cb.as_ref(), &sk, bits, Dtype::F32, &opts(policy)).unwrap();
        assert_eq!(y.shape(), vec![n as i32, d as i32]);
        let y = y.to_vec::<f32>().unwrap();
        if policy == Policy::Require {
            assert_eq!(y, want, "decode {tag}");
        } else if n > 0 {
            assert!(rel_err(&y, &want) < 1e-5, "decode {tag}: {}", rel_err(&y, &want));
        }
    }
}

#[test]
fn prod_matches_quantizer_byte_for_byte() {
    for &bits in &PROD_BITS {
        prod_case(37, 64, bits, u64::from(bits));
    }
    prod_case(1, 128, 4, 7);
    prod_case(0, 128, 3, 8);
    prod_case(9, 256, 9, 9);
    prod_case(5, 256, 1, 10);
}

fn rvq_case(n: usize, d: usize, bits: (u32, u32), seed: u64) {
    let q = TurboQuantRvq::new(d, bits.0, bits.1, RotationKind::Dense, seed).unwrap();
    let xf = gaussian(n, d, seed + 200);
    let enc = q.encode(&xf).unwrap();
    let want = q.decode(&enc).unwrap();
    let rot = dense_rotation(d, seed);
    let a = q.to_artifact();
    let c1 = arr(&a.f32s("codebook1", &[1 << bits.0]).unwrap(), &[1 << bits.0]);
    let c2 = arr(&a.f32s("codebook2", &[1 << bits.1]).unwrap(), &[1 << bits.1]);
    let x = arr(&xf, &[n, d]);
    let (b1, b2) = (d * bits.0 as usize / 8, d * bits.1 as usize / 8);
    for policy in [Policy::Require, Policy::Off] {
        let tag = format!("n={n} d={d} bits={bits:?} {policy}");
        let got = tq_rvq_encode(&x, Some(&rot), &c1, &c2, bits, &opts(policy)).unwrap();
        assert_eq!(got.codes1.shape(), vec![n as i32, b1 as i32], "{tag}");
        assert_eq!(got.codes2.shape(), vec![n as i32, b2 as i32], "{tag}");
        if policy == Policy::Require {
            assert_eq!(got.codes1.to_vec::<u8>().unwrap(), buffer(&enc, "codes1"), "codes1 {tag}");
            assert_eq!(got.codes2.to_vec::<u8>().unwrap(), buffer(&enc, "codes2"), "codes2 {tag}");
            assert_eq!(bytes_f16(&got.norms), buffer(&enc, "norms"), "norms {tag}");
        }
        let stored = RvqCodes {
            codes1: arr(buffer(&enc, "codes1"), &[n, b1]),
            codes2: arr(buffer(&enc, "codes2"), &[n, b2]),
            norms: arr(&f16s(buffer(&enc, "norms")), &[n]),
        };
        let y = tq_rvq_decode(&stored, Some(&rot), &c1, &c2, bits, d, Dtype::F32, &opts(policy)).unwrap();
        let y = y.to_vec::<f32>().unwrap();
        if policy == Policy::Require {
            assert_eq!(y, want, "decode {tag}");
        } else if n > 0 {
            assert!(rel_err(&y, &want) < 1e-5, "decode {tag}: {}", rel_err(&y, &want));
            // Encode + decode on the reference graph reconstructs as well as the quantizer.
            let round = tq_rvq_decode(&got, Some(&rot), &c1, &c2, bits, d, Dtype::F32, &opts(policy)).unwrap();
            let round = round.to_vec::<f32>().unwrap();
            assert!(rel_err(&round, &want) < 1e-2, "round trip {tag}: {}", rel_err(&round, &want));
        }
    }
}

#[test]
fn rvq_matches_quantizer_byte_for_byte() {
    for (i, bits) in [(1, 1), (2, 2), (1, 8), (4, 3), (8, 2), (3, 4), (2, 1)].into_iter().enumerate() {
        rvq_case(37, 64, bits, i as u64);
    }
    rvq_case(1, 128, (2, 2), 20);
    rvq_case(0, 128, (4, 4), 21);
    rvq_case(9, 256, (3, 8), 22);
}

/// Squared reconstruction error of a round trip with input rounded to `dtype`.
fn round_trip_error(dtype: Dtype, policy: Policy, prod: bool) -> f64 {
    let (n, d) = (64, 128);
    let xf = gaussian(n, d, 77);
    let x = ops::astype(&arr(&xf, &[n, d]), dtype, &Stream::cpu()).unwrap();
    let rot = dense_rotation(d, 3);
    let o = opts(policy);
    let y = if prod {
        let q = TurboQuantProd::new(d, 4, RotationKind::Dense, 3).unwrap();
        let (cb, sk) = prod_state(&q, d, 4);
        let e = tq_prod_encode(&x, Some(&rot), cb.as_ref(), &sk, 4, &o).unwrap();
        tq_prod_decode(&e, Some(&rot), cb.as_ref(), &sk, 4, dtype, &o).unwrap()
    } else {
        let q = TurboQuantRvq::new(d, 2, 2, RotationKind::Dense, 3).unwrap();
        let a = q.to_artifact();
        let c1 = arr(&a.f32s("codebook1", &[4]).unwrap(), &[4]);
        let c2 = arr(&a.f32s("codebook2", &[4]).unwrap(), &[4]);
        let e = tq_rvq_encode(&x, Some(&rot), &c1, &c2, (2, 2), &o).unwrap();
        tq_rvq_decode(&e, Some(&rot), &c1, &c2, (2, 2), d, dtype, &o).unwrap()
    };
    assert_eq!(y.dtype(), dtype);
    let y = ops::astype(&y, Dtype::F32, &Stream::cpu()).unwrap().to_vec::<f32>().unwrap();
    y.iter().zip(&xf).map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2)).sum()
}

#[test]
fn half_inputs_reconstruct_like_f32() {
    for prod in [true, false] {
        let base = round_trip_error(Dtype::F32, Policy::Require, prod);
        for dt in [Dtype::F16, Dtype::BF16] {
            for policy in [Policy::Require, Policy::Off] {
                let e = round_trip_error(dt, policy, prod);
                assert!((e / base - 1.0).abs() < 0.01, "prod={prod} {dt} {policy}: {e} vs {base}");
            }
        }
    }
}

#[test]
fn transposed_batched_and_unrotated_inputs() {
    let s = Stream::cpu();
    let d = 64;
    let q = TurboQuantProd::new(d, 3, RotationKind::Dense, 5).unwrap();
    let (cb, sk) = prod_state(&q, d, 3);
    let rot = dense_rotation(d, 5);
    let xf = gaussian(6, d, 1);
    // [d, 6] transposed to [6, d]: not row-contiguous.
    let mut cols = vec![0.0f32; 6 * d];
    for r in 0..6 {
        for j in 0..d {
            cols[j * 6 + r] = xf[r * d + j];
        }
    }
    let xt = ops::transpose(&arr(&cols, &[d, 6]), &[1, 0], &s).unwrap();
    let x3 = arr(&xf, &[2, 3, d]);
    let flat = tq_prod_encode(&arr(&xf, &[6, d]), Some(&rot), cb.as_ref(), &sk, 3, &opts(Policy::Require)).unwrap();
    for policy in [Policy::Require, Policy::Off] {
        let t = tq_prod_encode(&xt, Some(&rot), cb.as_ref(), &sk, 3, &opts(policy)).unwrap();
        let b = tq_prod_encode(&x3, Some(&rot), cb.as_ref(), &sk, 3, &opts(policy)).unwrap();
        assert_eq!(b.signs.shape(), vec![2, 3, 8]);
        assert_eq!(b.norms.shape(), vec![2, 3]);
        assert_eq!(b.codes.as_ref().unwrap().shape(), vec![2, 3, 16]);
        let y = tq_prod_decode(&b, Some(&rot), cb.as_ref(), &sk, 3, Dtype::F16, &opts(policy)).unwrap();
        assert_eq!((y.shape(), y.dtype()), (vec![2, 3, d as i32], Dtype::F16));
        if policy == Policy::Require {
            for e in [&t, &b] {
                assert_eq!(e.signs.to_vec::<u8>().unwrap(), flat.signs.to_vec::<u8>().unwrap());
                assert_eq!(e.codes.as_ref().unwrap().to_vec::<u8>().unwrap(), flat.codes.as_ref().unwrap().to_vec::<u8>().unwrap());
            }
        }
    }
    // Without a rotation: x is taken as rotated already, so encoding Π x
    // without Π gives the codes of x with Π (up to the rotation's rounding).
    let c1 = arr(ScalarCodebook::sphere(d, 2).unwrap().centroids(), &[4]);
    let c2 = arr(ScalarCodebook::sphere_residual(d, 2, 2).unwrap().centroids(), &[4]);
    let rvq = tq_rvq_encode(&arr(&xf, &[6, d]), None, &c1, &c2, (2, 2), &opts(Policy::Require)).unwrap();
    let rvq_off = tq_rvq_encode(&arr(&xf, &[6, d]), None, &c1, &c2, (2, 2), &opts(Policy::Off)).unwrap();
    assert_eq!(rvq.codes1.to_vec::<u8>().unwrap(), rvq_off.codes1.to_vec::<u8>().unwrap());
    assert_eq!(rvq.codes2.to_vec::<u8>().unwrap(), rvq_off.codes2.to_vec::<u8>().unwrap());
    let back = tq_rvq_decode(&rvq, None, &c1, &c2, (2, 2), d, Dtype::F32, &opts(Policy::Require)).unwrap();
    let reference = tq_rvq_decode(&rvq, None, &c1, &c2, (2, 2), d, Dtype::F32, &opts(Policy::Off)).unwrap();
    let (back, reference) = (back.to_vec::<f32>().unwrap(), reference.to_vec::<f32>().unwrap());
    assert_eq!(back, reference);
    // Two 2-bit stages: about 4-bit accuracy (relative MSE 0.01 per unit vector).
    assert!(rel_err(&back, &xf) < 0.15, "{}", rel_err(&back, &xf));
}

#[test]
fn bad_input_names_the_argument() {
    let o = opts(Policy::Auto);
    let msg = |e: Error| e.to_string();
    let d = 16;
    let x = arr(&gaussian(2, d, 1), &[2, d]);
    let rot = dense_rotation(d, 1);
    let sk = dense_rotation(d, 2);
    let cb = arr(&[-0.3f32, -0.1, 0.1, 0.3], &[4]);
    let rot_h = ops::astype(&rot, Dtype::F16, &Stream::cpu()).unwrap();
    let x_u8 = arr(&[1u8; 32], &[2, d]);
    assert!(msg(tq_prod_encode(&x, Some(&rot_h), Some(&cb), &sk, 3, &o).unwrap_err()).starts_with("rotation: dtype float16"));
    assert!(msg(tq_prod_encode(&x_u8, Some(&rot), Some(&cb), &sk, 3, &o).unwrap_err()).starts_with("x: dtype uint8"));
    assert!(msg(tq_prod_encode(&x, Some(&rot), Some(&cb), &sk, 6, &o).unwrap_err()).starts_with("bits: 6"));
    assert!(msg(tq_prod_encode(&x, Some(&rot), Some(&cb), &sk, 4, &o).unwrap_err()).starts_with("centroids: shape"));
    assert!(msg(tq_prod_encode(&x, Some(&rot), Some(&cb), &sk, 1, &o).unwrap_err()).starts_with("centroids:"));
    assert!(msg(tq_prod_encode(&x, Some(&rot), None, &sk, 3, &o).unwrap_err()).starts_with("centroids:"));
    assert!(msg(tq_prod_encode(&x, Some(&rot), Some(&cb), &rot_h, 3, &o).unwrap_err()).starts_with("sketch: dtype float16"));
    let x12 = arr(&[0.5f32; 24], &[2, 12]);
    assert!(msg(tq_prod_encode(&x12, None, Some(&cb), &sk, 3, &o).unwrap_err()).starts_with("x: head dimension 12"));
    let e = tq_prod_encode(&x, Some(&rot), Some(&cb), &sk, 3, &o).unwrap();
    let bad = ProdCodes { norms: ops::astype(&e.norms, Dtype::F32, &Stream::cpu()).unwrap(), ..e };
    assert!(msg(tq_prod_decode(&bad, Some(&rot), Some(&cb), &sk, 3, Dtype::F32, &o).unwrap_err()).starts_with("norms: dtype float32"));
    let e = tq_prod_encode(&x, Some(&rot), Some(&cb), &sk, 3, &o).unwrap();
    assert!(msg(tq_prod_decode(&e, Some(&rot), Some(&cb), &sk, 3, Dtype::U8, &o).unwrap_err()).starts_with("dtype: dtype uint8"));
    assert!(msg(tq_prod_decode(&e, Some(&rot), Some(&cb), &sk, 5, Dtype::F32, &o).unwrap_err()).starts_with("codes: shape"));
    let c2 = arr(&[-0.1f32, 0.1], &[2]);
    assert!(msg(tq_rvq_encode(&x, Some(&rot), &cb, &c2, (2, 5), &o).unwrap_err()).starts_with("bits2: 5"));
    assert!(msg(tq_rvq_encode(&x, Some(&rot), &cb, &c2, (2, 2), &o).unwrap_err()).starts_with("centroids2: shape"));
    assert!(tq_rvq_encode(&x, Some(&rot), &cb, &cb, (2, 2), &o).is_ok());
    let r = tq_rvq_encode(&x, Some(&rot), &cb, &c2, (2, 1), &o).unwrap();
    assert!(msg(tq_rvq_decode(&r, Some(&rot), &cb, &c2, (2, 1), 24, Dtype::F32, &o).unwrap_err()).starts_with("rotation: shape"));
    assert!(msg(tq_rvq_decode(&r, None, &cb, &c2, (2, 2), d, Dtype::F32, &o).unwrap_err()).starts_with("centroids2: shape"));
    let swapped = RvqCodes { codes1: r.codes2, codes2: r.codes1, norms: r.norms };
    assert!(msg(tq_rvq_decode(&swapped, None, &cb, &c2, (2, 1), d, Dtype::F32, &o).unwrap_err()).starts_with("codes1: shape"));
}

/// Hadamard quantizers: the fused encoders and decoders given the rotation's
/// signs (`rotation.signs`, `[d]`) run the same butterflies as
/// `Rotation::forward` and `inverse`, so they reproduce the quantizers byte
/// for byte, where the dense matrix of the same rotation would round
/// differently.
#[test]
fn hadamard_signs_code_as_the_quantizers_byte_for_byte() {
    for &(n, d, seed) in &[(37usize, 64usize, 3u64), (20, 128, 4), (5, 256, 5)] {
        let xf = gaussian(n, d, seed + 300);
        let x = arr(&xf, &[n, d]);
        for bits in [1u32, 3, 5] {
            let q = TurboQuantProd::new(d, bits, RotationKind::Hadamard, seed).unwrap();
            let enc = q.encode(&xf).unwrap();
            let signs = arr(&q.to_artifact().f32s("rotation.signs", &[d]).unwrap(), &[d]);
            let (cb, sk) = prod_state(&q, d, bits);
            let got = tq_prod_encode(&x, Some(&signs), cb.as_ref(), &sk, bits, &opts(Policy::Require)).unwrap();
            let tag = format!("prod n={n} d={d} bits={bits}");
            assert_eq!(got.signs.to_vec::<u8>().unwrap(), buffer(&enc, "signs"), "signs {tag}");
            assert_eq!(bytes_f16(&got.norms), buffer(&enc, "norms"), "norms {tag}");
            if let Some(codes) = &got.codes {
                assert_eq!(codes.to_vec::<u8>().unwrap(), buffer(&enc, "codes"), "codes {tag}");
            }
            // Decoding the same buffers with the signs: the quantizer's
            // inverse butterflies, bit for bit; the reference graph to rounding.
            let mb = bits as usize - 1;
            let stored = ProdCodes {
                codes: (mb > 0).then(|| arr(buffer(&enc, "codes"), &[n, d * mb / 8])),
                signs: arr(buffer(&enc, "signs"), &[n, d / 8]),
                norms: arr(&f16s(buffer(&enc, "norms")), &[n]),
                residual_norms: (mb > 0).then(|| arr(&f16s(buffer(&enc, "residual_norms")), &[n])),
            };
            let want = q.decode(&enc).unwrap();
            for policy in [Policy::Require, Policy::Off] {
                let y = tq_prod_decode(&stored, Some(&signs), cb.as_ref(), &sk, bits, Dtype::F32, &opts(policy)).unwrap();
                let y = y.to_vec::<f32>().unwrap();
                if policy == Policy::Require {
                    assert_eq!(y, want, "decode {tag}");
                } else {
                    assert!(rel_err(&y, &want) < 1e-5, "reference decode {tag}: {}", rel_err(&y, &want));
                }
            }
        }
        for bits in [(2u32, 2u32), (4, 3)] {
            let q = TurboQuantRvq::new(d, bits.0, bits.1, RotationKind::Hadamard, seed).unwrap();
            let enc = q.encode(&xf).unwrap();
            let a = q.to_artifact();
            let signs = arr(&a.f32s("rotation.signs", &[d]).unwrap(), &[d]);
            let c1 = arr(&a.f32s("codebook1", &[1 << bits.0]).unwrap(), &[1 << bits.0]);
            let c2 = arr(&a.f32s("codebook2", &[1 << bits.1]).unwrap(), &[1 << bits.1]);
            let got = tq_rvq_encode(&x, Some(&signs), &c1, &c2, bits, &opts(Policy::Require)).unwrap();
            let tag = format!("rvq n={n} d={d} bits={bits:?}");
            assert_eq!(got.codes1.to_vec::<u8>().unwrap(), buffer(&enc, "codes1"), "codes1 {tag}");
            assert_eq!(got.codes2.to_vec::<u8>().unwrap(), buffer(&enc, "codes2"), "codes2 {tag}");
            assert_eq!(bytes_f16(&got.norms), buffer(&enc, "norms"), "norms {tag}");
            let stored = RvqCodes {
                codes1: arr(buffer(&enc, "codes1"), &[n, d * bits.0 as usize / 8]),
                codes2: arr(buffer(&enc, "codes2"), &[n, d * bits.1 as usize / 8]),
                norms: arr(&f16s(buffer(&enc, "norms")), &[n]),
            };
            let y = tq_rvq_decode(&stored, Some(&signs), &c1, &c2, bits, d, Dtype::F32, &opts(Policy::Require)).unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), q.decode(&enc).unwrap(), "decode {tag}");
            // The reference graph multiplies by the dense matrix instead.
            let off = tq_rvq_encode(&x, Some(&signs), &c1, &c2, bits, &opts(Policy::Off)).unwrap();
            let differ = off.codes1.to_vec::<u8>().unwrap().iter().zip(buffer(&enc, "codes1")).filter(|(a, b)| a != b).count();
            assert!(differ * 100 <= n * d, "reference codes1 {tag}: {differ} bytes differ");
        }
    }
}
