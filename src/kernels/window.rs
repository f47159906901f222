//! `window_append`: a compressed layer's new tokens into its float16
//! windows, each side in its frame, in one operation.
//!
//! A decode step appends one token per layer. As plain MLX ops that is two
//! matmuls (into the frames) and two slice updates; on a GPU MLX's host time
//! per op is what a decode step costs, so the fused kernel does it in one
//! launch (copying the small windows into its outputs).

use super::gpu::{self, Launch};
use super::TemplateArg;
use super::{check_float, cpu_primitive, grid_1d, select, Implementation, Options, Kernel};
use crate::array::Array;
use crate::dtype::Dtype;
use crate::cpu::window::{self as cpu_window, WindowShape};
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::{Backend, Stream};

/// What [`window_append`] writes.
pub struct WindowAppend<'a> {
    /// New keys and values `[B, Hkv, T, D]`.
    pub keys: &'a Array,
    pub values: &'a Array,
    /// `[D, D]`: new keys enter their frame as `keys·key_frame`.
    pub key_frame: &'a Array,
    /// `[B, Hkv, 1, D]`, added to the framed keys (the key mean's offset).
    pub key_offset: Option<&'a Array>,
    /// `[D, D]`: values enter their frame as `values·value_frame`; `None`
    /// keeps them as given.
    pub value_frame: Option<&'a Array>,
    /// The windows `[B, Hkv, W, D]`.
    pub win_k: &'a Array,
    pub win_v: &'a Array,
    /// Slot of the first new token.
    pub at: usize,
}

impl WindowAppend<'_> {
    fn check(&self) -> Result<WindowShape> {
        self.check_rows(None)
    }

    /// `check`, or with `keys_rows` the check of one row of a batch: the
    /// windows of one sequence (batch 1), `keys` and `values` the batch's
    /// `keys_rows` rows.
    fn check_rows(&self, keys_rows: Option<i32>) -> Result<WindowShape> {
        let ws = self.win_k.shape();
        if ws.len() != 4 {
            return Err(Error::invalid("win_k", format!("shape {ws:?}, expected [batch, heads, slots, dim]")));
        }
        check_float("win_k", self.win_k)?;
        let dtype = self.win_k.dtype();
        let (b, h, w, d) = (ws[0], ws[1], ws[2], ws[3]);
        let same_dtype = |argument: &'static str, a: &Array| -> Result<()> {
            if a.dtype() == dtype {
                Ok(())
            } else {
                Err(Error::Dtype { argument, found: a.dtype().to_string(), expected: format!("{dtype} (the windows')") })
            }
        };
        let shaped = |argument: &'static str, a: &Array, want: &[i32]| -> Result<()> {
            same_dtype(argument, a)?;
            if a.shape() != want {
                return Err(Error::invalid(argument, format!("shape {:?}, expected {want:?}", a.shape())));
            }
            Ok(())
        };
        shaped("win_v", self.win_v, &ws)?;
        if keys_rows.is_some() && b != 1 {
            return Err(Error::invalid("win_k", format!("shape {ws:?}, expected one sequence's windows (batch 1)")));
        }
        let t = self.keys.shape().get(2).copied().unwrap_or(0);
        let kb = keys_rows.unwrap_or(b);
        shaped("keys", self.keys, &[kb, h, t, d])?;
        shaped("values", self.values, &[kb, h, t, d])?;
        shaped("key_frame", self.key_frame, &[d, d])?;
        if let Some(o) = self.key_offset {
            shaped("key_offset", o, &[b, h, 1, d])?;
        }
        if let Some(f) = self.value_frame {
            shaped("value_frame", f, &[d, d])?;
        }
        if self.at + t as usize > w as usize {
            return Err(Error::invalid("at", format!("{t} tokens from slot {} overrun the windows' {w} slots", self.at)));
        }
        Ok(WindowShape { batch: b as usize, heads: h as usize, slots: w as usize, dim: d as usize, tokens: t as usize, at: self.at })
    }
}

