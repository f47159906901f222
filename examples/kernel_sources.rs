//! Writes every CUDA kernel as the crate hands it to MLX, for
//! scripts/gpu/cuda-compile-check.py to compile without a GPU: for each
//! kernel with a CUDA body, in DIR,
//! - `<name>.cu`: the body, compacted (`kernels::compact_source`);
//! - `<name>.cuh`: the header (`Kernel::header`: the generated codec ids
//!   where the kernel reads them, then the declared header files);
//! - `<name>.tc.cuh`: the header of the tensor-core instantiations
//!   (template `TC` > 0) where it differs;
//! - `<name>.args`: the input names, then on a second line the output
//!   names, as MLX passes them (the CUDA body's own after the declared);
//! - and `tq_decode_each.*` and `window_append_each.*`, those kernels over
//!   four sequences' own arrays (`EACH` = 4).
//!
//!     cargo run --release --example kernel_sources -- DIR

use std::path::PathBuf;

use veloxquant::kernels::{compact_source, Kernel, TemplateArg};
use veloxquant::Backend;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).expect("usage: kernel_sources DIR"));
    std::fs::create_dir_all(&dir)?;
    for &kernel in Kernel::ALL {
        let d = kernel.declaration();
        let Some(body) = d.cuda else { continue };
        std::fs::write(dir.join(format!("{}.cu", d.name)), compact_source(body))?;
        let header = compact_source(&kernel.header(Backend::Cuda, &[]));
        let tensor_cores = compact_source(&kernel.header(Backend::Cuda, &[("TC", TemplateArg::Int(1))]));
        if tensor_cores != header {
            std::fs::write(dir.join(format!("{}.tc.cuh", d.name)), tensor_cores)?;
        }
        std::fs::write(dir.join(format!("{}.cuh", d.name)), &header)?;
        let (inputs, outputs, _) = kernel.signature(Backend::Cuda, &[]);
        std::fs::write(dir.join(format!("{}.args", d.name)), format!("{}\n{}\n", inputs.join(" "), outputs.join(" ")))?;
        if matches!(kernel, Kernel::TqDecode | Kernel::WindowAppend) {
            // Its instantiations over four sequences' own arrays.
            let (inputs, outputs, body) = kernel.signature(Backend::Cuda, &[("EACH", TemplateArg::Int(4))]);
            let name = format!("{}_each", d.name);
            std::fs::write(dir.join(format!("{name}.cu")), compact_source(&body.expect("a CUDA body")))?;
            std::fs::write(dir.join(format!("{name}.cuh")), &header)?;
            std::fs::write(dir.join(format!("{name}.args")), format!("{}\n{}\n", inputs.join(" "), outputs.join(" ")))?;
        }
    }
    Ok(())
}
