//! The quantizer kernels, fused against the reference graph, side by side in
//! one run: median time per call, speed-up, achieved bandwidth of the fused
//! kernel (bytes read + written / time), MLX peak memory above the inputs
//! against the outputs' size, and the kernels one call (one append of N
//! vectors to a cache) launches on the fused path, counted in MLX's graph.
//!
//!   cargo bench --bench quant_kernels -- [--device cpu|gpu] [--dtype f32|f16|bf16] [--n N] [--only TEXT] [--fused-only]
//!
//! `--only` keeps the rows whose name contains TEXT (repeatable);
//! `--fused-only` leaves the reference graph out (its columns "-").
//!
//! Defaults: d = 128; N = 65,536 on the CPU, 1,048,576 on the GPU.
//!
//! On the GPU two more columns place each kernel against the H200's limits:
//! its bandwidth as a share of HBM's 4.8 TB/s, and the floor its float32
//! arithmetic sets. The kernels sum in crate::cpu's order without fma (for
//! bit-exact parity), so a multiply-add costs two of the 33.5 T instructions
//! per second the H200's FP32 units issue; kernels whose floor exceeds their
//! memory time are compute-bound, and HBM's share cannot reach 50% for them.

use std::time::Instant;

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use veloxquant::array::{active_memory, clear_cache, peak_memory, reset_peak_memory};
use veloxquant::kernels::{
    kivi_dequantize, kivi_quantize, pq_decode, pq_encode, qjl_encode, qjl_score, scalar_dequantize, scalar_quantize,
    tq_encode, tq_prod_decode, tq_prod_encode, tq_rvq_decode, tq_rvq_encode, KiviMode,
};
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::ScalarCodebook;
use veloxquant::{Array, Dtype, Options, Policy, Stream};

const D: usize = 128;
/// H200 HBM3e bandwidth, bytes per second.
const HBM_BYTES_PER_S: f64 = 4.8e12;
/// H200 FP32 instructions per second (67 TFLOPS counts an fma as two).
const FP32_OPS_PER_S: f64 = 33.5e12;

fn random(dtype: Dtype, shape: &[usize], scale: f32, rng: &mut ChaCha8Rng) -> Array {
    let len: usize = shape.iter().product();
    let s: Vec<i32> = shape.iter().map(|&v| v as i32).collect();
    let v: Vec<f32> = (0..len).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect();
    match dtype {
        Dtype::F16 => Array::from_slice(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), &s),
        Dtype::BF16 => Array::from_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), &s),
        _ => Array::from_slice(&v, &s),
    }
    .expect("input array")
}

struct Measure {
    seconds: f64,
    /// The same calls' graphs built first, then evaluated: the GPU's time
    /// (kernels and MLX's launches), without the host building the graphs.
    eval_seconds: f64,
    /// Building one call's graph on the host (argument checks, the kernel
    /// object's lookup, MLX's source assembly), which `seconds` includes.
    build_seconds: f64,
    peak_above_inputs: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds per call over 5 samples, each building `repeat` calls'
/// graphs and evaluating them together (on the GPU, back-to-back launches:
/// one synchronisation no longer hides a sub-millisecond kernel): the whole,
/// the evaluation alone and the building alone; and the MLX peak of one call.
fn measure(f: &dyn Fn(&Options) -> Vec<Array>, opts: &Options, stream: &Stream, repeat: usize) -> Measure {
    let build = |calls: usize| -> Vec<Array> { (0..calls).flat_map(|_| f(opts)).collect() };
    let eval = |outs: Vec<Array>| {
        veloxquant::eval(&outs.iter().collect::<Vec<_>>()).unwrap();
        stream.synchronize().unwrap();
    };
    eval(build(1)); // warm-up: GPU kernels compile on first evaluation
    clear_cache().unwrap();
    let base = active_memory().unwrap();
    reset_peak_memory().unwrap();
    eval(build(1));
    let peak = peak_memory().unwrap();
    let per_call = |t: Instant| t.elapsed().as_secs_f64() / repeat as f64;
    let (mut totals, mut evals, mut builds) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let outs = build(repeat);
        let built = per_call(t);
        let t = Instant::now();
        eval(outs);
        let evaluated = per_call(t);
        totals.push(built + evaluated);
        evals.push(evaluated);
        builds.push(built);
    }
    Measure {
        seconds: median(totals),
        eval_seconds: median(evals),
        build_seconds: median(builds),
        peak_above_inputs: peak.saturating_sub(base),
    }
}

