//! The TurboQuant cache kernels on the GPU against the CPU kernels: the
//! encoder gives bit-identical codes and norms for the same float32 input
//! (same arithmetic), and on CUDA's tensor cores (float16 and bfloat16
//! inputs) codes that differ only at near-ties; caches filled on both agree (their windows are rotated by each
//! back-end's matmul, so a code may flip at a near-tie), and attention agrees
//! to rounding. Ignored where MLX has no GPU back-end; run on the GPU machine
//! with `--ignored`.

mod common;

use common::{f32s, normal, rel_err};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cache::{CacheConfig, LayerCache};
use veloxquant::kernels::turboquant::tq_encode;
use veloxquant::quant::ScalarCodebook;
use veloxquant::{ops, Array, Backend, Dtype, Options, Policy, Stream};

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_cache_matches_cpu_cache() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(d, hkv, hq, dtype, tol) in &[
        (128usize, 8usize, 32usize, Dtype::F32, 1e-5),
        (128, 8, 32, Dtype::F16, 1e-2),
        (64, 3, 9, Dtype::BF16, 2e-2),
        (96, 2, 8, Dtype::F16, 1e-2),
        (256, 1, 4, Dtype::F16, 1e-2),
    ] {
        let mut cfg = CacheConfig::new(d, hkv);
        cfg.key_bits = 4;
        cfg.value_bits = 3;
        cfg.policy = Policy::Require;
        let mut on_gpu = LayerCache::new(cfg.clone(), Some(gpu.clone())).unwrap();
        let mut on_cpu = LayerCache::new(cfg, Some(Stream::cpu())).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64);
        let chunks = [1000, 1, 1, 300, 1];
        // Shown with a failure: the case and the step it reached.
        eprintln!("d={d} kv_heads={hkv} q_heads={hq} {dtype}: appending {chunks:?}");
        for t in chunks {
            let k = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            let v = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            on_gpu.append(&k, &v).unwrap();
            on_cpu.append(&k, &v).unwrap();
        }
        eprintln!("d={d} {dtype}: dequantizing");
        let (kg, vg) = on_gpu.dequantize().unwrap();
        let (kc, vc) = on_cpu.dequantize().unwrap();
        for (name, g, c) in [("keys", kg, kc), ("values", vg, vc)] {
            let e = rel_err(&f32s(&g), &f32s(&c));
            assert!(e <= 2e-2, "decoded {name} d={d} {dtype}: GPU and CPU caches differ by {e}");
        }
        // The fused kernel against the CPU kernel over the same stored state,
        // and against decode-then-SDPA on the GPU (whose float32 matmuls may
        // round through TF32, hence the looser bound there).
        let same_on_cpu = LayerCache::from_bytes(&on_gpu.to_bytes().unwrap(), Some(Stream::cpu())).unwrap();
        let (kd, vd) = on_gpu.dequantize().unwrap();
        for (l, causal) in [(1, false), (7, true)] {
            // Laid out [B, L, Hq, D] and transposed, as mlx_lm hands queries over.
            let q = normal(&mut rng, &[2, l, hq as i32, d as i32], dtype);
            let q = ops::transpose(&q, &[0, 2, 1, 3], &gpu).unwrap();
            let scale = 1.0 / (d as f32).sqrt();
            eprintln!("d={d} {dtype}: attention of {l} queries");
            let g = f32s(&on_gpu.attention(&q, scale, causal).unwrap());
            let same = f32s(&same_on_cpu.attention(&q, scale, causal).unwrap());
            let e = rel_err(&g, &same);
            assert!(e <= tol, "attention d={d} {dtype} L={l}: relative error {e} against the CPU kernel on the same state");
            let r = f32s(&ops::scaled_dot_product_attention(&q, &kd, &vd, scale, causal && l > 1, &gpu).unwrap());
            let e = rel_err(&g, &r);
            assert!(e <= tol.max(2e-3), "attention d={d} {dtype} L={l}: relative error {e} against decode + SDPA");
            let c = f32s(&on_cpu.attention(&q, scale, causal).unwrap());
            let e = rel_err(&g, &c);
            assert!(e <= 5e-2, "attention d={d} {dtype} L={l}: GPU and CPU caches differ by {e}");
        }
    }
}

