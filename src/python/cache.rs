//! `veloxquant._native.LayerCache`: one layer's compressed cache for Python.

use pyo3::exceptions::PyValueError;
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
        let arr;
        let mask = match mask {
            None => AttentionMask::None,
            Some(m) if m.is_none() => AttentionMask::None,
            Some(m) => match m.extract::<String>() {
                Ok(s) if s == "causal" => AttentionMask::Causal,
                Ok(s) => return Err(PyValueError::new_err(format!("mask: {s:?} is not supported; use None, \"causal\" or an mx.array"))),
                Err(_) => {
                    arr = array_arg(m, "mask")?;
                    AttentionMask::Array(&arr)
                }
            },
        };
        let out = self.inner.attention_with_mask(&q, scale, mask).map_err(to_py_err)?;
        array_out(py, out)
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

    /// Bytes of the rotation and codebooks shared by layers of the same head
    /// size, seed and bits (count once per model).
    #[getter]
    fn shared_nbytes(&self) -> usize {
        self.inner.shared_nbytes()
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
