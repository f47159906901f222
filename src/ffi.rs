//! The raw bindings to `mlx-c/` and the one guard that turns a status into an
//! [`Error`](crate::Error). All `unsafe` of the crate lives in this module and
//! in the safe wrappers right on top of it (`array`, `stream`, `kernels::gpu`,
//! `kernels::cpu_primitive`, `python`).
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, clippy::all)]

include!(concat!(env!("OUT_DIR"), "/mlxc_bindings.rs"));

use std::ffi::CStr;
use std::panic::Location;

use crate::error::{Error, Result};

/// The message of the last failed mlx-c call on this thread.
pub(crate) fn last_error() -> String {
    // SAFETY: returns a pointer to a thread-local, NUL-terminated string.
    unsafe { CStr::from_ptr(mlx_last_error_message()) }.to_string_lossy().into_owned()
}

/// Turns an mlx-c status into a `Result`, carrying MLX's message and the
/// caller's location.
#[track_caller]
pub(crate) fn check(status: i32) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Mlx { message: last_error(), location: Location::caller() })
    }
}
