//! GPU kernels through MLX's `fast::metal_kernel` / `fast::cuda_kernel`.
//!
//! A kernel object is created once per (back-end, kernel, template arguments)
//! and kept in one process-wide cache. Template arguments travel through
//! MLX's template-argument API, which writes them into the source. CUDA
//! sources reach MLX as `#include` lines (`cuda_source`).

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

use super::cuda_source::{self, CudaSource};
use super::declaration::{Kernel, TemplateArg};
use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ffi;
use crate::stream::{Backend, Stream};

/// One launch of a GPU kernel.
pub(crate) struct Launch<'a> {
    pub kernel: Kernel,
    pub inputs: &'a [&'a Array],
    pub outputs: &'a [(Vec<i32>, Dtype)],
    /// Threads (not threadgroups) in each dimension.
    pub grid: (i32, i32, i32),
    pub threadgroup: (i32, i32, i32),
    pub template: &'a [(&'static str, TemplateArg)],
}

/// A kernel's body and header are compiled into the crate and chosen by its
/// source and template arguments alone, so those name it; hashing the text
/// (tens of KB) on every launch cost about 10 µs of host time a call.
#[derive(PartialEq, Eq, Hash)]
struct Key {
    backend: Backend,
    kernel: Kernel,
    template: Vec<(&'static str, TemplateArg)>,
}

enum Handle {
    Metal(ffi::mlx_fast_metal_kernel),
    Cuda(ffi::mlx_fast_cuda_kernel),
}

// SAFETY: the handle owns an immutable MLX CustomKernelFunction (a closure
// over strings); MLX guards its own compiled-kernel caches.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: owned handles, freed once.
        unsafe {
            match *self {
                Handle::Metal(k) => ffi::mlx_fast_metal_kernel_free(k),
                Handle::Cuda(k) => ffi::mlx_fast_cuda_kernel_free(k),
            }
        }
    }
}

fn cache() -> &'static Mutex<HashMap<Key, Arc<Handle>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Arc<Handle>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// How many kernel objects have been created (for tests of the cache).
pub fn cached_kernel_count() -> usize {
    cache().lock().map(|c| c.len()).unwrap_or(0)
}

fn strings(names: &[&str]) -> Result<ffi::mlx_vector_string> {
    // SAFETY: a new vector, filled with copies of the names.
    let v = unsafe { ffi::mlx_vector_string_new() };
    for n in names {
        let c = CString::new(*n).map_err(|_| Error::invalid("name", "contains NUL"))?;
        ffi::check(unsafe { ffi::mlx_vector_string_append_value(v, c.as_ptr()) })?;
    }
    Ok(v)
}

/// `text` without its comments, indentation and blank lines. MLX's
/// `cuda_kernel` assembles a kernel's whole source at every launch, and its
/// host time per launch grew with the source's length on the H200 (about
/// 0.25 µs per KB: a 93 KB kernel 31.6 µs a launch against 9.2 for a small
/// one, scripts/gpu/custom_kernel_host_cost.py); the sources are written
/// with a `//` comment on lines of their own or after code, never inside a
/// string.
pub fn compact_source(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let code = line.find("//").map_or(line, |i| &line[..i]).trim();
        if !code.is_empty() {
            out.push_str(code);
            out.push('\n');
        }
    }
    out
}

