//! The GPU kernel cache, in a process of its own so that no other test has
//! created kernels before it. Ignored where MLX has no GPU back-end.

use veloxquant::kernels::{bit_pack, cached_kernel_count};
use veloxquant::{Array, Options, Policy, Stream};

#[test]
#[ignore = "needs a GPU back-end"]
fn gpu_kernels_are_created_once_per_template_arguments() {
    let o = Options::on(Stream::gpu().expect("a GPU back-end"), Policy::Require);
    assert_eq!(cached_kernel_count(), 0);
    let a = Array::from_slice(&[1u8; 64], &[4, 16]).unwrap();
    bit_pack(&a, 3, &o).unwrap().eval().unwrap();
    assert_eq!(cached_kernel_count(), 1);
    for _ in 0..10 {
        bit_pack(&a, 3, &o).unwrap().eval().unwrap();
    }
    assert_eq!(cached_kernel_count(), 1, "the same template arguments reuse the kernel");
    bit_pack(&a, 2, &o).unwrap().eval().unwrap();
    assert_eq!(cached_kernel_count(), 2, "new template arguments, new kernel");
}