fn main() {
    let mut device = "cpu".to_string();
    let mut dtype = Dtype::F32;
    let mut n = None;
    let mut only: Vec<String> = Vec::new();
    // Without the reference graph (its columns "-"): for comparing builds'
    // fused times, where pq_encode's reference alone takes a minute.
    let mut fused_only = false;
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
            "--n" => n = Some(args.next().expect("--n N").parse::<usize>().expect("N")),
            "--only" => only.push(args.next().expect("--only TEXT")),
            "--fused-only" => fused_only = true,
            _ => {}
        }
    }
    let stream = if device == "gpu" { Stream::gpu().expect("GPU stream") } else { Stream::cpu() };
    let n = n.unwrap_or(if device == "gpu" { 1 << 20 } else { 1 << 16 });
    let es = dtype.size();
    let gpu = device == "gpu";
    // Back-to-back fused calls per timing sample on the GPU.
    let repeat = if gpu { 20 } else { 1 };
    println!(
        "quantizer kernels on {device} ({}), dtype {dtype}, N = {n}, d = {D}, median of 5 samples of {repeat} fused call(s) / 1 reference call",
        stream.backend().unwrap().name()
    );
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let x = random(dtype, &[n, D], 1.0, &mut rng);
    // Shared inputs, built once by the fused kernels on `stream` (their parity
    // with the CPU kernels is the GPU tests' job).
    let setup = Options::on(stream.clone(), Policy::Auto);

    let mut cb4: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) / 8.0).collect();
    cb4.sort_by(f32::total_cmp);
    let cb4 = Array::from_slice(&cb4, &[16]).unwrap();
    let packed4 = scalar_quantize(&x, &cb4, 4, &setup).unwrap();
    let (kc, ks, kz) = kivi_quantize(&x, 2, 32, KiviMode::Keys, &setup).unwrap();
    let (vc, vs, vz) = kivi_quantize(&x, 2, 32, KiviMode::Values, &setup).unwrap();
    let m = 256;
    let sketch = random(Dtype::F32, &[m, D], 1.0, &mut rng);
    let (signs, norms) = qjl_encode(&x, &sketch, &setup).unwrap();
    let q = random(dtype, &[4, D], 1.0, &mut rng);
    let pq_cb = random(Dtype::F32, &[256, 4], 1.0, &mut rng);
    let pq_codes = pq_encode(&x, &pq_cb, 8, &setup).unwrap();
    let pq_cb10 = random(Dtype::F32, &[1024, 4], 1.0, &mut rng);
    let pq_codes10 = pq_encode(&x, &pq_cb10, 10, &setup).unwrap();
    let pq_hi10 = pq_codes10.codes_hi.as_ref().expect("10-bit codes have a high plane");
    // TurboQuant-Prod at 4 bits (3 MSE bits + QJL) and RVQ 2 + 2 bits.
    let f32_array = |v: &[f32], shape: &[i32]| Array::from_slice(v, shape).unwrap();
    let rot = f32_array(&veloxquant::cache::rotation_matrix(D, 3).unwrap(), &[D as i32, D as i32]);
    let hadamard_signs = f32_array(veloxquant::quant::Rotation::hadamard(D, 3).unwrap().signs(), &[D as i32]);
    let tq_sketch = f32_array(&Sketch::new(D, D, true, 4).s, &[D as i32, D as i32]);
    let cent3 = f32_array(ScalarCodebook::sphere(D, 3).unwrap().centroids(), &[8]);
    let cent4 = f32_array(ScalarCodebook::sphere(D, 4).unwrap().centroids(), &[16]);
    let cent_a = f32_array(ScalarCodebook::sphere(D, 2).unwrap().centroids(), &[4]);
    let cent_b = f32_array(ScalarCodebook::sphere_residual(D, 2, 2).unwrap().centroids(), &[4]);
    let prod = tq_prod_encode(&x, Some(&rot), Some(&cent3), &tq_sketch, 4, &setup).unwrap();
    let rvq = tq_rvq_encode(&x, Some(&rot), &cent_a, &cent_b, (2, 2), &setup).unwrap();
    let prod_codes = prod.codes.as_ref().expect("codes at 4 bits");
    let prod_rnorms = prod.residual_norms.as_ref().expect("residual norms at 4 bits");
    let all = [
        &x, &cb4, &packed4, &kc, &ks, &kz, &vc, &vs, &vz, &sketch, &signs, &norms, &q, &pq_cb, &pq_codes.codes,
        &pq_cb10, &pq_codes10.codes, pq_hi10, &rot, &tq_sketch, &cent3, &cent4, &cent_a, &cent_b, prod_codes, &prod.signs,
        &prod.norms, prod_rnorms, &rvq.codes1, &rvq.codes2, &rvq.norms,
    ];
    veloxquant::eval(&all).unwrap();

    // The ceiling MLX's own bandwidth-bound op reaches in this harness: x + x
    // reads x once per element (the second operand is the same address) and
    // writes as many bytes.
    let ceiling = || measure(&|_: &Options| vec![veloxquant::ops::add(&x, &x, &stream).unwrap()], &setup, &stream, repeat);
    let copy = ceiling();
    let x_bytes = (n * D * es) as f64;
    let rate = |what: &str, bytes: f64, m: &Measure| {
        let share = |seconds: f64| {
            if gpu { format!(", {:.1}% of HBM", 100.0 * bytes / seconds / HBM_BYTES_PER_S) } else { String::new() }
        };
        println!(
            "{what}: {:.3} ms, {:.1} GB/s{}; graphs built first: {:.3} ms{}",
            m.seconds * 1e3,
            bytes / m.seconds / 1e9,
            share(m.seconds),
            m.eval_seconds * 1e3,
            share(m.eval_seconds),
        )
    };
    let mib = x_bytes / (1 << 20) as f64;
    rate(&format!("MLX x + x (reads and writes {mib:.0} MiB)"), 2.0 * x_bytes, &copy);
    // The ceilings of one direction alone: a kernel that mostly reads (a
    // quantizer) or mostly writes (a dequantizer) against MLX's own.
    let flat_x = veloxquant::ops::reshape(&x, &[-1], &stream).unwrap();
    let read = measure(&|_: &Options| vec![veloxquant::ops::sum_axis(&flat_x, 0, false, &stream).unwrap()], &setup, &stream, repeat);
    rate(&format!("MLX sum of x (reads {mib:.0} MiB)"), x_bytes, &read);
    let shape = [n as i32, D as i32];
    let write = measure(&|_: &Options| vec![veloxquant::ops::zeros(&shape, dtype, &stream).unwrap()], &setup, &stream, repeat);
    rate(&format!("MLX zeros like x (writes {mib:.0} MiB)"), x_bytes, &write);
    println!();

    // Each row's x + x is timed again just before its fused call, which
    // shows how fast the GPU was then.
    // "graphs built first": the same calls' graphs built before the clock
    // starts, so that the time is the GPU's; "build us": the host's part of
    // one call, which "fused ms" includes.
    println!("| kernel | fused ms | reference ms | speed-up | fused GB/s | % of HBM | graphs built first ms | its % of HBM | build us | x + x ms before | f32 floor ms | fused peak MiB | reference peak MiB | outputs MiB | fused launches/append |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");

    type Case<'a> = (&'static str, Box<dyn Fn(&Options) -> Vec<Array> + 'a>, usize, usize);
    let xb = n * D * es;
    let cases: Vec<Case<'_>> = vec![
        ("scalar_quantize b=4", Box::new(|o| vec![scalar_quantize(&x, &cb4, 4, o).unwrap()]), xb, n * D / 2),
        ("scalar_dequantize b=4", Box::new(|o| vec![scalar_dequantize(&packed4, &cb4, 4, D, dtype, o).unwrap()]), n * D / 2, xb),
        (
            "kivi_quantize keys b=2 G=32",
            Box::new(|o| {
                let (a, b, c) = kivi_quantize(&x, 2, 32, KiviMode::Keys, o).unwrap();
                vec![a, b, c]
            }),
            xb,
            n * D / 4 + n.div_ceil(32) * D * 4,
        ),
        (
            "kivi_quantize values b=2 G=32",
            Box::new(|o| {
                let (a, b, c) = kivi_quantize(&x, 2, 32, KiviMode::Values, o).unwrap();
                vec![a, b, c]
            }),
            xb,
            n * D / 4 + n * (D / 32) * 4,
        ),
        (
            "kivi_dequantize keys b=2 G=32",
            Box::new(|o| vec![kivi_dequantize(&kc, &ks, &kz, 2, 32, KiviMode::Keys, D, dtype, o).unwrap()]),
            n * D / 4 + n.div_ceil(32) * D * 4,
            xb,
        ),
        (
            "kivi_dequantize values b=2 G=32",
            Box::new(|o| vec![kivi_dequantize(&vc, &vs, &vz, 2, 32, KiviMode::Values, D, dtype, o).unwrap()]),
            n * D / 4 + n * (D / 32) * 4,
            xb,
        ),
        (
            "qjl_encode m=256",
            Box::new(|o| {
                let (a, b) = qjl_encode(&x, &sketch, o).unwrap();
                vec![a, b]
            }),
            xb,
            n * (m / 8 + 2),
        ),
        ("qjl_score m=256 Q=4", Box::new(|o| vec![qjl_score(&q, &sketch, &signs, &norms, o).unwrap()]), n * (m / 8 + 2), 4 * n * 4),
        ("pq_encode s=4 K=256", Box::new(|o| vec![pq_encode(&x, &pq_cb, 8, o).unwrap().codes]), xb, n * D / 4),
        ("pq_decode s=4 K=256", Box::new(|o| vec![pq_decode(&pq_codes, &pq_cb, 8, D, dtype, o).unwrap()]), n * D / 4, xb),
        (
            "pq_encode s=4 K=1024 (10 bits, two planes)",
            Box::new(|o| {
                let c = pq_encode(&x, &pq_cb10, 10, o).unwrap();
                vec![c.codes, c.codes_hi.expect("high plane")]
            }),
            xb,
            n * D * 10 / 32,
        ),
        ("pq_decode s=4 K=1024", Box::new(|o| vec![pq_decode(&pq_codes10, &pq_cb10, 10, D, dtype, o).unwrap()]), n * D * 10 / 32, xb),
        (
            "tq_encode b=4 (the cache's rotate-and-quantize)",
            Box::new(|o| {
                let (c, nm) = tq_encode(&x, Some(&rot), &cent4, 4, o).unwrap();
                vec![c, nm]
            }),
            xb + D * D * 4,
            n * (D / 2 + 2),
        ),
        (
            "tq_encode b=4 Hadamard signs (butterflies)",
            Box::new(|o| {
                let (c, nm) = tq_encode(&x, Some(&hadamard_signs), &cent4, 4, o).unwrap();
                vec![c, nm]
            }),
            xb + D * 4,
            n * (D / 2 + 2),
        ),
        (
            "tq_prod_encode b=4",
            Box::new(|o| {
                let e = tq_prod_encode(&x, Some(&rot), Some(&cent3), &tq_sketch, 4, o).unwrap();
                vec![e.codes.expect("codes"), e.signs, e.norms, e.residual_norms.expect("residual norms")]
            }),
            xb + 2 * D * D * 4,
            n * (D / 2 + 4),
        ),
        (
            "tq_prod_encode b=4 Hadamard signs (butterflies)",
            Box::new(|o| {
                let e = tq_prod_encode(&x, Some(&hadamard_signs), Some(&cent3), &tq_sketch, 4, o).unwrap();
                vec![e.codes.expect("codes"), e.signs, e.norms, e.residual_norms.expect("residual norms")]
            }),
            xb + D * D * 4 + D * 4,
            n * (D / 2 + 4),
        ),
        (
            "tq_prod_decode b=4",
            Box::new(|o| vec![tq_prod_decode(&prod, Some(&rot), Some(&cent3), &tq_sketch, 4, dtype, o).unwrap()]),
            n * (D / 2 + 4) + 2 * D * D * 4,
            xb,
        ),
        (
            "tq_prod_decode b=4 Hadamard signs (butterflies)",
            Box::new(|o| vec![tq_prod_decode(&prod, Some(&hadamard_signs), Some(&cent3), &tq_sketch, 4, dtype, o).unwrap()]),
            n * (D / 2 + 4) + D * D * 4 + D * 4,
            xb,
        ),
        (
            "tq_rvq_encode b=2+2",
            Box::new(|o| {
                let e = tq_rvq_encode(&x, Some(&rot), &cent_a, &cent_b, (2, 2), o).unwrap();
                vec![e.codes1, e.codes2, e.norms]
            }),
            xb + D * D * 4,
            n * (D / 2 + 2),
        ),
        (
            "tq_rvq_encode b=2+2 Hadamard signs (butterflies)",
            Box::new(|o| {
                let e = tq_rvq_encode(&x, Some(&hadamard_signs), &cent_a, &cent_b, (2, 2), o).unwrap();
                vec![e.codes1, e.codes2, e.norms]
            }),
            xb + D * 4,
            n * (D / 2 + 2),
        ),
        (
            "tq_rvq_decode b=2+2",
            Box::new(|o| vec![tq_rvq_decode(&rvq, Some(&rot), &cent_a, &cent_b, (2, 2), D, dtype, o).unwrap()]),
            n * (D / 2 + 2) + D * D * 4,
            xb,
        ),
        (
            "tq_rvq_decode b=2+2 Hadamard signs (butterflies)",
            Box::new(|o| vec![tq_rvq_decode(&rvq, Some(&hadamard_signs), &cent_a, &cent_b, (2, 2), D, dtype, o).unwrap()]),
            n * (D / 2 + 2) + D * 4,
            xb,
        ),
    ];
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    // Float32 instructions the in-order, fma-free arithmetic cannot avoid.
    let (nf, df, mf) = (n as f64, D as f64, m as f64);
    let f32_ops = |name: &str| -> f64 {
        match name.split_whitespace().next().unwrap_or("") {
            "qjl_encode" => 2.0 * nf * mf * df,
            "qjl_score" => nf * mf * 4.0,
            // Subtract, multiply, add per codebook entry and dimension.
            "pq_encode" if name.contains("K=1024") => 3.0 * nf * df * 1024.0,
            "pq_encode" => 3.0 * nf * df * 256.0,
            // Rotation and sketch products, D x D multiply-adds each.
            // Butterflies: D log2 D adds, then the scale (and Prod's sketch product).
            "tq_prod_encode" | "tq_prod_decode" if name.contains("Hadamard") => {
                2.0 * nf * df * df + nf * df * (df.log2() + 1.0)
            }
            "tq_prod_encode" | "tq_prod_decode" => 4.0 * nf * df * df,
            "tq_encode" | "tq_rvq_encode" | "tq_rvq_decode" if name.contains("Hadamard") => nf * df * (df.log2() + 1.0),
            "tq_encode" | "tq_rvq_encode" | "tq_rvq_decode" => 2.0 * nf * df * df,
            _ => 0.0,
        }
    };
    let selected: Vec<&Case<'_>> =
        cases.iter().filter(|(name, ..)| only.is_empty() || only.iter().any(|o| name.contains(o.as_str()))).collect();
    // Every fused call is timed before any reference runs: some references
    // run for seconds at tens of GB and leave the GPU slower for a while
    // after (x + x itself measured 20% slower right after pq_encode's).
    let fused: Vec<(Measure, Measure, usize)> = selected
        .iter()
        .map(|(_, f, ..)| {
            let before = ceiling();
            let fused = measure(f.as_ref(), &Options::on(stream.clone(), Policy::Require), &stream, repeat);
            // Inputs are evaluated: what is pending is the call's own kernels.
            let outs = f(&Options::on(stream.clone(), Policy::Require));
            let launches = veloxquant::graph::pending_kernels(&outs.iter().collect::<Vec<_>>()).unwrap().len();
            (before, fused, launches)
        })
        .collect();
    for ((name, f, read, written), (before, fused, launches)) in selected.iter().zip(fused) {
        let reference = (!fused_only).then(|| measure(f.as_ref(), &Options::on(stream.clone(), Policy::Off), &stream, 1));
        let (reference_ms, speed_up, reference_mib) = match &reference {
            Some(r) => (
                format!("{:.3}", r.seconds * 1e3),
                format!("{:.1}x", r.seconds / fused.seconds),
                format!("{:.2}", mib(r.peak_above_inputs)),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let bytes = (read + written) as f64;
        let bytes_per_s = bytes / fused.seconds;
        let share = |seconds: f64| if gpu { format!("{:.1}%", 100.0 * bytes / seconds / HBM_BYTES_PER_S) } else { "-".into() };
        let ops = f32_ops(name);
        let floor = if gpu && ops > 0.0 { format!("{:.3}", ops / FP32_OPS_PER_S * 1e3) } else { "-".into() };
        println!(
            "| {name} | {:.3} | {reference_ms} | {speed_up} | {:.1} | {} | {:.3} | {} | {:.1} | {:.3} | {floor} | {:.2} | {reference_mib} | {:.2} | {launches} |",
            fused.seconds * 1e3,
            bytes_per_s / 1e9,
            share(fused.seconds),
            fused.eval_seconds * 1e3,
            share(fused.eval_seconds),
            fused.build_seconds * 1e6,
            before.seconds * 1e3,
            mib(fused.peak_above_inputs),
            mib(*written),
        );
    }
}
