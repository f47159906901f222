//! The CPU implementation of a kernel as an MLX custom primitive.
//!
//! Building the op allocates and evaluates nothing. At evaluation MLX's CPU
//! worker calls back into Rust with the evaluated, row-contiguous inputs and the
//! freshly allocated outputs. The callback never unwinds into C++: a panic is
//! caught and reported as an error.

use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::array::Array;
use crate::dtype::{Dtype, Element};
use crate::error::{Error, Result};
use crate::ffi;
use crate::stream::Stream;

/// One input or output buffer as the callback sees it.
pub struct Tensor<'a> {
    view: &'a ffi::vq_tensor_view,
}

impl Tensor<'_> {
    pub fn dtype(&self) -> Dtype {
        Dtype::from_raw(self.view.dtype)
    }

    pub fn shape(&self) -> &[i32] {
        if self.view.ndim == 0 {
            return &[];
        }
        // SAFETY: MLX keeps the shape alive for the duration of the task.
        unsafe { std::slice::from_raw_parts(self.view.shape, self.view.ndim as usize) }
    }

    fn check<T: Element>(&self) -> std::result::Result<(), String> {
        if self.dtype() != T::DTYPE {
            return Err(format!("buffer has dtype {}, read as {}", self.dtype(), T::DTYPE));
        }
        Ok(())
    }

    pub fn as_slice<T: Element>(&self) -> std::result::Result<&[T], String> {
        self.check::<T>()?;
        if self.view.size == 0 {
            return Ok(&[]);
        }
        // SAFETY: an evaluated, row-contiguous buffer of `size` elements of T,
        // kept alive by the task.
        Ok(unsafe { std::slice::from_raw_parts(self.view.data as *const T, self.view.size) })
    }

    pub fn as_mut_slice<T: Element>(&mut self) -> std::result::Result<&mut [T], String> {
        self.check::<T>()?;
        if self.view.size == 0 {
            return Ok(&mut []);
        }
        // SAFETY: a freshly allocated output buffer that only this task writes.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.view.data as *mut T, self.view.size) })
    }
}

/// The work of a CPU primitive: inputs, then outputs.
pub type CpuKernel = dyn Fn(&[Tensor<'_>], &mut [Tensor<'_>]) -> std::result::Result<(), String> + Send + Sync;

struct Payload {
    kernel: Box<CpuKernel>,
}

fn write_error(err: *mut c_char, len: usize, msg: &str) {
    if err.is_null() || len == 0 {
        return;
    }
    let bytes = msg.as_bytes();
    let n = bytes.len().min(len - 1);
    // SAFETY: `err` points to `len` writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
}

unsafe extern "C" fn trampoline(
    payload: *mut c_void,
    inputs: *const ffi::vq_tensor_view,
    num_inputs: usize,
    outputs: *mut ffi::vq_tensor_view,
    num_outputs: usize,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    let run = AssertUnwindSafe(|| {
        // SAFETY: the C++ side passes the payload it was given and arrays of
        // `num_inputs` / `num_outputs` views that live for this call.
        let payload = unsafe { &*(payload as *const Payload) };
        let ins: Vec<Tensor<'_>> = (0..num_inputs).map(|i| Tensor { view: unsafe { &*inputs.add(i) } }).collect();
        let mut outs: Vec<Tensor<'_>> =
            (0..num_outputs).map(|i| Tensor { view: unsafe { &*outputs.add(i) } }).collect();
        (payload.kernel)(&ins, &mut outs)
    });
    match catch_unwind(run) {
        Ok(Ok(())) => 0,
        Ok(Err(msg)) => {
            write_error(err, err_len, &msg);
            1
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            write_error(err, err_len, &format!("panicked: {msg}"));
            2
        }
    }
}

unsafe extern "C" fn free_payload(payload: *mut c_void) {
    // SAFETY: created by Box::into_raw below, freed once by the primitive.
    drop(unsafe { Box::from_raw(payload as *mut Payload) });
}

/// Runs `$body` with `$T` bound to the element type of the float `dtype`
/// (float32, float16, else bfloat16): the dispatch of every CPU primitive
/// whose kernel is generic over the float types.
macro_rules! by_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            crate::dtype::Dtype::F32 => {
                type $T = f32;
                $body
            }
            crate::dtype::Dtype::F16 => {
                type $T = half::f16;
                $body
            }
            _ => {
                type $T = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use by_dtype;

/// [`apply`] for a primitive of one output: that output.
pub fn apply_one(name: &str, inputs: &[&Array], output: (Vec<i32>, Dtype), stream: &Stream, kernel: Box<CpuKernel>) -> Result<Array> {
    apply(name, inputs, &[output], stream, kernel).map(|mut v| v.remove(0))
}

/// Builds the outputs of a CPU primitive named `name` on the CPU `stream`.
pub fn apply(
    name: &str,
    inputs: &[&Array],
    outputs: &[(Vec<i32>, Dtype)],
    stream: &Stream,
    kernel: Box<CpuKernel>,
) -> Result<Vec<Array>> {
    let cname = CString::new(name).map_err(|_| Error::invalid("name", "contains NUL"))?;
    let shapes: Vec<i32> = outputs.iter().flat_map(|(s, _)| s.iter().copied()).collect();
    let ndims: Vec<i32> = outputs.iter().map(|(s, _)| s.len() as i32).collect();
    let dtypes: Vec<ffi::mlx_dtype> = outputs.iter().map(|(_, d)| d.to_raw()).collect();
    let payload = Box::into_raw(Box::new(Payload { kernel })) as *mut c_void;
    let raws: Vec<ffi::mlx_array> = inputs.iter().map(|a| a.raw()).collect();
    // SAFETY: pointers are valid for the call; the primitive takes ownership of
    // `payload` (and frees it on failure too).
    unsafe {
        let ins = ffi::mlx_vector_array_new_data(raws.as_ptr(), raws.len());
        let mut outs = ffi::mlx_vector_array { ctx: std::ptr::null_mut() };
        let status = ffi::vq_cpu_primitive_apply(
            &mut outs,
            cname.as_ptr(),
            Some(trampoline),
            payload,
            Some(free_payload),
            ins,
            shapes.as_ptr(),
            ndims.as_ptr(),
            dtypes.as_ptr(),
            outputs.len(),
            stream.raw(),
        );
        ffi::mlx_vector_array_free(ins);
        ffi::check(status)?;
        super::take_vector(outs)
    }
}
