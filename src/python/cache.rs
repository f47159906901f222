//! `veloxquant._native.LayerCache`: one layer's compressed cache for Python.

use std::collections::HashMap;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{array_arg, array_out, stream_for, to_py_err};
use crate::cache::{AttentionMask, CacheConfig, LayerCache};

#[pyclass(name = "LayerCache", module = "veloxquant._native", unsendable)]
pub struct PyLayerCache {
    inner: LayerCache,
}

#[pymethods]
impl PyLayerCache {
    #[new]
    #[pyo3(signature = (head_dim, n_kv_heads, key_method = "turboquant-mse", key_bits = 4, value_method = "turboquant-mse",
                        value_bits = 4, window = 128, sinks = 4, seed = 0, policy = "auto", device = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        head_dim: usize,
        n_kv_heads: usize,
        key_method: &str,
        key_bits: u32,
        value_method: &str,
        value_bits: u32,
        window: usize,
        sinks: usize,
        seed: u64,
        policy: &str,
        device: Option<&str>,
    ) -> PyResult<Self> {
        let mut cfg = CacheConfig::new(head_dim, n_kv_heads);
        cfg.key_method = key_method.parse().map_err(to_py_err)?;
        cfg.value_method = value_method.parse().map_err(to_py_err)?;
        cfg.key_bits = key_bits;
        cfg.value_bits = value_bits;
        cfg.window = window;
        cfg.sinks = sinks;
        cfg.seed = seed;
        cfg.policy = policy.parse().map_err(to_py_err)?;
        let inner = LayerCache::new(cfg, stream_for(device)?).map_err(to_py_err)?;
        Ok(PyLayerCache { inner })
    }

    /// Appends keys and values `[B, n_kv_heads, T, head_dim]`.
    fn append(&mut self, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        self.inner.append(&k, &v).map_err(to_py_err)
    }

    /// Attention of `queries` `[B, n_heads, L, head_dim]` over the cache.
    /// `mask`: None, "causal" (query l at position offset - L + l), or an
    /// mx.array (boolean, true attends; or additive) broadcastable to
    /// `[B, n_heads, L, offset]`.
    #[pyo3(signature = (queries, scale, mask = None))]
    fn attention(&self, py: Python<'_>, queries: &Bound<'_, PyAny>, scale: f32, mask: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let q = array_arg(queries, "queries")?;
        let mask = MaskArg::parse(mask)?;
        let out = self.inner.attention_with_mask(&q, scale, mask.get()).map_err(to_py_err)?;
        array_out(py, out)
    }

    /// The cache's keys and values followed by the chunk `keys`/`values`
    /// about to be appended, in the cache's attention frame (a transient
    /// buffer for `attend_framed`). Call before `append`.
    fn framed_with(&mut self, py: Python<'_>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        let (fk, fv) = self.inner.framed_with(&k, &v).map_err(to_py_err)?;
        Ok((array_out(py, fk)?, array_out(py, fv)?))
    }

    /// Attention of `queries` over `framed_with`'s buffer with MLX's SDPA;
    /// `mask` as for `attention`.
    #[pyo3(signature = (queries, keys, values, scale, mask = None))]
    fn attend_framed(
        &self,
        py: Python<'_>,
        queries: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        scale: f32,
        mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let q = array_arg(queries, "queries")?;
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        let mask = MaskArg::parse(mask)?;
        let out = self.inner.attend_framed(&q, &k, &v, scale, mask.get()).map_err(to_py_err)?;
        array_out(py, out)
    }

    /// The state as (arrays by name, metadata by name): lazy views of the
    /// used slots, so evaluating them copies nothing.
    fn state_parts<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let (tensors, meta) = self.inner.state_parts().map_err(to_py_err)?;
        let arrays = PyDict::new(py);
        for (name, a) in tensors {
            arrays.set_item(name, array_out(py, a)?)?;
        }
        let m = PyDict::new(py);
        for (k, v) in meta {
            m.set_item(k, v)?;
        }
        Ok((arrays, m))
    }

    /// A cache rebuilt from `state_parts`' two dicts.
    #[staticmethod]
    #[pyo3(signature = (arrays, meta, device = None))]
    fn from_state_parts(arrays: &Bound<'_, PyDict>, meta: &Bound<'_, PyDict>, device: Option<&str>) -> PyResult<Self> {
        let mut tensors = HashMap::new();
        for (k, v) in arrays.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("arrays: keys must be str"))?;
            let a = array_arg(&v, "arrays")?;
            tensors.insert(name, a);
        }
        let mut m = HashMap::new();
        for (k, v) in meta.iter() {
            let kv: PyResult<(String, String)> = (|| Ok((k.extract()?, v.extract()?)))();
            let (k, v) = kv.map_err(|_| PyTypeError::new_err("meta: keys and values must be str"))?;
            m.insert(k, v);
        }
        let inner = LayerCache::from_state_parts(&tensors, &m, stream_for(device)?).map_err(to_py_err)?;
        Ok(PyLayerCache { inner })
    }

    /// Tokens held.
    #[getter]
    fn offset(&self) -> usize {
        self.inner.offset()
    }

    /// Tokens held as codes (the rest are in the float16 windows).
    #[getter]
    fn compressed_tokens(&self) -> usize {
        self.inner.compressed_tokens()
    }

    /// Bytes of the arrays this layer holds.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Bytes of the rotation and codebooks, held once by all layers of the
    /// same head size, seed, methods, bits, dtype and device (count them once
    /// per `shared_id`).
    #[getter]
    fn shared_nbytes(&self) -> usize {
        self.inner.shared_nbytes()
    }

    /// Identifies the shared rotation and codebooks this layer holds (None
    /// before the first append): layers with equal ids hold the same arrays.
    #[getter]
    fn shared_id(&self) -> Option<usize> {
        self.inner.shared_id()
    }

    /// Drops the last `n` tokens; returns how many were dropped.
    fn trim(&mut self, n: usize) -> usize {
        self.inner.trim(n)
    }

    /// The compressed state (versioned safetensors bytes).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inner.to_bytes().map_err(to_py_err)?;
        Ok(PyBytes::new(py, &b))
    }

    #[staticmethod]
    #[pyo3(signature = (data, device = None))]
    fn from_bytes(data: &[u8], device: Option<&str>) -> PyResult<Self> {
        let inner = LayerCache::from_bytes(data, stream_for(device)?).map_err(to_py_err)?;
        Ok(PyLayerCache { inner })
    }

    /// The keys and values as the cache reconstructs them, `[B, H, offset, D]`.
    fn dequantize(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let (k, v) = self.inner.dequantize().map_err(to_py_err)?;
        Ok((array_out(py, k)?, array_out(py, v)?))
    }

    /// The configuration as a dict (the constructor's arguments).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.config();
        let d = PyDict::new(py);
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("n_kv_heads", c.kv_heads)?;
        d.set_item("key_method", c.key_method.name())?;
        d.set_item("key_bits", c.key_bits)?;
        d.set_item("value_method", c.value_method.name())?;
        d.set_item("value_bits", c.value_bits)?;
        d.set_item("window", c.window)?;
        d.set_item("sinks", c.sinks)?;
        d.set_item("seed", c.seed)?;
        d.set_item("policy", c.policy.to_string())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "LayerCache(keys={}@{}b, values={}@{}b, offset={}, nbytes={})",
            c.key_method,
            c.key_bits,
            c.value_method,
            c.value_bits,
            self.inner.offset(),
            self.inner.nbytes()
        )
    }
}

/// A mask argument as Python gives it: None, "causal" or an mx.array.
enum MaskArg {
    None,
    Causal,
    Array(crate::array::Array),
}

impl MaskArg {
    fn parse(mask: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let Some(m) = mask.filter(|m| !m.is_none()) else { return Ok(MaskArg::None) };
        match m.extract::<String>() {
            Ok(s) if s == "causal" => Ok(MaskArg::Causal),
            Ok(s) => Err(PyValueError::new_err(format!("mask: {s:?} is not supported; use None, \"causal\" or an mx.array"))),
            Err(_) => Ok(MaskArg::Array(array_arg(m, "mask")?)),
        }
    }

    fn get(&self) -> AttentionMask<'_> {
        match self {
            MaskArg::None => AttentionMask::None,
            MaskArg::Causal => AttentionMask::Causal,
            MaskArg::Array(a) => AttentionMask::Array(a),
        }
    }
}