/// The windows with `a.keys` and `a.values` written from slot `a.at`, each
/// in its frame: `(win_k', win_v')`.
pub fn window_append(a: &WindowAppend<'_>, opts: &Options) -> Result<(Array, Array)> {
    let sh = a.check()?;
    let stream = opts.resolve_stream()?;
    let mut imp = select(Kernel::WindowAppend, opts.policy, &stream)?;
    // The GPU bodies read the slot from a view of that length and work in
    // chunks of 8 dimensions.
    if matches!(imp, Implementation::Metal | Implementation::Cuda) && (sh.at == 0 || sh.dim % 8 != 0) {
        imp = Implementation::Reference;
    }
    if sh.tokens == 0 {
        return Ok((a.win_k.clone(), a.win_v.clone()));
    }
    match imp {
        Implementation::Reference => reference(a, &sh, &stream),
        Implementation::Cpu => on_cpu(a, sh, &stream),
        Implementation::Metal | Implementation::Cuda => on_gpu(a, &sh, &stream),
    }
}

/// Tokens `x` `[B, Hkv, T, D]` in a side's frame as plain MLX ops:
/// `x·frame` (one `addmm` with `offset` added), or `x` without a frame.
/// On the CPU a half-precision product runs in float32 and is rounded once:
/// MLX's CPU matmul of float16 (float32 sums, no BLAS) took most of a
/// prefill chunk's append there.
pub(crate) fn into_frame(x: &Array, frame: Option<&Array>, offset: Option<&Array>, s: &Stream) -> Result<Array> {
    let Some(f) = frame else { return Ok(x.clone()) };
    let dtype = x.dtype();
    if dtype != Dtype::F32 && s.backend()? == Backend::Cpu {
        let up = |a: &Array| ops::astype(a, Dtype::F32, s);
        let y = match offset {
            Some(o) => ops::addmm(&up(o)?, &up(x)?, &up(f)?, s)?,
            None => ops::matmul(&up(x)?, &up(f)?, s)?,
        };
        return ops::astype(&y, dtype, s);
    }
    match offset {
        Some(o) => ops::addmm(o, x, f, s),
        None => ops::matmul(x, f, s),
    }
}

fn reference(a: &WindowAppend<'_>, sh: &WindowShape, s: &Stream) -> Result<(Array, Array)> {
    let rk = into_frame(a.keys, Some(a.key_frame), a.key_offset, s)?;
    let rv = into_frame(a.values, a.value_frame, None, s)?;
    let (b, h, d) = (sh.batch as i32, sh.heads as i32, sh.dim as i32);
    let (lo, hi) = (sh.at as i32, (sh.at + sh.tokens) as i32);
    let put = |w: &Array, x: &Array| ops::slice_update(w, &ops::astype(x, w.dtype(), s)?, &[0, 0, lo, 0], &[b, h, hi, d], s);
    Ok((put(a.win_k, &rk)?, put(a.win_v, &rv)?))
}

fn on_cpu(a: &WindowAppend<'_>, sh: WindowShape, s: &Stream) -> Result<(Array, Array)> {
    let dtype = a.win_k.dtype();
    let mut inputs = vec![a.keys, a.values, a.key_frame, a.win_k, a.win_v];
    let (has_off, has_vf) = (a.key_offset.is_some(), a.value_frame.is_some());
    inputs.extend(a.key_offset.into_iter().chain(a.value_frame));
    let out = a.win_k.shape();
    let outs = cpu_primitive::apply(
        Kernel::WindowAppend.name(),
        &inputs,
        &[(out.clone(), dtype), (out, dtype)],
        s,
        Box::new(move |ins, outs| {
            cpu_primitive::by_dtype!(dtype, T => {
                let off = if has_off { Some(ins[5].as_slice::<T>()?) } else { None };
                let vf = if has_vf { Some(ins[5 + has_off as usize].as_slice::<T>()?) } else { None };
                let kf = ins[2].as_slice::<T>()?;
                let (ok, ov) = outs.split_at_mut(1);
                cpu_window::window_append(ins[0].as_slice::<T>()?, Some(kf), off, ins[3].as_slice::<T>()?, &sh, ok[0].as_mut_slice::<T>()?);
                cpu_window::window_append(ins[1].as_slice::<T>()?, vf, None, ins[4].as_slice::<T>()?, &sh, ov[0].as_mut_slice::<T>()?);
            });
            Ok(())
        }),
    )?;
    let mut outs = outs.into_iter();
    Ok((outs.next().expect("two outputs"), outs.next().expect("two outputs")))
}

