//! How one side (keys or values) of a compressed cache stores its tokens.
//!
//! Each codec is defined once, by a [`CodecDef`] in `defs.rs`: the name its
//! GPU bodies know it by, its frame, how its keys are scored, the layout of a
//! token's codes and side data, and the table it reads. [`Codec::def`] is the
//! registry. The ids the Metal and CUDA bodies switch on are generated from
//! it ([`Codec::gpu_defines`]), never written by hand.

mod defs;
mod tables;

pub use tables::{centroids, kivi_bit_offsets, pq_codebook, qjl_sketch, PQ_CODE_BITS};

use crate::error::Result;

/// How one side (keys or values) stores its compressed tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// The tokens themselves, in the cache's dtype.
    Dense,
    /// Norm (float16) + `bits`-bit Lloyd–Max codes of the rotated unit vector.
    TurboQuantMse,
    /// KIVI per channel: a float16 (scale, zero) per channel for every group
    /// of `group` consecutive tokens.
    KiviPerChannel,
    /// KIVI per token: a float16 (scale, zero) per group of `group` channels.
    KiviPerToken,
    /// Product quantization of the rotated unit vector: a float16 norm and
    /// one `bits`-bit code per sub-vector of `group` channels, into one
    /// codebook of `2^bits` entries shared by every position.
    ProductQuantized,
    /// QJL (keys only): the packed signs of `S k` for a sketch of `m = bits *
    /// dim` rows and the float16 norm; scored as `‖k‖ · Σ_r ±(c S q)_r`, the
    /// unbiased estimator of `crate::quant::qjl`.
    Qjl,
    /// TurboQuant-Prod (keys only), rotated frame: `bits − 1`-bit Lloyd–Max
    /// codes of the unit vector, then the signs of `S r` for its residual `r`
    /// (a `dim x dim` sketch); float16 (norm, residual norm) per token.
    /// Scored as `norm · (⟨Πq, c[code]⟩ + ‖r‖ · Σ_j ±(c S Πq)_j)`, the
    /// estimator of `crate::quant::TurboQuantProd`.
    TurboQuantProd,
    /// TurboQuant-RVQ, rotated frame: `bits − 1`-bit codes of the unit
    /// vector, then 1-bit codes of the residual (`ScalarCodebook::
    /// sphere_residual`); a float16 norm. Decoded as `norm · (c1 + c2)`.
    TurboQuantRvq,
}

/// What defines a codec. Layout methods take the side's [`SideCodec`] (its
/// bits and group) and the head size.
pub trait CodecDef: Sync {
    /// The variant this definition is for.
    fn codec(&self) -> Codec;
    /// The macro the GPU bodies name the codec's id by (`KV_*`).
    fn gpu_name(&self) -> &'static str;
    /// Whether the side's frame is the cache's rotation (else the identity).
    fn rotated(&self) -> bool;
    /// Whether keys of this codec are scored from features of the prepared
    /// query (a lookup table, a sketch) rather than decoded to a vector.
    fn keys_scored_from_query(&self) -> bool {
        false
    }
    /// Elements of a code row per token: bytes, or `dim` values for `Dense`.
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        crate::cpu::packed_len(dim, sc.bits)
    }
    /// Rows of the QJL sketch the codec scores with.
    fn sketch_rows(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    /// Rows of the scale and zero arrays for `tokens` token slots.
    fn param_rows(&self, _sc: &SideCodec, tokens: usize) -> usize {
        tokens
    }
    /// Columns of the scale and zero arrays (0: the codec has none).
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        1
    }
    /// Whether the codec has a zero array (else scales only).
    fn has_zeros(&self) -> bool {
        false
    }
    /// The float32 table the codec reads (`KvSide::table`), for heads of
    /// `dim` and the cache's `seed`; `None` for a codec without one.
    fn table(&self, _sc: &SideCodec, _dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
}

