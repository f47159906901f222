//! What the kernels know of a codec: its id, the name its GPU bodies call
//! that id by, and a side's layout as plain numbers. The kernels read only
//! this file, so the codecs' definitions (`defs.rs`), whose hooks are built
//! from kernel calls, can sit above them without an import loop.

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
    /// FP8: each element the nearest float8 e4m3 value of `x / scale`, with a
    /// float16 `scale = max|x| / 448` per token; decoded as `scale · grid[code]`.
    Fp8,
    /// TurboQuant-MSE's frame and norm with codes on a uniform grid
    /// (`tables::uniform_grid`) instead of Lloyd–Max centroids: the values
    /// of TurboQuant-MSE at 3 bits, which lose no quality by it, and which
    /// CUDA's decode then reads without a table.
    TurboQuantUniform,
}

impl Codec {
    /// Every codec, in the order of its id.
    pub const ALL: [Codec; 10] = [
        Codec::Dense,
        Codec::TurboQuantMse,
        Codec::KiviPerChannel,
        Codec::KiviPerToken,
        Codec::ProductQuantized,
        Codec::Qjl,
        Codec::TurboQuantProd,
        Codec::TurboQuantRvq,
        Codec::Fp8,
        Codec::TurboQuantUniform,
    ];

    /// The number the GPU bodies know the codec by (template `KM` / `VM`):
    /// its place in [`Codec::ALL`], the variants' order.
    pub fn id(self) -> i32 {
        self as i32
    }

    /// TurboQuant-MSE on either table: an element is a table entry times its
    /// token's norm, and the fused TurboQuant kernels read it.
    pub fn turboquant_mse(self) -> bool {
        matches!(self, Codec::TurboQuantMse | Codec::TurboQuantUniform)
    }

    /// Whether a token is a row of `dim` codes of `bits` into a table, times
    /// one scale: `kv_attention`'s GPU bodies stage a tile of such rows in
    /// threadgroup memory (their `kv_staged`).
    pub fn staged_in_attention(self) -> bool {
        matches!(self, Codec::TurboQuantMse | Codec::TurboQuantUniform | Codec::Fp8)
    }

    /// The macro the GPU bodies name the codec's id by.
    pub fn gpu_name(self) -> &'static str {
        match self {
            Codec::Dense => "KV_DENSE",
            Codec::TurboQuantMse => "KV_TURBOQUANT_MSE",
            Codec::KiviPerChannel => "KV_KIVI_PER_CHANNEL",
            Codec::KiviPerToken => "KV_KIVI_PER_TOKEN",
            Codec::ProductQuantized => "KV_PRODUCT_QUANTIZED",
            Codec::Qjl => "KV_QJL",
            Codec::TurboQuantProd => "KV_TURBOQUANT_PROD",
            Codec::TurboQuantRvq => "KV_TURBOQUANT_RVQ",
            Codec::Fp8 => "KV_FP8",
            Codec::TurboQuantUniform => "KV_TURBOQUANT_UNIFORM",
        }
    }

    /// The codec ids as the GPU bodies read them: one `#define` each, put
    /// before the header of every kernel declared with `codec_ids`.
    pub fn gpu_defines() -> String {
        Codec::ALL.iter().map(|c| format!("#define {} {}\n", c.gpu_name(), c.id())).collect()
    }
}

/// One side's layout for heads of one size, as the kernels read it
/// (`SideCodec::layout` computes it from the codec's definition).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideLayout {
    pub codec: Codec,
    pub bits: u32,
    /// The codec's group (see `SideCodec::group`).
    pub group: usize,
    /// Elements of a code row per token: bytes, or `dim` values for `Dense`.
    pub row_len: usize,
    /// Bytes of the first stage's codes in a two-stage row (TurboQuant-Prod,
    /// -RVQ); 0 for the other codecs.
    pub first_len: usize,
    /// Rows of the QJL sketch the codec scores with.
    pub sketch_rows: usize,
    /// Token slots that share one row of the scale and zero arrays.
    pub tokens_per_param_row: usize,
    /// Columns of the scale and zero arrays (0: the codec has none).
    pub param_cols: usize,
    /// Whether the codec has a zero array (else scales only).
    pub has_zeros: bool,
    /// Whether the side's frame is the cache's rotation (else the identity).
    pub rotated: bool,
    /// Whether keys are scored from features of the prepared query rather
    /// than decoded to a vector.
    pub scored_from_query: bool,
}

impl SideLayout {
    /// Rows of the scale and zero arrays for `tokens` token slots.
    pub fn param_rows(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.tokens_per_param_row)
    }
}
