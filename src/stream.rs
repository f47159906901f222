//! Devices and streams.

use std::ffi::CStr;

use crate::error::Result;
use crate::ffi;

/// The kind of device a stream runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Gpu,
}

/// The back-end that runs a stream's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cpu,
    Metal,
    Cuda,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Metal => "metal",
            Backend::Cuda => "cuda",
        }
    }
}

/// The GPU back-end compiled into the loaded libmlx, if any.
pub fn gpu_backend() -> Option<Backend> {
    // SAFETY: returns a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(ffi::mlx_gpu_backend_name()) };
    match name.to_bytes() {
        b"metal" => Some(Backend::Metal),
        b"cuda" => Some(Backend::Cuda),
        _ => None,
    }
}

/// An MLX stream (a queue of work on one device). Cloning shares the stream.
#[derive(Debug)]
pub struct Stream {
    raw: ffi::mlx_stream,
}

impl Stream {
    /// The default stream of the CPU (of this thread).
    pub fn cpu() -> Self {
        // SAFETY: returns a new owned handle (null ctx on failure, caught below).
        Stream { raw: unsafe { ffi::mlx_default_cpu_stream_new() } }
    }

    /// The default stream of the GPU (of this thread); an error when the loaded
    /// MLX has no GPU back-end.
    pub fn gpu() -> Result<Self> {
        if gpu_backend().is_none() {
            return Err(crate::Error::Unsupported("no GPU back-end in the loaded MLX".into()));
        }
        // SAFETY: as above.
        let s = Stream { raw: unsafe { ffi::mlx_default_gpu_stream_new() } };
        if s.raw.ctx.is_null() {
            return Err(crate::Error::Unsupported(ffi::last_error()));
        }
        Ok(s)
    }

    /// The default stream of MLX's default device (the GPU where there is one).
    pub fn default_stream() -> Result<Self> {
        match gpu_backend() {
            Some(_) => {
                let mut dev = ffi::mlx_device { ctx: std::ptr::null_mut() };
                // SAFETY: out-parameters are valid handles owned here.
                ffi::check(unsafe { ffi::mlx_get_default_device(&mut dev) })?;
                let mut raw = ffi::mlx_stream { ctx: std::ptr::null_mut() };
                let st = ffi::check(unsafe { ffi::mlx_get_default_stream(&mut raw, dev) });
                unsafe { ffi::mlx_device_free(dev) };
                st?;
                Ok(Stream { raw })
            }
            None => Ok(Stream::cpu()),
        }
    }

    pub fn device(&self) -> Result<Device> {
        let mut dev = ffi::mlx_device { ctx: std::ptr::null_mut() };
        let mut ty = ffi::mlx_device_type_::MLX_CPU;
        // SAFETY: valid handles; `dev` is freed below.
        let status = unsafe { ffi::mlx_stream_get_device(&mut dev, self.raw) };
        ffi::check(status)?;
        let status = unsafe { ffi::mlx_device_get_type(&mut ty, dev) };
        unsafe { ffi::mlx_device_free(dev) };
        ffi::check(status)?;
        Ok(match ty {
            ffi::mlx_device_type_::MLX_CPU => Device::Cpu,
            ffi::mlx_device_type_::MLX_GPU => Device::Gpu,
        })
    }

    /// The back-end that runs this stream's work.
    pub fn backend(&self) -> Result<Backend> {
        Ok(match self.device()? {
            Device::Cpu => Backend::Cpu,
            Device::Gpu => gpu_backend().unwrap_or(Backend::Cpu),
        })
    }

    /// Waits until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: valid handle.
        ffi::check(unsafe { ffi::mlx_synchronize(self.raw) })
    }

    pub(crate) fn raw(&self) -> ffi::mlx_stream {
        self.raw
    }
}

impl Clone for Stream {
    fn clone(&self) -> Self {
        let mut raw = ffi::mlx_stream { ctx: std::ptr::null_mut() };
        // SAFETY: valid handle in; a new owned handle out. A stream is a plain
        // (device, index) value, so copying cannot fail short of OOM.
        unsafe { ffi::mlx_stream_set(&mut raw, self.raw) };
        Stream { raw }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the handle is owned and freed once.
        unsafe { ffi::mlx_stream_free(self.raw) };
    }
}
