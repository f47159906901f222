//! The quantizers of [`crate::quant`] for Python: `Quantizer` and `Encoded`.
//!
//! Inputs are `[n, dim]` numpy arrays (float16, float32, float64) or
//! `mlx.core.array`s (float16, bfloat16, float32, float64). They are copied
//! into float32 rows because the quantizers are CPU code over `&[f32]`.
//! Results are numpy float32, or `mlx.core.array` float32 when the array that
//! produced them (the input of `encode`, the queries of
//! `estimate_inner_products`) was one. The GIL is released while the
//! quantizers run. Every error goes through [`super::to_py_err`].

use std::sync::{Arc, RwLock};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{array_arg, array_out, to_py_err};
use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::Error;
use crate::ffi;
use crate::quant::{self as q, artifact, kivi, outlier, pq, qjl, turboquant, PqConfig, QuantError, RotationKind};

/// Every method name the constructor takes ("outlier" is short for "outlier-split").
const METHODS: [&str; 8] = [
    turboquant::MSE,
    turboquant::PROD,
    turboquant::RVQ,
    outlier::METHOD,
    qjl::METHOD,
    pq::METHOD,
    kivi::KEYS,
    kivi::VALUES,
];

fn qerr(e: QuantError) -> PyErr {
    to_py_err(e.into())
}

// ------------------------------------------------------------------ arrays

/// Rows read from a Python array, and whether it was an `mlx.core.array`.
struct Rows {
    data: Vec<f32>,
    n: usize,
    mlx: bool,
}

fn is_mlx(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is a live Python object for the duration of the call.
    unsafe { ffi::vq_python_is_array(obj.as_ptr().cast()) != 0 }
}

fn bad_shape(name: &'static str, shape: &[usize], dim: usize) -> PyErr {
    to_py_err(Error::invalid(name, format!("shape {shape:?} is not [n, {dim}]")))
}

/// Copies `obj`, a `[n, dim]` float array, into f32 rows, refusing other
/// dtypes (TypeError), shapes (ValueError) and NaN/inf (ValueError).
fn rows_arg(obj: &Bound<'_, PyAny>, name: &'static str, dim: usize) -> PyResult<Rows> {
    const EXPECTED: &str = "float16, float32 or float64 (numpy), also bfloat16 (mlx)";
    let (data, n, mlx) = if is_mlx(obj) {
        let a = array_arg(obj, name)?;
        let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
        if shape.len() != 2 || shape[1] != dim {
            return Err(bad_shape(name, &shape, dim));
        }
        let data = match a.dtype() {
            Dtype::F32 => a.to_vec::<f32>(),
            Dtype::F16 => a.to_vec::<half::f16>().map(|v| v.iter().map(|x| x.to_f32()).collect()),
            Dtype::BF16 => a.to_vec::<half::bf16>().map(|v| v.iter().map(|x| x.to_f32()).collect()),
            Dtype::F64 => a.to_vec::<f64>().map(|v| v.iter().map(|&x| x as f32).collect()),
            other => {
                return Err(to_py_err(Error::Dtype { argument: name, found: other.to_string(), expected: EXPECTED.into() }))
            }
        }
        .map_err(to_py_err)?;
        (data, shape[0], true)
    } else {
        let Ok(arr) = obj.cast::<PyUntypedArray>() else {
            // Worded like `array_arg`'s refusal of a non-array.
            let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            return Err(PyTypeError::new_err(format!("{name}: expected a numpy.ndarray or mlx.core.array, got {ty}")));
        };
        let dt = arr.dtype();
        if dt.kind() != b'f' || ![2, 4, 8].contains(&dt.itemsize()) {
            let found = dt.to_string();
            return Err(to_py_err(Error::Dtype { argument: name, found, expected: EXPECTED.into() }));
        }
        if arr.ndim() != 2 || arr.shape()[1] != dim {
            return Err(bad_shape(name, arr.shape(), dim));
        }
        let f32s = if dt.itemsize() == 4 { arr.clone().into_any() } else { obj.call_method1("astype", ("float32",))? };
        let a = f32s.cast::<PyArray2<f32>>()?.readonly();
        let n = a.shape()[0];
        let data = match a.as_slice() {
            Ok(s) => s.to_vec(),
            // Strided views (a column slice, a transpose) are read in row order.
            Err(_) => a.as_array().iter().copied().collect(),
        };
        (data, n, false)
    };
    // Checked here rather than by the quantizer so that the message names `name`.
    if let Some((index, &value)) = data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(qerr(QuantError::NonFinite { arg: name, index, value }));
    }
    Ok(Rows { data, n, mlx })
}

