//! `Array`: an owned handle to an MLX array, freed on drop.

use std::ffi::CStr;
use std::fmt;

use crate::dtype::{Dtype, Element};
use crate::error::{Error, Result};
use crate::ffi;
use crate::stream::Stream;

/// An MLX array. Cloning shares the array (MLX arrays are reference-counted
/// and immutable); nothing is copied or evaluated.
///
/// An array may move to another thread, but MLX's streams are per thread: a
/// lazy array can be evaluated only on the thread that built it (elsewhere
/// MLX returns an error). Arrays are not `Sync`: evaluating one array from
/// two threads at once would race inside MLX.
pub struct Array {
    raw: ffi::mlx_array,
}

// SAFETY: the handle owns one heap `mlx::core::array`, a shared pointer whose
// reference count is atomic, so freeing or copying it on any thread is sound;
// MLX's allocator is thread-safe. Evaluating work queued on another thread's
// stream fails with an MLX error, not undefined behaviour.
unsafe impl Send for Array {}

impl Array {
    /// Takes ownership of a raw handle, turning a null handle into the last
    /// recorded MLX error.
    #[track_caller]
    pub(crate) fn from_raw(raw: ffi::mlx_array) -> Result<Self> {
        if raw.ctx.is_null() {
            ffi::check(1)?;
        }
        Ok(Array { raw })
    }

    pub(crate) fn raw(&self) -> ffi::mlx_array {
        self.raw
    }

    /// An empty handle to be filled by an mlx-c call's out-parameter.
    pub(crate) fn empty_handle() -> ffi::mlx_array {
        ffi::mlx_array { ctx: std::ptr::null_mut() }
    }

    /// Copies `data` into a new array of `shape` (row-major).
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Self> {
        let count: i64 = shape.iter().map(|&d| i64::from(d)).product();
        if shape.iter().any(|&d| d < 0) || count != data.len() as i64 {
            return Err(Error::invalid(
                "shape",
                format!("{shape:?} does not hold {} elements", data.len()),
            ));
        }
        // SAFETY: `data` holds exactly `count` elements of T's dtype; mlx-c copies them.
        let raw = unsafe {
            ffi::mlx_array_new_data(
                data.as_ptr().cast(),
                shape.as_ptr(),
                shape.len() as i32,
                T::DTYPE.to_raw(),
            )
        };
        Array::from_raw(raw)
    }

    /// A 0-d float32 array.
    pub fn scalar_f32(v: f32) -> Result<Self> {
        // SAFETY: creates a new owned handle.
        Array::from_raw(unsafe { ffi::mlx_array_new_float(v) })
    }

    pub fn ndim(&self) -> usize {
        // SAFETY: valid handle.
        unsafe { ffi::mlx_array_ndim(self.raw) }
    }

    pub fn shape(&self) -> Vec<i32> {
        let n = self.ndim();
        if n == 0 {
            return Vec::new();
        }
        // SAFETY: mlx-c returns a pointer to `ndim` ints owned by the array.
        unsafe { std::slice::from_raw_parts(ffi::mlx_array_shape(self.raw), n) }.to_vec()
    }

    pub fn dtype(&self) -> Dtype {
        // SAFETY: valid handle.
        Dtype::from_raw(unsafe { ffi::mlx_array_dtype(self.raw) })
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        // SAFETY: valid handle.
        unsafe { ffi::mlx_array_size(self.raw) }
    }

    /// Bytes of the array's elements.
    pub fn nbytes(&self) -> usize {
        // SAFETY: valid handle.
        unsafe { ffi::mlx_array_nbytes(self.raw) }
    }

    /// Evaluates the array (and what it depends on).
    pub fn eval(&self) -> Result<()> {
        // SAFETY: valid handle.
        ffi::check(unsafe { ffi::mlx_array_eval(self.raw) })
    }

    /// Evaluates and copies the elements out, row-major.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(Error::Dtype {
                argument: "array",
                found: self.dtype().to_string(),
                expected: T::DTYPE.to_string(),
            });
        }
        let dense = self.row_contiguous()?;
        let n = dense.size();
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: `dense` is evaluated and row-contiguous, holding `n` elements of T.
        let ptr = unsafe { ffi::mlx_array_data_raw(dense.raw) };
        if ptr.is_null() {
            ffi::check(1)?;
        }
        let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), n * std::mem::size_of::<T>()) };
        let mut out = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(bytes);
        Ok(out)
    }
}

impl Array {
    /// The elements row-contiguous and evaluated (the array itself where it
    /// already is so), made on the CPU stream: what reading them out needs.
    fn row_contiguous(&self) -> Result<Array> {
        let mut out = Array::empty_handle();
        // SAFETY: valid handles for the call; `out` receives a new owned handle.
        ffi::check(unsafe { ffi::mlx_contiguous(&mut out, self.raw, false, Stream::cpu().raw()) })?;
        let dense = Array::from_raw(out)?;
        dense.eval()?;
        Ok(dense)
    }

