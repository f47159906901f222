//! The cache's TurboQuant encoder (`kernels::tq_encode`) with a Hadamard
//! rotation passed as its ±1 signs: the CPU kernel's butterflies against the
//! same rotation as a dense matrix and against the reference graph (codes
//! equal but at near-ties, norms identical), and the signs' checks.

mod common;

use common::normal;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use veloxquant::kernels::turboquant::tq_encode;
use veloxquant::quant::{Rotation, ScalarCodebook};
use veloxquant::{Array, Dtype, Error, Options, Policy, Stream};

fn unpack(bytes: &[u8], bits: u32, count: usize) -> Vec<u32> {
    (0..count)
        .map(|j| {
            let o = j * bits as usize;
            let w = bytes[o / 8] as u32 | (*bytes.get(o / 8 + 1).unwrap_or(&0) as u32) << 8;
            (w >> (o % 8)) & ((1 << bits) - 1)
        })
        .collect()
}

#[test]
fn hadamard_signs_encode_as_the_dense_rotation() {
    for &d in &[64usize, 128, 256] {
        for &bits in &[1u32, 2, 4, 8] {
            let mut rng = ChaCha8Rng::seed_from_u64(d as u64 * 10 + bits as u64);
            let n = 300;
            let x = normal(&mut rng, &[n, d as i32], Dtype::F16);
            let rot = Rotation::hadamard(d, 9).unwrap();
            let signs = Array::from_slice(rot.signs(), &[d as i32]).unwrap();
            let dense = Array::from_slice(&rot.to_dense(), &[d as i32, d as i32]).unwrap();
            let cent = ScalarCodebook::sphere(d, bits).unwrap().centroids().to_vec();
            let cent = Array::from_slice(&cent, &[cent.len() as i32]).unwrap();
            let run = |r: &Array, policy: Policy| {
                let (c, nm) = tq_encode(&x, Some(r), &cent, bits, &Options::on(Stream::cpu(), policy)).unwrap();
                (unpack(&c.to_vec::<u8>().unwrap(), bits, n as usize * d), nm.to_bytes().unwrap())
            };
            let (fly, fly_norms) = run(&signs, Policy::Require);
            let (mat, mat_norms) = run(&dense, Policy::Require);
            let (refc, _) = run(&signs, Policy::Off);
            assert_eq!(fly_norms, mat_norms, "d={d} bits={bits}: norms");
            // The two orders of summation round differently: a code may move
            // to its neighbour at a near-tie, and only there.
            for (name, other) in [("dense", &mat), ("reference", &refc)] {
                let differ = fly.iter().zip(other).filter(|(a, b)| a != b).count();
                let far = fly.iter().zip(other).filter(|(a, b)| a.abs_diff(**b) > 1).count();
                assert!(differ * 1000 <= fly.len(), "d={d} bits={bits}: {differ} codes differ from the {name} path");
                assert_eq!(far, 0, "d={d} bits={bits}: codes more than one step from the {name} path");
            }
        }
    }
}

#[test]
fn hadamard_signs_are_checked() {
    let cent = Array::from_slice(&ScalarCodebook::sphere(96, 4).unwrap().centroids().to_vec(), &[16]).unwrap();
    let opts = Options::on(Stream::cpu(), Policy::Require);
    let x = Array::from_slice(&vec![0.5f32; 2 * 96], &[2, 96]).unwrap();
    let signs = Array::from_slice(&vec![1.0f32; 96], &[96]).unwrap();
    match tq_encode(&x, Some(&signs), &cent, 4, &opts) {
        Err(e @ Error::InvalidArgument { .. }) => assert!(e.to_string().starts_with("rotation"), "{e}"),
        other => panic!("signs for d = 96 should be refused, got {:?}", other.map(|_| ())),
    }
    let x = Array::from_slice(&vec![0.5f32; 2 * 64], &[2, 64]).unwrap();
    let wrong = Array::from_slice(&vec![1.0f32; 32], &[32]).unwrap();
    let cent = Array::from_slice(&ScalarCodebook::sphere(64, 4).unwrap().centroids().to_vec(), &[16]).unwrap();
    let err = tq_encode(&x, Some(&wrong), &cent, 4, &opts).map(|_| ()).unwrap_err();
    assert!(err.to_string().starts_with("rotation"), "{err}");
}
