//! `graph::pending_primitives`: the nodes MLX would run, before evaluation.

use veloxquant::graph::pending_primitives;
use veloxquant::kernels::{Kernel, tq_prod_encode, tq_rvq_encode};
use veloxquant::quant::qjl::Sketch;
use veloxquant::quant::ScalarCodebook;
use veloxquant::{ops, Array, Options, Policy, Stream};

fn constant(v: &[f32]) -> Array {
    Array::from_slice(v, &[v.len() as i32]).unwrap()
}

#[test]
fn counts_unevaluated_nodes_once() {
    let s = Stream::cpu();
    let (a, b, c) = (constant(&[1.0, 2.0]), constant(&[3.0, 4.0]), constant(&[5.0, 6.0]));
    assert!(pending_primitives(&[&a]).unwrap().is_empty(), "a constant runs nothing");
    let sum = ops::add(&a, &b, &s).unwrap();
    let prod = ops::multiply(&sum, &c, &s).unwrap();
    assert_eq!(pending_primitives(&[&prod]).unwrap(), ["Add", "Multiply"]);
    // A node shared by two outputs, and an output listed twice, count once.
    let other = ops::subtract(&sum, &c, &s).unwrap();
    assert_eq!(pending_primitives(&[&prod, &other, &prod]).unwrap(), ["Add", "Multiply", "Subtract"]);
    // Evaluating the shared input removes it from the count, evaluating all leaves none.
    sum.eval().unwrap();
    assert_eq!(pending_primitives(&[&prod, &other]).unwrap(), ["Multiply", "Subtract"]);
    veloxquant::eval(&[&prod, &other]).unwrap();
    assert!(pending_primitives(&[&prod, &other]).unwrap().is_empty());
    assert!(pending_primitives(&[]).unwrap().is_empty());
    assert_eq!(prod.to_vec::<f32>().unwrap(), [20.0, 36.0]);
}

#[test]
fn a_fused_kernel_is_one_node_for_all_its_outputs() {
    let s = Stream::cpu();
    let d = 64;
    let x = ops::reshape(&constant(&vec![0.25f32; 5 * d]), &[5, d as i32], &s).unwrap();
    let sk = Array::from_slice(&Sketch::new(d, d, true, 1).s, &[d as i32, d as i32]).unwrap();
    let cb = constant(ScalarCodebook::sphere(d, 2).unwrap().centroids());
    let e = tq_prod_encode(&x, None, Some(&cb), &sk, 3, &Options::on(s.clone(), Policy::Require)).unwrap();
    let outs = [e.codes.as_ref().unwrap(), &e.signs, &e.norms, e.residual_norms.as_ref().unwrap()];
    let names = pending_primitives(&outs).unwrap();
    assert_eq!(names.iter().filter(|n| *n == Kernel::TqProdEncode.name()).count(), 1, "{names:?}");
    // The reference graph runs many more nodes for the same result.
    let r = tq_rvq_encode(&x, None, &cb, &cb, (2, 2), &Options::on(s.clone(), Policy::Off)).unwrap();
    let fused = tq_rvq_encode(&x, None, &cb, &cb, (2, 2), &Options::on(s, Policy::Require)).unwrap();
    let n_ref = pending_primitives(&[&r.codes1, &r.codes2, &r.norms]).unwrap().len();
    let n_fused = pending_primitives(&[&fused.codes1, &fused.codes2, &fused.norms]).unwrap();
    assert_eq!(n_fused.iter().filter(|n| *n == Kernel::TqRvqEncode.name()).count(), 1, "{n_fused:?}");
    assert!(n_ref > 2 * n_fused.len(), "reference {n_ref} nodes, fused {n_fused:?}");
}