/// `[n, cols]` float32 rows as numpy, or as `mlx.core.array` when `mlx`.
fn rows_out(py: Python<'_>, data: Vec<f32>, n: usize, cols: usize, mlx: bool) -> PyResult<Py<PyAny>> {
    if mlx {
        let a = Array::from_slice(&data, &[n as i32, cols as i32]).map_err(to_py_err)?;
        return array_out(py, a);
    }
    let a = Array2::from_shape_vec((n, cols), data).expect("n * cols elements");
    Ok(a.into_pyarray(py).into_any().unbind())
}

/// A non-negative integer argument, range-checked here so that the error
/// names it (pyo3's own conversion raises an unnamed OverflowError).
fn uint<T: TryFrom<i64>>(name: &'static str, v: i64) -> PyResult<T> {
    T::try_from(v).map_err(|_| qerr(QuantError::arg(name, format!("{v} is out of range"))))
}

// --------------------------------------------------------------- Encoded

/// The stored form of `rows` vectors: named byte buffers (codes, norms,
/// scales, ...), exactly the bytes a cache keeps.
#[pyclass(name = "Encoded", module = "veloxquant._native", frozen)]
pub struct PyEncoded {
    inner: q::Encoded,
    /// Decode to `mlx.core.array` (the encoded input was one).
    mlx: bool,
}

#[pymethods]
impl PyEncoded {
    /// Rebuilds an encoding from its parts, e.g. buffers kept elsewhere.
    #[new]
    #[pyo3(signature = (method, rows, dim, buffers))]
    fn new(method: String, rows: i64, dim: i64, buffers: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut inner = q::Encoded { method, rows: uint("rows", rows)?, dim: uint("dim", dim)?, buffers: Vec::new() };
        for (k, v) in buffers.iter() {
            let name: String = k.extract()?;
            let bytes: Vec<u8> = v.extract().map_err(|_| {
                let ty = v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                PyTypeError::new_err(format!("buffers: {name:?} must be bytes, got {ty}"))
            })?;
            inner.buffers.push(q::Buffer { name, bytes });
        }
        Ok(PyEncoded { inner, mlx: false })
    }

    #[getter]
    fn method(&self) -> &str {
        &self.inner.method
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows
    }

    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim
    }

    /// Total bytes of all buffers.
    #[getter]
    fn stored_bytes(&self) -> usize {
        self.inner.stored_bytes()
    }

    /// `{name: bytes}` in storage order.
    #[getter]
    fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for b in &self.inner.buffers {
            d.set_item(&b.name, PyBytes::new(py, &b.bytes))?;
        }
        Ok(d)
    }

    /// The buffer `name` as a numpy uint8 array (a copy).
    fn buffer<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match self.inner.buffers.iter().find(|b| b.name == name) {
            Some(b) => Ok(b.bytes.clone().into_pyarray(py).into_any()),
            None => {
                let names: Vec<&str> = self.inner.buffers.iter().map(|b| b.name.as_str()).collect();
                Err(to_py_err(Error::invalid("name", format!("no buffer {name:?} (buffers: {names:?})"))))
            }
        }
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyEncoded>().map(|o| o.get().inner == self.inner).unwrap_or(false)
    }

    fn __repr__(&self) -> String {
        let bufs: Vec<String> = self.inner.buffers.iter().map(|b| format!("{}={}", b.name, b.bytes.len())).collect();
        format!(
            "Encoded(method={:?}, rows={}, dim={}, stored_bytes={}, buffers=[{}])",
            self.inner.method,
            self.inner.rows,
            self.inner.dim,
            self.inner.stored_bytes(),
            bufs.join(", ")
        )
    }
}