fn create(backend: Backend, kernel: Kernel, template: &[(&'static str, TemplateArg)]) -> Result<Handle> {
    let d = kernel.declaration();
    let name = CString::new(d.mlx_name).expect("static name");
    let (input_names, output_names, body) = kernel.signature(backend, template);
    let Some(body) = body else {
        return Err(Error::Unsupported(format!("{}: no kernel body for the {} back-end", d.name, backend.name())));
    };
    let (mut body, mut header) = (compact_source(&body), compact_source(&kernel.header(backend, template)));
    if backend == Backend::Cuda {
        let dir = cuda_source::source_dir();
        CudaSource { header, body } = cuda_source::by_include(dir.as_deref(), d.mlx_name, &header, &body, &input_names);
    }
    let body = CString::new(body).map_err(|_| Error::invalid("source", "contains NUL"))?;
    let header = CString::new(header).map_err(|_| Error::invalid("header", "contains NUL"))?;
    let inputs = strings(&input_names.iter().map(String::as_str).collect::<Vec<_>>())?;
    let outputs = strings(&output_names.iter().map(String::as_str).collect::<Vec<_>>())?;
    // SAFETY: all pointers are valid for the call; MLX copies the strings.
    let handle = unsafe {
        match backend {
            Backend::Metal => {
                let k = ffi::mlx_fast_metal_kernel_new(
                    name.as_ptr(), inputs, outputs, body.as_ptr(), header.as_ptr(), !d.strided, false,
                );
                (!k.ctx.is_null()).then_some(Handle::Metal(k))
            }
            _ => {
                let k = ffi::mlx_fast_cuda_kernel_new(
                    name.as_ptr(),
                    inputs,
                    outputs,
                    body.as_ptr(),
                    header.as_ptr(),
                    !d.strided,
                    kernel.cuda_dynamic_shared_bytes(template),
                );
                (!k.ctx.is_null()).then_some(Handle::Cuda(k))
            }
        }
    };
    unsafe {
        ffi::mlx_vector_string_free(inputs);
        ffi::mlx_vector_string_free(outputs);
    }
    match handle {
        Some(h) => Ok(h),
        None => {
            ffi::check(1)?;
            unreachable!()
        }
    }
}

fn kernel(backend: Backend, launch: &Launch<'_>) -> Result<Arc<Handle>> {
    let key = Key { backend, kernel: launch.kernel, template: launch.template.to_vec() };
    let mut cache = cache().lock().map_err(|_| Error::Unsupported("kernel cache poisoned".into()))?;
    if let Some(k) = cache.get(&key) {
        return Ok(k.clone());
    }
    let k = Arc::new(create(backend, launch.kernel, launch.template)?);
    cache.insert(key, k.clone());
    Ok(k)
}

/// Builds the kernel's outputs (lazily) on `stream`, a GPU stream.
pub(crate) fn launch(launch: &Launch<'_>, stream: &Stream) -> Result<Vec<Array>> {
    let backend = stream.backend()?;
    let handle = kernel(backend, launch)?;
    // The config type differs by name only; both are the same C++ struct.
    macro_rules! configure_and_apply {
        ($cfg_new:ident, $cfg_free:ident, $out:ident, $grid:ident, $tg:ident, $tdtype:ident, $tint:ident,
         $tbool:ident, $apply:ident, $k:expr) => {{
            // SAFETY: the config is created, filled and freed here; handles are valid.
            unsafe {
                let cfg = ffi::$cfg_new();
                let result = (|| -> Result<ffi::mlx_vector_array> {
                    for (shape, dtype) in launch.outputs {
                        ffi::check(ffi::$out(cfg, shape.as_ptr(), shape.len(), dtype.to_raw()))?;
                    }
                    let (g0, g1, g2) = launch.grid;
                    ffi::check(ffi::$grid(cfg, g0, g1, g2))?;
                    let (t0, t1, t2) = launch.threadgroup;
                    ffi::check(ffi::$tg(cfg, t0, t1, t2))?;
                    for (name, arg) in launch.template {
                        let n = CString::new(*name).expect("static name");
                        ffi::check(match arg {
                            TemplateArg::Dtype(d) => ffi::$tdtype(cfg, n.as_ptr(), d.to_raw()),
                            TemplateArg::Int(v) => ffi::$tint(cfg, n.as_ptr(), *v),
                            TemplateArg::Bool(v) => ffi::$tbool(cfg, n.as_ptr(), *v),
                        })?;
                    }
                    let raws: Vec<ffi::mlx_array> = launch.inputs.iter().map(|a| a.raw()).collect();
                    let ins = ffi::mlx_vector_array_new_data(raws.as_ptr(), raws.len());
                    let mut outs = ffi::mlx_vector_array { ctx: std::ptr::null_mut() };
                    let status = ffi::$apply(&mut outs, $k, ins, cfg, stream.raw());
                    ffi::mlx_vector_array_free(ins);
                    ffi::check(status)?;
                    Ok(outs)
                })();
                ffi::$cfg_free(cfg);
                result
            }
        }};
    }
    let outs = match *handle {
        Handle::Metal(k) => configure_and_apply!(
            mlx_fast_metal_kernel_config_new, mlx_fast_metal_kernel_config_free,
            mlx_fast_metal_kernel_config_add_output_arg, mlx_fast_metal_kernel_config_set_grid,
            mlx_fast_metal_kernel_config_set_thread_group, mlx_fast_metal_kernel_config_add_template_arg_dtype,
            mlx_fast_metal_kernel_config_add_template_arg_int, mlx_fast_metal_kernel_config_add_template_arg_bool,
            mlx_fast_metal_kernel_apply, k
        ),
        Handle::Cuda(k) => configure_and_apply!(
            mlx_fast_cuda_kernel_config_new, mlx_fast_cuda_kernel_config_free,
            mlx_fast_cuda_kernel_config_add_output_arg, mlx_fast_cuda_kernel_config_set_grid,
            mlx_fast_cuda_kernel_config_set_thread_group, mlx_fast_cuda_kernel_config_add_template_arg_dtype,
            mlx_fast_cuda_kernel_config_add_template_arg_int, mlx_fast_cuda_kernel_config_add_template_arg_bool,
            mlx_fast_cuda_kernel_apply, k
        ),
    }?;
    super::take_vector(outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_sources_keep_code_and_lines_and_drop_comments() {
        let text = "// a kernel\n#define W 4 \\\n  + 1\n\n  float x = 1.0f;  // why\n    // more\nasm(\"a;\\n\" ::: \"memory\");\n";
        assert_eq!(compact_source(text), "#define W 4 \\\n+ 1\nfloat x = 1.0f;\nasm(\"a;\\n\" ::: \"memory\");\n");
    }
}
