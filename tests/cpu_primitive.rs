//! The CPU custom primitive: laziness, errors and panics inside the callback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use veloxquant::kernels::cpu_primitive;
use veloxquant::{Array, Dtype, Stream};

#[test]
fn callback_runs_only_at_evaluation() {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let out = cpu_primitive::apply(
        "double",
        &[&x],
        &[(vec![3], Dtype::F32)],
        &Stream::cpu(),
        Box::new(move |ins, outs| {
            seen.fetch_add(1, Ordering::SeqCst);
            let src = ins[0].as_slice::<f32>()?;
            for (o, v) in outs[0].as_mut_slice::<f32>()?.iter_mut().zip(src) {
                *o = 2.0 * v;
            }
            Ok(())
        }),
    )
    .unwrap()
    .remove(0);
    assert_eq!(calls.load(Ordering::SeqCst), 0, "building the op must not run it");
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

fn failing(kind: &'static str) -> veloxquant::Result<()> {
    let x = Array::from_slice(&[1.0f32], &[1]).unwrap();
    let out = cpu_primitive::apply(
        "failing",
        &[&x],
        &[(vec![1], Dtype::F32)],
        &Stream::cpu(),
        Box::new(move |_, _| {
            if kind == "panic" {
                panic!("deliberate panic");
            }
            Err("deliberate error".into())
        }),
    )?
    .remove(0);
    out.eval()
}

#[test]
fn a_failing_or_panicking_callback_is_an_error_not_a_crash() {
    let e = failing("error").unwrap_err().to_string();
    assert!(e.contains("deliberate error"), "{e}");
    let e = failing("panic").unwrap_err().to_string();
    assert!(e.contains("deliberate panic"), "{e}");
    // The stream keeps working afterwards.
    let y = Array::from_slice(&[5u8], &[1]).unwrap();
    assert_eq!(y.to_vec::<u8>().unwrap(), vec![5]);
}

#[test]
fn a_cpu_primitive_on_a_gpu_stream_is_refused() {
    if let Ok(gpu) = Stream::gpu() {
        let x = Array::from_slice(&[1.0f32], &[1]).unwrap();
        let r = cpu_primitive::apply("x", &[&x], &[(vec![1], Dtype::F32)], &gpu, Box::new(|_, _| Ok(())));
        assert!(r.unwrap_err().to_string().contains("CPU stream"));
    } else {
        assert!(Stream::gpu().unwrap_err().to_string().contains("no GPU"));
    }
}