/// Decodes of one layer built into one graph (a benchmark's batch of calls,
/// a speculative step) may run on the GPU at once: each must still give
/// what it gives alone, and leave the layer's later decodes right. CUDA's
/// decode merges its splits through per-layer counters, so MLX must order
/// the calls (each hands the next its counters).
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_decodes_of_one_layer_in_one_graph_match_each_alone() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    let (d, hkv, hq, batch) = (128usize, 8usize, 32usize, 4i32);
    let mut cfg = CacheConfig::new(d, hkv);
    cfg.key_bits = 4;
    cfg.value_bits = 3;
    cfg.policy = Policy::Require;
    let mut cache = LayerCache::new(cfg, Some(gpu.clone())).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for _ in 0..4 {
        let k = normal(&mut rng, &[batch, hkv as i32, 8192, d as i32], Dtype::F16);
        let v = normal(&mut rng, &[batch, hkv as i32, 8192, d as i32], Dtype::F16);
        cache.append(&k, &v).unwrap();
    }
    let scale = 1.0 / (d as f32).sqrt();
    let queries: Vec<Array> = (0..16).map(|_| normal(&mut rng, &[batch, hq as i32, 1, d as i32], Dtype::F16)).collect();
    let alone: Vec<Vec<f32>> = queries.iter().map(|q| f32s(&cache.attention(q, scale, false).unwrap())).collect();
    for round in 0..3 {
        let together: Vec<Array> = queries.iter().map(|q| cache.attention(q, scale, false).unwrap()).collect();
        veloxquant::eval(&together.iter().collect::<Vec<_>>()).unwrap();
        for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
            let e = rel_err(&f32s(t), a);
            assert!(e <= 1e-3, "round {round}, call {i} of 16 in one graph: relative error {e} against the call alone");
        }
    }
    let again = f32s(&cache.attention(&queries[0], scale, false).unwrap());
    assert!(rel_err(&again, &alone[0]) <= 1e-3, "a decode after the batches of calls differs from before them");
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_encode_is_bit_identical_to_cpu() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &d in &[64usize, 80, 96, 128, 256] {
        for &bits in &[1u32, 2, 3, 4, 8] {
            let mut rng = ChaCha8Rng::seed_from_u64(100 + d as u64 + bits as u64);
            let x = normal(&mut rng, &[517, d as i32], Dtype::F32);
            let rot = normal(&mut rng, &[d as i32, d as i32], Dtype::F32);
            let cent = ScalarCodebook::sphere(d, bits).unwrap().centroids().to_vec();
            let cent = Array::from_slice(&cent, &[cent.len() as i32]).unwrap();
            // A Hadamard rotation as its signs (power-of-two d): butterflies.
            let signs = d.is_power_of_two().then(|| {
                let r = veloxquant::quant::Rotation::hadamard(d, 5).unwrap();
                Array::from_slice(r.signs(), &[d as i32]).unwrap()
            });
            let mut rotations = vec![Some(&rot), None];
            rotations.extend(signs.as_ref().map(Some));
            for rotation in rotations {
                let run = |s: &Stream| {
                    let (c, n) = tq_encode(&x, rotation, &cent, bits, &Options::on(s.clone(), Policy::Require)).unwrap();
                    (c.to_vec::<u8>().unwrap(), n.to_bytes().unwrap())
                };
                let (gc, gn) = run(&gpu);
                let (cc, cn) = run(&Stream::cpu());
                let codes_differ = gc.iter().zip(&cc).filter(|(a, b)| a != b).count();
                let norms_differ = gn.iter().zip(&cn).filter(|(a, b)| a != b).count();
                assert_eq!(
                    (codes_differ, norms_differ),
                    (0, 0),
                    "d={d} bits={bits} rotation {:?}: differing code bytes, norm bytes",
                    rotation.map(|r| r.shape())
                );
            }
        }
    }
}

