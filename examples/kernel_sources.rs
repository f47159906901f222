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
//! With `--by-include`, `.cu` and `.cuh` hold what MLX receives instead: the
//! `#include` lines of files the crate writes (`kernels::cuda_source_by_include`),
//! here in `DIR/included`.
//!
//!     cargo run --release --example kernel_sources -- DIR [--by-include]

use std::path::PathBuf;

use veloxquant::kernels::{compact_source, cuda_source_by_include, Kernel, TemplateArg};
use veloxquant::Backend;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: kernel_sources DIR [--by-include]"));
    let included = args.any(|a| a == "--by-include").then(|| dir.join("included"));
    std::fs::create_dir_all(&dir)?;
    // A body and header as written: as compacted, or as MLX receives them.
    let write = |name: &str, ext: &str, header: &str, body: &str, inputs: &[String]| -> std::io::Result<()> {
        let (header, body) = match &included {
            Some(at) => {
                let s = cuda_source_by_include(Some(at), name, header, body, inputs);
                (s.header, s.body)
            }
            None => (header.to_owned(), body.to_owned()),
        };
        std::fs::write(dir.join(format!("{name}.{ext}")), header)?;
        std::fs::write(dir.join(format!("{name}.cu")), body)
    };
    for &kernel in Kernel::ALL {
        let d = kernel.declaration();
        let Some(body) = d.cuda else { continue };
        let (inputs, outputs, _) = kernel.signature(Backend::Cuda, &[]);
        let body = compact_source(body);
        let header = compact_source(&kernel.header(Backend::Cuda, &[]));
        let tensor_cores = compact_source(&kernel.header(Backend::Cuda, &[("TC", TemplateArg::Int(1))]));
        if tensor_cores != header {
            write(d.name, "tc.cuh", &tensor_cores, &body, &inputs)?;
        }
        write(d.name, "cuh", &header, &body, &inputs)?;
        std::fs::write(dir.join(format!("{}.args", d.name)), format!("{}\n{}\n", inputs.join(" "), outputs.join(" ")))?;
        if matches!(kernel, Kernel::TqDecode | Kernel::WindowAppend) {
            // Its instantiations over four sequences' own arrays.
            let (inputs, outputs, body) = kernel.signature(Backend::Cuda, &[("EACH", TemplateArg::Int(4))]);
            let name = format!("{}_each", d.name);
            write(&name, "cuh", &header, &compact_source(&body.expect("a CUDA body")), &inputs)?;
            std::fs::write(dir.join(format!("{name}.args")), format!("{}\n{}\n", inputs.join(" "), outputs.join(" ")))?;
        }
    }
    Ok(())
}