/// One sequence's windows in [`window_append_each`].
pub struct WindowRow<'a> {
    /// The batch row of `keys` and `values` it takes.
    pub row: usize,
    /// The sequence's windows `[1, Hkv, W, D]` (any slots `W`).
    pub win_k: &'a Array,
    pub win_v: &'a Array,
    /// `[1, Hkv, 1, D]`, added to its framed keys; all rows have one or none.
    pub key_offset: Option<&'a Array>,
    /// Slot of its first new token.
    pub at: usize,
}

/// A decode step of a batch whose sequences keep their own windows: row
/// `rows[i].row` of `keys` and `values` `[B, Hkv, T, D]` written into
/// `rows[i]`'s windows from its slot, in the frames of [`window_append`]
/// (shared by the rows). On the CPU one operation for the rows; on CUDA one
/// launch per run of up to [`APPEND_EACH_MAX`] rows whose windows hold a
/// token, the others one [`window_append`] each; on Metal one
/// [`window_append`] per row. The rows' new `(win_k, win_v)`.
pub fn window_append_each<'a>(
    keys: &'a Array,
    values: &'a Array,
    key_frame: &'a Array,
    value_frame: Option<&'a Array>,
    rows: &[WindowRow<'a>],
    opts: &Options,
) -> Result<Vec<(Array, Array)>> {
    let ks = keys.shape();
    if ks.len() != 4 {
        return Err(Error::invalid("keys", format!("shape {ks:?}, expected [batch, heads, tokens, head_dim]")));
    }
    let batch = ks[0];
    if let Some(r) = rows.iter().find(|r| r.row >= batch as usize) {
        return Err(Error::invalid("rows", format!("row {} of keys with a batch of {batch}", r.row)));
    }
    let append = |r: &WindowRow<'a>| -> WindowAppend<'a> {
        WindowAppend { keys, values, key_frame, key_offset: r.key_offset, value_frame, win_k: r.win_k, win_v: r.win_v, at: r.at }
    };
    let shapes = rows.iter().map(|r| append(r).check_rows(Some(batch))).collect::<Result<Vec<_>>>()?;
    let stream = opts.resolve_stream()?;
    let same_offsets = rows.iter().all(|r| r.key_offset.is_some() == rows[0].key_offset.is_some());
    let (h, t, d) = (ks[1], ks[2], ks[3]);
    let row = |x: &Array, b: usize| ops::slice(x, &[b as i32, 0, 0, 0], &[b as i32 + 1, h, t, d], &stream);
    let alone = |r: &WindowRow<'a>| -> Result<(Array, Array)> {
        let (k, v) = (row(keys, r.row)?, row(values, r.row)?);
        window_append(&WindowAppend { keys: &k, values: &v, ..append(r) }, opts)
    };
    // CUDA runs the rows through its `window_append` (WindowAppendEach
    // names the CPU's operation). Metal appends row by row: MLX binds every
    // input, shape and strides to a buffer of its own, and two rows would
    // take more than a Metal kernel's 31.
    if stream.backend()? == Backend::Cuda {
        let fused = select(Kernel::WindowAppend, opts.policy, &stream)? == Implementation::Cuda && d % 8 == 0;
        if !(fused && same_offsets && t > 0) {
            return rows.iter().map(alone).collect();
        }
        // Runs of rows whose windows already hold a token (the kernel's
        // slot view is not empty), up to APPEND_EACH_MAX a launch.
        let mut out = Vec::with_capacity(rows.len());
        for r in super::runs(rows.len(), APPEND_EACH_MAX, |first, i| shapes[first].at > 0 && shapes[i].at > 0) {
            if r.len() == 1 {
                out.push(alone(&rows[r.start])?);
            } else {
                let ks: Vec<Array> = rows[r.clone()].iter().map(|x| row(keys, x.row)).collect::<Result<_>>()?;
                let vs: Vec<Array> = rows[r.clone()].iter().map(|x| row(values, x.row)).collect::<Result<_>>()?;
                out.extend(each_on_cuda(&ks, &vs, key_frame, value_frame, &rows[r.clone()], &shapes[r], &stream)?);
            }
        }
        return Ok(out);
    }
    let imp = select(Kernel::WindowAppendEach, opts.policy, &stream)?;
    if imp != Implementation::Cpu || !same_offsets || t == 0 {
        return rows.iter().map(alone).collect();
    }
    let dtype = rows[0].win_k.dtype();
    let (has_off, has_vf) = (rows[0].key_offset.is_some(), value_frame.is_some());
    let mut inputs = vec![keys, values, key_frame];
    inputs.extend(value_frame);
    for r in rows {
        inputs.extend([r.win_k, r.win_v].into_iter().chain(r.key_offset));
    }
    let outputs: Vec<(Vec<i32>, crate::dtype::Dtype)> =
        rows.iter().flat_map(|r| [(r.win_k.shape(), dtype), (r.win_v.shape(), dtype)]).collect();
    let per_row = 2 + has_off as usize;
    let first = 3 + has_vf as usize;
    let key_rows: Vec<usize> = rows.iter().map(|r| r.row).collect();
    let outs = cpu_primitive::apply(
        Kernel::WindowAppendEach.name(),
        &inputs,
        &outputs,
        &stream,
        Box::new(move |ins, outs| {
            cpu_primitive::by_dtype!(dtype, T => {
                let (keys, values, kf) = (ins[0].as_slice::<T>()?, ins[1].as_slice::<T>()?, ins[2].as_slice::<T>()?);
                let vf = if has_vf { Some(ins[3].as_slice::<T>()?) } else { None };
                for (i, (sh, out)) in shapes.iter().zip(outs.chunks_mut(2)).enumerate() {
                    let at = first + i * per_row;
                    let b = key_rows[i];
                    let n = sh.heads * sh.tokens * sh.dim;
                    let off = if has_off { Some(ins[at + 2].as_slice::<T>()?) } else { None };
                    let (ok, ov) = out.split_at_mut(1);
                    cpu_window::window_append(&keys[b * n..(b + 1) * n], Some(kf), off, ins[at].as_slice::<T>()?, sh, ok[0].as_mut_slice::<T>()?);
                    cpu_window::window_append(&values[b * n..(b + 1) * n], vf, None, ins[at + 1].as_slice::<T>()?, sh, ov[0].as_mut_slice::<T>()?);
                }
            });
            Ok(())
        }),
    )?;
    let mut outs = outs.into_iter();
    Ok((0..rows.len()).map(|_| (outs.next().expect("two outputs a row"), outs.next().expect("two outputs a row"))).collect())
}

