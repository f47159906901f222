//! The GPU kernel sources, embedded from `metal/` and `cuda/`.

use super::gpu::TemplateArg;

/// One kernel body per variant, in both GPU languages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    BitPack,
    BitUnpack,
    VqQuantize,
    TqEncode,
    TqAttention,
    TqDecode,
    TqReduce,
    TqRotate,
    KvAttention,
    TqProdEncode,
    TqProdDecode,
    TqRvqEncode,
    TqRvqDecode,
    ScalarQuantize,
    ScalarDequantize,
    KiviQuantize,
    KiviDequantize,
    QjlEncode,
    QjlSketchQuery,
    QjlScore,
    PqEncode,
    PqDecode,
    WindowAppend,
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
            Source::TqDecode => "veloxquant_tq_decode",
            Source::TqReduce => "veloxquant_tq_reduce",
            Source::TqRotate => "veloxquant_tq_rotate",
            Source::KvAttention => "veloxquant_kv_attention",
            Source::TqProdEncode => "veloxquant_tq_prod_encode",
            Source::TqProdDecode => "veloxquant_tq_prod_decode",
            Source::TqRvqEncode => "veloxquant_tq_rvq_encode",
            Source::TqRvqDecode => "veloxquant_tq_rvq_decode",
            Source::ScalarQuantize => "veloxquant_scalar_quantize",
            Source::ScalarDequantize => "veloxquant_scalar_dequantize",
            Source::KiviQuantize => "veloxquant_kivi_quantize",
            Source::KiviDequantize => "veloxquant_kivi_dequantize",
            Source::QjlEncode => "veloxquant_qjl_encode",
            Source::QjlSketchQuery => "veloxquant_qjl_sketch_query",
            Source::QjlScore => "veloxquant_qjl_score",
            Source::PqEncode => "veloxquant_pq_encode",
            Source::PqDecode => "veloxquant_pq_decode",
            Source::WindowAppend => "veloxquant_window_append",
        }
    }

    pub fn metal(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../metal/bit_pack.metal"),
            Source::BitUnpack => include_str!("../../metal/bit_unpack.metal"),
            Source::VqQuantize => include_str!("../../metal/vq_quantize.metal"),
            Source::TqEncode => include_str!("../../metal/tq_encode.metal"),
            Source::TqAttention => include_str!("../../metal/tq_attention.metal"),
            Source::TqDecode => include_str!("../../metal/tq_decode.metal"),
            Source::TqReduce => include_str!("../../metal/tq_reduce.metal"),
            Source::TqRotate => include_str!("../../metal/tq_rotate.metal"),
            Source::KvAttention => include_str!("../../metal/kv_attention.metal"),
            Source::TqProdEncode => include_str!("../../metal/tq_prod_encode.metal"),
            Source::TqProdDecode => include_str!("../../metal/tq_prod_decode.metal"),
            Source::TqRvqEncode => include_str!("../../metal/tq_rvq_encode.metal"),
            Source::TqRvqDecode => include_str!("../../metal/tq_rvq_decode.metal"),
            Source::ScalarQuantize => include_str!("../../metal/scalar_quantize.metal"),
            Source::ScalarDequantize => include_str!("../../metal/scalar_dequantize.metal"),
            Source::KiviQuantize => include_str!("../../metal/kivi_quantize.metal"),
            Source::KiviDequantize => include_str!("../../metal/kivi_dequantize.metal"),
            Source::QjlEncode => include_str!("../../metal/qjl_encode.metal"),
            Source::QjlSketchQuery => include_str!("../../metal/qjl_sketch_query.metal"),
            Source::QjlScore => include_str!("../../metal/qjl_score.metal"),
            Source::PqEncode => include_str!("../../metal/pq_encode.metal"),
            Source::PqDecode => include_str!("../../metal/pq_decode.metal"),
            Source::WindowAppend => include_str!("../../metal/window_append.metal"),
        }
    }

    pub fn cuda(self) -> &'static str {
        match self {
            Source::BitPack => include_str!("../../cuda/bit_pack.cu"),
            Source::BitUnpack => include_str!("../../cuda/bit_unpack.cu"),
            Source::VqQuantize => include_str!("../../cuda/vq_quantize.cu"),
            Source::TqEncode => include_str!("../../cuda/tq_encode.cu"),
            Source::TqAttention => include_str!("../../cuda/tq_attention.cu"),
            Source::TqDecode => include_str!("../../cuda/tq_decode.cu"),
            Source::TqReduce => include_str!("../../cuda/tq_reduce.cu"),
            Source::TqRotate => include_str!("../../cuda/tq_rotate.cu"),
            Source::KvAttention => include_str!("../../cuda/kv_attention.cu"),
            Source::TqProdEncode => include_str!("../../cuda/tq_prod_encode.cu"),
            Source::TqProdDecode => include_str!("../../cuda/tq_prod_decode.cu"),
            Source::TqRvqEncode => include_str!("../../cuda/tq_rvq_encode.cu"),
            Source::TqRvqDecode => include_str!("../../cuda/tq_rvq_decode.cu"),
            Source::ScalarQuantize => include_str!("../../cuda/scalar_quantize.cu"),
            Source::ScalarDequantize => include_str!("../../cuda/scalar_dequantize.cu"),
            Source::KiviQuantize => include_str!("../../cuda/kivi_quantize.cu"),
            Source::KiviDequantize => include_str!("../../cuda/kivi_dequantize.cu"),
            Source::QjlEncode => include_str!("../../cuda/qjl_encode.cu"),
            Source::QjlSketchQuery => include_str!("../../cuda/qjl_sketch_query.cu"),
            Source::QjlScore => include_str!("../../cuda/qjl_score.cu"),
            Source::PqEncode => include_str!("../../cuda/pq_encode.cu"),
            Source::PqDecode => include_str!("../../cuda/pq_decode.cu"),
            Source::WindowAppend => include_str!("../../cuda/window_append.cu"),
        }
    }

    /// Inputs the CUDA body takes after [`Source::input_names`]: the
    /// attention kernels' second size carrier (`kernels::split_sizes`),
    /// `tq_decode`'s counters of finished splits (its `REDUCE`).
    pub fn cuda_extra_input_names(self) -> &'static [&'static str] {
        match self {
            Source::TqAttention | Source::KvAttention => &["params_hi"],
            Source::TqDecode => &["counters"],
            _ => &[],
        }
    }

    /// Outputs of the CUDA body only: `tq_decode`'s splits merged in the
    /// kernel (its `REDUCE`).
    pub fn cuda_extra_output_names(self) -> &'static [&'static str] {
        match self {
            Source::TqDecode => &["out"],
            _ => &[],
        }
    }

    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["codes", "params"],
            Source::BitUnpack => &["packed", "params"],
            Source::VqQuantize => &["x", "codebook", "params"],
            Source::TqEncode => &["x", "rotation", "centroids"],
            Source::TqAttention => &[
                "qr", "k_codes", "k_norms", "k_cent", "v_codes", "v_norms", "v_cent", "win_k", "win_v", "params",
            ],
            Source::TqDecode => &[
                "q", "rot", "k_codes", "k_norms", "k_cent", "v_codes", "v_norms", "v_cent", "win_k", "win_v",
            ],
            Source::TqReduce => &["part_m", "part_l", "part_acc", "rot_v"],
            Source::TqRotate => &["q", "rot"],
            Source::KvAttention => &[
                "qf", "k_codes", "k_scales", "k_zeros", "k_table", "v_codes", "v_scales", "v_zeros", "v_table", "win_k",
                "win_v", "mask", "params",
            ],
            Source::TqProdEncode => &["x", "rotation", "centroids", "sketch", "params"],
            Source::TqProdDecode => &[
                "codes", "signs", "norms", "residual_norms", "rotation", "centroids", "sketch", "params",
            ],
            Source::TqRvqEncode => &["x", "rotation", "centroids1", "centroids2", "params"],
            Source::TqRvqDecode => &["codes1", "codes2", "norms", "rotation", "centroids1", "centroids2", "params"],
            Source::ScalarQuantize => &["x", "codebook", "params"],
            Source::ScalarDequantize => &["packed", "codebook", "params"],
            Source::KiviQuantize => &["x", "params"],
            Source::KiviDequantize => &["packed", "scales", "zeros", "params"],
            Source::QjlEncode => &["k", "sketch", "params"],
            Source::QjlSketchQuery => &["q", "sketch", "params"],
            Source::QjlScore => &["sq", "signs", "norms", "params"],
            Source::PqEncode => &["x", "codebook", "params"],
            Source::PqDecode => &["packed", "packed_hi", "codebook", "params"],
            Source::WindowAppend => &["keys", "values", "key_frame", "value_frame", "key_offset", "win_k", "win_v", "filled"],
        }
    }

    pub fn output_names(self) -> &'static [&'static str] {
        match self {
            Source::BitPack => &["packed"],
            Source::BitUnpack => &["codes"],
            Source::VqQuantize => &["indices"],
            Source::TqEncode => &["codes", "norms"],
            Source::TqAttention | Source::TqDecode | Source::KvAttention => &["m_out", "l_out", "acc_out"],
            Source::TqReduce | Source::TqRotate => &["out"],
            Source::TqProdEncode => &["codes", "signs", "norms", "residual_norms"],
            Source::TqProdDecode => &["y"],
            Source::TqRvqEncode => &["codes1", "codes2", "norms"],
            Source::TqRvqDecode => &["y"],
            Source::ScalarQuantize => &["packed"],
            Source::ScalarDequantize => &["y"],
            Source::KiviQuantize => &["packed", "scales", "zeros"],
            Source::KiviDequantize => &["y"],
            Source::QjlEncode => &["signs", "norms"],
            Source::QjlSketchQuery => &["sq"],
            Source::QjlScore => &["scores"],
            Source::PqEncode => &["packed", "packed_hi"],
            Source::PqDecode => &["y"],
            Source::WindowAppend => &["out_k", "out_v"],
        }
    }

    /// Helpers placed before the Metal kernel (MLX's `header`).
    pub fn metal_header(self) -> &'static str {
        match self {
            Source::TqAttention => include_str!("../../metal/tq_common.h"),
            Source::TqEncode => include_str!("../../metal/tq_norm.h"),
            Source::KvAttention => concat!(include_str!("../../metal/tq_common.h"), include_str!("../../metal/kv_common.h")),
            Source::TqProdEncode | Source::TqProdDecode | Source::TqRvqEncode | Source::TqRvqDecode => {
                concat!(include_str!("../../metal/tq_common.h"), include_str!("../../metal/tq_norm.h"))
            }
            _ => "",
        }
    }

    /// Dynamic shared memory of a CUDA launch, in bytes, for the template
    /// arguments given: `tq_prod_decode`'s dense tensor-core path keeps the
    /// split sketch's fragments there (4 bytes per entry of the `D x D`
    /// sketch; MLX raises the kernel's limit past 48 KB); `tq_prod_encode`'s
    /// tensor-core path the sketch's float16 fragments (2 bytes an entry)
    /// and its residual tile of 64 rows (`tq_prod_tc_dynamic_bytes`);
    /// `scalar_quantize`'s table path the code of each of the 65536 values
    /// of a 16-bit type (a byte each), and so `tq_encode`'s and
    /// `tq_rvq_encode`'s for float16 values; `tq_decode` a split's key and
    /// value codes; 0 elsewhere.
    pub fn cuda_dynamic_shared_bytes(self, template: &[(&str, TemplateArg)]) -> i32 {
        let arg = |name: &str| template.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        match self {
            Source::TqProdEncode => match (arg("D"), arg("TC")) {
                (Some(TemplateArg::Int(d)), Some(TemplateArg::Int(tc))) if tc > 0 => 2 * d * d + 64 * (d + 8) * 2,
                _ => 0,
            },
            Source::ScalarQuantize | Source::TqEncode | Source::TqRvqEncode if arg("TABLE") == Some(TemplateArg::Bool(true)) => 65536,
            Source::TqDecode => match (arg("D"), arg("KB"), arg("VB")) {
                (Some(TemplateArg::Int(d)), Some(TemplateArg::Int(kb)), Some(TemplateArg::Int(vb))) => {
                    // The tensor-core path's two chunk buffers and their
                    // float16 norms, else one split's codes; and a spare
                    // word past them: the tensor-core path reads whole words
                    // from any bit on.
                    let chunk = super::turboquant::DECODE_SPLIT_MAX as i32;
                    let codes = chunk * (d * kb / 8 + d * vb / 8);
                    let tensor_cores = matches!(arg("T"), Some(TemplateArg::Dtype(t)) if super::turboquant::decode_on_tensor_cores(t, d as usize));
                    if tensor_cores { 2 * codes + 8 * chunk + 16 } else { codes + 16 }
                }
                _ => 0,
            },
            Source::TqProdDecode => {
                let on = |name: &str| arg(name) == Some(TemplateArg::Bool(true));
                match arg("D") {
                    Some(TemplateArg::Int(d)) if on("TC") && on("ROTATE") && !on("HADAMARD") => 4 * d * d,
                    _ => 0,
                }
            }
            _ => 0,
        }
    }

    /// Helpers placed before the CUDA kernel (MLX's `header`).
    pub fn cuda_header(self) -> &'static str {
        match self {
            Source::TqProdDecode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/tq_decode_common.cuh"),
                include_str!("../../cuda/tq_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/tq_tensor_cores.cuh"),
                include_str!("../../cuda/two_blocks_per_sm.cuh")
            ),
            Source::TqRvqDecode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/tq_decode_common.cuh"),
                include_str!("../../cuda/tq_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/tq_tensor_cores.cuh")
            ),
            Source::TqEncode | Source::TqRvqEncode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/tq_decode_common.cuh"),
                include_str!("../../cuda/tq_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/tq_encode_tensor_cores.cuh"),
                include_str!("../../cuda/two_blocks_per_sm.cuh")
            ),
            Source::TqProdEncode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/tq_decode_common.cuh"),
                include_str!("../../cuda/tq_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/tq_encode_tensor_cores.cuh")
            ),
            // Only what the decode reads: MLX's host time per launch grows
            // with the source's length (gpu::compact_source).
            Source::TqDecode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/tq_decode_common.cuh")
            ),
            Source::KvAttention => include_str!("../../cuda/kv_common.cuh"),
            Source::QjlEncode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/qjl_tensor_cores.cuh")
            ),
            Source::PqEncode => concat!(
                include_str!("../../cuda/quant_load.cuh"),
                include_str!("../../cuda/quant_common.cuh"),
                include_str!("../../cuda/mma.cuh"),
                include_str!("../../cuda/mma_common.cuh"),
                include_str!("../../cuda/pq_encode_tensor_cores.cuh")
            ),
            Source::BitPack
            | Source::BitUnpack
            | Source::VqQuantize
            | Source::ScalarQuantize
            | Source::ScalarDequantize
            | Source::KiviQuantize
            | Source::KiviDequantize
            | Source::QjlSketchQuery
            | Source::QjlScore
            | Source::PqDecode => concat!(include_str!("../../cuda/quant_load.cuh"), include_str!("../../cuda/quant_common.cuh")),
            _ => "",
        }
    }

    /// The CUDA header of an instantiation with these template arguments:
    /// [`Source::cuda_header`], but `tq_prod_encode`'s tensor-core path
    /// (`TC` > 0) takes `tq_encode`'s, which adds two_blocks_per_sm.cuh's
    /// register bound that its exact path goes without (ptxas would give
    /// that path more registers, and at D = 256 a spill). The template
    /// arguments differ, so MLX compiles the two apart.
    pub fn cuda_header_for(self, template: &[(&str, TemplateArg)]) -> &'static str {
        let tensor_cores = template.iter().any(|(n, v)| *n == "TC" && matches!(v, TemplateArg::Int(p) if *p > 0));
        match self {
            Source::TqProdEncode if tensor_cores => Source::TqEncode.cuda_header(),
            _ => self.cuda_header(),
        }
    }

    /// Whether MLX must hand the inputs over row-contiguous (copying views).
    /// `tq_decode`, `tq_rotate` and `window_append` read their inputs
    /// through their strides, so that views of the cache's stores and
    /// transposed queries cost no copy.
    pub fn row_contiguous(self) -> bool {
        !matches!(self, Source::TqDecode | Source::TqRotate | Source::WindowAppend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_memory_for_the_tensor_core_prod_codecs_and_the_code_table() {
        let args = |d: i32, tc: bool, rotate: bool, hadamard: bool| {
            vec![
                ("D", TemplateArg::Int(d)),
                ("ROTATE", TemplateArg::Bool(rotate)),
                ("HADAMARD", TemplateArg::Bool(hadamard)),
                ("TC", TemplateArg::Bool(tc)),
            ]
        };
        let prod = Source::TqProdDecode;
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, true, false)), 65536);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(64, true, true, false)), 16384);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, true, true)), 0);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, false, false)), 0);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, false, true, false)), 0);
        assert_eq!(Source::TqRvqDecode.cuda_dynamic_shared_bytes(&args(128, true, true, false)), 0);
        let encode = |d: i32, tc: i32| vec![("D", TemplateArg::Int(d)), ("TC", TemplateArg::Int(tc))];
        assert_eq!(Source::TqProdEncode.cuda_dynamic_shared_bytes(&encode(128, 1)), 32768 + 17408);
        assert_eq!(Source::TqProdEncode.cuda_dynamic_shared_bytes(&encode(64, 2)), 8192 + 9216);
        assert_eq!(Source::TqProdEncode.cuda_dynamic_shared_bytes(&encode(128, 0)), 0);
        let table = |on: bool| vec![("B_BITS", TemplateArg::Int(4)), ("TABLE", TemplateArg::Bool(on))];
        assert_eq!(Source::ScalarQuantize.cuda_dynamic_shared_bytes(&table(true)), 65536);
        assert_eq!(Source::ScalarQuantize.cuda_dynamic_shared_bytes(&table(false)), 0);
        assert_eq!(Source::ScalarQuantize.cuda_dynamic_shared_bytes(&[("B_BITS", TemplateArg::Int(4))]), 0);
        for encoder in [Source::TqEncode, Source::TqRvqEncode] {
            assert_eq!(encoder.cuda_dynamic_shared_bytes(&table(true)), 65536);
            assert_eq!(encoder.cuda_dynamic_shared_bytes(&table(false)), 0);
        }
        assert_eq!(Source::TqProdEncode.cuda_dynamic_shared_bytes(&table(true)), 0);
    }

    #[test]
    fn only_the_tensor_core_prod_encoder_takes_the_register_bound() {
        let bound = |h: &str| h.contains("__launch_bounds__(256, 2)");
        let tc = |p: i32| vec![("D", TemplateArg::Int(128)), ("TC", TemplateArg::Int(p))];
        assert!(bound(Source::TqProdEncode.cuda_header_for(&tc(1))));
        assert!(!bound(Source::TqProdEncode.cuda_header_for(&tc(0))));
        assert!(Source::TqProdEncode.cuda_header_for(&tc(1)).starts_with(Source::TqProdEncode.cuda_header()));
        assert_eq!(Source::TqEncode.cuda_header_for(&tc(0)), Source::TqEncode.cuda_header());
    }
}