// ------------------------------------------------------------- Quantizer

/// What `fit` does.
#[derive(Clone, Debug)]
enum Fit {
    /// Nothing to calibrate: `fit` only checks the samples.
    None,
    Pq(PqConfig),
    Outlier { n_outliers: usize, outlier_bits: u32, bits: u32, rotation: RotationKind, seed: u64 },
    /// Calibrated state loaded from an artifact, whose file does not keep the
    /// training settings: refitting needs a new quantizer.
    Loaded,
}

/// One quantization method for vectors of `dim`; calibrated ones (PQ, the
/// outlier split) are usable after `fit`.
#[pyclass(name = "Quantizer", module = "veloxquant._native", frozen)]
pub struct PyQuantizer {
    method: &'static str,
    dim: usize,
    fit: Fit,
    // Behind a lock (not `&mut self`) so that `fit` can swap it in while
    // other threads encode with the previous one, all without the GIL.
    inner: RwLock<Option<Arc<dyn q::Quantizer>>>,
}

/// The constructor's options: `Some` when given.
struct Opts {
    seed: Option<i64>,
    rotation: Option<String>,
    orthogonal: Option<bool>,
    residual_bits: Option<i64>,
    sketch_rows: Option<i64>,
    sub_dim: Option<i64>,
    smooth: Option<bool>,
    rotate: Option<bool>,
    max_iters: Option<i64>,
    tol: Option<f64>,
    n_outliers: Option<i64>,
    outlier_bits: Option<i64>,
    group: Option<i64>,
}

impl Opts {
    /// Refuses an option the method does not take, so a misspelt method or a
    /// misplaced option does not pass silently.
    fn allow(&self, method: &str, allowed: &[&str]) -> PyResult<()> {
        let given = [
            ("seed", self.seed.is_some()),
            ("rotation", self.rotation.is_some()),
            ("orthogonal", self.orthogonal.is_some()),
            ("residual_bits", self.residual_bits.is_some()),
            ("sketch_rows", self.sketch_rows.is_some()),
            ("sub_dim", self.sub_dim.is_some()),
            ("smooth", self.smooth.is_some()),
            ("rotate", self.rotate.is_some()),
            ("max_iters", self.max_iters.is_some()),
            ("tol", self.tol.is_some()),
            ("n_outliers", self.n_outliers.is_some()),
            ("outlier_bits", self.outlier_bits.is_some()),
            ("group", self.group.is_some()),
        ];
        for (name, set) in given {
            if set && !allowed.contains(&name) {
                return Err(qerr(QuantError::arg(
                    name,
                    format!("is not an option of {method} (options: {})", allowed.join(", ")),
                )));
            }
        }
        Ok(())
    }

    fn seed(&self) -> PyResult<u64> {
        uint("seed", self.seed.unwrap_or(0))
    }

    fn rotation(&self) -> PyResult<RotationKind> {
        RotationKind::from_name(self.rotation.as_deref().unwrap_or("hadamard")).map_err(qerr)
    }
}

fn require_bits(method: &str, bits: Option<i64>) -> PyResult<u32> {
    match bits {
        Some(b) => uint("bits", b),
        None => Err(qerr(QuantError::arg("bits", format!("{method} needs bits")))),
    }
}

