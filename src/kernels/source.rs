//! The GPU kernel sources, embedded from `metal/` and `cuda/`.

/// One kernel body per variant, in both GPU languages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    BitPack,
    BitUnpack,
    VqQuantize,
}

impl Source {
    /// The kernel name given to MLX (unique per body).
    pub fn name(self) -> &'static str {
        match self {
            Source::BitPack => "veloxquant_bit_pack",
            Source::BitUnpack => "veloxquant_bit_unpack",
            Source::VqQuantize => "veloxquant_vq_quantize",
        }
    }

    pub fn metal(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../metal/bit_pack.metal"),
            Source::BitUnpack => include_str!("../../metal/bit_unpack.metal"),
            Source::VqQuantize => include_str!("../../metal/vq_quantize.metal"),
        }
    }

    pub fn cuda(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../cuda/bit_pack.cu"),
            Source::BitUnpack => include_str!("../../cuda/bit_unpack.cu"),
            Source::VqQuantize => include_str!("../../cuda/vq_quantize.cu"),
        }
    }

    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["codes", "params"],
            Source::BitUnpack => &["packed", "params"],
            Source::VqQuantize => &["x", "codebook", "params"],
        }
    }

    pub fn output_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["packed"],
            Source::BitUnpack => &["codes"],
            Source::VqQuantize => &["indices"],
        }
    }
}
