//! The TurboQuant cache kernels on the GPU against the CPU kernels: the
//! encoder gives bit-identical codes and norms for the same input (same
//! arithmetic), caches filled on both agree (their windows are rotated by each
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
use veloxquant::{ops, Array, Dtype, Options, Policy, Stream};

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
        for t in chunks {
            let k = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            let v = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            on_gpu.append(&k, &v).unwrap();
            on_cpu.append(&k, &v).unwrap();
        }
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
