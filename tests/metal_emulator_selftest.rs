//! The emulator itself: dispatch semantics, threadgroup memory, barriers,
//! simd functions, atomics, the shim's types, and failures that must be
//! reported quickly and clearly rather than hang or pass.

mod metal_emulator;

use std::time::{Duration, Instant};

use half::{bf16, f16};
use metal_emulator::{Dtype, EmuError, HostArray, MetalKernel, TemplateArg};

fn iota(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

#[test]
fn threadgroup_memory_barriers_and_partial_threadgroup() {
    // Each thread reads what another thread of its threadgroup wrote before a
    // barrier, then the threadgroup sums its values in a tree of barriers.
    let src = r#"
threadgroup uint buf[256];
threadgroup uint partial[256];
const uint lid = thread_index_in_threadgroup;
const uint count = threads_per_threadgroup.x;
const uint gid = thread_position_in_grid.x;
// A pointer into threadgroup memory is the thread's own, not shared.
threadgroup uint* mine = buf + lid;
*mine = x[gid];
partial[lid] = x[gid];
threadgroup_barrier(mem_flags::mem_threadgroup);
mirrored[gid] = buf[count - 1 - lid];
for (uint stride = 1; stride < 256; stride *= 2) {
  uint v = 0;
  if (lid % (2 * stride) == 0 && lid + stride < count) {
    v = partial[lid + stride];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  partial[lid] += v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (lid == 0) {
  sums[threadgroup_position_in_grid.x] = partial[0];
}
"#;
    let k = MetalKernel::new("tg_memory", &["x"], &["mirrored", "sums"], src);
    let n = 1000usize; // 3 threadgroups of 256 and a partial one of 232
    let x: Vec<u32> = (0..n as u32).map(|i| i * 7 + 1).collect();
    let out = k
        .launch()
        .input(HostArray::new(&[n], &x))
        .output(&[n], Dtype::U32)
        .output(&[4], Dtype::U32)
        .grid(n as u32, 1, 1)
        .threadgroup(256, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let mirrored: Vec<u32> = out[0].to_vec();
    let sums: Vec<u32> = out[1].to_vec();
    for (g, &sum) in sums.iter().enumerate() {
        let lo = g * 256;
        let hi = (lo + 256).min(n);
        for i in lo..hi {
            assert_eq!(mirrored[i], x[hi - 1 - (i - lo)], "thread {i}");
        }
        assert_eq!(sum, x[lo..hi].iter().sum::<u32>(), "threadgroup {g}");
    }
}

#[test]
fn threadgroup_arrays_sized_by_expressions_are_shared() {
    // Sizes written as expressions (`*`, parentheses, shifts, template
    // arguments) are threadgroup memory too; a pointer stays per thread.
    let src = r#"
threadgroup float a[N * 2];
threadgroup uint b[(N + 1) * 2], c[1 << K];
threadgroup float* p = a + thread_index_in_threadgroup;
const uint lid = thread_index_in_threadgroup;
const uint count = threads_per_threadgroup.x;
*p = float(x[thread_position_in_grid.x]);
a[N + lid] = 2.0f * float(x[thread_position_in_grid.x]);
b[lid] = x[thread_position_in_grid.x] + 1;
c[lid] = x[thread_position_in_grid.x] + 2;
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint o = count - 1 - lid;
out[thread_position_in_grid.x] = uint(a[o]) + uint(a[N + o]) + b[o] + c[o];
"#;
    let k = MetalKernel::new("tg_expr", &["x"], &["out"], src);
    let n = 100usize; // a threadgroup of 64 and a partial one of 36
    let x: Vec<u32> = (0..n as u32).map(|i| i * 3 + 1).collect();
    let out = k
        .launch()
        .input(HostArray::new(&[n], &x))
        .output(&[n], Dtype::U32)
        .template("N", TemplateArg::Int(64))
        .template("K", TemplateArg::Int(7))
        .grid(n as u32, 1, 1)
        .threadgroup(64, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<u32> = out[0].to_vec();
    for i in 0..n {
        let (lo, hi) = if i < 64 { (0, 64) } else { (64, n) };
        let v = x[hi - 1 - (i - lo)];
        assert_eq!(got[i], 5 * v + 3, "thread {i}");
    }
}

#[test]
fn simd_functions() {
    // A threadgroup of 48 threads has a full simdgroup and one of 16 lanes;
    // the simd functions see only the lanes that exist.
    let src = r#"
const uint gid = thread_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const float v = x[gid];
out[gid * 10 + 0] = simd_sum(v);
out[gid * 10 + 1] = simd_shuffle(v, 3);
out[gid * 10 + 2] = simd_shuffle_xor(v, 1);
out[gid * 10 + 3] = simd_prefix_exclusive_sum(v);
out[gid * 10 + 4] = simd_prefix_inclusive_sum(v);
out[gid * 10 + 5] = simd_max(v);
out[gid * 10 + 6] = simd_min(v);
out[gid * 10 + 7] = float(uint64_t(simd_ballot(lane % 3 == 0)));
out[gid * 10 + 8] = simd_shuffle_down(v, 1);
simdgroup_barrier(mem_flags::mem_none);
out[gid * 10 + 9] = float(threads_per_simdgroup * 1000 + simdgroup_index_in_threadgroup * 100 + simdgroups_per_threadgroup);
"#;
    let k = MetalKernel::new("simd", &["x"], &["out"], src);
    let n = 48usize;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 50) as f32 - 20.0).collect();
    let out = k
        .launch()
        .input(HostArray::new(&[n], &x))
        .output(&[n * 10], Dtype::F32)
        .grid(n as u32, 1, 1)
        .threadgroup(64, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<f32> = out[0].to_vec();
    for i in 0..n {
        let (base, lanes) = if i < 32 { (0, 32) } else { (32, 16) };
        let lane = i - base;
        let sg = &x[base..base + lanes];
        let r = &got[i * 10..i * 10 + 10];
        assert_eq!(r[0], sg.iter().sum::<f32>(), "simd_sum at {i}");
        assert_eq!(r[1], sg[3], "simd_shuffle at {i}");
        assert_eq!(r[2], sg[lane ^ 1], "simd_shuffle_xor at {i}");
        assert_eq!(r[3], sg[..lane].iter().sum::<f32>(), "simd_prefix_exclusive_sum at {i}");
        assert_eq!(r[4], sg[..=lane].iter().sum::<f32>(), "simd_prefix_inclusive_sum at {i}");
        assert_eq!(r[5], sg.iter().cloned().fold(f32::MIN, f32::max), "simd_max at {i}");
        assert_eq!(r[6], sg.iter().cloned().fold(f32::MAX, f32::min), "simd_min at {i}");
        let ballot: u64 = (0..lanes).filter(|l| l % 3 == 0).map(|l| 1u64 << l).sum();
        assert_eq!(r[7], ballot as f32, "simd_ballot at {i}");
        let down = if lane + 1 < lanes { sg[lane + 1] } else { sg[lane] };
        assert_eq!(r[8], down, "simd_shuffle_down at {i}");
        assert_eq!(r[9], (32_000 + (i / 32) * 100 + 2) as f32, "simdgroup attributes at {i}");
    }
}

#[test]
fn lanes_that_returned_are_inactive() {
    // Odd lanes return; the even lanes' simd_sum adds the even lanes only.
    let src = r#"
const uint lane = thread_index_in_simdgroup;
if (lane % 2 == 1) {
  return;
}
out[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);
"#;
    let k = MetalKernel::new("early_return", &["x"], &["out"], src);
    let x: Vec<u32> = (0..64).map(|i| i * i).collect();
    let out = k
        .launch()
        .input(HostArray::new(&[64], &x))
        .output(&[64], Dtype::U32)
        .grid(64, 1, 1)
        .threadgroup(64, 1, 1)
        .init_value(1.0)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<u32> = out[0].to_vec();
    for (i, &v) in got.iter().enumerate() {
        let base = i / 32 * 32;
        let even: u32 = (base..base + 32).step_by(2).map(|j| x[j]).sum();
        assert_eq!(v, if i % 2 == 0 { even } else { 1 }, "lane {i}");
    }
}

#[test]
fn dispatch_attributes_in_three_dimensions() {
    // grid 5x3x2 threads in threadgroups of 4x2x2: partial in x and y.
    let src = r#"
const uint3 p = thread_position_in_grid;
const uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
const uint3 l = thread_position_in_threadgroup;
const uint3 g = threadgroup_position_in_grid;
const uint3 t = threads_per_threadgroup;
const uint3 d = dispatch_threads_per_threadgroup;
const uint3 n = threadgroups_per_grid;
device uint* o = out + i * 16;
o[0] = l.x; o[1] = l.y; o[2] = l.z;
o[3] = g.x; o[4] = g.y; o[5] = g.z;
o[6] = t.x; o[7] = t.y; o[8] = t.z;
o[9] = d.x * 100 + d.y * 10 + d.z;
o[10] = n.x * 100 + n.y * 10 + n.z;
o[11] = thread_index_in_threadgroup;
o[12] = grid_size.x * 100 + grid_size.y * 10 + grid_size.z;
o[13] = quadgroup_index_in_threadgroup * 10 + thread_index_in_quadgroup;
o[14] = dispatch_simdgroups_per_threadgroup;
o[15] = 7;
"#;
    let k = MetalKernel::new("attrs", &["x"], &["out"], src);
    let (gx, gy, gz) = (5u32, 3u32, 2u32);
    let total = (gx * gy * gz) as usize;
    let out = k
        .launch()
        .input(HostArray::new(&[1], &[0u32]))
        .output(&[total * 16], Dtype::U32)
        .grid(gx, gy, gz)
        .threadgroup(4, 2, 2)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<u32> = out[0].to_vec();
    for z in 0..gz {
        for y in 0..gy {
            for x in 0..gx {
                let i = ((z * gy + y) * gx + x) as usize;
                let o = &got[i * 16..i * 16 + 16];
                let (l, g) = ([x % 4, y % 2, z % 2], [x / 4, y / 2, z / 2]);
                let t = [if g[0] == 1 { 1 } else { 4 }, if g[1] == 1 { 1 } else { 2 }, 2];
                assert_eq!(&o[0..3], &l, "thread_position_in_threadgroup of ({x},{y},{z})");
                assert_eq!(&o[3..6], &g, "threadgroup_position_in_grid of ({x},{y},{z})");
                assert_eq!(&o[6..9], &t, "threads_per_threadgroup of ({x},{y},{z})");
                assert_eq!(o[9], 422);
                assert_eq!(o[10], 221);
                let index = l[0] + l[1] * t[0] + l[2] * t[0] * t[1];
                assert_eq!(o[11], index, "thread_index_in_threadgroup of ({x},{y},{z})");
                assert_eq!(o[12], 532);
                assert_eq!(o[13], (index / 4) * 10 + index % 4);
                assert_eq!(o[14], 1);
                assert_eq!(o[15], 7);
            }
        }
    }
}

#[test]
fn atomics_shapes_scalars_and_templates() {
    // elem_to_loc over shape/strides buffers, a 0-d input, an int and a bool
    // template argument, and atomic outputs.
    let src = r#"
const uint i = thread_position_in_grid.x;
const auto loc = elem_to_loc(i, x_shape, x_strides, x_ndim);
const T v = x[loc] * s + T(OFFSET) * T(NEG ? -1 : 1);
atomic_fetch_add_explicit(&total[0], uint(v), memory_order_relaxed);
atomic_fetch_max_explicit(&total[1], uint(v), memory_order_relaxed);
"#;
    let k = MetalKernel::new("atomics", &["x", "s"], &["total"], src).with_atomic_outputs(true);
    let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let out = k
        .launch()
        .input(HostArray::new(&[2, 3, 4], &x))
        .input(HostArray::scalar(3.0f32))
        .output(&[2], Dtype::U32)
        .template("T", TemplateArg::Dtype(Dtype::F32))
        .template("OFFSET", TemplateArg::Int(-5))
        .template("NEG", TemplateArg::Bool(true))
        .grid(24, 1, 1)
        .threadgroup(8, 1, 1)
        .init_value(0.0)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let total: Vec<u32> = out[0].to_vec();
    let expect: u32 = (0..24).map(|i| i * 3 + 5).sum();
    assert_eq!(total, vec![expect, 23 * 3 + 5]);
}

#[test]
fn half_and_bfloat_round_like_the_half_crate() {
    let src = r#"
const uint i = thread_position_in_grid.x;
h[i] = float16_t(x[i]);
b[i] = bfloat16_t(x[i]);
back[i] = float(h[i]) + float(b[i]);
"#;
    let k = MetalKernel::new("casts", &["x"], &["h", "b", "back"], src);
    let mut x: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) * 0.012_345_67).collect();
    x.extend([1.000_976_6, 65520.0, -1e-8, 3.0e38, f32::INFINITY, 0.1, 1.003_906_2]);
    let n = x.len();
    let out = k
        .launch()
        .input(HostArray::new(&[n], &x))
        .output(&[n], Dtype::F16)
        .output(&[n], Dtype::BF16)
        .output(&[n], Dtype::F32)
        .grid(n as u32, 1, 1)
        .threadgroup(1024, 1, 1)
        .run()
        .unwrap_or_else(|e| panic!("{e}"));
    let h: Vec<f16> = out[0].to_vec();
    let b: Vec<bf16> = out[1].to_vec();
    let back: Vec<f32> = out[2].to_vec();
    for i in 0..n {
        assert_eq!(h[i].to_bits(), f16::from_f32(x[i]).to_bits(), "half({})", x[i]);
        assert_eq!(b[i].to_bits(), bf16::from_f32(x[i]).to_bits(), "bfloat({})", x[i]);
        assert_eq!(back[i], h[i].to_f32() + b[i].to_f32());
    }
}

/// Runs `run` once to compile the kernel (cached by source), then again,
/// timed, so that only the failing run counts against a test's limit.
fn run_after_compile(run: impl Fn() -> Result<Vec<HostArray>, EmuError>) -> (Result<Vec<HostArray>, EmuError>, Duration) {
    let _ = run();
    let start = Instant::now();
    let r = run();
    (r, start.elapsed())
}

fn expect_failure(run: impl Fn() -> Result<Vec<HostArray>, EmuError>, limit: Duration, needle: &str) -> String {
    let (result, elapsed) = run_after_compile(run);
    let err = match result {
        Ok(_) => panic!("the kernel was expected to fail ({needle})"),
        Err(e) => e.to_string(),
    };
    assert!(elapsed < limit, "failing took {elapsed:?}: {err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    err
}

#[test]
fn barrier_in_a_divergent_branch_fails_fast() {
    let k = MetalKernel::new(
        "divergent_barrier",
        &["x"],
        &["out"],
        "const uint lid = thread_index_in_threadgroup;\n\
         if (lid < 16) {\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n\
         out[thread_position_in_grid.x] = x[lid];",
    );
    let run = || {
        k
            .launch()
            .input(HostArray::new(&[64], &iota(64)))
            .output(&[64], Dtype::U32)
            .grid(64, 1, 1)
            .threadgroup(64, 1, 1)
            .run()
    };
    expect_failure(run, Duration::from_secs(10), "had returned from the kernel");
}

#[test]
fn barriers_at_different_places_fail_fast() {
    let k = MetalKernel::new(
        "two_barriers",
        &["x"],
        &["out"],
        "const uint lid = thread_index_in_threadgroup;\n\
         if (lid % 2 == 0) {\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n} else {\n  \
         threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n\
         out[thread_position_in_grid.x] = x[lid];",
    );
    let run = || {
        k
            .launch()
            .input(HostArray::new(&[32], &iota(32)))
            .output(&[32], Dtype::U32)
            .grid(32, 1, 1)
            .threadgroup(32, 1, 1)
            .run()
    };
    expect_failure(run, Duration::from_secs(10), "different barriers");
}

#[test]
fn deadlock_times_out_within_seconds() {
    // Half the threads wait at a barrier while the others spin forever: only
    // the barrier's timeout can end it.
    let k = MetalKernel::new(
        "deadlock",
        &["x"],
        &["out"],
        "const uint lid = thread_index_in_threadgroup;\n\
         if (lid < 16) {\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n} else {\n  \
         volatile uint spin = 0;\n  while (spin == 0) {\n  }\n}\n\
         out[thread_position_in_grid.x] = x[lid];",
    );
    let run = || {
        k
            .launch()
            .input(HostArray::new(&[32], &iota(32)))
            .output(&[32], Dtype::U32)
            .grid(32, 1, 1)
            .threadgroup(32, 1, 1)
            .barrier_timeout(Duration::from_millis(500))
            .run()
    };
    expect_failure(run, Duration::from_secs(10), "deadlock at threadgroup_barrier");
}

#[test]
fn divergent_simd_call_fails_fast() {
    let k = MetalKernel::new(
        "divergent_simd",
        &["x"],
        &["out"],
        "const uint lane = thread_index_in_simdgroup;\n\
         float v = float(x[lane]);\n\
         if (lane < 8) {\n  v = simd_sum(v);\n} else {\n  v = simd_max(v);\n}\n\
         out[thread_position_in_grid.x] = uint(v);",
    );
    let run = || {
        k
            .launch()
            .input(HostArray::new(&[32], &iota(32)))
            .output(&[32], Dtype::U32)
            .grid(32, 1, 1)
            .threadgroup(32, 1, 1)
            .run()
    };
    expect_failure(run, Duration::from_secs(10), "divergent simd functions");
}

#[test]
fn runaway_kernel_is_killed() {
    let k = MetalKernel::new(
        "runaway",
        &["x"],
        &["out"],
        "volatile uint spin = x[0];\nwhile (spin == 0) {\n}\nout[thread_position_in_grid.x] = spin;",
    );
    let run = || {
        k
            .launch()
            .input(HostArray::new(&[8], &[0u32; 8]))
            .output(&[8], Dtype::U32)
            .grid(8, 1, 1)
            .threadgroup(8, 1, 1)
            .timeout(Duration::from_secs(2))
            .run()
    };
    let (r, elapsed) = run_after_compile(run);
    assert!(matches!(r, Err(EmuError::Timeout(_))), "{:?}", r.map(|_| ()));
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
}

#[test]
fn errors_are_reported() {
    // MLX's two-output signature bug: the source does not compile.
    let k = MetalKernel::new("bug", &["x"], &["a", "b"], "a[0] = x[0] + float(x_shape[0]);\nb[0] = x[1];");
    let r = k
        .launch()
        .input(HostArray::new(&[16], &[0f32; 16]))
        .output(&[1], Dtype::F32)
        .output(&[1], Dtype::F32)
        .run();
    assert!(matches!(r, Err(EmuError::Compile(_))), "{:?}", r.map(|_| ()));

    let k = MetalKernel::new("ok", &["x"], &["out"], "out[thread_position_in_grid.x] = x[0];");
    let r = k.launch().input(HostArray::new(&[1], &[1u32])).output(&[1], Dtype::U32).threadgroup(64, 32, 1).run();
    assert!(matches!(r, Err(EmuError::Invalid(_))), "{:?}", r.map(|_| ()));

    // A write past the end of an output is caught by the guard bytes.
    let r = k
        .launch()
        .input(HostArray::new(&[1], &[1u32]))
        .output(&[3], Dtype::U32)
        .grid(4, 1, 1)
        .threadgroup(4, 1, 1)
        .run();
    let msg = r.map(|_| ()).unwrap_err().to_string();
    assert!(msg.contains("wrote past the end of `out`"), "{msg}");
}

#[test]
fn more_buffers_than_a_metal_kernel_binds_are_refused() {
    // Each input takes a buffer, and its strides another when the body reads
    // them: 15 such inputs and an output are 31 buffers, 16 are 33.
    let launch = |inputs: usize| {
        let names: Vec<String> = (0..inputs).map(|i| format!("x{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let src = names.iter().map(|n| format!("(void){n}_strides;")).collect::<String>()
            + "uint i = thread_position_in_grid.x; out[i] = x0[i];";
        let k = MetalKernel::new("buffers", &names, &["out"], &src);
        let mut run = k.launch();
        for _ in 0..inputs {
            run = run.input(HostArray::new(&[4], &iota(4)));
        }
        run.output(&[4], Dtype::U32).grid(4, 1, 1).threadgroup(4, 1, 1).run()
    };
    assert_eq!(launch(15).unwrap_or_else(|e| panic!("{e}"))[0].to_vec::<u32>(), iota(4));
    let msg = launch(16).map(|_| ()).unwrap_err().to_string();
    assert!(msg.contains("33 buffers") && msg.contains("31"), "{msg}");
}
