//! The GPU kernel sources, embedded from `metal/` and `cuda/`.

/// One kernel body per variant, in both GPU languages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    BitPack,
    BitUnpack,
    VqQuantize,
    TqEncode,
    TqAttention,
    TqReduce,
}

impl Source {
    /// The kernel name given to MLX (unique per body).
    pub fn name(self) -> &'static str {
        match self {
            Source::BitPack => "veloxquant_bit_pack",
            Source::BitUnpack => "veloxquant_bit_unpack",
            Source::VqQuantize => "veloxquant_vq_quantize",
            Source::TqEncode => "veloxquant_tq_encode",
            Source::TqAttention => "veloxquant_tq_attention",
            Source::TqReduce => "veloxquant_tq_reduce",
        }
    }

    pub fn metal(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../metal/bit_pack.metal"),
            Source::BitUnpack => include_str!("../../metal/bit_unpack.metal"),
            Source::VqQuantize => include_str!("../../metal/vq_quantize.metal"),
            Source::TqEncode => include_str!("../../metal/tq_encode.metal"),
            Source::TqAttention => include_str!("../../metal/tq_attention.metal"),
            Source::TqReduce => include_str!("../../metal/tq_reduce.metal"),
        }
    }

    pub fn cuda(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../cuda/bit_pack.cu"),
            Source::BitUnpack => include_str!("../../cuda/bit_unpack.cu"),
            Source::VqQuantize => include_str!("../../cuda/vq_quantize.cu"),
            Source::TqEncode => include_str!("../../cuda/tq_encode.cu"),
            Source::TqAttention => include_str!("../../cuda/tq_attention.cu"),
            Source::TqReduce => include_str!("../../cuda/tq_reduce.cu"),
        }
    }

    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["codes", "params"],
            Source::BitUnpack => &["packed", "params"],
            Source::VqQuantize => &["x", "codebook", "params"],
            Source::TqEncode => &["x", "rotation", "centroids", "params"],
            Source::TqAttention => &[
                "q", "rot_k", "k_codes", "k_norms", "k_cent", "v_codes", "v_norms", "v_cent", "win_k", "win_v",
                "params", "scale",
            ],
            Source::TqReduce => &["part_m", "part_l", "part_acc", "rot_v", "params"],
        }
    }

    pub fn output_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["packed"],
            Source::BitUnpack => &["codes"],
            Source::VqQuantize => &["indices"],
            Source::TqEncode => &["codes", "norms"],
            Source::TqAttention => &["m_out", "l_out", "acc_out"],
            Source::TqReduce => &["out"],
        }
    }

    /// Helpers placed before the Metal kernel (MLX's `header`).
    pub fn metal_header(self) -> &'static str {
        match self {
            Source::TqAttention => include_str!("../../metal/tq_common.h"),
            _ => "",
        }
    }

    /// Helpers placed before the CUDA kernel (MLX's `header`).
    pub fn cuda_header(self) -> &'static str {
        match self {
            Source::TqAttention => include_str!("../../cuda/tq_common.cuh"),
            _ => "",
        }
    }
}