    /// A new array of `dtype` and `shape` holding a copy of `bytes` (row-major).
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Self> {
        let count: i64 = shape.iter().map(|&d| i64::from(d)).product();
        if shape.iter().any(|&d| d < 0) || count * dtype.size() as i64 != bytes.len() as i64 {
            return Err(Error::invalid(
                "bytes",
                format!("{} bytes do not fill shape {shape:?} of {dtype}", bytes.len()),
            ));
        }
        // SAFETY: `bytes` holds exactly `count` elements of `dtype`; mlx-c copies them.
        let raw = unsafe { ffi::mlx_array_new_data(bytes.as_ptr().cast(), shape.as_ptr(), shape.len() as i32, dtype.to_raw()) };
        Array::from_raw(raw)
    }

    /// Evaluates and copies the raw element bytes out, row-major.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let dense = self.row_contiguous()?;
        let n = dense.nbytes();
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: evaluated and row-contiguous, `n` bytes long.
        let ptr = unsafe { ffi::mlx_array_data_raw(dense.raw) };
        if ptr.is_null() {
            ffi::check(1)?;
        }
        Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), n) }.to_vec())
    }
}

/// Evaluates several arrays together (one graph walk).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let raws: Vec<ffi::mlx_array> = arrays.iter().map(|a| a.raw).collect();
    // SAFETY: the handles are valid for the call; the vector is freed below.
    unsafe {
        let v = ffi::mlx_vector_array_new_data(raws.as_ptr(), raws.len());
        let status = ffi::mlx_eval(v);
        ffi::mlx_vector_array_free(v);
        ffi::check(status)
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        let mut raw = Array::empty_handle();
        // SAFETY: copies a shared pointer into a new handle.
        unsafe { ffi::mlx_array_set(&mut raw, self.raw) };
        Array { raw }
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: the handle is owned and freed once.
        unsafe { ffi::mlx_array_free(self.raw) };
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array(shape={:?}, dtype={})", self.shape(), self.dtype())
    }
}

impl fmt::Display for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = ffi::mlx_string { ctx: std::ptr::null_mut() };
        // SAFETY: valid handles; the string is freed below.
        let status = unsafe { ffi::mlx_array_tostring(&mut s, self.raw) };
        if status != 0 {
            return write!(f, "{self:?}");
        }
        let text = unsafe { CStr::from_ptr(ffi::mlx_string_data(s)) }.to_string_lossy().into_owned();
        unsafe { ffi::mlx_string_free(s) };
        f.write_str(&text)
    }
}

/// The MLX memory MLX's allocator holds (bytes).
pub fn active_memory() -> Result<usize> {
    let mut v = 0usize;
    // SAFETY: out-parameter.
    ffi::check(unsafe { ffi::mlx_get_active_memory(&mut v) })?;
    Ok(v)
}

/// The high-water mark of MLX's memory since the last reset (bytes).
pub fn peak_memory() -> Result<usize> {
    let mut v = 0usize;
    // SAFETY: out-parameter.
    ffi::check(unsafe { ffi::mlx_get_peak_memory(&mut v) })?;
    Ok(v)
}

pub fn reset_peak_memory() -> Result<()> {
    // SAFETY: no arguments.
    ffi::check(unsafe { ffi::mlx_reset_peak_memory() })
}

/// Frees MLX's buffer cache.
pub fn clear_cache() -> Result<()> {
    // SAFETY: no arguments.
    ffi::check(unsafe { ffi::mlx_clear_cache() })
}

/// The string an mlx-c call writes into its out-parameter.
fn string_from(call: unsafe extern "C" fn(*mut ffi::mlx_string) -> std::os::raw::c_int) -> Result<String> {
    let mut s = ffi::mlx_string { ctx: std::ptr::null_mut() };
    // SAFETY: out-parameter; freed below.
    ffi::check(unsafe { call(&mut s) })?;
    let v = unsafe { CStr::from_ptr(ffi::mlx_string_data(s)) }.to_string_lossy().into_owned();
    unsafe { ffi::mlx_string_free(s) };
    Ok(v)
}

/// The version of the libmlx loaded at run time.
pub fn mlx_runtime_version() -> Result<String> {
    string_from(ffi::mlx_version)
}

/// MLX's kernel cache directory (absolute), where the CUDA kernels' machine
/// code and sources are kept.
pub(crate) fn kernel_cache_dir() -> Result<String> {
    string_from(ffi::vq_kernel_cache_dir)
}

/// The MLX version veloxquant was compiled against.
pub fn mlx_compiled_version() -> &'static str {
    // SAFETY: a static string.
    unsafe { CStr::from_ptr(ffi::vq_compiled_mlx_version()) }.to_str().unwrap_or("?")
}

/// Refuses to run with a libmlx other than the one compiled against.
pub fn check_mlx_version() -> Result<()> {
    let loaded = mlx_runtime_version()?;
    let compiled = mlx_compiled_version();
    if loaded != compiled {
        return Err(Error::VersionMismatch { compiled: compiled.into(), loaded });
    }
    Ok(())
}