impl Codec {
    /// Every codec, in the order of its id.
    pub const ALL: [Codec; 8] = [
        Codec::Dense,
        Codec::TurboQuantMse,
        Codec::KiviPerChannel,
        Codec::KiviPerToken,
        Codec::ProductQuantized,
        Codec::Qjl,
        Codec::TurboQuantProd,
        Codec::TurboQuantRvq,
    ];

    /// The codec's definition.
    #[inline]
    pub fn def(self) -> &'static dyn CodecDef {
        defs::DEFS[self as usize]
    }

    /// The number the GPU bodies know the codec by (template `KM` / `VM`):
    /// its place in [`Codec::ALL`], the variants' order.
    pub fn id(self) -> i32 {
        self as i32
    }

    /// The macro the GPU bodies name the codec's id by.
    pub fn gpu_name(self) -> &'static str {
        self.def().gpu_name()
    }

    /// The codec ids as the GPU bodies read them: one `#define` each, put
    /// before the header of every kernel declared with `codec_ids`.
    pub fn gpu_defines() -> String {
        Codec::ALL.iter().map(|c| format!("#define {} {}\n", c.gpu_name(), c.id())).collect()
    }

    /// See [`CodecDef::keys_scored_from_query`].
    pub fn keys_scored_from_query(self) -> bool {
        self.def().keys_scored_from_query()
    }

    /// See [`CodecDef::rotated`].
    pub fn rotated(self) -> bool {
        self.def().rotated()
    }
}

/// One side's codec and its sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideCodec {
    pub codec: Codec,
    pub bits: u32,
    /// Tokens per (scale, zero) row for `KiviPerChannel`, channels per group
    /// for `KiviPerToken`, channels per sub-vector for `ProductQuantized`; 1
    /// otherwise.
    pub group: usize,
}


impl SideCodec {
    /// Elements of a code row per token (see [`CodecDef::row_len`]).
    /// TurboQuant-Prod and -RVQ rows are the `bits − 1`-bit codes followed
    /// by the 1-bit signs or residual codes (`dim` a multiple of 8, so that
    /// is `dim * bits / 8` bytes too); QJL rows the `bits * dim` sign bits.
    #[inline]
    pub fn row_len(&self, dim: usize) -> usize {
        self.codec.def().row_len(self, dim)
    }

    /// Bytes of the first stage's codes in a TurboQuant-Prod or -RVQ row.
    pub fn first_len(&self, dim: usize) -> usize {
        crate::cpu::packed_len(dim, self.bits - 1)
    }

    /// Rows of the QJL sketch.
    pub fn sketch_rows(&self, dim: usize) -> usize {
        self.codec.def().sketch_rows(self, dim)
    }

    /// Rows of the scale and zero arrays for `tokens` token slots.
    pub fn param_rows(&self, tokens: usize) -> usize {
        self.codec.def().param_rows(self, tokens)
    }

    /// Columns of the scale and zero arrays (0: the codec has none).
    pub fn param_cols(&self, dim: usize) -> usize {
        self.codec.def().param_cols(self, dim)
    }

    /// Whether the codec has a zero array (else scales only).
    pub fn has_zeros(&self) -> bool {
        self.codec.def().has_zeros()
    }

    /// The float32 table the codec reads (see [`CodecDef::table`]).
    pub fn table(&self, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
        self.codec.def().table(self, dim, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_codec_has_its_own_definition_and_gpu_name() {
        let mut names = std::collections::HashSet::new();
        for c in Codec::ALL {
            assert_eq!(Codec::ALL[c.id() as usize], c, "ALL lists {c:?} out of the variants' order");
            assert_eq!(c.def().codec(), c, "the registry's entry {} defines another codec", c.id());
            assert!(names.insert(c.gpu_name()), "{} named twice", c.gpu_name());
        }
        assert_eq!(defs::DEFS.len(), Codec::ALL.len());
    }
}