/// The tensor-core encoder (float16 and bfloat16 `x` with a rotation, d = 64
/// or 128) against the CPU kernel, by the parity rule for these types: a code
/// may differ only at a near-tie, so every differing code is a neighbour of
/// the CPU's and `y = Π x / ‖x‖` (float64) lies within 2e-4 of the midpoint
/// between the two centroids; at most 1% differ, and the reconstruction
/// errors of both agree within 1% relative. Norms agree to one float16 step.
/// Rows of zeros, a NaN and an infinity match the CPU exactly; a row of
/// values whose squares overflow float32 (bfloat16) too. 70,001 vectors walk more tiles than the grid has blocks.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_tensor_core_encode_matches_cpu_at_near_ties() {
    use veloxquant::kernels::encode_tensor_core_parts;
    use veloxquant::quant::Rotation;
    let gpu = Stream::gpu().expect("a GPU back-end");
    let cuda = gpu.backend().unwrap() == Backend::Cuda;
    let mut cases = Vec::new();
    for d in [64usize, 128] {
        for dtype in [Dtype::F16, Dtype::BF16] {
            for bits in [1u32, 2, 3, 4, 8] {
                for hadamard in [false, true] {
                    cases.push((d, dtype, bits, hadamard, 517usize));
                }
            }
        }
    }
    for dtype in [Dtype::F16, Dtype::BF16] {
        for hadamard in [false, true] {
            cases.push((128, dtype, 4, hadamard, 70_001));
        }
    }
    for (d, dtype, bits, hadamard, n) in cases {
        let tag = format!("d={d} {dtype} bits={bits} hadamard={hadamard} n={n}");
        if cuda {
            assert!(encode_tensor_core_parts(dtype, d, true, bits) > 0, "{tag}: expected the tensor-core path");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(7 * d as u64 + bits as u64 + n as u64);
        let mut xv = f32s(&normal(&mut rng, &[n as i32, d as i32], Dtype::F32));
        let huge = if dtype == Dtype::F16 { 60000.0 } else { 1e30 };
        xv[..d].fill(0.0);
        xv[d + 3] = f32::NAN;
        xv[2 * d + 5] = f32::INFINITY;
        xv[3 * d..4 * d].fill(huge);
        let x = ops::astype(&Array::from_slice(&xv, &[n as i32, d as i32]).unwrap(), dtype, &Stream::cpu()).unwrap();
        let rotation = if hadamard { Rotation::hadamard(d, 5).unwrap() } else { Rotation::dense(d, 5).unwrap() };
        let rot = if hadamard {
            Array::from_slice(rotation.signs(), &[d as i32]).unwrap()
        } else {
            Array::from_slice(rotation.matrix(), &[d as i32, d as i32]).unwrap()
        };
        let cent = ScalarCodebook::sphere(d, bits).unwrap().centroids().to_vec();
        // Rows 0-2: zeros, a NaN, an infinity. Row 3 (huge values) is an
        // ordinary vector in float16 and has a norm of ∞ in bfloat16.
        assert_encodes_match_at_near_ties(&gpu, (&x, &x), &rotation, &rot, &cent, bits, 3, &tag);
    }
}

