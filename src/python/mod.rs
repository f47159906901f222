//! The pyo3 module `veloxquant._native`: the only Python entry to native code.
//!
//! Arrays cross as `mlx.core.array` objects with no copy and no evaluation
//! (through mlx's own nanobind type registry, see mlx-c/src/python_bridge.cpp).
//! Errors become Python exceptions in one place, [`to_py_err`].

mod cache;

use pyo3::exceptions::{
    PyFileNotFoundError, PyImportError, PyOSError, PyPermissionError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;

use crate::array::{check_mlx_version, mlx_compiled_version, Array};
use crate::error::Error;
use crate::ffi;
use crate::dtype::Dtype;
use crate::kernels::{self, KiviMode, Options, Policy};
use crate::quant::QuantError;
use crate::stream::Stream;

mod quant;

/// The one mapping from veloxquant errors to Python exceptions.
fn to_py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Dtype { .. } => PyTypeError::new_err(msg),
        Error::InvalidArgument { .. } => PyValueError::new_err(msg),
        Error::VersionMismatch { .. } => PyImportError::new_err(msg),
        Error::Unsupported(_) | Error::Mlx { .. } | Error::Kernel { .. } => PyRuntimeError::new_err(msg),
        // The file could not be read or written: the OSError subclass Python
        // itself would raise.
        Error::Quant(QuantError::Io(io)) => match io.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => PyOSError::new_err(msg),
        },
        // Bad bits/dim/options, non-finite data, an empty calibration set, an
        // encoding or artifact that does not match: all wrong values.
        Error::Quant(_) => PyValueError::new_err(msg),
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

fn float_dtype(name: &str) -> PyResult<Dtype> {
    match name {
        "float32" => Ok(Dtype::F32),
        "float16" => Ok(Dtype::F16),
        "bfloat16" => Ok(Dtype::BF16),
        other => Err(PyTypeError::new_err(format!(
            "dtype: dtype {other} is not supported; expected float32, float16 or bfloat16"
        ))),
    }
}

fn kivi_mode(mode: &str) -> PyResult<KiviMode> {
    match mode {
        "keys" => Ok(KiviMode::Keys),
        "values" => Ok(KiviMode::Values),
        other => Err(PyValueError::new_err(format!("mode: {other:?} is not one of \"keys\", \"values\""))),
    }
}

#[pyfunction]
#[pyo3(signature = (x, codebook, bits, *, policy = "auto", device = None))]
fn scalar_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: u32,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let (x, cb) = (array_arg(x, "x")?, array_arg(codebook, "codebook")?);
    let out = kernels::scalar_quantize(&x, &cb, bits, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (packed, codebook, bits, d, dtype, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn scalar_dequantize(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: u32,
    d: usize,
    dtype: &str,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let (p, cb) = (array_arg(packed, "packed")?, array_arg(codebook, "codebook")?);
    let out = kernels::scalar_dequantize(&p, &cb, bits, d, float_dtype(dtype)?, &options(policy, device)?)
        .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, bits, group, mode, *, policy = "auto", device = None))]
#[allow(clippy::type_complexity)]
fn kivi_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    bits: u32,
    group: usize,
    mode: &str,
    policy: &str,
    device: Option<&str>,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let x = array_arg(x, "x")?;
    let (c, s, z) =
        kernels::kivi_quantize(&x, bits, group, kivi_mode(mode)?, &options(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, c)?, array_out(py, s)?, array_out(py, z)?))
}

#[pyfunction]
#[pyo3(signature = (packed, scales, zeros, bits, group, mode, d, dtype, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn kivi_dequantize(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    zeros: &Bound<'_, PyAny>,
    bits: u32,
    group: usize,
    mode: &str,
    d: usize,
    dtype: &str,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let (p, s, z) = (array_arg(packed, "packed")?, array_arg(scales, "scales")?, array_arg(zeros, "zeros")?);
    let out = kernels::kivi_dequantize(
        &p,
        &s,
        &z,
        bits,
        group,
        kivi_mode(mode)?,
        d,
        float_dtype(dtype)?,
        &options(policy, device)?,
    )
    .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (k, sketch, *, policy = "auto", device = None))]
