//! Inspection of MLX's lazy graph.

use std::ffi::{c_char, CStr};

use crate::array::Array;
use crate::error::Result;
use crate::ffi;

/// The names of the primitives MLX would run to evaluate `outputs`: one per
/// graph node not evaluated yet (the outputs of one primitive, such as a
/// kernel's several outputs, count once), inputs before the nodes that read
/// them. Evaluated and constant arrays contribute nothing. Builds and
/// evaluates nothing, so it counts the kernel launches an operation adds:
/// `(a + b) * c` over constants gives `["Add", "Multiply"]`.
pub fn pending_primitives(outputs: &[&Array]) -> Result<Vec<String>> {
    let raws: Vec<ffi::mlx_array> = outputs.iter().map(|a| a.raw()).collect();
    // SAFETY: the handles are valid for the call; both vectors are freed
    // before returning and the names are copied out first.
    unsafe {
        let arrays = ffi::mlx_vector_array_new_data(raws.as_ptr(), raws.len());
        let names = ffi::mlx_vector_string_new();
        let status = ffi::vq_graph_pending_primitives(names, arrays);
        ffi::mlx_vector_array_free(arrays);
        let mut out = Vec::new();
        let mut result = ffi::check(status);
        if result.is_ok() {
            for i in 0..ffi::mlx_vector_string_size(names) {
                let mut p: *mut c_char = std::ptr::null_mut();
                result = ffi::check(ffi::mlx_vector_string_get(&mut p, names, i));
                if result.is_err() {
                    break;
                }
                out.push(CStr::from_ptr(p).to_string_lossy().into_owned());
            }
        }
        ffi::mlx_vector_string_free(names);
        result.map(|_| out)
    }
}

/// Primitives MLX evaluates as views of their input's buffer, launching no
/// kernel (a `Contiguous` copies only when its input is not contiguous, so it
/// is counted).
pub const VIEW_PRIMITIVES: [&str; 9] =
    ["Broadcast", "Flatten", "Unflatten", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "AsStrided"];

/// `pending_primitives` without the views: the kernels MLX will launch to
/// evaluate `outputs`.
pub fn pending_kernels(outputs: &[&Array]) -> Result<Vec<String>> {
    Ok(pending_primitives(outputs)?.into_iter().filter(|n| !VIEW_PRIMITIVES.contains(&n.as_str())).collect())
}
