//! The pyo3 module `veloxquant._native`: the only Python entry to native code.
//!
//! Arrays cross as `mlx.core.array` objects with no copy and no evaluation
//! (through mlx's own nanobind type registry, see mlx-c/src/python_bridge.cpp).
//! Errors become Python exceptions in one place, [`to_py_err`].

mod cache;

use pyo3::exceptions::{PyImportError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::array::{check_mlx_version, mlx_compiled_version, Array};
use crate::error::Error;
use crate::ffi;
use crate::kernels::{self, Options, Policy};
use crate::stream::Stream;

/// The one mapping from veloxquant errors to Python exceptions.
fn to_py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Dtype { .. } => PyTypeError::new_err(msg),
        Error::InvalidArgument { .. } => PyValueError::new_err(msg),
        Error::VersionMismatch { .. } => PyImportError::new_err(msg),
        Error::Unsupported(_) | Error::Mlx { .. } | Error::Kernel { .. } => PyRuntimeError::new_err(msg),
    }
}

/// Borrows the C++ array behind an `mlx.core.array` argument.
fn array_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Array> {
    // SAFETY: `obj` is a live Python object for the duration of the call.
    if unsafe { ffi::vq_python_is_array(obj.as_ptr().cast()) } == 0 {
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        return Err(PyTypeError::new_err(format!("{name}: expected an mlx.core.array, got {ty}")));
    }
    let mut raw = Array::empty_handle();
    // SAFETY: as above; `raw` receives a new handle sharing the array.
    let status = unsafe { ffi::vq_python_array_borrow(&mut raw, obj.as_ptr().cast()) };
    ffi::check(status).and_then(|_| Array::from_raw(raw)).map_err(to_py_err)
}

/// A new `mlx.core.array` owning `a`.
fn array_out(py: Python<'_>, a: Array) -> PyResult<Py<PyAny>> {
    // SAFETY: returns a new reference or NULL with a Python error set.
    let ptr = unsafe { ffi::vq_python_array_wrap(a.raw()) };
    unsafe { Bound::from_owned_ptr_or_err(py, ptr.cast()) }.map(Bound::unbind)
}

/// The stream for a `device` argument: None (MLX's default), "cpu" or "gpu".
fn stream_for(device: Option<&str>) -> PyResult<Option<Stream>> {
    Ok(match device {
        None => None,
        Some("cpu") => Some(Stream::cpu()),
        Some("gpu") => Some(Stream::gpu().map_err(to_py_err)?),
        Some(other) => {
            return Err(PyValueError::new_err(format!("device: {other:?} is not one of \"cpu\", \"gpu\"")))
        }
    })
}

fn options(policy: &str, device: Option<&str>) -> PyResult<Options> {
    let policy: Policy = policy.parse().map_err(to_py_err)?;
    Ok(Options { policy, stream: stream_for(device)? })
}

#[pyfunction]
#[pyo3(signature = (codes, bits, *, policy = "auto", device = None))]
fn bit_pack(py: Python<'_>, codes: &Bound<'_, PyAny>, bits: u32, policy: &str, device: Option<&str>) -> PyResult<Py<PyAny>> {
    let codes = array_arg(codes, "codes")?;
    let out = kernels::bit_pack(&codes, bits, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (packed, bits, n, *, policy = "auto", device = None))]
fn bit_unpack(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    bits: u32,
    n: usize,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let packed = array_arg(packed, "packed")?;
    let out = kernels::bit_unpack(&packed, bits, n, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, codebook, *, policy = "auto", device = None))]
fn vq_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let x = array_arg(x, "x")?;
    let codebook = array_arg(codebook, "codebook")?;
    let out = kernels::vq_quantize(&x, &codebook, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

/// The GPU back-end of the loaded MLX: "metal", "cuda" or None.
#[pyfunction]
fn gpu_backend() -> Option<&'static str> {
    crate::stream::gpu_backend().map(|b| b.name())
}

/// Number of GPU kernel objects created so far (one per kernel, template
/// arguments and source).
#[pyfunction]
fn cached_kernel_count() -> usize {
    kernels::cached_kernel_count()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // mlx.core must be loaded first: it owns libmlx and the nanobind domain.
    m.py().import("mlx.core")?;
    check_mlx_version().map_err(to_py_err)?;
    // SAFETY: `m` is the module object being initialised.
    if unsafe { ffi::vq_python_bridge_init(m.as_ptr().cast()) } != 0 {
        return Err(PyErr::take(m.py()).unwrap_or_else(|| PyImportError::new_err("nanobind bridge to mlx failed")));
    }
    m.add("MLX_VERSION", mlx_compiled_version())?;
    m.add_function(wrap_pyfunction!(bit_pack, m)?)?;
    m.add_function(wrap_pyfunction!(bit_unpack, m)?)?;
    m.add_function(wrap_pyfunction!(vq_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_backend, m)?)?;
    m.add_function(wrap_pyfunction!(cached_kernel_count, m)?)?;
    m.add_class::<cache::PyLayerCache>()?;
    Ok(())
}
