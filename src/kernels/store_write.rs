//! `store_write`: a TurboQuant-MSE layer's two stores (keys and values)
//! grown to a new capacity with a prefill chunk's encoded tokens written, in
//! one operation.
//!
//! As plain ops that is zeros and a join for the codes and for the norms, a
//! slice update of each and the norms' non-finite mark: ten launches a side,
//! each a few microseconds of host and GPU time, in every prefill chunk
//! (a chunk outgrows the store).

use half::f16;

use super::gpu::{self, Launch};
use super::{cpu_primitive, grid_1d, select, sizes, Implementation, Kernel, Options};
use crate::array::Array;
use crate::cpu::store_write::{self as cpu_store, StoreShape};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ops;
use crate::stream::Stream;

/// One side's store and the tokens to write into it.
pub struct StoreWrite<'a> {
    /// The packed codes `[B, Hkv, capacity, row_bytes]` (uint8).
    pub codes: &'a Array,
    /// The norms `[B, Hkv, capacity]` (float16).
    pub norms: &'a Array,
    /// The new tokens' codes `[B, Hkv, tokens, row_bytes]` and norms `[B, Hkv, tokens]`.
    pub new_codes: &'a Array,
    pub new_norms: &'a Array,
    /// The slot of the first new token; slots past it are not kept.
    pub first: usize,
    /// Slots of the store written.
    pub capacity: usize,
}

impl StoreWrite<'_> {
    fn check(&self) -> Result<StoreShape> {
        let cs = self.codes.shape();
        if cs.len() != 4 || self.codes.dtype() != Dtype::U8 {
            return Err(Error::invalid("codes", format!("{:?} {cs:?}, expected uint8 [batch, heads, capacity, row_bytes]", self.codes.dtype())));
        }
        let (b, h, cap0, nb) = (cs[0], cs[1], cs[2], cs[3]);
        if self.norms.shape() != [b, h, cap0] || self.norms.dtype() != Dtype::F16 {
            return Err(Error::invalid("norms", format!("{:?} {:?}, expected float16 [{b}, {h}, {cap0}]", self.norms.dtype(), self.norms.shape())));
        }
        let ns = self.new_codes.shape();
        if ns.len() != 4 || ns[..2] != [b, h] || ns[3] != nb || self.new_codes.dtype() != Dtype::U8 {
            return Err(Error::invalid("new_codes", format!("{:?} {ns:?}, expected uint8 [{b}, {h}, tokens, {nb}]", self.new_codes.dtype())));
        }
        let m = ns[2];
        if self.new_norms.shape() != [b, h, m] || self.new_norms.dtype() != Dtype::F16 {
            return Err(Error::invalid("new_norms", format!("{:?} {:?}, expected float16 [{b}, {h}, {m}]", self.new_norms.dtype(), self.new_norms.shape())));
        }
        if self.first > cap0 as usize {
            return Err(Error::invalid("first", format!("slot {} is past the store's {cap0} slots", self.first)));
        }
        if self.first + m as usize > self.capacity {
            return Err(Error::invalid("capacity", format!("{} slots cannot hold {} tokens from slot {}", self.capacity, m, self.first)));
        }
        Ok(StoreShape {
            rows: (b * h) as usize,
            capacity: cap0 as usize,
            new_capacity: self.capacity,
            first: self.first,
            tokens: m as usize,
            row_bytes: nb as usize,
        })
    }
}

