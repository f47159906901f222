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

/// The Python type name of `obj`, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// An integer argument: a Python int or an object that is one
/// (`operator.index`: NumPy's integers), not a bool; else a TypeError naming
/// `name`.
fn int_arg<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, pyo3::types::PyInt>> {
    let wrong = || PyTypeError::new_err(format!("{name}: expected an int, got {}", type_name(obj)));
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(wrong());
    }
    if let Ok(i) = obj.cast::<pyo3::types::PyInt>() {
        return Ok(i.clone());
    }
    let index = obj.py().import("operator")?.getattr("index")?;
    index.call1((obj,)).ok().and_then(|i| i.cast_into::<pyo3::types::PyInt>().ok()).ok_or_else(wrong)
}

/// A count or size argument (an int from 0 up): a TypeError naming `name`
/// for another type, a ValueError naming it and `allowed` for a negative or
/// too large value.
fn size_arg(obj: &Bound<'_, PyAny>, name: &str, allowed: &str) -> PyResult<usize> {
    let v = int_arg(obj, name)?;
    v.extract::<usize>().map_err(|_| PyValueError::new_err(format!("{name}: {v} is out of range; expected {allowed}")))
}

/// A bit-width argument (an int from 0 up that fits 32 bits).
fn bits_arg(obj: &Bound<'_, PyAny>, name: &str, allowed: &str) -> PyResult<u32> {
    let v = int_arg(obj, name)?;
    v.extract::<u32>().map_err(|_| PyValueError::new_err(format!("{name}: {v} is not supported; expected {allowed}")))
}

/// A float argument (a Python float or int, or a number that converts, such
/// as NumPy's), else a TypeError naming `name`.
fn float_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    let wrong = || PyTypeError::new_err(format!("{name}: expected a float, got {}", type_name(obj)));
    if obj.is_instance_of::<pyo3::types::PyBool>()
        || obj.is_instance_of::<pyo3::types::PyString>()
        || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(wrong());
    }
    obj.extract::<f64>().map_err(|_| wrong())
}

/// A string argument, else a TypeError naming `name`.
fn str_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    obj.cast::<pyo3::types::PyString>()
        .map_err(|_| PyTypeError::new_err(format!("{name}: expected a str, got {}", type_name(obj))))?
        .to_str()
        .map(str::to_string)
}

/// An optional string argument with a default: None gives `default`.
fn str_or(obj: Option<&Bound<'_, PyAny>>, name: &str, default: &str) -> PyResult<String> {
    match obj.filter(|o| !o.is_none()) {
        Some(o) => str_arg(o, name),
        None => Ok(default.to_string()),
    }
}

