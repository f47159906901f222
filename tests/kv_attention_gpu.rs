//! Mixed-method caches (`kv_attention`) on the GPU against the CPU kernel:
//! the fused GPU kernel over a state agrees to rounding with the CPU kernel
//! over the same state (moved through the bytes) and with decode-then-SDPA
//! on the GPU. Ignored where MLX has no GPU back-end; run on the GPU machine
//! with `--ignored`.

mod common;

use common::{attention_masks, f32s, normal, rel_err};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cache::{AttentionMask, CacheConfig, LayerCache, Method};
use veloxquant::{ops, Dtype, Policy, Stream};

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_mixed_methods_match_cpu_kernel() {
    let gpu = Stream::gpu().expect("a GPU back-end");
    for &(km, kb, vm, vb, d, hkv, hq, dtype, tol) in &[
        (Method::Kivi, 4u32, Method::Kivi, 2u32, 128usize, 8usize, 32usize, Dtype::F32, 1e-5),
        (Method::Kivi, 2, Method::TurboQuantMse, 4, 128, 8, 32, Dtype::F16, 1e-2),
        (Method::TurboQuantMse, 4, Method::Kivi, 3, 64, 3, 9, Dtype::BF16, 2e-2),
        (Method::Kivi, 8, Method::Fp16, 16, 96, 2, 8, Dtype::F16, 1e-2),
        (Method::Fp16, 16, Method::Kivi, 4, 80, 2, 4, Dtype::F32, 1e-5),
        (Method::Kivi, 4, Method::Kivi, 4, 256, 1, 4, Dtype::F16, 1e-2),
        (Method::Pq, 2, Method::Pq, 4, 128, 8, 32, Dtype::F32, 1e-5),
        (Method::Pq, 1, Method::Kivi, 2, 64, 2, 8, Dtype::F16, 1e-2),
        (Method::Qjl, 1, Method::TurboQuantMse, 4, 128, 8, 32, Dtype::F32, 1e-5),
        (Method::Qjl, 2, Method::Kivi, 4, 64, 2, 8, Dtype::F16, 1e-2),
        (Method::TurboQuantProd, 4, Method::TurboQuantRvq, 3, 128, 8, 32, Dtype::F32, 1e-5),
        (Method::TurboQuantProd, 2, Method::Fp16, 16, 96, 2, 4, Dtype::BF16, 2e-2),
        (Method::TurboQuantRvq, 5, Method::TurboQuantRvq, 2, 64, 3, 9, Dtype::F16, 1e-2),
        // Per-token groups on the key side too (64 channels; 32 for d = 96).
        (Method::Affine, 4, Method::Affine, 4, 128, 8, 32, Dtype::F16, 1e-2),
        (Method::Affine, 8, Method::TurboQuantMse, 3, 96, 2, 8, Dtype::F32, 1e-5),
        // FP8 on both sides, and beside TurboQuant values.
        (Method::Fp8, 8, Method::Fp8, 8, 128, 8, 32, Dtype::F16, 1e-2),
        (Method::Fp8, 8, Method::TurboQuantMse, 3, 64, 2, 8, Dtype::BF16, 2e-2),
        // TurboQuant on both sides: its own kernels, and the generic one under a mask.
        (Method::TurboQuantMse, 4, Method::TurboQuantMse, 3, 128, 8, 32, Dtype::F16, 1e-2),
    ] {
        // Shown when a case fails: which case, and how far it got.
        println!("case {km}/{kb} {vm}/{vb} d={d} {dtype}: append");
        let mut cfg = CacheConfig::new(d, hkv);
        (cfg.key_method, cfg.key_bits, cfg.value_method, cfg.value_bits) = (km, kb, vm, vb);
        cfg.policy = Policy::Require;
        let mut on_gpu = LayerCache::new(cfg, Some(gpu.clone())).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(d as u64 + kb as u64);
        for t in [1000, 1, 1, 300, 1] {
            let k = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            let v = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            on_gpu.append(&k, &v).unwrap();
        }
        let same_on_cpu = LayerCache::from_bytes(&on_gpu.to_bytes().unwrap(), Some(Stream::cpu())).unwrap();
        let (kd, vd) = on_gpu.dequantize().unwrap();
        println!("  appended and decoded");
        f32s(&kd);
        let tag = format!("{km}/{kb} {vm}/{vb} d={d} {dtype}");
        for (l, causal) in [(1, false), (7, true)] {
            let q = normal(&mut rng, &[2, hq as i32, l, d as i32], dtype);
            let scale = 1.0 / (d as f32).sqrt();
            println!("  L={l}: GPU kernel");
            let g = f32s(&on_gpu.attention(&q, scale, causal).unwrap());
            println!("  L={l}: CPU kernel");
            let c = f32s(&same_on_cpu.attention(&q, scale, causal).unwrap());
            let e = rel_err(&g, &c);
            assert!(e <= tol, "{tag} L={l}: relative error {e} against the CPU kernel on the same state");
            println!("  L={l}: decode + SDPA");
            let r = f32s(&ops::scaled_dot_product_attention(&q, &kd, &vd, scale, causal && l > 1, &gpu).unwrap());
            let e = rel_err(&g, &r);
            assert!(e <= tol.max(2e-3), "{tag} L={l}: relative error {e} against decode + SDPA");
            // Array masks (boolean shared by the heads, additive per head).
            println!("  L={l}: masks");
            let (boolean, additive) = attention_masks(&mut rng, 2, hq as i32, l, on_gpu.offset() as i32);
            for mask in [&boolean, &additive] {
                let g = f32s(&on_gpu.attention_with_mask(&q, scale, AttentionMask::Array(mask)).unwrap());
                let c = f32s(&same_on_cpu.attention_with_mask(&q, scale, AttentionMask::Array(mask)).unwrap());
                let e = rel_err(&g, &c);
                assert!(e <= tol, "{tag} L={l} mask {}: relative error {e} against the CPU kernel", mask.dtype());
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kivi_keys_with_bits_per_channel_match_cpu_kernel() {
    // KIVI keys of 3 bits on average over channels of 1 to 8 bits, each KV
    // head its own widths: the GPU kernel reads them at the same offsets as
    // the CPU kernel and the decode.
    let gpu = Stream::gpu().expect("a GPU back-end");
    let (d, hkv, hq) = (128usize, 8usize, 32usize);
    let mut rng = ChaCha8Rng::seed_from_u64(81);
    let weights = f32s(&normal(&mut rng, &[(hkv * d) as i32], Dtype::F32)).iter().map(|w| w.abs().powi(4)).collect::<Vec<_>>();
    let mut cfg = CacheConfig::new(d, hkv);
    (cfg.key_method, cfg.key_bits, cfg.value_method, cfg.value_bits) = (Method::Kivi, 3, Method::TurboQuantMse, 3);
    cfg.key_group = 128;
    cfg.key_widths = Some(veloxquant::cache::channel_widths(&weights, d, 3).unwrap());
    cfg.policy = Policy::Require;
    for dtype in [Dtype::F32, Dtype::F16] {
        let mut on_gpu = LayerCache::new(cfg.clone(), Some(gpu.clone())).unwrap();
        for t in [1000, 1, 300, 1] {
            let k = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            let v = normal(&mut rng, &[2, hkv as i32, t, d as i32], dtype);
            on_gpu.append(&k, &v).unwrap();
        }
        let same_on_cpu = LayerCache::from_bytes(&on_gpu.to_bytes().unwrap(), Some(Stream::cpu())).unwrap();
        let (kd, vd) = on_gpu.dequantize().unwrap();
        let tol = if dtype == Dtype::F32 { 1e-5 } else { 1e-2 };
        for (l, causal) in [(1, false), (7, true)] {
            let q = normal(&mut rng, &[2, hq as i32, l, d as i32], dtype);
            let scale = 1.0 / (d as f32).sqrt();
            let g = f32s(&on_gpu.attention(&q, scale, causal).unwrap());
            let c = f32s(&same_on_cpu.attention(&q, scale, causal).unwrap());
            let e = rel_err(&g, &c);
            assert!(e <= tol, "{dtype} L={l}: relative error {e} against the CPU kernel on the same state");
            let r = f32s(&ops::scaled_dot_product_attention(&q, &kd, &vd, scale, causal && l > 1, &gpu).unwrap());
            let e = rel_err(&g, &r);
            assert!(e <= tol.max(2e-3), "{dtype} L={l}: relative error {e} against decode + SDPA");
        }
    }
}