fn qjl_encode(
    py: Python<'_>,
    k: &Bound<'_, PyAny>,
    sketch: &Bound<'_, PyAny>,
    policy: &str,
    device: Option<&str>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let (k, s) = (array_arg(k, "k")?, array_arg(sketch, "sketch")?);
    let (signs, norms) = kernels::qjl_encode(&k, &s, &options(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, signs)?, array_out(py, norms)?))
}

#[pyfunction]
#[pyo3(signature = (q, sketch, signs, norms, *, policy = "auto", device = None))]
fn qjl_score(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    sketch: &Bound<'_, PyAny>,
    signs: &Bound<'_, PyAny>,
    norms: &Bound<'_, PyAny>,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let (q, s) = (array_arg(q, "q")?, array_arg(sketch, "sketch")?);
    let (sg, nm) = (array_arg(signs, "signs")?, array_arg(norms, "norms")?);
    let out = kernels::qjl_score(&q, &s, &sg, &nm, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, codebook, bits, *, policy = "auto", device = None))]
fn pq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: u32,
    policy: &str,
    device: Option<&str>,
) -> PyResult<(Py<PyAny>, Option<Py<PyAny>>)> {
    let (x, cb) = (array_arg(x, "x")?, array_arg(codebook, "codebook")?);
    let out = kernels::pq_encode(&x, &cb, bits, &options(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, out.codes)?, out.codes_hi.map(|h| array_out(py, h)).transpose()?))
}

#[pyfunction]
#[pyo3(signature = (codes, codebook, bits, d, dtype, *, codes_hi = None, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn pq_decode(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: u32,
    d: usize,
    dtype: &str,
    codes_hi: Option<&Bound<'_, PyAny>>,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let codes = kernels::PqCodes {
        codes: array_arg(codes, "codes")?,
        codes_hi: codes_hi.map(|h| array_arg(h, "codes_hi")).transpose()?,
    };
    let cb = array_arg(codebook, "codebook")?;
    let out =
        kernels::pq_decode(&codes, &cb, bits, d, float_dtype(dtype)?, &options(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

fn optional_array(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Array>> {
    obj.map(|o| array_arg(o, name)).transpose()
}

type ProdTuple = (Option<Py<PyAny>>, Py<PyAny>, Py<PyAny>, Option<Py<PyAny>>);

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids, sketch, bits, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_prod_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids: Option<&Bound<'_, PyAny>>,
    sketch: &Bound<'_, PyAny>,
    bits: u32,
    policy: &str,
    device: Option<&str>,
) -> PyResult<ProdTuple> {
    let x = array_arg(x, "x")?;
    let (rot, cent) = (optional_array(rotation, "rotation")?, optional_array(centroids, "centroids")?);
    let sk = array_arg(sketch, "sketch")?;
    let e = kernels::tq_prod_encode(&x, rot.as_ref(), cent.as_ref(), &sk, bits, &options(policy, device)?)
        .map_err(to_py_err)?;
    Ok((
        e.codes.map(|a| array_out(py, a)).transpose()?,
        array_out(py, e.signs)?,
        array_out(py, e.norms)?,
        e.residual_norms.map(|a| array_out(py, a)).transpose()?,
    ))
}

#[pyfunction]
#[pyo3(signature = (codes, signs, norms, residual_norms, rotation, centroids, sketch, bits, dtype, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_prod_decode(
    py: Python<'_>,
    codes: Option<&Bound<'_, PyAny>>,
    signs: &Bound<'_, PyAny>,
    norms: &Bound<'_, PyAny>,
    residual_norms: Option<&Bound<'_, PyAny>>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids: Option<&Bound<'_, PyAny>>,
    sketch: &Bound<'_, PyAny>,
    bits: u32,
    dtype: &str,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let enc = kernels::ProdCodes {
        codes: optional_array(codes, "codes")?,
        signs: array_arg(signs, "signs")?,
        norms: array_arg(norms, "norms")?,
        residual_norms: optional_array(residual_norms, "residual_norms")?,
    };
    let (rot, cent) = (optional_array(rotation, "rotation")?, optional_array(centroids, "centroids")?);
    let sk = array_arg(sketch, "sketch")?;
    let out = kernels::tq_prod_decode(&enc, rot.as_ref(), cent.as_ref(), &sk, bits, float_dtype(dtype)?, &options(policy, device)?)
        .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids, bits, *, policy = "auto", device = None))]
