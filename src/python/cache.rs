//! `veloxquant._native.LayerCache`: one layer's compressed cache for Python.
//!
//! A cache may be created, used and dropped on any thread (mlx_lm's server
//! makes caches on its generation thread and may drop them elsewhere): the
//! Rust cache is `Send`, and a lock serialises the calls on one cache.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, TryLockError};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::{array_arg, array_out, bits_arg, device_arg, float_arg, size_arg, str_or, to_py_err, type_name};
use crate::cache::{AttentionMask, CacheConfig, LayerCache, Method};

#[pyclass(name = "LayerCache", module = "veloxquant._native", frozen)]
pub struct PyLayerCache {
    inner: Mutex<LayerCache>,
}

/// Runs `f`, turning a panic (a bug: bad arguments are errors) into a
/// RuntimeError naming `method` rather than letting it reach Python as a
/// `PanicException`, which no `except Exception` catches.
fn guarded<R>(method: &str, f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(PyRuntimeError::new_err(format!("LayerCache.{method}: internal error ({why}); please report it")))
    })
}

impl PyLayerCache {
    fn wrap(inner: LayerCache) -> Self {
        PyLayerCache { inner: Mutex::new(inner) }
    }

    /// Runs `f` on the cache under its lock. Calls hold the GIL and run no
    /// Python code while they hold the lock, so two never overlap; the lock
    /// is tried rather than waited for so that a call that did overlap (a
    /// free-threaded Python) gets an error, not a deadlock. A panic unwinds
    /// through the guard and poisons the lock, which then refuses the cache
    /// whose state it may have left half-changed.
    fn with<R>(&self, method: &str, f: impl FnOnce(&mut LayerCache) -> crate::Result<R>) -> PyResult<R> {
        guarded(method, || {
            let mut cache = match self.inner.try_lock() {
                Ok(cache) => cache,
                Err(TryLockError::WouldBlock) => {
                    return Err(PyRuntimeError::new_err(format!("LayerCache.{method}: the cache is in use by another call")))
                }
                Err(TryLockError::Poisoned(_)) => {
                    return Err(PyRuntimeError::new_err(format!(
                        "LayerCache.{method}: the cache is unusable after an internal error in an earlier call"
                    )))
                }
            };
            f(&mut cache).map_err(to_py_err)
        })
    }
}