/// The stream for a `device` argument object: None, "cpu" or "gpu" (a
/// TypeError naming `device` for another type).
fn device_arg(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Stream>> {
    let Some(d) = device.filter(|d| !d.is_none()) else { return Ok(None) };
    let name = d
        .cast::<pyo3::types::PyString>()
        .map_err(|_| PyTypeError::new_err(format!("device: expected None, \"cpu\" or \"gpu\", got {}", type_name(d))))?
        .to_str()?
        .to_string();
    stream_for(Some(&name))
}

/// Kernel options from `policy` and `device` argument objects.
fn options_arg(policy: Option<&Bound<'_, PyAny>>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Options> {
    let policy: Policy = str_or(policy, "policy", "auto")?.parse().map_err(to_py_err)?;
    Ok(Options { policy, stream: device_arg(device)? })
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

/// The Lloyd–Max levels TurboQuant-MSE quantizes a rotated, normalised
/// coordinate of a `dim`-dimensional vector with (`bits` bits, ascending).
#[pyfunction]
fn sphere_codebook(dim: &Bound<'_, PyAny>, bits: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    let dim = size_arg(dim, "dim", "a vector size >= 2")?;
    let bits = bits_arg(bits, "bits", "1 to 8")?;
    let book = crate::quant::ScalarCodebook::sphere(dim, bits).map_err(|e| to_py_err(e.into()))?;
    Ok(book.centroids().to_vec())
}

/// The levels a cache's TurboQuant-MSE keys (`keys`) or values of `bits`
/// bits quantize a rotated, normalised coordinate of a `dim`-dimensional
/// vector with (ascending): the Lloyd–Max levels, or the uniform grid of
/// 3-bit values (`CacheConfig`'s choice of codec).
#[pyfunction]
fn turboquant_levels(dim: &Bound<'_, PyAny>, bits: &Bound<'_, PyAny>, keys: bool) -> PyResult<Vec<f32>> {
    let dim = size_arg(dim, "dim", "a vector size >= 2")?;
    if dim < 2 {
        return Err(PyValueError::new_err(format!("dim: {dim} is out of range; expected a vector size >= 2")));
    }
    let bits = bits_arg(bits, "bits", "1 to 8")?;
    let mut cfg = crate::cache::CacheConfig::new(dim, 1);
    (cfg.key_bits, cfg.value_bits) = (bits, bits);
    let side = if keys { cfg.key_codec() } else { cfg.value_codec() };
    side.table(dim, cfg.seed).map_err(to_py_err)?.ok_or_else(|| PyValueError::new_err("TurboQuant-MSE has a table"))
}

/// The values' bits when a configuration gives none
/// (`crate::cache::default_value_bits`): what `KVConfig` and `LayerCache`
/// both take.
#[pyfunction]
#[pyo3(signature = (key_method, value_method, key_bits = None))]
fn default_value_bits(key_method: &str, value_method: &str, key_bits: Option<u32>) -> PyResult<u32> {
    let key = crate::cache::Method::parse_arg("key_method", key_method).map_err(to_py_err)?;
    let value = crate::cache::Method::parse_arg("value_method", value_method).map_err(to_py_err)?;
    Ok(crate::cache::default_value_bits(key, value, key_bits))
}

/// KIVI keys' bits per channel from `weights` `[kv_heads][head_dim]` (what
/// an error in each channel costs the scores), `bits` on average: the
/// `key_widths` of a `LayerCache`, flat (`crate::cache::channel_widths`).
#[pyfunction]
fn kivi_channel_widths(weights: &Bound<'_, PyAny>, bits: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let bits = bits_arg(bits, "bits", "1 to 8")?;
    let rows: Vec<Vec<f32>> = weights
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("weights: expected a [kv_heads][head_dim] nested list of floats, got {}", type_name(weights))))?;
    let dim = rows.first().map_or(0, Vec::len);
    if rows.iter().any(|r| r.len() != dim) {
        return Err(PyValueError::new_err("weights: rows of unequal length; expected [kv_heads][head_dim]"));
    }
    Ok(crate::cache::channel_widths(&rows.concat(), dim, bits).map_err(to_py_err)?.into_iter().map(u32::from).collect())
}

