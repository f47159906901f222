//! The layer cache across threads: made on one, filled and attended on
//! another, dropped on a third, it computes what it computes on one thread;
//! layers of different threads share one set of rotation and codebooks.

mod common;

use std::thread;

use common::{f32s, normal};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::cache::{CacheConfig, LayerCache, Method};
use veloxquant::{Dtype, Stream};

fn config(key: Method, value: Method) -> CacheConfig {
    let mut c = CacheConfig::new(64, 2);
    c.key_method = key;
    c.value_method = value;
    c.window = 8;
    c.sinks = 2;
    c
}

fn new_cache(cfg: &CacheConfig) -> LayerCache {
    LayerCache::new(cfg.clone(), Some(Stream::cpu())).unwrap()
}

/// A prefill chunk, then single tokens each followed by a decode query: the
/// attention outputs, evaluated on the calling thread. Inputs are made here
/// too (a lazy array can be evaluated only on the thread that built it).
fn fill_and_attend(cache: &mut LayerCache, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let k = normal(&mut rng, &[1, 2, 40, 64], Dtype::F16);
    let v = normal(&mut rng, &[1, 2, 40, 64], Dtype::F16);
    cache.append(&k, &v).unwrap();
    let mut outs = Vec::new();
    for _ in 0..12 {
        let k = normal(&mut rng, &[1, 2, 1, 64], Dtype::F16);
        let v = normal(&mut rng, &[1, 2, 1, 64], Dtype::F16);
        cache.append(&k, &v).unwrap();
        let q = normal(&mut rng, &[1, 4, 1, 64], Dtype::F16);
        outs.push(f32s(&cache.attention(&q, 0.125, false).unwrap()));
    }
    outs
}

const METHODS: [(Method, Method); 4] = [
    (Method::TurboQuantMse, Method::TurboQuantMse),
    (Method::Kivi, Method::TurboQuantMse),
    (Method::TurboQuantProd, Method::Kivi),
    (Method::Fp16, Method::Fp16),
];

#[test]
fn layer_cache_is_send() {
    fn send<T: Send>() {}
    send::<LayerCache>();
}

#[test]
fn made_used_and_dropped_on_three_threads_as_on_one() {
    for (key, value) in METHODS {
        let cfg = config(key, value);
        let want = fill_and_attend(&mut new_cache(&cfg), 3);
        let made = {
            let cfg = cfg.clone();
            thread::spawn(move || new_cache(&cfg)).join().unwrap()
        };
        let (cache, got) = thread::spawn(move || {
            let mut cache = made;
            let got = fill_and_attend(&mut cache, 3);
            (cache, got)
        })
        .join()
        .unwrap();
        thread::spawn(move || drop(cache)).join().unwrap();
        assert_eq!(got, want, "{key}/{value}");
    }
}

#[test]
fn layers_of_different_threads_share_their_rotation_and_codebooks() {
    let cfg = config(Method::TurboQuantMse, Method::Kivi);
    // The first layer makes the shared arrays and evaluates nothing.
    let first = {
        let cfg = cfg.clone();
        thread::spawn(move || {
            let mut cache = new_cache(&cfg);
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            let k = normal(&mut rng, &[1, 2, 40, 64], Dtype::F16);
            cache.append(&k, &k).unwrap();
            cache
        })
        .join()
        .unwrap()
    };
    // The second evaluates its attention, which reads them, on its own thread.
    let (second, outs) = thread::spawn(move || {
        let mut cache = new_cache(&cfg);
        let outs = fill_and_attend(&mut cache, 2);
        (cache, outs)
    })
    .join()
    .unwrap();
    assert!(outs.iter().flatten().all(|x| x.is_finite()));
    assert!(first.shared_id().is_some());
    assert_eq!(first.shared_id(), second.shared_id());
}

#[test]
fn caches_used_at_once_from_several_threads() {
    let want: Vec<_> = (0..8u64).map(|i| fill_and_attend(&mut new_cache(&config(METHODS[i as usize % 4].0, METHODS[i as usize % 4].1)), i)).collect();
    let workers: Vec<_> = (0..8u64)
        .map(|i| {
            thread::spawn(move || {
                let (key, value) = METHODS[i as usize % 4];
                fill_and_attend(&mut new_cache(&config(key, value)), i)
            })
        })
        .collect();
    for (i, w) in workers.into_iter().enumerate() {
        assert_eq!(w.join().unwrap(), want[i], "cache {i}");
    }
}