#[pymethods]
impl PyLayerCache {
    /// Every argument is checked here, so that a wrong type is a TypeError
    /// and a wrong value a ValueError, each naming the argument (and the
    /// allowed values). Optional arguments given as None take their default.
    #[new]
    #[pyo3(
        signature = (head_dim, n_kv_heads, key_method = None, key_bits = None, value_method = None, value_bits = None,
                     window = None, sinks = None, seed = None, policy = None, device = None, key_group = None, key_widths = None),
        text_signature = "(head_dim, n_kv_heads, key_method='turboquant-mse', key_bits=4, value_method='turboquant-mse', \
                          value_bits=None, window=128, sinks=4, seed=0, policy='auto', device=None, key_group=32, key_widths=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        head_dim: &Bound<'_, PyAny>,
        n_kv_heads: &Bound<'_, PyAny>,
        key_method: Option<&Bound<'_, PyAny>>,
        key_bits: Option<&Bound<'_, PyAny>>,
        value_method: Option<&Bound<'_, PyAny>>,
        value_bits: Option<&Bound<'_, PyAny>>,
        window: Option<&Bound<'_, PyAny>>,
        sinks: Option<&Bound<'_, PyAny>>,
        seed: Option<&Bound<'_, PyAny>>,
        policy: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        key_group: Option<&Bound<'_, PyAny>>,
        key_widths: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        fn given<'py>(o: Option<&Bound<'py, PyAny>>) -> Option<Bound<'py, PyAny>> {
            o.filter(|o| !o.is_none()).cloned()
        }
        let head = size_arg(head_dim, "head_dim", "a multiple of 8 from 8 to 256")?;
        let heads = size_arg(n_kv_heads, "n_kv_heads", "an integer >= 1")?;
        let mut cfg = CacheConfig::new(head, heads);
        cfg.key_method = Method::parse_arg("key_method", &str_or(key_method, "key_method", "turboquant-mse")?).map_err(to_py_err)?;
        cfg.value_method = Method::parse_arg("value_method", &str_or(value_method, "value_method", "turboquant-mse")?).map_err(to_py_err)?;
        let bits = |o: Option<&Bound<'_, PyAny>>, name: &str, method: Method, default: u32| -> PyResult<u32> {
            let Some(o) = given(o) else { return Ok(default) };
            let allowed = match method.supported_bits() {
                Some(b) => format!("one of {b:?} for {method}"),
                None => format!("an integer >= 0 ({method} ignores bits)"),
            };
            bits_arg(&o, name, &allowed)
        };
        cfg.key_bits = bits(key_bits, "key_bits", cfg.key_method, cfg.key_bits)?;
        let keys_given = given(key_bits).is_some().then_some(cfg.key_bits);
        let value_default = crate::cache::default_value_bits(cfg.key_method, cfg.value_method, keys_given);
        cfg.value_bits = bits(value_bits, "value_bits", cfg.value_method, value_default)?;
        let size = |o: Option<&Bound<'_, PyAny>>, name: &str, default: usize, allowed: &str| -> PyResult<usize> {
            given(o).map_or(Ok(default), |o| size_arg(&o, name, allowed))
        };
        cfg.window = size(window, "window", 128, "a number of tokens >= 0 (>= 1 for a compressed method)")?;
        cfg.sinks = size(sinks, "sinks", 4, "a number of tokens >= 0")?;
        let groups = format!("a multiple of 8 from 8 to {} tokens", crate::cache::MAX_KIVI_KEY_GROUP);
        cfg.key_group = size(key_group, "key_group", crate::cache::KIVI_GROUP, &groups)?;
        cfg.seed = match given(seed) {
            None => 0,
            Some(o) => {
                let v = super::int_arg(&o, "seed")?;
                v.extract::<u64>().map_err(|_| PyValueError::new_err(format!("seed: {v} is out of range; expected an integer from 0 to 2**64 - 1")))?
            }
        };
        cfg.policy = str_or(policy, "policy", "auto")?.parse().map_err(to_py_err)?;
        if let Some(w) = given(key_widths) {
            let widths: Vec<i64> = w.extract().map_err(|_| {
                PyTypeError::new_err(format!("key_widths: expected a list of kv_heads * head_dim ints, got {}", type_name(&w)))
            })?;
            let widths = widths.iter().map(|&v| u8::try_from(v)).collect::<Result<Vec<u8>, _>>();
            cfg.key_widths = Some(widths.map_err(|_| PyValueError::new_err("key_widths: each width must be 1 to 8 bits"))?);
        }
        let stream = device_arg(device)?;
        let inner = guarded("__init__", || LayerCache::new(cfg, stream).map_err(to_py_err))?;
        Ok(PyLayerCache::wrap(inner))
    }

    /// Appends keys and values `[B, n_kv_heads, T, head_dim]`.
    fn append(&self, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        self.with("append", |c| c.append(&k, &v))
    }

    /// Attention of `queries` `[B, n_heads, L, head_dim]` over the cache.
    /// `mask`: None, "causal" (query l at position offset - L + l), or an
    /// mx.array (boolean, true attends; or additive) broadcastable to
    /// `[B, n_heads, L, offset]`.
    #[pyo3(signature = (queries, scale, mask = None))]
    fn attention(&self, py: Python<'_>, queries: &Bound<'_, PyAny>, scale: &Bound<'_, PyAny>, mask: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let q = array_arg(queries, "queries")?;
        let scale = float_arg(scale, "scale")? as f32;
        let mask = MaskArg::parse(mask)?;
        let out = self.with("attention", |c| c.attention_with_mask(&q, scale, mask.get()))?;
        array_out(py, out)
    }

    /// Decode attention of a batch whose sequences each have their own cache:
    /// `queries` `[B, n_heads, 1, head_dim]`, row `b` over `caches[b]`.
    /// Caches with TurboQuant-MSE codes and one configuration attend in one
    /// operation (on CUDA one launch per 16 caches); others, and Metal's,
    /// sequence by sequence.
    #[staticmethod]
    fn attention_each(py: Python<'_>, caches: Vec<PyRef<'_, PyLayerCache>>, queries: &Bound<'_, PyAny>, scale: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let q = array_arg(queries, "queries")?;
        let scale = float_arg(scale, "scale")? as f32;
        let out = guarded("attention_each", || {
            let mut guards = Vec::with_capacity(caches.len());
            for (i, c) in caches.iter().enumerate() {
                guards.push(c.inner.try_lock().map_err(|_| {
                    PyRuntimeError::new_err(format!("LayerCache.attention_each: cache {i} is in use by another call or unusable"))
                })?);
            }
            let refs: Vec<&LayerCache> = guards.iter().map(|g| &**g).collect();
            LayerCache::attention_each(&refs, &q, scale).map_err(to_py_err)
        })?;
        array_out(py, out)
    }

    /// A decode step of a batch whose sequences each have their own cache:
    /// row `b` of `keys` and `values` `[B, Hkv, T, D]` appended to
    /// `caches[b]`, in one operation where the caches allow
    /// (`LayerCache::append_each`).
    #[staticmethod]
    fn append_each(caches: Vec<PyRef<'_, PyLayerCache>>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        guarded("append_each", || {
            let mut guards = Vec::with_capacity(caches.len());
            for (i, c) in caches.iter().enumerate() {
                guards.push(c.inner.try_lock().map_err(|_| {
                    PyRuntimeError::new_err(format!("LayerCache.append_each: cache {i} is in use by another call or unusable"))
                })?);
            }
            let mut refs: Vec<&mut LayerCache> = guards.iter_mut().map(|g| &mut **g).collect();
            LayerCache::append_each(&mut refs, &k, &v).map_err(to_py_err)
        })
    }

    /// The cache's keys and values followed by the chunk `keys`/`values`
    /// about to be appended, in the cache's attention frame (a transient
    /// buffer for `attend_framed`). Call before `append`.
    fn framed_with(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        let (fk, fv) = self.with("framed_with", |c| c.framed_with(&k, &v))?;
        Ok((array_out(py, fk)?, array_out(py, fv)?))
    }

    /// `framed_with`, then `append` of the same chunk, the chunk entering the
    /// cache's frame once: a prefill chunk's path.
    fn framed_append(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, values: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        let (fk, fv) = self.with("framed_append", |c| c.framed_append(&k, &v))?;
        Ok((array_out(py, fk)?, array_out(py, fv)?))
    }

    /// Attention of `queries` over `framed_with`'s buffer with MLX's SDPA;
    /// `mask` as for `attention`; `float32`: the products in float32, the
    /// output in the cache's dtype.
    #[pyo3(signature = (queries, keys, values, scale, mask = None, float32 = false))]
    #[allow(clippy::too_many_arguments)]
    fn attend_framed(
        &self,
        py: Python<'_>,
        queries: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        scale: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
        float32: bool,
    ) -> PyResult<Py<PyAny>> {
        let q = array_arg(queries, "queries")?;
        let k = array_arg(keys, "keys")?;
        let v = array_arg(values, "values")?;
        let scale = float_arg(scale, "scale")? as f32;
        let mask = MaskArg::parse(mask)?;
        let out = self.with("attend_framed", |c| c.attend_framed(&q, &k, &v, scale, mask.get(), float32))?;
        array_out(py, out)
    }

    /// The state as (arrays by name, metadata by name): lazy views of the
    /// used slots, so evaluating them copies nothing.
    fn state_parts<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let (tensors, meta) = self.with("state_parts", |c| c.state_parts())?;
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
    fn from_state_parts(arrays: &Bound<'_, PyAny>, meta: &Bound<'_, PyAny>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        fn dict<'py>(obj: &Bound<'py, PyAny>, name: &str, what: &str) -> PyResult<Bound<'py, PyDict>> {
            obj.cast::<PyDict>().cloned().map_err(|_| PyTypeError::new_err(format!("{name}: expected a dict of {what}, got {}", type_name(obj))))
        }
        let mut tensors = HashMap::new();
        for (k, v) in dict(arrays, "arrays", "mlx.core.array by name")?.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err(format!("arrays: keys must be str, got {}", type_name(&k))))?;
            let a = array_arg(&v, &format!("arrays[{name:?}]"))?;
            tensors.insert(name, a);
        }
        let mut m = HashMap::new();
        for (k, v) in dict(meta, "meta", "str by str")?.iter() {
            let kv: PyResult<(String, String)> = (|| Ok((k.extract()?, v.extract()?)))();
            let (k, v) = kv.map_err(|_| PyTypeError::new_err(format!("meta: keys and values must be str, got {} and {}", type_name(&k), type_name(&v))))?;
            m.insert(k, v);
        }
        let stream = device_arg(device)?;
        let inner = guarded("from_state_parts", || LayerCache::from_state_parts(&tensors, &m, stream).map_err(to_py_err))?;
        Ok(PyLayerCache::wrap(inner))
    }

    /// Tokens held.
    #[getter]
    fn offset(&self) -> PyResult<usize> {
        self.with("offset", |c| Ok(c.offset()))
    }

    /// Tokens held as codes (the rest are in the float16 windows).
    #[getter]
    fn compressed_tokens(&self) -> PyResult<usize> {
        self.with("compressed_tokens", |c| Ok(c.compressed_tokens()))
    }

    /// Bytes of the arrays this layer holds.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        self.with("nbytes", |c| Ok(c.nbytes()))
    }

    /// Bytes of the data stored for the tokens held (codes, norms, scales,
    /// float16 window rows, the keys' mean); `nbytes` less this is capacity.
    #[getter]
    fn data_nbytes(&self) -> PyResult<usize> {
        self.with("data_nbytes", |c| Ok(c.data_nbytes()))
    }

    /// Bytes of the rotation and codebooks, held once by all layers of the
    /// same head size, seed, methods, bits, dtype and device (count them once
    /// per `shared_id`).
    #[getter]
    fn shared_nbytes(&self) -> PyResult<usize> {
        self.with("shared_nbytes", |c| Ok(c.shared_nbytes()))
    }

    /// Identifies the shared rotation and codebooks this layer holds (None
    /// before the first append): layers with equal ids hold the same arrays.
    #[getter]
    fn shared_id(&self) -> PyResult<Option<usize>> {
        self.with("shared_id", |c| Ok(c.shared_id()))
    }

    /// Drops the last `n` tokens; returns how many were dropped.
    fn trim(&self, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = size_arg(n, "n", "a number of tokens >= 0")?;
        self.with("trim", |c| Ok(c.trim(n)))
    }

    /// The compressed state (versioned safetensors bytes).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.with("to_bytes", |c| c.to_bytes())?;
        Ok(PyBytes::new(py, &b))
    }

    #[staticmethod]
    #[pyo3(signature = (data, device = None))]
    fn from_bytes(data: &Bound<'_, PyAny>, device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let stream = device_arg(device)?;
        let load = |bytes: &[u8]| guarded("from_bytes", || LayerCache::from_bytes(bytes, stream).map_err(to_py_err));
        let inner = if let Ok(b) = data.cast::<PyBytes>() {
            load(b.as_bytes())
        } else if let Ok(b) = data.cast::<pyo3::types::PyByteArray>() {
            load(&b.to_vec())
        } else {
            return Err(PyTypeError::new_err(format!("data: expected bytes (from to_bytes), got {}", type_name(data))));
        };
        Ok(PyLayerCache::wrap(inner?))
    }

    /// The keys and values as the cache reconstructs them, `[B, H, offset, D]`.
    fn dequantize(&self, py: Python<'_>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let (k, v) = self.with("dequantize", |c| c.dequantize())?;
        Ok((array_out(py, k)?, array_out(py, v)?))
    }

    /// The configuration as a dict (the constructor's arguments).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with("config", |c| Ok(c.config().clone()))?;
        let d = PyDict::new(py);
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("n_kv_heads", c.kv_heads)?;
        d.set_item("key_method", c.key_method.name())?;
        d.set_item("key_bits", c.key_bits)?;
        d.set_item("value_method", c.value_method.name())?;
        d.set_item("value_bits", c.value_bits)?;
        d.set_item("window", c.window)?;
        d.set_item("sinks", c.sinks)?;
        d.set_item("key_group", c.key_group)?;
        d.set_item("key_widths", c.key_widths.as_ref().map(|w| w.iter().map(|&v| u32::from(v)).collect::<Vec<u32>>()))?;
        d.set_item("seed", c.seed)?;
        d.set_item("policy", c.policy.to_string())?;
        Ok(d)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.with("__repr__", |cache| {
            let c = cache.config();
            Ok(format!(
                "LayerCache(keys={}@{}b, values={}@{}b, offset={}, nbytes={})",
                c.key_method,
                c.key_bits,
                c.value_method,
                c.value_bits,
                cache.offset(),
                cache.nbytes()
            ))
        })
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