#[pyfunction]
#[pyo3(signature = (codes, bits, *, policy = None, device = None))]
fn bit_pack(py: Python<'_>, codes: &Bound<'_, PyAny>, bits: &Bound<'_, PyAny>, policy: Option<&Bound<'_, PyAny>>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let codes = array_arg(codes, "codes")?;
    let out = kernels::bit_pack(&codes, bits, &options_arg(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (packed, bits, n, *, policy = None, device = None))]
fn bit_unpack(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    n: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let n = size_arg(n, "n", "a count >= 0")?;
    let packed = array_arg(packed, "packed")?;
    let out = kernels::bit_unpack(&packed, bits, n, &options_arg(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, codebook, *, policy = None, device = None))]
fn vq_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let x = array_arg(x, "x")?;
    let codebook = array_arg(codebook, "codebook")?;
    let out = kernels::vq_quantize(&x, &codebook, &options_arg(policy, device)?).map_err(to_py_err)?;
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
#[pyo3(signature = (x, codebook, bits, *, policy = None, device = None))]
fn scalar_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let (x, cb) = (array_arg(x, "x")?, array_arg(codebook, "codebook")?);
    let out = kernels::scalar_quantize(&x, &cb, bits, &options_arg(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (packed, codebook, bits, d, dtype, *, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn scalar_dequantize(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let d = size_arg(d, "d", "a head size >= 1")?;
    let dtype = str_arg(dtype, "dtype")?;
    let (p, cb) = (array_arg(packed, "packed")?, array_arg(codebook, "codebook")?);
    let out = kernels::scalar_dequantize(&p, &cb, bits, d, float_dtype(&dtype)?, &options_arg(policy, device)?)
        .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, bits, group, mode, *, policy = None, device = None))]
#[allow(clippy::type_complexity)]
fn kivi_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    group: &Bound<'_, PyAny>,
    mode: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let group = size_arg(group, "group", "a group size >= 1")?;
    let mode = str_arg(mode, "mode")?;
    let x = array_arg(x, "x")?;
    let (c, s, z) =
        kernels::kivi_quantize(&x, bits, group, kivi_mode(&mode)?, &options_arg(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, c)?, array_out(py, s)?, array_out(py, z)?))
}

#[pyfunction]
#[pyo3(signature = (packed, scales, zeros, bits, group, mode, d, dtype, *, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn kivi_dequantize(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    zeros: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    group: &Bound<'_, PyAny>,
    mode: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let d = size_arg(d, "d", "a head size >= 1")?;
    let group = size_arg(group, "group", "a group size >= 1")?;
    let dtype = str_arg(dtype, "dtype")?;
    let mode = str_arg(mode, "mode")?;
    let (p, s, z) = (array_arg(packed, "packed")?, array_arg(scales, "scales")?, array_arg(zeros, "zeros")?);
    let out = kernels::kivi_dequantize(
        &p,
        &s,
        &z,
        bits,
        group,
        kivi_mode(&mode)?,
        d,
        float_dtype(&dtype)?,
        &options_arg(policy, device)?,
    )
    .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (k, sketch, *, policy = None, device = None))]
fn qjl_encode(
    py: Python<'_>,
    k: &Bound<'_, PyAny>,
    sketch: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let (k, s) = (array_arg(k, "k")?, array_arg(sketch, "sketch")?);
    let (signs, norms) = kernels::qjl_encode(&k, &s, &options_arg(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, signs)?, array_out(py, norms)?))
}

#[pyfunction]
#[pyo3(signature = (q, sketch, signs, norms, *, policy = None, device = None))]
fn qjl_score(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    sketch: &Bound<'_, PyAny>,
    signs: &Bound<'_, PyAny>,
    norms: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let (q, s) = (array_arg(q, "q")?, array_arg(sketch, "sketch")?);
    let (sg, nm) = (array_arg(signs, "signs")?, array_arg(norms, "norms")?);
    let out = kernels::qjl_score(&q, &s, &sg, &nm, &options_arg(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, codebook, bits, *, policy = None, device = None))]
fn pq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Option<Py<PyAny>>)> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let (x, cb) = (array_arg(x, "x")?, array_arg(codebook, "codebook")?);
    let out = kernels::pq_encode(&x, &cb, bits, &options_arg(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, out.codes)?, out.codes_hi.map(|h| array_out(py, h)).transpose()?))
}

#[pyfunction]
#[pyo3(signature = (codes, codebook, bits, d, dtype, *, codes_hi = None, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn pq_decode(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    codebook: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    codes_hi: Option<&Bound<'_, PyAny>>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let d = size_arg(d, "d", "a head size >= 1")?;
    let dtype = str_arg(dtype, "dtype")?;
    let codes = kernels::PqCodes {
        codes: array_arg(codes, "codes")?,
        codes_hi: codes_hi.map(|h| array_arg(h, "codes_hi")).transpose()?,
    };
    let cb = array_arg(codebook, "codebook")?;
    let out =
        kernels::pq_decode(&codes, &cb, bits, d, float_dtype(&dtype)?, &options_arg(policy, device)?).map_err(to_py_err)?;
    array_out(py, out)
}

