//! A compressed KV cache from Rust: build one layer's cache, append a prefill
//! chunk and decode tokens, attend, and print memory and timings beside the
//! float16 control.
//!
//!   cargo run --release --example cache_demo -- [--tokens 4096] [--device cpu|gpu]

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::array::{active_memory, clear_cache};
use veloxquant::cache::{CacheConfig, LayerCache, Method};
use veloxquant::{ops, Array, Dtype, Stream};

fn normal(rng: &mut ChaCha8Rng, shape: &[i32], s: &Stream) -> veloxquant::Result<Array> {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
    ops::astype(&Array::from_slice(&v, shape)?, Dtype::F16, s)
}

fn main() -> veloxquant::Result<()> {
    let mut tokens = 4096i32;
    let mut device = "cpu".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => tokens = args.next().and_then(|v| v.parse().ok()).expect("--tokens N"),
            "--device" => device = args.next().expect("--device cpu|gpu"),
            other => panic!("unknown argument {other}"),
        }
    }
    let stream = if device == "gpu" { Stream::gpu()? } else { Stream::cpu() };
    let (hq, hkv, d) = (32, 8, 128);
    let scale = 1.0 / (d as f32).sqrt();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let keys = normal(&mut rng, &[1, hkv, tokens, d], &stream)?;
    let values = normal(&mut rng, &[1, hkv, tokens, d], &stream)?;
    let q = normal(&mut rng, &[1, hq, 1, d], &stream)?;
    veloxquant::eval(&[&keys, &values, &q])?;
    println!("one layer: {tokens} tokens, {hq} query heads, {hkv} KV heads, head_dim {d}, float16, on {device}");
    println!("| method | append ms | 32 decode steps ms | attention µs | nbytes | MLX grew by | float16 bytes of the tokens / nbytes |");
    println!("|---|---|---|---|---|---|---|");
    for (method, kb, vb) in [(Method::Fp16, 16, 16), (Method::TurboQuantMse, 4, 4), (Method::TurboQuantMse, 4, 3), (Method::TurboQuantMse, 3, 2)] {
        let mut cfg = CacheConfig::new(d as usize, hkv as usize);
        cfg.key_method = method;
        cfg.value_method = method;
        cfg.key_bits = kb;
        cfg.value_bits = vb;
        clear_cache()?;
        let before = active_memory()?;
        let mut cache = LayerCache::new(cfg, Some(stream.clone()))?;
        let t = Instant::now();
        cache.append(&keys, &values)?;
        cache.attention(&q, scale, false)?.eval()?;
        let append_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        for _ in 0..32 {
            let k = normal(&mut rng, &[1, hkv, 1, d], &stream)?;
            cache.append(&k, &k)?;
            cache.attention(&q, scale, false)?.eval()?;
        }
        let decode_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let reps = 20;
        for _ in 0..reps {
            cache.attention(&q, scale, false)?.eval()?;
        }
        let attn_us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        clear_cache()?;
        let grew = active_memory()?.saturating_sub(before);
        // Float16 keys and values of the tokens held, without any slack.
        let fp16_bytes = 2 * cache.offset() * (hkv * d) as usize * 2;
        let label = if method == Method::Fp16 { "fp16".to_string() } else { format!("turboquant-mse K{kb}/V{vb}") };
        println!(
            "| {label} | {append_ms:.1} | {decode_ms:.1} | {attn_us:.0} | {} | {grew} | {:.2} |",
            cache.nbytes() + cache.shared_nbytes(),
            fp16_bytes as f64 / (cache.nbytes() + cache.shared_nbytes()) as f64
        );
    }
    Ok(())
}
