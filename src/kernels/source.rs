//! The GPU kernel sources, embedded from `metal/` and `cuda/`.

/// One kernel body per variant, in both GPU languages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    BitPack,
    BitUnpack,
    VqQuantize,
    ScalarQuantize,
    ScalarDequantize,
    KiviQuantize,
    KiviDequantize,
    QjlEncode,
    QjlScore,
    PqEncode,
    PqDecode,
}

impl Source {
    /// The kernel name given to MLX (unique per body).
    pub fn name(self) -> &'static str {
        match self {
            Source::BitPack => "veloxquant_bit_pack",
            Source::BitUnpack => "veloxquant_bit_unpack",
            Source::VqQuantize => "veloxquant_vq_quantize",
            Source::ScalarQuantize => "veloxquant_scalar_quantize",
            Source::ScalarDequantize => "veloxquant_scalar_dequantize",
            Source::KiviQuantize => "veloxquant_kivi_quantize",
            Source::KiviDequantize => "veloxquant_kivi_dequantize",
            Source::QjlEncode => "veloxquant_qjl_encode",
            Source::QjlScore => "veloxquant_qjl_score",
            Source::PqEncode => "veloxquant_pq_encode",
            Source::PqDecode => "veloxquant_pq_decode",
        }
    }

    pub fn metal(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../metal/bit_pack.metal"),
            Source::BitUnpack => include_str!("../../metal/bit_unpack.metal"),
            Source::VqQuantize => include_str!("../../metal/vq_quantize.metal"),
            Source::ScalarQuantize => include_str!("../../metal/scalar_quantize.metal"),
            Source::ScalarDequantize => include_str!("../../metal/scalar_dequantize.metal"),
            Source::KiviQuantize => include_str!("../../metal/kivi_quantize.metal"),
            Source::KiviDequantize => include_str!("../../metal/kivi_dequantize.metal"),
            Source::QjlEncode => include_str!("../../metal/qjl_encode.metal"),
            Source::QjlScore => include_str!("../../metal/qjl_score.metal"),
            Source::PqEncode => include_str!("../../metal/pq_encode.metal"),
            Source::PqDecode => include_str!("../../metal/pq_decode.metal"),
        }
    }

    pub fn cuda(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../cuda/bit_pack.cu"),
            Source::BitUnpack => include_str!("../../cuda/bit_unpack.cu"),
            Source::VqQuantize => include_str!("../../cuda/vq_quantize.cu"),
            Source::ScalarQuantize => include_str!("../../cuda/scalar_quantize.cu"),
            Source::ScalarDequantize => include_str!("../../cuda/scalar_dequantize.cu"),
            Source::KiviQuantize => include_str!("../../cuda/kivi_quantize.cu"),
            Source::KiviDequantize => include_str!("../../cuda/kivi_dequantize.cu"),
            Source::QjlEncode => include_str!("../../cuda/qjl_encode.cu"),
            Source::QjlScore => include_str!("../../cuda/qjl_score.cu"),
            Source::PqEncode => include_str!("../../cuda/pq_encode.cu"),
            Source::PqDecode => include_str!("../../cuda/pq_decode.cu"),
        }
    }

    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["codes", "params"],
            Source::BitUnpack => &["packed", "params"],
            Source::VqQuantize => &["x", "codebook", "params"],
            Source::ScalarQuantize => &["x", "codebook", "params"],
            Source::ScalarDequantize => &["packed", "codebook", "params"],
            Source::KiviQuantize => &["x", "params"],
            Source::KiviDequantize => &["packed", "scales", "zeros", "params"],
            Source::QjlEncode => &["k", "sketch", "params"],
            Source::QjlScore => &["q", "sketch", "signs", "norms", "params"],
            Source::PqEncode => &["x", "codebook", "params"],
            Source::PqDecode => &["packed", "codebook", "params"],
        }
    }

    pub fn output_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["packed"],
            Source::BitUnpack => &["codes"],
            Source::VqQuantize => &["indices"],
            Source::ScalarQuantize => &["packed"],
            Source::ScalarDequantize => &["y"],
            Source::KiviQuantize => &["packed", "scales", "zeros"],
            Source::KiviDequantize => &["y"],
            Source::QjlEncode => &["signs", "norms"],
            Source::QjlScore => &["scores"],
            Source::PqEncode => &["packed"],
            Source::PqDecode => &["y"],
        }
    }
}