fn optional_array(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Array>> {
    obj.map(|o| array_arg(o, name)).transpose()
}

type ProdTuple = (Option<Py<PyAny>>, Py<PyAny>, Py<PyAny>, Option<Py<PyAny>>);

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids, sketch, bits, *, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_prod_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids: Option<&Bound<'_, PyAny>>,
    sketch: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<ProdTuple> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let x = array_arg(x, "x")?;
    let (rot, cent) = (optional_array(rotation, "rotation")?, optional_array(centroids, "centroids")?);
    let sk = array_arg(sketch, "sketch")?;
    let e = kernels::tq_prod_encode(&x, rot.as_ref(), cent.as_ref(), &sk, bits, &options_arg(policy, device)?)
        .map_err(to_py_err)?;
    Ok((
        e.codes.map(|a| array_out(py, a)).transpose()?,
        array_out(py, e.signs)?,
        array_out(py, e.norms)?,
        e.residual_norms.map(|a| array_out(py, a)).transpose()?,
    ))
}

#[pyfunction]
#[pyo3(signature = (codes, signs, norms, residual_norms, rotation, centroids, sketch, bits, dtype, *, policy = None, device = None))]
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
    bits: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let dtype = str_arg(dtype, "dtype")?;
    let enc = kernels::ProdCodes {
        codes: optional_array(codes, "codes")?,
        signs: array_arg(signs, "signs")?,
        norms: array_arg(norms, "norms")?,
        residual_norms: optional_array(residual_norms, "residual_norms")?,
    };
    let (rot, cent) = (optional_array(rotation, "rotation")?, optional_array(centroids, "centroids")?);
    let sk = array_arg(sketch, "sketch")?;
    let out = kernels::tq_prod_decode(&enc, rot.as_ref(), cent.as_ref(), &sk, bits, float_dtype(&dtype)?, &options_arg(policy, device)?)
        .map_err(to_py_err)?;
    array_out(py, out)
}

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids, bits, *, policy = None, device = None))]
fn tq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids: &Bound<'_, PyAny>,
    bits: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
    let bits = bits_arg(bits, "bits", "a supported bit width (an integer >= 1)")?;
    let x = array_arg(x, "x")?;
    let rot = optional_array(rotation, "rotation")?;
    let cent = array_arg(centroids, "centroids")?;
    let (codes, norms) =
        kernels::tq_encode(&x, rot.as_ref(), &cent, bits, &options_arg(policy, device)?).map_err(to_py_err)?;
    Ok((array_out(py, codes)?, array_out(py, norms)?))
}

#[pyfunction]
#[pyo3(signature = (x, rotation, centroids1, centroids2, bits1, bits2, *, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_rvq_encode(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids1: &Bound<'_, PyAny>,
    centroids2: &Bound<'_, PyAny>,
    bits1: &Bound<'_, PyAny>,
    bits2: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> {
    let bits1 = bits_arg(bits1, "bits1", "a supported bit width (an integer >= 1)")?;
    let bits2 = bits_arg(bits2, "bits2", "a supported bit width (an integer >= 1)")?;
    let x = array_arg(x, "x")?;
    let rot = optional_array(rotation, "rotation")?;
    let (c1, c2) = (array_arg(centroids1, "centroids1")?, array_arg(centroids2, "centroids2")?);
    let e = kernels::tq_rvq_encode(&x, rot.as_ref(), &c1, &c2, (bits1, bits2), &options_arg(policy, device)?)
        .map_err(to_py_err)?;
    Ok((array_out(py, e.codes1)?, array_out(py, e.codes2)?, array_out(py, e.norms)?))
}

