//! How one side (keys or values) of a compressed cache stores its tokens.
//!
//! Each codec is defined once, by a [`CodecDef`] in `defs.rs`: its frame,
//! how its keys are scored, the layout of a token's codes and side data,
//! the table it reads, and its hooks (encode, non-finite marks, decode,
//! the query features its keys are scored from). [`Codec::def`] is the
//! registry. The kernels read only `layout.rs` (the ids, which the Metal and
//! CUDA bodies get generated as `#define`s, and a side's layout as plain
//! numbers); the hooks, built from kernel calls, sit above them, and
//! `graphs.rs` hands the fused attention what it needs from them.

mod defs;
pub mod graphs;
pub mod layout;
pub mod tables;

pub use layout::{Codec, SideLayout};
pub use tables::{centroids, e4m3_grid, kivi_bit_offsets, pq_codebook, qjl_sketch, E4M3_MAX, PQ_CODE_BITS};

use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::cpu::kv_attention::KvShape;
use crate::kernels::kv_attention::KvSideArrays;
use crate::kernels::Options;
use crate::stream::Stream;

/// A compressed side's new tokens, encoded: codes `[B, Hkv, m, row_len]`
/// and the codec's scales or norms and zeros.
pub struct Encoded {
    pub codes: Array,
    pub scales: Option<Array>,
    pub zeros: Option<Array>,
}

/// What defines a codec. Layout methods take the side's [`SideCodec`] (its
/// bits and group) and the head size; hooks take the side's [`SideLayout`].
pub trait CodecDef: Sync {
    /// The variant this definition is for.
    fn codec(&self) -> Codec;
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
    /// Bytes of the first stage's codes in a two-stage row; 0 for a codec
    /// of one stage.
    fn first_len(&self, _sc: &SideCodec, _dim: usize) -> usize {
        0
    }
    /// Rows of the QJL sketch the codec scores with.
    fn sketch_rows(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    /// Token slots that share one row of the scale and zero arrays.
    fn tokens_per_param_row(&self, _sc: &SideCodec) -> usize {
        1
    }
    /// Columns of the scale and zero arrays (0: the codec has none).
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        1
    }
    /// Whether the codec has a zero array (else scales only).
    fn has_zeros(&self) -> bool {
        false
    }
    /// Whether its norms are stored `[B, Hkv, slots]` (the layout
    /// `tq_attention` reads) rather than `[B, Hkv, rows, param_cols]`.
    fn flat_norms(&self) -> bool {
        false
    }
    /// Name of the scale array in a saved state (what it holds).
    fn scales_name(&self) -> &'static str {
        "norms"
    }
    /// The float32 table the codec reads (`KvSide::table`), for heads of
    /// `dim` and the cache's `seed`; `None` for a codec without one.
    fn table(&self, _sc: &SideCodec, _dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
    /// Floats per prepared query row: the query in the key frame, then what
    /// the key codec scores against besides it.
    fn query_features(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }

    /// Encodes `x` `[B, Hkv, m, D]`, in the side's frame (`m` a whole number
    /// of the codec's token groups), with the side's `table` and, for KIVI
    /// keys of unequal widths, the bits of each head's channels.
    fn encode(&self, l: &SideLayout, x: &Array, table: Option<&Array>, widths: Option<&[u8]>, dtype: Dtype, opts: &Options) -> Result<Encoded>;
    /// NaN where the tokens of `x` `[B, Hkv, m, D]` hold a NaN or an
    /// infinity, 0 elsewhere, float32, shaped to add to the codec's scales
    /// (by default from the norm, which is also infinite beyond float16's
    /// range).
    fn non_finite(&self, _l: &SideLayout, x: &Array, s: &Stream) -> Result<Array> {
        defs::norm_non_finite(x, false, s)
    }
    /// `scales` (what `encode` made of `x`) with a NaN for every token of
    /// `x` that holds a NaN or an infinity, so that it decodes to NaN.
    fn mark_non_finite(&self, l: &SideLayout, x: &Array, scales: &Array, s: &Stream) -> Result<Array> {
        let bad = self.non_finite(l, x, s)?;
        crate::ops::add(scales, &crate::ops::astype(&bad, Dtype::F16, s)?, s)
    }
    /// The side's compressed tokens decoded in its frame, float32 `[B, Hkv,
    /// compressed, D]`, with plain MLX ops (the reference the fused kernels
    /// are checked against).
    fn decode(&self, l: &SideLayout, side: &KvSideArrays<'_>, sh: &KvShape, s: &Stream) -> Result<Array>;
    /// What keys of this codec are scored against besides the framed
    /// query `framed` `[B, Hq, L, D]` (scaled): `None` for a codec whose keys
    /// are decoded.
    fn query_extras(&self, _l: &SideLayout, _framed: &Array, _table: Option<&Array>, _sh: &KvShape, _s: &Stream) -> Result<Option<Array>> {
        Ok(None)
    }
}

impl Codec {
    /// The codec's definition.
    #[inline]
    pub fn def(self) -> &'static dyn CodecDef {
        defs::DEFS[self as usize]
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
        self.codec.def().first_len(self, dim)
    }

    /// Rows of the QJL sketch.
    pub fn sketch_rows(&self, dim: usize) -> usize {
        self.codec.def().sketch_rows(self, dim)
    }

    /// Rows of the scale and zero arrays for `tokens` token slots.
    pub fn param_rows(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.codec.def().tokens_per_param_row(self))
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

    /// Floats per prepared query row (see [`CodecDef::query_features`]).
    pub fn query_features(&self, dim: usize) -> usize {
        self.codec.def().query_features(self, dim)
    }

    /// The side's layout for heads of `dim`, as the kernels read it.
    pub fn layout(&self, dim: usize) -> SideLayout {
        let def = self.codec.def();
        SideLayout {
            codec: self.codec,
            bits: self.bits,
            group: self.group,
            row_len: def.row_len(self, dim),
            first_len: def.first_len(self, dim),
            sketch_rows: def.sketch_rows(self, dim),
            tokens_per_param_row: def.tokens_per_param_row(self),
            param_cols: def.param_cols(self, dim),
            has_zeros: def.has_zeros(),
            rotated: def.rotated(),
            scored_from_query: def.keys_scored_from_query(),
        }
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