/// Sequences one CUDA `window_append` over several sequences' windows
/// serves at most (each adds six inputs and two outputs to the launch).
pub const APPEND_EACH_MAX: usize = 16;

/// One CUDA `window_append` over `rows` (at least two), whose new tokens
/// are `keys[i]`/`values[i]` `[1, Hkv, T, D]`: the grid's `y` index is the
/// row, each row's threads the single launch's for batch 1. Names a power
/// of two of row slots (one compiled kernel each); the slots past the rows
/// repeat the first row's arrays, which no thread reads, and their outputs
/// are dropped.
fn each_on_cuda(
    keys: &[Array],
    values: &[Array],
    key_frame: &Array,
    value_frame: Option<&Array>,
    rows: &[WindowRow<'_>],
    shapes: &[WindowShape],
    s: &Stream,
) -> Result<Vec<(Array, Array)>> {
    let n = rows.len();
    let slots = n.next_power_of_two().max(2);
    let sh = &shapes[0];
    let filled = rows.iter().zip(shapes).map(|(r, x)| super::leading(r.win_k, x.at as i32, s)).collect::<Result<Vec<_>>>()?;
    let ((gx, _, _), threadgroup) = grid_1d("win_k", items_per_launch(sh, s.backend()?))?;
    let mut inputs: Vec<&Array> = vec![key_frame, value_frame.unwrap_or(key_frame)];
    let mut outputs = Vec::with_capacity(2 * slots);
    for i in 0..slots {
        let b = if i < n { i } else { 0 };
        let r = &rows[b];
        inputs.extend([&keys[b], &values[b], r.key_offset.unwrap_or(&keys[b]), r.win_k, r.win_v, &filled[b]]);
        outputs.extend([(r.win_k.shape(), r.win_k.dtype()), (r.win_v.shape(), r.win_v.dtype())]);
    }
    let outs = gpu::launch(
        &Launch {
            kernel: Kernel::WindowAppend,
            inputs: &inputs,
            outputs: &outputs,
            grid: (gx, n as i32, 1),
            threadgroup,
            template: &[
                ("T", TemplateArg::Dtype(rows[0].win_k.dtype())),
                ("D", TemplateArg::Int(sh.dim as i32)),
                ("OFFSET", TemplateArg::Bool(rows[0].key_offset.is_some())),
                ("ROTATE_V", TemplateArg::Bool(value_frame.is_some())),
                ("EACH", TemplateArg::Int(slots as i32)),
            ],
        },
        s,
    )?;
    let mut outs = outs.into_iter();
    Ok((0..n).map(|_| (outs.next().expect("two outputs a row"), outs.next().expect("two outputs a row"))).collect())
}

/// Lanes of CUDA's `window_append` per 8 output dimensions of a new slot
/// (the body's `KS`): a whole warp where the head size allows.
fn cuda_window_lanes(d: usize) -> usize {
    if d % 32 == 0 { 32 } else { 8 }
}

/// Threads of a `window_append` launch over windows of shape `sh`: CUDA's
/// body first gives each new slot's 8-dimension chunk a group of lanes, in
/// whole warps, then copies; Metal's one thread per 8-dimension chunk of
/// every slot (metal/ and cuda/ say how).
fn items_per_launch(sh: &WindowShape, backend: Backend) -> usize {
    let copies = 2 * sh.batch * sh.heads * sh.slots * (sh.dim / 8);
    match backend {
        Backend::Cuda => (2 * sh.batch * sh.heads * sh.tokens * (sh.dim / 8) * cuda_window_lanes(sh.dim)).div_ceil(32) * 32 + copies,
        _ => copies,
    }
}

fn on_gpu(a: &WindowAppend<'_>, sh: &WindowShape, s: &Stream) -> Result<(Array, Array)> {
    let d = sh.dim as i32;
    // The slot travels as the length of a view (no host array per call).
    let filled = super::leading(a.win_k, sh.at as i32, s)?;
    let (grid, threadgroup) = grid_1d("win_k", items_per_launch(sh, s.backend()?))?;
    let out = a.win_k.shape();
    let mut outs = gpu::launch(
        &Launch {
            kernel: Kernel::WindowAppend,
            inputs: &[
                a.keys,
                a.values,
                a.key_frame,
                a.value_frame.unwrap_or(a.key_frame),
                a.key_offset.unwrap_or(a.keys),
                a.win_k,
                a.win_v,
                &filled,
            ],
            outputs: &[(out.clone(), a.win_k.dtype()), (out, a.win_k.dtype())],
            grid,
            threadgroup,
            template: &[
                ("T", TemplateArg::Dtype(a.win_k.dtype())),
                ("D", TemplateArg::Int(d)),
                ("OFFSET", TemplateArg::Bool(a.key_offset.is_some())),
                ("ROTATE_V", TemplateArg::Bool(a.value_frame.is_some())),
            ],
        },
        s,
    )?
    .into_iter();
    Ok((outs.next().expect("two outputs"), outs.next().expect("two outputs")))
}
