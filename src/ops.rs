//! Plain MLX operations: what the reference graphs are built from. Each builds
//! a lazy node on `stream`; nothing is evaluated.

use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::ffi;
use crate::stream::Stream;

macro_rules! call {
    ($f:ident($($arg:expr),*)) => {{
        let mut out = Array::empty_handle();
        // SAFETY: every handle argument is valid for the call; `out` receives a
        // new owned handle.
        let status = unsafe { ffi::$f(&mut out, $($arg),*) };
        ffi::check(status)?;
        Array::from_raw(out)
    }};
}

macro_rules! binary {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        pub fn $name(a: &Array, b: &Array, s: &Stream) -> Result<Array> {
            call!($f(a.raw(), b.raw(), s.raw()))
        }
    )*};
}

binary!(
    add => mlx_add,
    subtract => mlx_subtract,
    multiply => mlx_multiply,
    divide => mlx_divide,
    bitwise_and => mlx_bitwise_and,
    bitwise_or => mlx_bitwise_or,
    left_shift => mlx_left_shift,
    right_shift => mlx_right_shift,
);

pub fn square(a: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_square(a.raw(), s.raw()))
}

pub fn astype(a: &Array, dtype: Dtype, s: &Stream) -> Result<Array> {
    call!(mlx_astype(a.raw(), dtype.to_raw(), s.raw()))
}

pub fn reshape(a: &Array, shape: &[i32], s: &Stream) -> Result<Array> {
    call!(mlx_reshape(a.raw(), shape.as_ptr(), shape.len(), s.raw()))
}

/// `a` as `shape` (NumPy broadcasting), without copying.
pub fn broadcast_to(a: &Array, shape: &[i32], s: &Stream) -> Result<Array> {
    call!(mlx_broadcast_to(a.raw(), shape.as_ptr(), shape.len(), s.raw()))
}

pub fn expand_dims(a: &Array, axis: i32, s: &Stream) -> Result<Array> {
    call!(mlx_expand_dims(a.raw(), axis, s.raw()))
}

pub fn contiguous(a: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_contiguous(a.raw(), false, s.raw()))
}

pub fn transpose(a: &Array, axes: &[i32], s: &Stream) -> Result<Array> {
    call!(mlx_transpose(a.raw(), axes.as_ptr(), axes.len(), s.raw()))
}

pub fn sum_axis(a: &Array, axis: i32, keepdims: bool, s: &Stream) -> Result<Array> {
    call!(mlx_sum_axis(a.raw(), axis, keepdims, s.raw()))
}

pub fn argmin_axis(a: &Array, axis: i32, keepdims: bool, s: &Stream) -> Result<Array> {
    call!(mlx_argmin_axis(a.raw(), axis, keepdims, s.raw()))
}

pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype, s: &Stream) -> Result<Array> {
    call!(mlx_arange(start, stop, step, dtype.to_raw(), s.raw()))
}

pub fn zeros(shape: &[i32], dtype: Dtype, s: &Stream) -> Result<Array> {
    call!(mlx_zeros(shape.as_ptr(), shape.len(), dtype.to_raw(), s.raw()))
}

pub fn concatenate(arrays: &[Array], axis: i32, s: &Stream) -> Result<Array> {
    let raws: Vec<ffi::mlx_array> = arrays.iter().map(Array::raw).collect();
    // SAFETY: the handles live for the call; the vector is freed right after.
    let v = unsafe { ffi::mlx_vector_array_new_data(raws.as_ptr(), raws.len()) };
    let out = (|| call!(mlx_concatenate_axis(v, axis, s.raw())))();
    unsafe { ffi::mlx_vector_array_free(v) };
    out
}

/// `a[start:stop]` along every axis, step 1.
pub fn slice(a: &Array, start: &[i32], stop: &[i32], s: &Stream) -> Result<Array> {
    let strides = vec![1i32; start.len()];
    call!(mlx_slice(
        a.raw(),
        start.as_ptr(),
        start.len(),
        stop.as_ptr(),
        stop.len(),
        strides.as_ptr(),
        strides.len(),
        s.raw()
    ))
}

