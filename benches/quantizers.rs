//! Encode/decode throughput of every quantizer (plain `main`, std::time).
//!
//!     cargo bench --bench quantizers
//!
//! Prints, per method and bit width, million vectors (and elements) per
//! second for encoding and decoding 65,536 random vectors of d = 128, best
//! of 3 runs, and the time to train a 256-entry k-means codebook on 1M
//! sub-vectors.

use rand::{RngExt, SeedableRng};
use rand_distr::StandardNormal;
use std::time::Instant;
use veloxquant::quant::*;

const D: usize = 128;
const N: usize = 65_536;

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(v);
    }
    (best, out.unwrap())
}

fn bench(name: &str, q: &dyn Quantizer, x: &[f32]) {
    let (te, e) = best_of(3, || q.encode(x).unwrap());
    let (td, _) = best_of(3, || q.decode(&e).unwrap());
    println!(
        "{name:<32} {:>6.3} bits/elem  encode {:>7.3} Mvec/s ({:>6.1} Melem/s)  decode {:>7.3} Mvec/s ({:>6.1} Melem/s)",
        q.bits_per_element(&e, 4096),
        N as f64 / te / 1e6,
        (N * D) as f64 / te / 1e6,
        N as f64 / td / 1e6,
        (N * D) as f64 / td / 1e6
    );
}

fn main() {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let x: Vec<f32> = (0..N * D).map(|_| r.sample::<f32, _>(StandardNormal)).collect();
    let h = RotationKind::Hadamard;
    for b in [1, 2, 3, 4, 8] {
        bench(&format!("turboquant-mse b={b}"), &TurboQuantMse::new(D, b, h, 1).unwrap(), &x);
    }
    bench("turboquant-mse b=4 dense", &TurboQuantMse::new(D, 4, RotationKind::Dense, 1).unwrap(), &x);
    for b in [1, 2, 3, 4] {
        bench(&format!("turboquant-prod b={b}"), &TurboQuantProd::new(D, b, h, 1).unwrap(), &x);
    }
    for (b1, b2) in [(2, 2), (4, 4)] {
        bench(&format!("turboquant-rvq {b1}+{b2}"), &TurboQuantRvq::new(D, b1, b2, h, 1).unwrap(), &x);
    }
    let calib = &x[..4096 * D];
    bench("outlier 32@3+96@2", &OutlierSplit::calibrate(calib, D, 32, 3, 2, h, 1).unwrap(), &x);
    for m in [128, 256] {
        bench(&format!("qjl m={m}"), &Qjl::new(D, m, false, 1).unwrap(), &x);
    }
    for (s, c) in [(2, 4), (4, 8), (8, 12)] {
        let (q, _) = ProductQuantizer::train(calib, D, PqConfig { max_iters: 10, ..PqConfig::keys(s, c) }).unwrap();
        bench(&format!("pq s={s} K=2^{c}"), &q, &x);
    }
    for b in [2, 4] {
        bench(&format!("kivi-keys b={b} G=32"), &KiviKeys::new(D, b, 32).unwrap(), &x);
        bench(&format!("kivi-values b={b} G=32"), &KiviValues::new(D, b, 32).unwrap(), &x);
    }
    let data: Vec<f32> = (0..4_000_000).map(|_| r.sample::<f32, _>(StandardNormal)).collect();
    let (t, (_, rep)) = best_of(1, || pq::kmeans(&data, 4, 256, 1, 25, 1e-4).unwrap());
    println!("k-means K=256 on 1M sub-vectors of 4: {t:.2} s, {} iterations", rep.distortion.len());
}