fn tq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids: &Bound<'_, PyAny>,
    bits: u32,
    policy: &str,
    device: Option<&str>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let x = array_arg(x, "x")?;
    let rot = optional_array(rotation, "rotation")?;
    let cent = array_arg(centroids, "centroids")?;
    let (codes, norms) =
        kernels::tq_encode(&x, rot.as_ref(), &cent, bits, &options(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, codes)?, array_out(py, norms)?))
}

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids1, centroids2, bits1, bits2, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_rvq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids1: &Bound<'_, PyAny>,
    centroids2: &Bound<'_, PyAny>,
    bits1: u32,
    bits2: u32,
    policy: &str,
    device: Option<&str>,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let x = array_arg(x, "x")?;
    let rot = optional_array(rotation, "rotation")?;
    let (c1, c2) = (array_arg(centroids1, "centroids1")?, array_arg(centroids2, "centroids2")?);
    let e = kernels::tq_rvq_encode(&x, rot.as_ref(), &c1, &c2, (bits1, bits2), &options(policy, device)?)
        .map_err(to_py_err)?;
    Ok((array_out(py, e.codes1)?, array_out(py, e.codes2)?, array_out(py, e.norms)?))
}

#[pyfunction]
#[pyo3(signature = (codes1, codes2, norms, rotation, centroids1, centroids2, bits1, bits2, d, dtype, *, policy = "auto", device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_rvq_decode(
    py: Python<'_>,
    codes1: &Bound<'_, PyAny>,
    codes2: &Bound<'_, PyAny>,
    norms: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids1: &Bound<'_, PyAny>,
    centroids2: &Bound<'_, PyAny>,
    bits1: u32,
    bits2: u32,
    d: usize,
    dtype: &str,
    policy: &str,
    device: Option<&str>,
) -> PyResult<Py<PyAny>> {
    let enc = kernels::RvqCodes {
        codes1: array_arg(codes1, "codes1")?,
        codes2: array_arg(codes2, "codes2")?,
        norms: array_arg(norms, "norms")?,
    };
    let rot = optional_array(rotation, "rotation")?;
    let (c1, c2) = (array_arg(centroids1, "centroids1")?, array_arg(centroids2, "centroids2")?);
    let out = kernels::tq_rvq_decode(&enc, rot.as_ref(), &c1, &c2, (bits1, bits2), d, float_dtype(dtype)?, &options(policy, device)?)
        .map_err(to_py_err)?;
    array_out(py, out)
}

/// Names of the primitives MLX would run to evaluate `arrays` (one per
/// unevaluated graph node).
#[pyfunction]
fn pending_primitives(arrays: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let mut held = Vec::new();
    for (i, item) in arrays.try_iter()?.enumerate() {
        held.push(array_arg(&item?, &format!("arrays[{i}]"))?);
    }
    let refs: Vec<&Array> = held.iter().collect();
    crate::graph::pending_primitives(&refs).map_err(to_py_err)
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
    m.add_function(wrap_pyfunction!(scalar_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(scalar_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(kivi_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(kivi_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(qjl_encode, m)?)?;
    m.add_function(wrap_pyfunction!(qjl_score, m)?)?;
    m.add_function(wrap_pyfunction!(pq_encode, m)?)?;
    m.add_function(wrap_pyfunction!(pq_decode, m)?)?;
    m.add_function(wrap_pyfunction!(tq_encode, m)?)?;
    m.add_function(wrap_pyfunction!(tq_prod_encode, m)?)?;
    m.add_function(wrap_pyfunction!(tq_prod_decode, m)?)?;
    m.add_function(wrap_pyfunction!(tq_rvq_encode, m)?)?;
    m.add_function(wrap_pyfunction!(tq_rvq_decode, m)?)?;
    m.add_function(wrap_pyfunction!(pending_primitives, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_backend, m)?)?;
    m.add_function(wrap_pyfunction!(cached_kernel_count, m)?)?;
    m.add_class::<cache::PyLayerCache>()?;
    quant::register(m)?;
    Ok(())
}
