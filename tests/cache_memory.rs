//! Resident memory of the compressed cache against MLX's own accounting, in a
//! process of its own: MLX's active-memory counter is global, so no other test
//! may allocate meanwhile.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use veloxquant::array::active_memory;
use veloxquant::cache::{CacheConfig, LayerCache, Method};
use veloxquant::{ops, Array, Dtype, Policy, Stream};

fn normal(rng: &mut ChaCha8Rng, shape: &[i32], dtype: Dtype) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| StandardNormal.sample(rng)).collect();
    ops::astype(&Array::from_slice(&v, shape).unwrap(), dtype, &Stream::cpu()).unwrap()
}

fn config(d: usize, hkv: usize, method: Method, policy: Policy) -> CacheConfig {
    let mut c = CacheConfig::new(d, hkv);
    c.key_method = method;
    c.value_method = method;
    c.window = 16;
    c.policy = policy;
    c
}

/// MLX's active memory grows by the cache's `nbytes + shared_nbytes` when it
/// fills (within 5%).
fn check_resident(cfg: CacheConfig, tokens: i32) -> LayerCache {
    let s = Stream::cpu();
    let (h, d) = (cfg.kv_heads as i32, cfg.head_dim as i32);
    let tag = format!("{}/{} {}/{}", cfg.key_method, cfg.key_bits, cfg.value_method, cfg.value_bits);
    let mut cache = LayerCache::new(cfg, Some(s.clone())).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let k = normal(&mut rng, &[1, h, tokens, d], Dtype::F16);
    let v = normal(&mut rng, &[1, h, tokens, d], Dtype::F16);
    let q = normal(&mut rng, &[1, h, 1, d], Dtype::F16);
    veloxquant::eval(&[&k, &v, &q]).unwrap();
    veloxquant::array::clear_cache().unwrap();
    let before = active_memory().unwrap();
    cache.append(&k, &v).unwrap();
    // Evaluate what the cache holds (attention reads all of it), then compare
    // MLX's active memory.
    let out = cache.attention(&q, 0.1, false).unwrap();
    out.eval().unwrap();
    drop(out);
    veloxquant::array::clear_cache().unwrap();
    let grown = active_memory().unwrap() - before;
    let reported = cache.nbytes() + cache.shared_nbytes();
    let ratio = grown as f64 / reported as f64;
    assert!((0.95..=1.05).contains(&ratio), "{tag}: MLX grew {grown} bytes, cache reports {reported}");
    cache
}

// One test: MLX's active-memory counter is global, so the cases run one
// after the other.
#[test]
fn resident_memory_is_the_reported_nbytes() {
    let cache = check_resident(config(128, 8, Method::TurboQuantMse, Policy::Auto), 4000);
    // A second layer of the same configuration holds the same rotation and
    // codebooks: MLX grows by its own nbytes only.
    {
        let s = Stream::cpu();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let k = normal(&mut rng, &[1, 8, 4000, 128], Dtype::F16);
        let q = normal(&mut rng, &[1, 8, 1, 128], Dtype::F16);
        veloxquant::eval(&[&k, &q]).unwrap();
        veloxquant::array::clear_cache().unwrap();
        let before = active_memory().unwrap();
        let mut second = LayerCache::new(config(128, 8, Method::TurboQuantMse, Policy::Auto), Some(s)).unwrap();
        second.append(&k, &k).unwrap();
        let out = second.attention(&q, 0.1, false).unwrap();
        out.eval().unwrap();
        drop(out);
        veloxquant::array::clear_cache().unwrap();
        let grown = active_memory().unwrap() - before;
        let (own, shared) = (second.nbytes(), second.shared_nbytes());
        assert!(
            grown.abs_diff(own) < shared / 2,
            "second layer: MLX grew {grown} bytes, its nbytes is {own} (shared arrays: {shared} bytes)"
        );
        assert_eq!(second.shared_id(), cache.shared_id());
    }
    // 4 bits + norms for 4000 tokens: about 3.6x smaller than float16 keys and values.
    let fp16 = 2 * 8 * 4000 * 128 * 2;
    assert!((fp16 as f64 / cache.nbytes() as f64) > 3.0, "nbytes {}", cache.nbytes());
    for (km, kb, vm, vb, smaller) in [
        (Method::Kivi, 4, Method::Kivi, 2, 2.2),
        (Method::Kivi, 2, Method::TurboQuantMse, 4, 2.2),
        (Method::TurboQuantMse, 4, Method::Fp16, 16, 1.1),
        (Method::Pq, 2, Method::Pq, 1, 4.0),
        (Method::Qjl, 1, Method::Kivi, 4, 2.5),
        (Method::TurboQuantProd, 4, Method::TurboQuantRvq, 3, 3.0),
    ] {
        let mut cfg = config(128, 8, km, Policy::Auto);
        cfg.key_bits = kb;
        cfg.value_method = vm;
        cfg.value_bits = vb;
        let cache = check_resident(cfg, 3000);
        let fp16 = 2 * 8 * 3000 * 128 * 2;
        assert!(fp16 as f64 / cache.nbytes() as f64 > smaller, "{km}/{vm}: nbytes {}", cache.nbytes());
    }
}