impl PyQuantizer {
    fn get(&self) -> PyResult<Arc<dyn q::Quantizer>> {
        self.inner.read().expect("lock").clone().ok_or_else(|| {
            qerr(QuantError::Calibration(format!("{} is not calibrated: call fit(samples) first", self.method)))
        })
    }

    fn from_box(b: Box<dyn q::Quantizer>, fit: Fit) -> Self {
        let q: Arc<dyn q::Quantizer> = Arc::from(b);
        PyQuantizer { method: q.method(), dim: q.dim(), fit, inner: RwLock::new(Some(q)) }
    }

    fn from_artifact(a: &artifact::Artifact) -> PyResult<Self> {
        let b = artifact::quantizer_from_artifact(a).map_err(qerr)?;
        let fit = if matches!(b.method(), pq::METHOD | outlier::METHOD) { Fit::Loaded } else { Fit::None };
        Ok(Self::from_box(b, fit))
    }
}

#[pymethods]
impl PyQuantizer {
    #[new]
    #[pyo3(signature = (
        method, dim, bits = None, *, seed = None, rotation = None, orthogonal = None, residual_bits = None,
        sketch_rows = None, sub_dim = None, smooth = None, rotate = None, max_iters = None, tol = None,
        n_outliers = None, outlier_bits = None, group = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        method: &str,
        dim: i64,
        bits: Option<i64>,
        seed: Option<i64>,
        rotation: Option<String>,
        orthogonal: Option<bool>,
        residual_bits: Option<i64>,
        sketch_rows: Option<i64>,
        sub_dim: Option<i64>,
        smooth: Option<bool>,
        rotate: Option<bool>,
        max_iters: Option<i64>,
        tol: Option<f64>,
        n_outliers: Option<i64>,
        outlier_bits: Option<i64>,
        group: Option<i64>,
    ) -> PyResult<Self> {
        let o = Opts {
            seed,
            rotation,
            orthogonal,
            residual_bits,
            sketch_rows,
            sub_dim,
            smooth,
            rotate,
            max_iters,
            tol,
            n_outliers,
            outlier_bits,
            group,
        };
        let dim: usize = uint("dim", dim)?;
        let method = if method == "outlier" { outlier::METHOD } else { method };
        let fixed = |b: q::Result<Box<dyn q::Quantizer>>| b.map(|b| Self::from_box(b, Fit::None)).map_err(qerr);
        match method {
            turboquant::MSE => {
                o.allow(method, &["seed", "rotation"])?;
                let b = require_bits(method, bits)?;
                fixed(q::TurboQuantMse::new(dim, b, o.rotation()?, o.seed()?).map(|q| Box::new(q) as _))
            }
            turboquant::PROD => {
                o.allow(method, &["seed", "rotation", "orthogonal"])?;
                let b = require_bits(method, bits)?;
                let orth = o.orthogonal.unwrap_or(true);
                fixed(q::TurboQuantProd::with_sketch(dim, b, o.rotation()?, o.seed()?, orth).map(|q| Box::new(q) as _))
            }
            turboquant::RVQ => {
                o.allow(method, &["seed", "rotation", "residual_bits"])?;
                let b1 = require_bits(method, bits)?;
                let Some(b2) = o.residual_bits else {
                    return Err(qerr(QuantError::arg("residual_bits", "turboquant-rvq needs residual_bits")));
                };
                let b2 = uint("residual_bits", b2)?;
                fixed(q::TurboQuantRvq::new(dim, b1, b2, o.rotation()?, o.seed()?).map(|q| Box::new(q) as _))
            }
            qjl::METHOD => {
                o.allow(method, &["seed", "orthogonal", "sketch_rows"])?;
                if bits.is_some() {
                    return Err(qerr(QuantError::arg("bits", "qjl stores one bit per sketch row: set sketch_rows")));
                }
                let m = uint("sketch_rows", o.sketch_rows.unwrap_or(dim as i64))?;
                // The paper's i.i.d. sketch, as in docs/quantizer_table.md.
                let orth = o.orthogonal.unwrap_or(false);
                fixed(q::Qjl::new(dim, m, orth, o.seed()?).map(|q| Box::new(q) as _))
            }
            kivi::KEYS | kivi::VALUES => {
                o.allow(method, &["group"])?;
                let b = require_bits(method, bits)?;
                let g = uint("group", o.group.unwrap_or(32))?;
                if method == kivi::KEYS {
                    fixed(q::KiviKeys::new(dim, b, g).map(|q| Box::new(q) as _))
                } else {
                    fixed(q::KiviValues::new(dim, b, g).map(|q| Box::new(q) as _))
                }
            }
            pq::METHOD => {
                o.allow(method, &["seed", "sub_dim", "smooth", "rotate", "max_iters", "tol"])?;
                let d = PqConfig::keys(4, 8);
                let cfg = PqConfig {
                    sub_dim: uint("sub_dim", o.sub_dim.unwrap_or(d.sub_dim as i64))?,
                    bits: uint("bits", bits.unwrap_or(i64::from(d.bits)))?,
                    smooth: o.smooth.unwrap_or(d.smooth),
                    rotate: o.rotate.unwrap_or(d.rotate),
                    seed: o.seed()?,
                    max_iters: uint("max_iters", o.max_iters.unwrap_or(d.max_iters as i64))?,
                    tol: o.tol.unwrap_or(d.tol),
                };
                if cfg.tol.is_nan() || cfg.tol < 0.0 {
                    return Err(qerr(QuantError::arg("tol", format!("{} is not a non-negative number", cfg.tol))));
                }
                // `train` checks sub_dim, bits and dim before it looks at the
                // data, so an empty set reports a bad configuration now
                // rather than at `fit`.
                match q::ProductQuantizer::train(&[], dim, cfg) {
                    Err(QuantError::Calibration(_)) => {}
                    Err(e) => return Err(qerr(e)),
                    Ok(_) => unreachable!("training on no data"),
                }
                Ok(PyQuantizer { method: pq::METHOD, dim, fit: Fit::Pq(cfg), inner: RwLock::new(None) })
            }
            outlier::METHOD => {
                o.allow(method, &["seed", "rotation", "n_outliers", "outlier_bits"])?;
                let bits = require_bits(method, bits)?;
                let n_outliers = uint("n_outliers", o.n_outliers.unwrap_or((dim / 4) as i64))?;
                let outlier_bits = uint("outlier_bits", o.outlier_bits.unwrap_or(i64::from(bits) + 1))?;
                if n_outliers == 0 || n_outliers >= dim {
                    return Err(qerr(QuantError::arg("n_outliers", format!("{n_outliers} is not in 1..{dim}"))));
                }
                let (rotation, seed) = (o.rotation()?, o.seed()?);
                // Building both parts now reports bad bits or sizes here, not at `fit`.
                q::TurboQuantMse::new(n_outliers, outlier_bits, rotation, seed).map_err(qerr)?;
                q::TurboQuantMse::new(dim - n_outliers, bits, rotation, seed).map_err(qerr)?;
                Ok(PyQuantizer {
                    method: outlier::METHOD,
                    dim,
                    fit: Fit::Outlier { n_outliers, outlier_bits, bits, rotation, seed },
                    inner: RwLock::new(None),
                })
            }
            other => Err(qerr(QuantError::arg("method", format!("unknown method {other:?} (one of {})", METHODS.join(", "))))),
        }
    }

    #[getter]
    fn method(&self) -> &'static str {
        self.method
    }

    #[getter]
    fn dim(&self) -> usize {
        self.dim
    }

    /// Whether `encode` can run: calibrated, or a method without calibration.
    #[getter]
    fn fitted(&self) -> bool {
        self.inner.read().expect("lock").is_some()
    }

    /// Bytes of the shared state (codebooks, rotation signs, sketch, λ,
    /// channel mask), as counted by `bits_per_element`.
    #[getter]
    fn shared_bytes(&self) -> PyResult<usize> {
        Ok(self.get()?.shared_bytes())
    }

    /// The configuration as written in the artifact (`config.*`), as strings.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let a = self.get()?.to_artifact();
        let d = PyDict::new(py);
        for (k, v) in &a.config {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Calibrates on `samples` `[n, dim]` (PQ: λ and the k-means codebook;
    /// outlier split: the channels of largest mean square). Methods without
    /// calibration only check the samples.
    fn fit(&self, py: Python<'_>, samples: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = rows_arg(samples, "samples", self.dim)?;
        let dim = self.dim;
        let built: Box<dyn q::Quantizer> = match self.fit.clone() {
            Fit::None => return Ok(()),
            Fit::Loaded => {
                return Err(qerr(QuantError::Calibration(format!(
                    "this {} was loaded calibrated and its file keeps no training settings; construct a new one to fit",
                    self.method
                ))))
            }
            Fit::Pq(cfg) => Box::new(py.detach(|| q::ProductQuantizer::train(&s.data, dim, cfg)).map_err(qerr)?.0),
            Fit::Outlier { n_outliers, outlier_bits, bits, rotation, seed } => Box::new(
                py.detach(|| q::OutlierSplit::calibrate(&s.data, dim, n_outliers, outlier_bits, bits, rotation, seed))
                    .map_err(qerr)?,
            ),
        };
        *self.inner.write().expect("lock") = Some(Arc::from(built));
        Ok(())
    }

    /// Encodes `x` `[n, dim]`.
    fn encode(&self, py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<PyEncoded> {
        let qz = self.get()?;
        let rows = rows_arg(x, "x", self.dim)?;
        let inner = py.detach(|| qz.encode(&rows.data)).map_err(qerr)?;
        Ok(PyEncoded { inner, mlx: rows.mlx })
    }

    /// Reconstructs `[rows, dim]` float32: numpy, or `mlx.core.array` if the
    /// encoded input was one; `output` ("numpy" or "mlx") overrides.
    #[pyo3(signature = (encoded, *, output = None))]
    fn decode(&self, py: Python<'_>, encoded: &Bound<'_, PyEncoded>, output: Option<&str>) -> PyResult<Py<PyAny>> {
        let qz = self.get()?;
        let enc = encoded.get();
        let mlx = match output {
            None => enc.mlx,
            Some("numpy") => false,
            Some("mlx") => true,
            Some(other) => {
                return Err(to_py_err(Error::invalid("output", format!("{other:?} is not \"numpy\" or \"mlx\""))))
            }
        };
        let data = py.detach(|| qz.decode(&enc.inner)).map_err(qerr)?;
        rows_out(py, data, enc.inner.rows, self.dim, mlx)
    }

    /// Bits per element counting every stored byte, with the shared state
    /// spread over `tokens` rows. With `encoded`: that encoding's bytes
    /// (`tokens` defaults to its rows). Without: a cache of `tokens` rows
    /// (default 4096), measured by encoding that many zero rows.
    #[pyo3(signature = (encoded = None, *, tokens = None))]
    fn bits_per_element(&self, py: Python<'_>, encoded: Option<&Bound<'_, PyEncoded>>, tokens: Option<i64>) -> PyResult<f64> {
        let qz = self.get()?;
        let tokens: Option<usize> = tokens.map(|t| uint("tokens", t)).transpose()?;
        if tokens == Some(0) {
            return Err(qerr(QuantError::arg("tokens", "must be positive")));
        }
        match encoded {
            Some(e) => {
                let e = &e.get().inner;
                if e.method != qz.method() || e.dim != self.dim {
                    return Err(qerr(QuantError::Encoded(format!(
                        "made by {} for dim {}, not by this {} for dim {}",
                        e.method,
                        e.dim,
                        qz.method(),
                        self.dim
                    ))));
                }
                Ok(qz.bits_per_element(e, tokens.unwrap_or(e.rows)))
            }
            None => {
                let t = tokens.unwrap_or(4096);
                let zeros = vec![0.0f32; t * self.dim];
                let e = py.detach(|| qz.encode(&zeros)).map_err(qerr)?;
                Ok(qz.bits_per_element(&e, t))
            }
        }
    }

    /// `[n_queries, rows]` estimates of ⟨q, x⟩ for turboquant-prod and qjl,
    /// whose reconstructions are unbiased for inner products: the inner
    /// products with the decoded rows (for qjl, equal to `Qjl::estimate`
    /// up to float rounding).
    fn estimate_inner_products(
        &self,
        py: Python<'_>,
        queries: &Bound<'_, PyAny>,
        encoded: &Bound<'_, PyEncoded>,
    ) -> PyResult<Py<PyAny>> {
        let qz = self.get()?;
        if !matches!(qz.method(), turboquant::PROD | qjl::METHOD) {
            return Err(qerr(QuantError::arg(
                "method",
                format!("{} has no unbiased inner-product estimate (turboquant-prod and qjl do); use decode", qz.method()),
            )));
        }
        let qs = rows_arg(queries, "queries", self.dim)?;
        let enc = &encoded.get().inner;
        let d = self.dim;
        let out = py
            .detach(|| -> q::Result<Vec<f32>> {
                let keys = qz.decode(enc)?;
                let mut out = Vec::with_capacity(qs.n * enc.rows);
                for qrow in qs.data.chunks_exact(d) {
                    for krow in keys.chunks_exact(d) {
                        out.push(qrow.iter().zip(krow).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32);
                    }
                }
                Ok(out)
            })
            .map_err(qerr)?;
        rows_out(py, out, qs.n, enc.rows, qs.mlx)
    }

    /// The calibration artifact's bytes (safetensors, see docs/QUANTIZERS.md).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.get()?.to_artifact().to_bytes().map_err(qerr)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Writes the calibration artifact to `path`.
    fn save(&self, path: std::path::PathBuf) -> PyResult<()> {
        let bytes = self.get()?.to_artifact().to_bytes().map_err(qerr)?;
        std::fs::write(&path, bytes).map_err(|e| qerr(with_path(e, &path)))
    }

    /// The quantizer an artifact's bytes describe, whatever its method.
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> PyResult<Self> {
        Self::from_artifact(&artifact::Artifact::from_bytes(data, None).map_err(qerr)?)
    }

    /// The quantizer saved at `path`.
    #[staticmethod]
    fn load(path: std::path::PathBuf) -> PyResult<Self> {
        let bytes = std::fs::read(&path).map_err(|e| qerr(with_path(e, &path)))?;
        Self::from_artifact(&artifact::Artifact::from_bytes(&bytes, None).map_err(|e| qerr(prefix_path(e, &path)))?)
    }

    fn __repr__(&self) -> String {
        match self.inner.read().expect("lock").as_ref() {
            Some(qz) => {
                let cfg: Vec<String> = qz.to_artifact().config.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("Quantizer({:?}, {})", self.method, cfg.join(", "))
            }
            None => format!("Quantizer({:?}, dim={}, not fitted)", self.method, self.dim),
        }
    }
}

/// An io error whose message says which file.
fn with_path(e: std::io::Error, path: &std::path::Path) -> QuantError {
    QuantError::Io(std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn prefix_path(e: QuantError, path: &std::path::Path) -> QuantError {
    match e {
        QuantError::Artifact(m) => QuantError::Artifact(format!("{}: {m}", path.display())),
        e => e,
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyQuantizer>()?;
    m.add_class::<PyEncoded>()?;
    m.add("QUANT_METHODS", METHODS.to_vec())?;
    Ok(())
}