#[pyfunction]
#[pyo3(signature = (codes1, codes2, norms, rotation, centroids1, centroids2, bits1, bits2, d, dtype, *, policy = None, device = None))]
#[allow(clippy::too_many_arguments)]
fn tq_rvq_decode(
    py: Python<'_>,
    codes1: &Bound<'_, PyAny>,
    codes2: &Bound<'_, PyAny>,
    norms: &Bound<'_, PyAny>,
    rotation: Option<&Bound<'_, PyAny>>,
    centroids1: &Bound<'_, PyAny>,
    centroids2: &Bound<'_, PyAny>,
    bits1: &Bound<'_, PyAny>,
    bits2: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    policy: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let bits1 = bits_arg(bits1, "bits1", "a supported bit width (an integer >= 1)")?;
    let bits2 = bits_arg(bits2, "bits2", "a supported bit width (an integer >= 1)")?;
    let d = size_arg(d, "d", "a head size >= 1")?;
    let dtype = str_arg(dtype, "dtype")?;
    let enc = kernels::RvqCodes {
        codes1: array_arg(codes1, "codes1")?,
        codes2: array_arg(codes2, "codes2")?,
        norms: array_arg(norms, "norms")?,
    };
    let rot = optional_array(rotation, "rotation")?;
    let (c1, c2) = (array_arg(centroids1, "centroids1")?, array_arg(centroids2, "centroids2")?);
    let out = kernels::tq_rvq_decode(&enc, rot.as_ref(), &c1, &c2, (bits1, bits2), d, float_dtype(&dtype)?, &options_arg(policy, device)?)
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
    m.add("MAX_KIVI_KEY_GROUP", crate::cache::MAX_KIVI_KEY_GROUP)?;
    m.add("DEFAULT_KEY_BITS", crate::cache::DEFAULT_KEY_BITS)?;
    m.add("DEFAULT_VALUE_BITS", crate::cache::DEFAULT_VALUE_BITS)?;
    // The cache's methods as the crate defines them: name -> (supported
    // bits or None where bits are ignored, keys only).
    let methods = pyo3::types::PyDict::new(m.py());
    for method in crate::cache::METHODS {
        methods.set_item(method.name(), (method.supported_bits().map(|b| b.to_vec()), method.keys_only()))?;
    }
    m.add("CACHE_METHODS", methods)?;
    // Other names each method answers to: alias -> name.
    let aliases = pyo3::types::PyDict::new(m.py());
    for method in crate::cache::METHODS {
        for alias in method.def().aliases {
            aliases.set_item(*alias, method.name())?;
        }
    }
    m.add("CACHE_METHOD_ALIASES", aliases)?;
    // The kernels' argument ranges, for the Python wrappers' early checks.
    m.add("SUPPORTED_BITS", crate::cpu::SUPPORTED_BITS.to_vec())?;
    m.add("PROD_BITS", kernels::PROD_BITS.to_vec())?;
    m.add("PQ_BITS", crate::cpu::PQ_BITS.collect::<Vec<u32>>())?;
    m.add("PQ_SUB_DIMS", kernels::PQ_SUB_DIMS.to_vec())?;
    m.add("VQ_DIMS", kernels::VQ_DIMS.to_vec())?;
    m.add("MAX_CODEBOOK_SIZE", kernels::MAX_CODEBOOK_SIZE)?;
    m.add_function(wrap_pyfunction!(sphere_codebook, m)?)?;
    m.add_function(wrap_pyfunction!(turboquant_levels, m)?)?;
    m.add_function(wrap_pyfunction!(bit_pack, m)?)?;
    m.add_function(wrap_pyfunction!(kivi_channel_widths, m)?)?;
    m.add_function(wrap_pyfunction!(default_value_bits, m)?)?;
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