/// Pads `axes` with `low`/`high` zeros.
pub fn pad_zeros(a: &Array, axes: &[i32], low: &[i32], high: &[i32], s: &Stream) -> Result<Array> {
    let zero = astype(&Array::scalar_f32(0.0)?, a.dtype(), s)?;
    let mode = c"constant";
    call!(mlx_pad(
        a.raw(),
        axes.as_ptr(),
        axes.len(),
        low.as_ptr(),
        low.len(),
        high.as_ptr(),
        high.len(),
        zero.raw(),
        mode.as_ptr(),
        s.raw()
    ))
}

/// A 0-d boolean: whether `a` and `b` have equal shapes and elements.
pub fn array_equal(a: &Array, b: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_array_equal(a.raw(), b.raw(), false, s.raw()))
}

pub fn take_axis(a: &Array, indices: &Array, axis: i32, s: &Stream) -> Result<Array> {
    call!(mlx_take_axis(a.raw(), indices.raw(), axis, s.raw()))
}

/// Softmax along `axis`, computed in float32 (`precise`).
pub fn softmax(a: &Array, axis: i32, s: &Stream) -> Result<Array> {
    call!(mlx_softmax_axis(a.raw(), axis, true, s.raw()))
}

binary!(
    greater => mlx_greater,
    greater_equal => mlx_greater_equal,
    maximum => mlx_maximum,
    minimum => mlx_minimum,
    matmul => mlx_matmul,
    take => mlx_take,
);

/// `c + a @ b` as one matmul (`c` broadcast to the product's shape).
pub fn addmm(c: &Array, a: &Array, b: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_addmm(c.raw(), a.raw(), b.raw(), s.raw()))
}

pub fn min_axis(a: &Array, axis: i32, keepdims: bool, s: &Stream) -> Result<Array> {
    call!(mlx_min_axis(a.raw(), axis, keepdims, s.raw()))
}

pub fn max_axis(a: &Array, axis: i32, keepdims: bool, s: &Stream) -> Result<Array> {
    call!(mlx_max_axis(a.raw(), axis, keepdims, s.raw()))
}

/// Rounds half to even (MLX's `round`).
pub fn round(a: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_round(a.raw(), 0, s.raw()))
}

pub fn sqrt(a: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_sqrt(a.raw(), s.raw()))
}

/// `src` with `src[start:stop] = update` (step 1 on every axis). MLX writes in
/// place when `src` is not referenced elsewhere.
pub fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32], s: &Stream) -> Result<Array> {
    let strides = vec![1i32; start.len()];
    call!(mlx_slice_update(
        src.raw(),
        update.raw(),
        start.as_ptr(),
        start.len(),
        stop.as_ptr(),
        stop.len(),
        strides.as_ptr(),
        strides.len(),
        s.raw()
    ))
}

/// MLX's fused attention over dense keys and values; `causal` applies the
/// bottom-right causal mask.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    causal: bool,
    s: &Stream,
) -> Result<Array> {
    let mode = if causal { c"causal" } else { c"" };
    let none = Array::empty_handle();
    call!(mlx_fast_scaled_dot_product_attention(q.raw(), k.raw(), v.raw(), scale, mode.as_ptr(), none, none, s.raw()))
}

/// MLX's fused attention with an array mask (boolean: true attends; or
/// additive, in the queries' dtype or float32).
pub fn scaled_dot_product_attention_masked(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array, s: &Stream) -> Result<Array> {
    let none = Array::empty_handle();
    call!(mlx_fast_scaled_dot_product_attention(q.raw(), k.raw(), v.raw(), scale, c"array".as_ptr(), mask.raw(), none, s.raw()))
}

pub fn where_(condition: &Array, x: &Array, y: &Array, s: &Stream) -> Result<Array> {
    call!(mlx_where(condition.raw(), x.raw(), y.raw(), s.raw()))
}