/// `tq_encode` of `x` `[n, d]` on `gpu` against the CPU's of `x_cpu` (the
/// same values) by the parity rule for float16 and bfloat16 inputs (as the
/// test above says; at most one differing norm or code where 1% is less);
/// the first `exact_rows` rows' codes bit for bit. `rotation` as `rot`
/// passes it.
#[allow(clippy::too_many_arguments)]
fn assert_encodes_match_at_near_ties(
    gpu: &Stream,
    (x, x_cpu): (&Array, &Array),
    rotation: &veloxquant::quant::Rotation,
    rot: &Array,
    cent: &[f32],
    bits: u32,
    exact_rows: usize,
    tag: &str,
) {
    let (n, d) = (x.shape()[0] as usize, x.shape()[1] as usize);
    let cent_arr = Array::from_slice(cent, &[cent.len() as i32]).unwrap();
    let run = |x: &Array, s: &Stream| {
        let (c, nm) = tq_encode(x, Some(rot), &cent_arr, bits, &Options::on(s.clone(), Policy::Require)).unwrap();
        let mut codes = vec![0u8; n * d];
        veloxquant::cpu::bit_unpack(&c.to_vec::<u8>().unwrap(), n, d, bits, &mut codes);
        let norms: Vec<u16> = nm.to_bytes().unwrap().chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        (codes, norms)
    };
    let (gc, gn) = run(x, gpu);
    let (cc, cn) = run(x_cpu, &Stream::cpu());
    // Norms: one float16 step at most, and rarely that.
    let mut norms_differ = 0;
    for (i, (&a, &b)) in gn.iter().zip(&cn).enumerate() {
        assert!(a.abs_diff(b) <= 1, "{tag}: norm {i}: GPU {a:#x}, CPU {b:#x}");
        norms_differ += usize::from(a != b);
    }
    assert!(norms_differ * 100 <= n.max(100), "{tag}: {norms_differ} norms differ");
    assert_eq!(gc[..exact_rows * d], cc[..exact_rows * d], "{tag}: the first {exact_rows} rows' codes");
    let special = exact_rows;
    let pi = rotation.to_dense();
    let xr = f32s(x_cpu);
    let (mut differ, mut err_gpu, mut err_cpu) = (0usize, 0.0f64, 0.0f64);
    for i in special..n {
        let row = &xr[i * d..(i + 1) * d];
        let norm = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        for j in 0..d {
            let y = (0..d).map(|k| f64::from(pi[j * d + k]) * f64::from(row[k])).sum::<f64>() / norm;
            let (g, c) = (gc[i * d + j] as usize, cc[i * d + j] as usize);
            err_gpu += (y - f64::from(cent[g])).powi(2);
            err_cpu += (y - f64::from(cent[c])).powi(2);
            if g != c {
                differ += 1;
                let mid = 0.5 * (f64::from(cent[g]) + f64::from(cent[c]));
                assert!(
                    g.abs_diff(c) == 1 && (y - mid).abs() <= 2e-4,
                    "{tag}: vector {i} coordinate {j}: code {g} against the CPU's {c}, y = {y}, midpoint {mid}"
                );
            }
        }
    }
    assert!(differ * 100 <= (n * d).max(100), "{tag}: {differ} of {} codes differ", n * d);
    let rel = (err_gpu.sqrt() - err_cpu.sqrt()).abs() / err_cpu.sqrt();
    assert!(rel <= 0.01, "{tag}: reconstruction errors differ by {rel}");
    println!("{tag}: {differ} of {} codes and {norms_differ} norms differ from the CPU's", n * d);
}