/// Each side's store: codes `[B, Hkv, capacity, row_bytes]` and norms `[B,
/// Hkv, capacity]`, slots before `first` as held, then the new tokens (a
/// norm at or past float16's largest, where the encoder saturates a token
/// with a NaN or an infinity, as NaN, so that it decodes to NaN), then
/// zeros. The two sides (a layer's keys and values) share their rows,
/// slots and tokens; their code rows may differ in length.
pub fn store_write(sides: [&StoreWrite<'_>; 2], opts: &Options) -> Result<[(Array, Array); 2]> {
    let [k, v] = sides;
    let (ks, vs) = (k.check()?, v.check()?);
    if (vs.rows, vs.capacity, vs.new_capacity, vs.first, vs.tokens) != (ks.rows, ks.capacity, ks.new_capacity, ks.first, ks.tokens) {
        return Err(Error::invalid(
            "sides",
            format!("the values' store {vs:?} and the keys' {ks:?} differ in rows, slots or tokens"),
        ));
    }
    let stream = opts.resolve_stream()?;
    let shapes = |a: &StoreWrite<'_>, sh: &StoreShape| {
        let cs = a.codes.shape();
        let codes = vec![cs[0], cs[1], sh.new_capacity as i32, cs[3]];
        let norms = codes[..3].to_vec();
        [(codes, Dtype::U8), (norms, Dtype::F16)]
    };
    let [kc, kn] = shapes(k, &ks);
    let [vc, vn] = shapes(v, &vs);
    let outputs = [kc, kn, vc, vn];
    let words = |sh: &StoreShape| sh.rows * sh.new_capacity * sh.row_bytes.div_ceil(4);
    let items = words(&ks) + words(&vs);
    let imp = select(Kernel::StoreWrite, opts.policy, &stream)?;
    let outs = match imp {
        _ if items == 0 => return Ok([reference(k, &ks, &stream)?, reference(v, &vs, &stream)?]),
        Implementation::Reference => return Ok([reference(k, &ks, &stream)?, reference(v, &vs, &stream)?]),
        Implementation::Cpu => cpu_primitive::apply(
            Kernel::StoreWrite.name(),
            &[k.codes, k.norms, k.new_codes, k.new_norms, v.codes, v.norms, v.new_codes, v.new_norms],
            &outputs,
            &stream,
            Box::new(move |ins, outs| {
                for (side, sh) in [ks, vs].iter().enumerate() {
                    let i = &ins[4 * side..];
                    let (oc, on) = outs[2 * side..].split_at_mut(1);
                    cpu_store::store_write(
                        i[0].as_slice::<u8>()?,
                        i[1].as_slice::<f16>()?,
                        i[2].as_slice::<u8>()?,
                        i[3].as_slice::<f16>()?,
                        sh,
                        oc[0].as_mut_slice::<u8>()?,
                        on[0].as_mut_slice::<f16>()?,
                    );
                }
                Ok(())
            }),
        )?,
        imp @ (Implementation::Metal | Implementation::Cuda) => {
            let p = sizes(imp, "codes", &[ks.rows, ks.capacity, ks.first, ks.tokens, ks.new_capacity, ks.row_bytes, vs.row_bytes])?;
            let (grid, threadgroup) = grid_1d("capacity", items)?;
            let inputs = [k.codes, k.norms, k.new_codes, k.new_norms, v.codes, v.norms, v.new_codes, v.new_norms, &p];
            gpu::launch(
                &Launch { kernel: Kernel::StoreWrite, inputs: &inputs, outputs: &outputs, grid, threadgroup, template: &[] },
                &stream,
            )?
        }
    };
    let [kc, kn, vc, vn]: [Array; 4] = outs.try_into().map_err(|_| Error::invalid("store_write", "expected four outputs"))?;
    Ok([(kc, kn), (vc, vn)])
}

/// Float16 norms as the store keeps them, as MLX ops
/// ([`cpu::store_write::stored_norm`](cpu_store::stored_norm) on the CPU): a
/// NaN for a norm at or past float16's largest, where the encoder saturates
/// a token with a NaN or an infinity; a NaN norm stays NaN. Float16
/// constants, so that the norms compare and select without casts.
pub(crate) fn stored_norms(norms: &Array, s: &Stream) -> Result<Array> {
    let limit = Array::from_slice(&[f16::from_f32(crate::cpu::turboquant::MAX_NORM)], &[])?;
    let nan = Array::from_slice(&[f16::NAN], &[])?;
    ops::where_(&ops::greater_equal(norms, &limit, s)?, &nan, norms, s)
}

/// One side as plain MLX ops.
fn reference(a: &StoreWrite<'_>, sh: &StoreShape, s: &Stream) -> Result<(Array, Array)> {
    let cs = a.codes.shape();
    let (b, h, nb) = (cs[0], cs[1], cs[3]);
    let codes_shape = [b, h, sh.new_capacity as i32, nb];
    let (first, end) = (sh.first as i32, (sh.first + sh.tokens) as i32);
    let mut codes = ops::zeros(&codes_shape, Dtype::U8, s)?;
    let mut norms = ops::zeros(&codes_shape[..3], Dtype::F16, s)?;
    if first > 0 {
        let old = ops::slice(a.codes, &[0, 0, 0, 0], &[b, h, first, nb], s)?;
        codes = ops::slice_update(&codes, &old, &[0, 0, 0, 0], &[b, h, first, nb], s)?;
        let old = ops::slice(a.norms, &[0, 0, 0], &[b, h, first], s)?;
        norms = ops::slice_update(&norms, &old, &[0, 0, 0], &[b, h, first], s)?;
    }
    if end > first {
        codes = ops::slice_update(&codes, a.new_codes, &[0, 0, first, 0], &[b, h, end, nb], s)?;
        norms = ops::slice_update(&norms, &stored_norms(a.new_norms, s)?, &[0, 0, first], &[b, h, end], s)?;
    }
    Ok((codes, norms))
}
