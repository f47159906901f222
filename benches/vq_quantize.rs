//! vq_quantize: the fused kernel against the chunked reference graph, side by
//! side in one run: time per call and MLX peak memory above the inputs.
//!
//!   cargo bench --bench vq_quantize -- [--device cpu|gpu] [--dtype f32|f16|bf16] [N:K:d ...]
//!
//! Defaults: the CPU stream, f32, 262144:256:4 (the CPU target); on the GPU
//! machine: `--device gpu --dtype f16 1048576:256:4 262144:256:8`.

use std::time::Instant;

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::array::{active_memory, clear_cache, peak_memory, reset_peak_memory};
use veloxquant::kernels::vq_quantize;
use veloxquant::{Array, Dtype, Options, Policy, Stream};

fn random(dtype: Dtype, len: usize, shape: &[i32], rng: &mut ChaCha8Rng) -> Array {
    let v: Vec<f32> = (0..len).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    match dtype {
        Dtype::F16 => Array::from_slice(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape),
        Dtype::BF16 => Array::from_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape),
        _ => Array::from_slice(&v, shape),
    }
    .expect("input array")
}

struct Measure {
    seconds: f64,
    peak_above_inputs: usize,
}

fn measure(x: &Array, cb: &Array, opts: &Options, stream: &Stream) -> Measure {
    // Warm up (GPU kernels compile on first evaluation).
    vq_quantize(x, cb, opts).unwrap().eval().unwrap();
    stream.synchronize().unwrap();
    clear_cache().unwrap();
    let base = active_memory().unwrap();
    reset_peak_memory().unwrap();
    let reps = 5;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let y = vq_quantize(x, cb, opts).unwrap();
        y.eval().unwrap();
        stream.synchronize().unwrap();
        times.push(t.elapsed().as_secs_f64());
        drop(y);
    }
    let peak = peak_memory().unwrap();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Measure { seconds: times[reps / 2], peak_above_inputs: peak.saturating_sub(base) }
}

fn main() {
    let mut device = "cpu".to_string();
    let mut dtype = Dtype::F32;
    let mut shapes = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => device = args.next().expect("--device cpu|gpu"),
            "--dtype" => {
                dtype = match args.next().as_deref() {
                    Some("f16") => Dtype::F16,
                    Some("bf16") => Dtype::BF16,
                    _ => Dtype::F32,
                }
            }
            "--bench" => {}
            s if s.contains(':') => {
                let v: Vec<usize> = s.split(':').map(|p| p.parse().expect("N:K:d")).collect();
                shapes.push((v[0], v[1], v[2]));
            }
            _ => {}
        }
    }
    if shapes.is_empty() {
        shapes.push((262_144, 256, 4));
    }
    let stream = if device == "gpu" { Stream::gpu().expect("GPU stream") } else { Stream::cpu() };
    let backend = stream.backend().unwrap();
    println!("vq_quantize on {} ({}), dtype {dtype}, median of 5 calls", device, backend.name());
    println!(
        "| N | K | d | fused ms | reference ms | speed-up | fused peak MiB | reference peak MiB | output MiB | fused peak / output |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (n, k, d) in shapes {
        let x = random(dtype, n * d, &[n as i32, d as i32], &mut rng);
        let cb = random(dtype, k * d, &[k as i32, d as i32], &mut rng);
        veloxquant::eval(&[&x, &cb]).unwrap();
        let fused_opts = Options::on(stream.clone(), Policy::Require);
        // `require` guarantees the fused kernel (or fails here).
        let fused = measure(&x, &cb, &fused_opts, &stream);
        let reference = measure(&x, &cb, &Options::on(stream.clone(), Policy::Off), &stream);
        let out_bytes = n * 4;
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        println!(
            "| {n} | {k} | {d} | {:.3} | {:.3} | {:.1}x | {:.2} | {:.2} | {:.2} | {:.2} |",
            fused.seconds * 1e3,
            reference.seconds * 1e3,
            reference.seconds / fused.seconds,
            mib(fused.peak_above_inputs),
            mib(reference.peak_above_inputs),
            mib(out_bytes),
            fused.peak_above_inputs as f64 / out_bytes as f64,
        );
    }
}