/// The tensor-core encoder on the inputs' edges, against the CPU by the
/// parity rule: 1, 63, 64 and 65 vectors (a partial tile, a whole one, one
/// more), a view one element into its buffer (not 16-byte aligned: element
/// loads), a transposed input (made contiguous by MLX) and leading
/// dimensions [2, 5, d].
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_tensor_core_encode_edges_match_cpu() {
    use veloxquant::quant::Rotation;
    let gpu = Stream::gpu().expect("a GPU back-end");
    let d = 128usize;
    let bits = 4;
    let rotation = Rotation::dense(d, 9).unwrap();
    let rot = Array::from_slice(rotation.matrix(), &[d as i32, d as i32]).unwrap();
    let cent = ScalarCodebook::sphere(d, bits).unwrap().centroids().to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for n in [1usize, 63, 64, 65] {
        let x = normal(&mut rng, &[n as i32, d as i32], Dtype::F16);
        assert_encodes_match_at_near_ties(&gpu, (&x, &x), &rotation, &rot, &cent, bits, 0, &format!("n={n}"));
    }
    let n = 300usize;
    let vals: Vec<half::f16> = f32s(&normal(&mut rng, &[n as i32, d as i32], Dtype::F32)).into_iter().map(half::f16::from_f32).collect();
    let view = common::offset_view(&vals, &[n, d], 1);
    let whole = Array::from_slice(&vals, &[n as i32, d as i32]).unwrap();
    assert_encodes_match_at_near_ties(&gpu, (&view, &whole), &rotation, &rot, &cent, bits, 0, "a view off 16-byte alignment");
    let t = normal(&mut rng, &[d as i32, n as i32], Dtype::BF16);
    let (t_gpu, t_cpu) = (ops::transpose(&t, &[1, 0], &gpu).unwrap(), ops::transpose(&t, &[1, 0], &Stream::cpu()).unwrap());
    assert_encodes_match_at_near_ties(&gpu, (&t_gpu, &t_cpu), &rotation, &rot, &cent, bits, 0, "a transposed input");
    // Leading dimensions: codes [2, 5, d / 2] and norms [2, 5], as [10, d] gives them.
    let x3 = normal(&mut rng, &[2, 5, d as i32], Dtype::F16);
    let opts = Options::on(gpu.clone(), Policy::Require);
    let (c3, n3) = tq_encode(&x3, Some(&rot), &Array::from_slice(&cent, &[16]).unwrap(), bits, &opts).unwrap();
    assert_eq!((c3.shape(), n3.shape()), (vec![2, 5, 64], vec![2, 5]));
    let flat = ops::reshape(&x3, &[10, d as i32], &gpu).unwrap();
    let (c2, n2) = tq_encode(&flat, Some(&rot), &Array::from_slice(&cent, &[16]).unwrap(), bits, &opts).unwrap();
    assert_eq!(c3.to_vec::<u8>().unwrap(), c2.to_vec::<u8>().unwrap(), "codes of [2, 5, d] against [10, d]");
    assert_eq!(n3.to_bytes().unwrap(), n2.to_bytes().unwrap(), "norms of [2, 5, d] against [10, d]");
}

