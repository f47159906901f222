//! Every codec's definition, one block each, and the registry that finds
//! them. A new codec is a variant of [`Codec`], a block here, its entry in
//! [`DEFS`], and its arms in the attention bodies (CPU, Metal, CUDA) and in
//! the cache's encoder.

use super::tables::{centroids, kivi_bit_offsets, pq_codebook, qjl_sketch};
use super::{Codec, CodecDef, SideCodec};
use crate::cpu::packed_len;
use crate::error::{Error, Result};
use crate::quant::ScalarCodebook;

/// The definitions, in the order of [`Codec::ALL`] (the ids).
pub(super) static DEFS: [&dyn CodecDef; 8] =
    [&Dense, &TurboQuantMse, &KiviPerChannel, &KiviPerToken, &ProductQuantized, &Qjl, &TurboQuantProd, &TurboQuantRvq];

/// A two-stage code row (TurboQuant-Prod, -RVQ): the first stage's `bits −
/// 1`-bit codes, then one bit per channel (the residual's sign or code).
fn two_stage_row_len(sc: &SideCodec, dim: usize) -> usize {
    sc.first_len(dim) + packed_len(dim, 1)
}

struct Dense;

impl CodecDef for Dense {
    fn codec(&self) -> Codec {
        Codec::Dense
    }
    fn gpu_name(&self) -> &'static str {
        "KV_DENSE"
    }
    fn rotated(&self) -> bool {
        false
    }
    fn row_len(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        0
    }
}

struct TurboQuantMse;

impl CodecDef for TurboQuantMse {
    fn codec(&self) -> Codec {
        Codec::TurboQuantMse
    }
    fn gpu_name(&self) -> &'static str {
        "KV_TURBOQUANT_MSE"
    }
    fn rotated(&self) -> bool {
        true
    }
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(centroids(dim, sc.bits)?))
    }
}

struct KiviPerChannel;

impl CodecDef for KiviPerChannel {
    fn codec(&self) -> Codec {
        Codec::KiviPerChannel
    }
    fn gpu_name(&self) -> &'static str {
        "KV_KIVI_PER_CHANNEL"
    }
    fn rotated(&self) -> bool {
        false
    }
    fn param_rows(&self, sc: &SideCodec, tokens: usize) -> usize {
        tokens.div_ceil(sc.group)
    }
    fn param_cols(&self, _sc: &SideCodec, dim: usize) -> usize {
        dim
    }
    fn has_zeros(&self) -> bool {
        true
    }
    /// The uniform bit offsets (one row every head reads); a layer with
    /// unequal widths holds its own.
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(kivi_bit_offsets(None, dim, sc.bits)))
    }
}

struct KiviPerToken;

impl CodecDef for KiviPerToken {
    fn codec(&self) -> Codec {
        Codec::KiviPerToken
    }
    fn gpu_name(&self) -> &'static str {
        "KV_KIVI_PER_TOKEN"
    }
    fn rotated(&self) -> bool {
        false
    }
    fn param_cols(&self, sc: &SideCodec, dim: usize) -> usize {
        dim / sc.group
    }
    fn has_zeros(&self) -> bool {
        true
    }
}

struct ProductQuantized;

impl CodecDef for ProductQuantized {
    fn codec(&self) -> Codec {
        Codec::ProductQuantized
    }
    fn gpu_name(&self) -> &'static str {
        "KV_PRODUCT_QUANTIZED"
    }
    fn rotated(&self) -> bool {
        true
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        packed_len(dim / sc.group, sc.bits)
    }
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(pq_codebook(dim, sc.group)?))
    }
}

struct Qjl;

impl CodecDef for Qjl {
    fn codec(&self) -> Codec {
        Codec::Qjl
    }
    fn gpu_name(&self) -> &'static str {
        "KV_QJL"
    }
    fn rotated(&self) -> bool {
        false
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    /// `bits` sketch rows per channel (`m = bits * dim`), one sign bit each.
    fn sketch_rows(&self, sc: &SideCodec, dim: usize) -> usize {
        sc.bits as usize * dim
    }
    fn table(&self, sc: &SideCodec, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
        Ok(Some(qjl_sketch(self.sketch_rows(sc, dim), dim, seed)))
    }
}

struct TurboQuantProd;

impl CodecDef for TurboQuantProd {
    fn codec(&self) -> Codec {
        Codec::TurboQuantProd
    }
    fn gpu_name(&self) -> &'static str {
        "KV_TURBOQUANT_PROD"
    }
    fn rotated(&self) -> bool {
        true
    }
    fn keys_scored_from_query(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        two_stage_row_len(sc, dim)
    }
    /// Norm and residual norm.
    fn param_cols(&self, _sc: &SideCodec, _dim: usize) -> usize {
        2
    }
    /// First-stage centroids, then the residual's `dim x dim` sketch.
    fn table(&self, sc: &SideCodec, dim: usize, seed: u64) -> Result<Option<Vec<f32>>> {
        let mut t = centroids(dim, sc.bits - 1)?;
        t.extend(qjl_sketch(dim, dim, seed));
        Ok(Some(t))
    }
}

struct TurboQuantRvq;

impl CodecDef for TurboQuantRvq {
    fn codec(&self) -> Codec {
        Codec::TurboQuantRvq
    }
    fn gpu_name(&self) -> &'static str {
        "KV_TURBOQUANT_RVQ"
    }
    fn rotated(&self) -> bool {
        true
    }
    fn row_len(&self, sc: &SideCodec, dim: usize) -> usize {
        two_stage_row_len(sc, dim)
    }
    /// First-stage centroids, then the residual's 1-bit codebook.
    fn table(&self, sc: &SideCodec, dim: usize, _seed: u64) -> Result<Option<Vec<f32>>> {
        let mut t = centroids(dim, sc.bits - 1)?;
        let second = ScalarCodebook::sphere_residual(dim, sc.bits - 1, 1).map_err(|e| Error::invalid("bits", e.to_string()))?;
        t.extend_from_slice(second.centroids());
        Ok(Some(t))
    }
}