/// CUDA's tensor-core encoders code large inputs by a table of every
/// float16 value's code (`encode_code_table`), built from the paired search
/// that codes smaller ones: the same rows give the same codes and norms both
/// ways, bit for bit. 70,001 rows (rows 0-2 a zero, a NaN and an infinity)
/// are encoded whole (the table) and in two halves (the search), for
/// `tq_encode` at 3 and 4 bits and `tq_rvq_encode` at 4 + 2 and 3 + 1,
/// float16 and bfloat16, a dense Π and Hadamard signs, d = 64 and 128; a
/// codebook shifted off symmetry as well as the sphere's.
#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_tensor_core_code_table_matches_search() {
    use veloxquant::kernels::{encode_code_table, encode_tensor_core_parts, tq_rvq_encode};
    use veloxquant::quant::Rotation;
    let gpu = Stream::gpu().expect("a GPU back-end");
    let cuda = gpu.backend().unwrap() == Backend::Cuda;
    let opts = Options::on(gpu.clone(), Policy::Require);
    let n = 70_001usize;
    let half = n / 2;
    let bytes = |a: &Array| a.to_bytes().unwrap();
    for d in [128usize, 64] {
        for dtype in [Dtype::F16, Dtype::BF16] {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + 3);
            let mut xv = f32s(&normal(&mut rng, &[n as i32, d as i32], Dtype::F32));
            xv[..d].fill(0.0);
            xv[d + 3] = f32::NAN;
            xv[2 * d + 5] = f32::INFINITY;
            let x = ops::astype(&Array::from_slice(&xv, &[n as i32, d as i32]).unwrap(), dtype, &Stream::cpu()).unwrap();
            let rows = |a: usize, b: usize| ops::slice(&x, &[a as i32, 0], &[b as i32, d as i32], &Stream::cpu()).unwrap();
            let (first, second) = (rows(0, half), rows(half, n));
            for hadamard in [false, true] {
                let rotation = if hadamard { Rotation::hadamard(d, 8).unwrap() } else { Rotation::dense(d, 8).unwrap() };
                let rot = if hadamard {
                    Array::from_slice(rotation.signs(), &[d as i32]).unwrap()
                } else {
                    Array::from_slice(rotation.matrix(), &[d as i32, d as i32]).unwrap()
                };
                for bits in [4u32, 3] {
                    for shift in [0.0f32, 0.013] {
                        let tag = format!("tq_encode d={d} {dtype} hadamard={hadamard} bits={bits} shift={shift}");
                        let parts = encode_tensor_core_parts(dtype, d, true, bits);
                        if cuda {
                            assert!(encode_code_table(parts, (bits, 0), n) && !encode_code_table(parts, (bits, 0), n - half), "{tag}: the paths");
                        }
                        let cent: Vec<f32> = ScalarCodebook::sphere(d, bits).unwrap().centroids().iter().map(|c| c + shift).collect();
                        let cent = Array::from_slice(&cent, &[cent.len() as i32]).unwrap();
                        let (whole_c, whole_n) = tq_encode(&x, Some(&rot), &cent, bits, &opts).unwrap();
                        let (a_c, a_n) = tq_encode(&first, Some(&rot), &cent, bits, &opts).unwrap();
                        let (b_c, b_n) = tq_encode(&second, Some(&rot), &cent, bits, &opts).unwrap();
                        assert!(bytes(&whole_c) == [bytes(&a_c), bytes(&b_c)].concat(), "{tag}: codes");
                        assert!(bytes(&whole_n) == [bytes(&a_n), bytes(&b_n)].concat(), "{tag}: norms");
                    }
                }
                for bits in [(4u32, 2u32), (3, 1)] {
                    let tag = format!("tq_rvq_encode d={d} {dtype} hadamard={hadamard} bits={bits:?}");
                    if cuda {
                        let parts = encode_tensor_core_parts(dtype, d, true, bits.0 + bits.1);
                        assert!(encode_code_table(parts, bits, n) && !encode_code_table(parts, bits, n - half), "{tag}: the paths");
                    }
                    let c1 = ScalarCodebook::sphere(d, bits.0).unwrap().centroids().to_vec();
                    let c2 = ScalarCodebook::sphere_residual(d, bits.0, bits.1).unwrap().centroids().to_vec();
                    let (c1, c2) = (Array::from_slice(&c1, &[c1.len() as i32]).unwrap(), Array::from_slice(&c2, &[c2.len() as i32]).unwrap());
                    let whole = tq_rvq_encode(&x, Some(&rot), &c1, &c2, bits, &opts).unwrap();
                    let a = tq_rvq_encode(&first, Some(&rot), &c1, &c2, bits, &opts).unwrap();
                    let b = tq_rvq_encode(&second, Some(&rot), &c1, &c2, bits, &opts).unwrap();
                    assert!(bytes(&whole.codes1) == [bytes(&a.codes1), bytes(&b.codes1)].concat(), "{tag}: first codes");
                    assert!(bytes(&whole.codes2) == [bytes(&a.codes2), bytes(&b.codes2)].concat(), "{tag}: second codes");
                    assert!(bytes(&whole.norms) == [bytes(&a.norms), bytes(&b.norms)].concat(), "{tag}: norms");
                }
            }
        }
    }
}
