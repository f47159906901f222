//! Every kernel declared once: its contract with MLX (input and output
//! names, the CUDA body's extra arguments), which bodies and headers it has,
//! whether it has a CPU primitive and how it reads its inputs. The bodies are
//! found from the kernel's name: `metal/<name>.metal`, `cuda/<name>.cu`; the
//! CPU implementation is the primitive its op builds (`kernels::<op>`), run
//! under the kernel's MLX name. docs/KERNELS.md has each contract in full.

use crate::codec::layout::Codec;
use crate::dtype::Dtype;
use crate::stream::Backend;

/// Tokens one `tq_decode` threadgroup reads at most at once: a split's codes
/// and scores stay in threadgroup memory (the CUDA kernel's `TT`). CUDA's
/// tensor-core path reads longer splits in chunks of this size.
pub(crate) const DECODE_SPLIT_MAX: usize = 256;

/// Whether CUDA's `tq_decode` takes its tensor-core path for a cache of
/// `dtype` and head size `d` (the kernel's `MMA`).
pub(crate) fn decode_on_tensor_cores(dtype: Dtype, d: usize) -> bool {
    matches!(dtype, Dtype::F16 | Dtype::BF16) && d % 16 == 0
}

/// A template argument of a kernel body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// What MLX and the ops need to know of one kernel.
#[derive(Debug)]
pub struct Declaration {
    /// The kernel's name: its files' stem and its contract's heading.
    pub name: &'static str,
    /// The name MLX knows its GPU kernel and CPU primitive by.
    pub mlx_name: &'static str,
    pub inputs: &'static [&'static str],
    pub outputs: &'static [&'static str],
    /// Inputs the CUDA body takes after `inputs`.
    pub cuda_inputs: &'static [&'static str],
    /// Outputs of the CUDA body only, after `outputs`.
    pub cuda_outputs: &'static [&'static str],
    pub metal: Option<&'static str>,
    /// Helpers placed before the Metal body (MLX's `header`).
    pub metal_header: &'static str,
    pub cuda: Option<&'static str>,
    /// Helpers placed before the CUDA body (MLX's `header`).
    pub cuda_header: &'static str,
    /// Whether the op has a CPU primitive for it.
    pub cpu: bool,
    /// Whether the bodies name the codecs' ids (`Codec::gpu_defines`,
    /// placed before the header).
    pub codec_ids: bool,
    /// Whether the GPU bodies read their inputs through their strides, so
    /// that views (the cache's stores, transposed queries) cost no copy;
    /// otherwise MLX hands them over row-contiguous.
    pub strided: bool,
}

macro_rules! body {
    (metal, $name:literal) => {
        Some(include_str!(concat!("../../metal/", $name, ".metal")))
    };
    (cuda, $name:literal) => {
        Some(include_str!(concat!("../../cuda/", $name, ".cu")))
    };
    (none, $name:literal) => {
        None
    };
}

macro_rules! kernels {
    ($(
        $(#[doc = $doc:literal])*
        $kernel:ident = $name:literal {
            inputs: [$($input:literal),* $(,)?],
            outputs: [$($output:literal),* $(,)?],
            $(cuda_inputs: [$($cuda_input:literal),* $(,)?],)?
            $(cuda_outputs: [$($cuda_output:literal),* $(,)?],)?
            metal: $metal:ident [$($metal_header:literal),* $(,)?],
            cuda: $cuda:ident [$($cuda_header:literal),* $(,)?],
            cpu: $cpu:literal,
            $(codec_ids: $codec_ids:literal,)?
            strided: $strided:literal $(,)?
        }
    ),* $(,)?) => {
        /// A kernel; [`Kernel::declaration`] says what it is.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($(#[doc = $doc])* $kernel,)*
        }

        /// Every kernel's declaration, in [`Kernel`]'s order.
        pub static DECLARATIONS: &[Declaration] = &[$(
            Declaration {
                name: $name,
                mlx_name: concat!("veloxquant_", $name),
                inputs: &[$($input),*],
                outputs: &[$($output),*],
                cuda_inputs: &[$($($cuda_input),*)?],
                cuda_outputs: &[$($($cuda_output),*)?],
                metal: body!($metal, $name),
                metal_header: concat!($(include_str!(concat!("../../metal/", $metal_header))),*),
                cuda: body!($cuda, $name),
                cuda_header: concat!($(include_str!(concat!("../../cuda/", $cuda_header))),*),
                cpu: $cpu,
                codec_ids: false $(|| $codec_ids)?,
                strided: $strided,
            },
        )*];

        impl Kernel {
            /// Every kernel, in declaration order.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$kernel),*];
        }
    };
}

kernels! {
    /// b-bit codes packed along the last axis.
    BitPack = "bit_pack" {
        inputs: ["codes", "params"],
        outputs: ["packed"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    BitUnpack = "bit_unpack" {
        inputs: ["packed", "params"],
        outputs: ["codes"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    /// Nearest codebook entry of each short vector.
    VqQuantize = "vq_quantize" {
        inputs: ["x", "codebook", "params"],
        outputs: ["indices"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    /// The cache's TurboQuant-MSE encoder: norm and rotated Lloyd–Max codes.
    TqEncode = "tq_encode" {
        inputs: ["x", "rotation", "centroids"],
        outputs: ["codes", "norms"],
        metal: metal ["tq_norm.h"],
        cuda: cuda [
            "vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "tq_decode_common.cuh", "tq_common.cuh", "mma.cuh",
            "mma_common.cuh", "tq_encode_tensor_cores.cuh", "two_blocks_per_sm.cuh",
        ],
        cpu: true,
        strided: false,
    },
    /// Attention over a TurboQuant cache on the CPU. GPUs run `tq_decode`
    /// for one query and `kv_attention`, the kernel of every codec, for several.
    TqAttention = "tq_attention" {
        inputs: [],
        outputs: [],
        metal: none [],
        cuda: none [],
        cpu: true,
        strided: false,
    },
    /// A batch of per-sequence TurboQuant caches attended in one call (CPU).
    TqAttentionEach = "tq_attention_each" {
        inputs: [],
        outputs: [],
        metal: none [],
        cuda: none [],
        cpu: true,
        strided: false,
    },
    /// Decode attention over a TurboQuant cache; on CUDA it merges its
    /// splits itself (`counters`, `out`, `counters_out`).
    TqDecode = "tq_decode" {
        inputs: ["q", "rot", "k_codes", "k_norms", "k_cent", "v_codes", "v_norms", "v_cent", "win_k", "win_v"],
        outputs: ["m_out", "l_out", "acc_out"],
        cuda_inputs: ["counters"],
        cuda_outputs: ["out", "counters_out"],
        metal: metal [],
        // Only what the decode reads: MLX's host time per launch grows with
        // the source's length (gpu::compact_source).
        cuda: cuda ["quant_load.cuh", "mma.cuh", "tq_decode_common.cuh", "two_blocks_per_sm.cuh"],
        cpu: false,
        strided: true,
    },
    /// Merges the attention kernels' partial softmaxes and rotates back.
    TqReduce = "tq_reduce" {
        inputs: ["part_m", "part_l", "part_acc", "rot_v"],
        outputs: ["out"],
        metal: metal [],
        cuda: cuda [],
        cpu: false,
        strided: false,
    },
    /// Decode queries rotated and scaled once per call.
    TqRotate = "tq_rotate" {
        inputs: ["q", "rot"],
        outputs: ["out"],
        metal: metal [],
        cuda: cuda [],
        cpu: false,
        strided: true,
    },
    /// Attention over keys and values of any two codecs.
    KvAttention = "kv_attention" {
        inputs: [
            "qf", "k_codes", "k_scales", "k_zeros", "k_table", "v_codes", "v_scales", "v_zeros", "v_table", "win_k",
            "win_v", "mask", "params",
        ],
        outputs: ["m_out", "l_out", "acc_out"],
        cuda_inputs: ["params_hi"],
        metal: metal ["tq_common.h", "kv_common.h"],
        cuda: cuda ["kv_common.cuh"],
        cpu: true,
        codec_ids: true,
        strided: false,
    },
    TqProdEncode = "tq_prod_encode" {
        inputs: ["x", "rotation", "centroids", "sketch", "params"],
        outputs: ["codes", "signs", "norms", "residual_norms"],
        metal: metal ["tq_common.h", "tq_norm.h"],
        cuda: cuda [
            "vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "tq_decode_common.cuh", "tq_common.cuh", "mma.cuh",
            "mma_common.cuh", "tq_encode_tensor_cores.cuh",
        ],
        cpu: true,
        strided: false,
    },
    TqProdDecode = "tq_prod_decode" {
        inputs: ["codes", "signs", "norms", "residual_norms", "rotation", "centroids", "sketch", "params"],
        outputs: ["y"],
        metal: metal ["tq_common.h", "tq_norm.h"],
        cuda: cuda [
            "vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "tq_decode_common.cuh", "tq_common.cuh", "mma.cuh",
            "mma_common.cuh", "tq_tensor_cores.cuh", "two_blocks_per_sm.cuh",
        ],
        cpu: true,
        strided: false,
    },
    TqRvqEncode = "tq_rvq_encode" {
        inputs: ["x", "rotation", "centroids1", "centroids2", "params"],
        outputs: ["codes1", "codes2", "norms"],
        metal: metal ["tq_common.h", "tq_norm.h"],
        cuda: cuda [
            "vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "tq_decode_common.cuh", "tq_common.cuh", "mma.cuh",
            "mma_common.cuh", "tq_encode_tensor_cores.cuh", "two_blocks_per_sm.cuh",
        ],
        cpu: true,
        strided: false,
    },
    TqRvqDecode = "tq_rvq_decode" {
        inputs: ["codes1", "codes2", "norms", "rotation", "centroids1", "centroids2", "params"],
        outputs: ["y"],
        metal: metal ["tq_common.h", "tq_norm.h"],
        cuda: cuda [
            "vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "tq_decode_common.cuh", "tq_common.cuh", "mma.cuh",
            "mma_common.cuh", "tq_tensor_cores.cuh",
        ],
        cpu: true,
        strided: false,
    },
    ScalarQuantize = "scalar_quantize" {
        inputs: ["x", "codebook", "params"],
        outputs: ["packed"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    ScalarDequantize = "scalar_dequantize" {
        inputs: ["packed", "codebook", "params"],
        outputs: ["y"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    /// One TurboQuant-MSE side as the buffer a prefill chunk attends over.
    FramedDequantize = "framed_dequantize" {
        inputs: ["window", "codes", "norms", "table", "chunk", "params"],
        outputs: ["out"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh"],
        cpu: true,
        strided: false,
    },
    /// A TurboQuant-MSE layer's two stores grown with a prefill chunk's codes written.
    StoreWrite = "store_write" {
        inputs: [
            "k_codes", "k_norms", "k_new_codes", "k_new_norms", "v_codes", "v_norms", "v_new_codes", "v_new_norms",
            "params",
        ],
        outputs: ["k_out_codes", "k_out_norms", "v_out_codes", "v_out_norms"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh"],
        cpu: true,
        strided: false,
    },
    KiviQuantize = "kivi_quantize" {
        inputs: ["x", "params"],
        outputs: ["packed", "scales", "zeros"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    KiviDequantize = "kivi_dequantize" {
        inputs: ["packed", "scales", "zeros", "params"],
        outputs: ["y"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    QjlEncode = "qjl_encode" {
        inputs: ["k", "sketch", "params"],
        outputs: ["signs", "norms"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "mma.cuh", "mma_common.cuh", "qjl_tensor_cores.cuh"],
        cpu: true,
        strided: false,
    },
    QjlSketchQuery = "qjl_sketch_query" {
        inputs: ["q", "sketch", "params"],
        outputs: ["sq"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: false,
        strided: false,
    },
    QjlScore = "qjl_score" {
        inputs: ["sq", "signs", "norms", "params"],
        outputs: ["scores"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    PqEncode = "pq_encode" {
        inputs: ["x", "codebook", "params"],
        outputs: ["packed", "packed_hi"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh", "mma.cuh", "mma_common.cuh", "pq_encode_tensor_cores.cuh"],
        cpu: true,
        strided: false,
    },
    PqDecode = "pq_decode" {
        inputs: ["packed", "packed_hi", "codebook", "params"],
        outputs: ["y"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh", "quant_common.cuh"],
        cpu: true,
        strided: false,
    },
    /// A layer's key mean over its first chunk and its offset in the keys' frame.
    KeyMean = "key_mean" {
        inputs: ["keys", "rotation"],
        outputs: ["mean", "offset"],
        metal: metal [],
        cuda: cuda ["vq_access.cuh", "quant_load.cuh"],
        cpu: true,
        strided: true,
    },
    /// A decode step's tokens written into the float16 windows.
    WindowAppend = "window_append" {
        inputs: ["keys", "values", "key_frame", "value_frame", "key_offset", "win_k", "win_v", "filled"],
        outputs: ["out_k", "out_v"],
        metal: metal [],
        cuda: cuda [],
        cpu: true,
        strided: true,
    },
    /// A decode step of a batch of per-sequence windows in one call (CPU).
    WindowAppendEach = "window_append_each" {
        inputs: [],
        outputs: [],
        metal: none [],
        cuda: none [],
        cpu: true,
        strided: false,
    },
}

/// Dynamic shared memory to ask MLX for, for a launch that uses `dynamic`
/// bytes of it and at most `statics` of static shared memory. A block may
/// hold 48 KB of both without opting in; past that the kernel must raise its
/// dynamic limit, which MLX's CUDA custom kernel does only for requests above
/// 48000 bytes (it sets the limit to the request). A launch past 48 KB in all
/// that asks for less is refused ("invalid argument": `tq_decode` at D = 96,
/// 4/3 bits, 45 KB dynamic and 15 KB static), so it asks for 48001.
fn opted_in(dynamic: i32, statics: i32) -> i32 {
    const DEFAULT_LIMIT: i32 = 48 * 1024;
    const MLX_OPTS_IN_ABOVE: i32 = 48000;
    if dynamic > 0 && dynamic <= MLX_OPTS_IN_ABOVE && dynamic + statics > DEFAULT_LIMIT {
        MLX_OPTS_IN_ABOVE + 1
    } else {
        dynamic
    }
}

/// A kernel body's instantiation over several sequences' own arrays
/// (template argument `EACH` = n > 0): inputs the sequences share, each
/// sequence's own (`_i` appended; whether the body reads its shape and its
/// strides), outputs of the launch, each sequence's own outputs, and the
/// source that finds the block's sequence, `seq_`.
struct EachSignature {
    shared: &'static [&'static str],
    per_sequence: &'static [(&'static str, (bool, bool))],
    outputs: &'static [&'static str],
    per_sequence_outputs: &'static [&'static str],
    sequence: &'static str,
}

/// `tq_decode` over sequences: one rotation and codebooks for all; the
/// grid's slowest index is the sequence (`q`'s rows).
const TQ_DECODE_EACH: EachSignature = EachSignature {
    shared: &["q", "rot", "k_cent", "v_cent"],
    per_sequence: &[
        ("k_codes", (false, true)),
        ("k_norms", (true, true)),
        ("v_codes", (false, true)),
        ("v_norms", (false, true)),
        ("win_k", (true, true)),
        ("win_v", (false, true)),
        ("counters", (true, false)),
    ],
    outputs: &["m_out", "l_out", "acc_out", "out"],
    per_sequence_outputs: &["counters_out"],
    sequence: "blockIdx.x / (gridDim.x / uint32_t(q_shape[0]))",
};

/// `window_append` over sequences: one pair of frames for all; each
/// sequence's row of the new keys and values, its windows, slot and key
/// offset its own; the grid's `y` index is the sequence.
const WINDOW_APPEND_EACH: EachSignature = EachSignature {
    shared: &["key_frame", "value_frame"],
    per_sequence: &[
        ("keys", (true, true)),
        ("values", (false, true)),
        ("key_offset", (false, true)),
        ("win_k", (true, true)),
        ("win_v", (false, true)),
        ("filled", (true, false)),
    ],
    outputs: &[],
    per_sequence_outputs: &["out_k", "out_v"],
    sequence: "blockIdx.y",
};

impl EachSignature {
    /// Inputs and outputs for `n` sequences.
    fn names(&self, n: usize) -> (Vec<String>, Vec<String>) {
        let mut inputs: Vec<String> = self.shared.iter().map(|x| x.to_string()).collect();
        let mut outputs: Vec<String> = self.outputs.iter().map(|x| x.to_string()).collect();
        for i in 0..n {
            inputs.extend(self.per_sequence.iter().map(|(x, _)| format!("{x}_{i}")));
            outputs.extend(self.per_sequence_outputs.iter().map(|x| format!("{x}_{i}")));
        }
        (inputs, outputs)
    }

    /// Source placed before the body for `n` sequences: the block's
    /// sequence, then each name the body reads bound to that sequence's
    /// input or output (its pointer, and its shape and strides as pointers
    /// into the parameters). Every slot of `n` is named; launches of fewer
    /// sequences repeat the first's arrays in the slots past them, which no
    /// block reads.
    fn prelude(&self, n: usize) -> String {
        let pick = |f: &dyn Fn(usize) -> String| -> String {
            let mut x = f(n - 1);
            for i in (0..n - 1).rev() {
                x = format!("seq_ == {i} ? {} : {x}", f(i));
            }
            x
        };
        let mut s = format!("const unsigned seq_ = {};\n", self.sequence);
        for (name, (shape, strides)) in self.per_sequence {
            s += &format!("const auto {name} = {};\n", pick(&|i| format!("{name}_{i}")));
            if *shape {
                s += &format!("const auto {name}_shape = {};\n", pick(&|i| format!("&{name}_{i}_shape[0]")));
            }
            if *strides {
                s += &format!("const auto {name}_strides = {};\n", pick(&|i| format!("&{name}_{i}_strides[0]")));
            }
        }
        for name in self.per_sequence_outputs {
            s += &format!("auto* const {name} = {};\n", pick(&|i| format!("{name}_{i}")));
        }
        s
    }
}

impl Kernel {
    pub fn declaration(self) -> &'static Declaration {
        &DECLARATIONS[self as usize]
    }

    /// The kernel name given to MLX (unique per kernel).
    pub fn name(self) -> &'static str {
        self.declaration().mlx_name
    }

    /// The header MLX places before the body on `backend` for an
    /// instantiation with these template arguments: the codec ids where the
    /// kernel reads them, then the declared header (on CUDA
    /// [`Kernel::cuda_header_for`]'s).
    pub fn header(self, backend: Backend, template: &[(&str, TemplateArg)]) -> String {
        let d = self.declaration();
        let declared = match backend {
            Backend::Metal => d.metal_header,
            Backend::Cuda => self.cuda_header_for(template),
            Backend::Cpu => return String::new(),
        };
        let ids = if d.codec_ids { Codec::gpu_defines() } else { String::new() };
        ids + declared
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
            Kernel::TqProdEncode => match (arg("D"), arg("TC")) {
                (Some(TemplateArg::Int(d)), Some(TemplateArg::Int(tc))) if tc > 0 => 2 * d * d + 64 * (d + 8) * 2,
                _ => 0,
            },
            Kernel::ScalarQuantize | Kernel::TqEncode | Kernel::TqRvqEncode if arg("TABLE") == Some(TemplateArg::Bool(true)) => 65536,
            Kernel::TqDecode => match (arg("D"), arg("KB"), arg("VB"), arg("QN")) {
                (Some(TemplateArg::Int(d)), Some(TemplateArg::Int(kb)), Some(TemplateArg::Int(vb)), Some(TemplateArg::Int(qn))) => {
                    // The tensor-core path's two chunk buffers and their
                    // float16 norms, else one split's codes; and a spare
                    // word past them: the tensor-core path reads whole words
                    // from any bit on.
                    let chunk = DECODE_SPLIT_MAX as i32;
                    let codes = chunk * (d * kb / 8 + d * vb / 8);
                    let tensor_cores = matches!(arg("T"), Some(TemplateArg::Dtype(t)) if decode_on_tensor_cores(t, d as usize));
                    let dynamic = if tensor_cores { 2 * codes + 8 * chunk + 16 } else { codes + 16 };
                    // At most the kernel's static arrays: the queries (qs),
                    // the scores (sc), the queries' A fragments (qa_s, 32 D
                    // bytes on the tensor cores), the norms (kn_s, vn_s), the
                    // code tables (kt, kc, vc, vt, each at most 1 KB, but kt
                    // copied once per bank: 32 KB) and a few per-row words.
                    let variant = match arg("VARIANT") {
                        Some(TemplateArg::Int(v)) => v,
                        _ => 0,
                    };
                    let replicated = tensor_cores && kb == 4 && d <= 128 && variant & 1 == 0 && variant & 8 != 0 && variant & 32 != 0;
                    let key_table = if replicated { 32 * 1024 } else { 1024 };
                    let statics = 4 * qn * d + 4 * qn * chunk + if tensor_cores { 32 * d } else { 16 } + 8 * chunk + 3 * 1024 + key_table + 256;
                    opted_in(dynamic, statics)
                }
                _ => 0,
            },
            Kernel::TqProdDecode => {
                let on = |name: &str| arg(name) == Some(TemplateArg::Bool(true));
                match arg("D") {
                    Some(TemplateArg::Int(d)) if on("TC") && on("ROTATE") && !on("HADAMARD") => 4 * d * d,
                    _ => 0,
                }
            }
            _ => 0,
        }
    }

    /// The CUDA header of an instantiation with these template arguments:
    /// the declared CUDA header, but `tq_prod_encode`'s tensor-core path
    /// (`TC` > 0) takes `tq_encode`'s, which adds two_blocks_per_sm.cuh's
    /// register bound that its exact path goes without (ptxas would give
    /// that path more registers, and at D = 256 a spill). The template
    /// arguments differ, so MLX compiles the two apart.
    pub fn cuda_header_for(self, template: &[(&str, TemplateArg)]) -> &'static str {
        let tensor_cores = template.iter().any(|(n, v)| *n == "TC" && matches!(v, TemplateArg::Int(p) if *p > 0));
        match self {
            Kernel::TqProdEncode if tensor_cores => Kernel::TqEncode.declaration().cuda_header,
            _ => self.declaration().cuda_header,
        }
    }

    /// The body's input names, output names and source on `backend` for an
    /// instantiation with these template arguments: the declared ones (on
    /// CUDA with its own names after them), but CUDA's `tq_decode` and
    /// `window_append` over `n` sequences' own arrays (`EACH` = n > 0) take
    /// the shared inputs once and each sequence's suffixed `_0` to `_{n-1}`,
    /// behind a prelude that binds the body's names to the block's sequence
    /// ([`EachSignature`]). Not on Metal: MLX binds every input, shape and
    /// strides to a buffer of its own, and a Metal kernel takes at most 31
    /// (two sequences' decode would need 37).
    pub fn signature(self, backend: Backend, template: &[(&str, TemplateArg)]) -> (Vec<String>, Vec<String>, Option<String>) {
        let d = self.declaration();
        let each = template.iter().find_map(|(k, v)| match (*k, v) {
            ("EACH", TemplateArg::Int(n)) if *n > 0 => Some(*n as usize),
            _ => None,
        });
        let names = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let (signature, body) = match (backend, self) {
            (Backend::Cuda, Kernel::TqDecode) => (Some(&TQ_DECODE_EACH), d.cuda),
            (Backend::Cuda, Kernel::WindowAppend) => (Some(&WINDOW_APPEND_EACH), d.cuda),
            (Backend::Cuda, _) => (None, d.cuda),
            (Backend::Metal, _) => (None, d.metal),
            (Backend::Cpu, _) => (None, None),
        };
        match (signature, each, body) {
            (Some(sig), Some(n), Some(body)) => {
                let (inputs, outputs) = sig.names(n);
                (inputs, outputs, Some(sig.prelude(n) + body))
            }
            _ => {
                let (mut inputs, mut outputs) = (names(d.inputs), names(d.outputs));
                if backend == Backend::Cuda {
                    inputs.extend(names(d.cuda_inputs));
                    outputs.extend(names(d.cuda_outputs));
                }
                (inputs, outputs, body.map(str::to_string))
            }
        }
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declaration_is_its_kernel_and_its_bodies_read_what_it_declares() {
        assert_eq!(Kernel::ALL.len(), DECLARATIONS.len());
        let mut names = std::collections::HashSet::new();
        for &kernel in Kernel::ALL {
            let d = kernel.declaration();
            assert!(names.insert(d.name), "{} declared twice", d.name);
            assert_eq!(kernel.name(), format!("veloxquant_{}", d.name));
            assert!(d.cpu || d.metal.is_some() || d.cuda.is_some(), "{}: no implementation", d.name);
            // MLX passes every declared name as an argument: a name a body
            // never reads is a contract out of step with its body.
            let reads = |text: &str, name: &str| {
                text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == name || w == format!("{name}_shape"))
            };
            if let Some(metal) = d.metal {
                let text = format!("{}{metal}", d.metal_header);
                for name in d.inputs.iter().chain(d.outputs) {
                    assert!(reads(&text, name), "{}: the Metal body never names {name}", d.name);
                }
            }
            if let Some(cuda) = d.cuda {
                let text = format!("{}{cuda}", d.cuda_header);
                for name in d.inputs.iter().chain(d.outputs).chain(d.cuda_inputs).chain(d.cuda_outputs) {
                    assert!(reads(&text, name), "{}: the CUDA body never names {name}", d.name);
                }
            }
        }
    }

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
        let prod = Kernel::TqProdDecode;
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, true, false)), 65536);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(64, true, true, false)), 16384);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, true, true)), 0);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, true, false, false)), 0);
        assert_eq!(prod.cuda_dynamic_shared_bytes(&args(128, false, true, false)), 0);
        assert_eq!(Kernel::TqRvqDecode.cuda_dynamic_shared_bytes(&args(128, true, true, false)), 0);
        let encode = |d: i32, tc: i32| vec![("D", TemplateArg::Int(d)), ("TC", TemplateArg::Int(tc))];
        assert_eq!(Kernel::TqProdEncode.cuda_dynamic_shared_bytes(&encode(128, 1)), 32768 + 17408);
        assert_eq!(Kernel::TqProdEncode.cuda_dynamic_shared_bytes(&encode(64, 2)), 8192 + 9216);
        assert_eq!(Kernel::TqProdEncode.cuda_dynamic_shared_bytes(&encode(128, 0)), 0);
        let table = |on: bool| vec![("B_BITS", TemplateArg::Int(4)), ("TABLE", TemplateArg::Bool(on))];
        assert_eq!(Kernel::ScalarQuantize.cuda_dynamic_shared_bytes(&table(true)), 65536);
        assert_eq!(Kernel::ScalarQuantize.cuda_dynamic_shared_bytes(&table(false)), 0);
        assert_eq!(Kernel::ScalarQuantize.cuda_dynamic_shared_bytes(&[("B_BITS", TemplateArg::Int(4))]), 0);
        // tq_decode at D = 64: its chunk buffers fit the default 48 KB beside
        // the small tables, but not beside the key-pair table copied per bank.
        let decode = |variant: i32| {
            vec![
                ("T", TemplateArg::Dtype(Dtype::F16)),
                ("D", TemplateArg::Int(64)),
                ("KB", TemplateArg::Int(4)),
                ("VB", TemplateArg::Int(3)),
                ("QN", TemplateArg::Int(4)),
                ("VARIANT", TemplateArg::Int(variant)),
            ]
        };
        assert_eq!(Kernel::TqDecode.cuda_dynamic_shared_bytes(&decode(30)), 2 * 256 * (32 + 24) + 8 * 256 + 16);
        assert_eq!(Kernel::TqDecode.cuda_dynamic_shared_bytes(&decode(62)), 48001);
        for encoder in [Kernel::TqEncode, Kernel::TqRvqEncode] {
            assert_eq!(encoder.cuda_dynamic_shared_bytes(&table(true)), 65536);
            assert_eq!(encoder.cuda_dynamic_shared_bytes(&table(false)), 0);
        }
        assert_eq!(Kernel::TqProdEncode.cuda_dynamic_shared_bytes(&table(true)), 0);
    }

    #[test]
    fn decode_launches_past_48_kb_in_all_ask_mlx_to_opt_in() {
        let decode = |t: Dtype, d: i32, kb: i32, vb: i32| {
            let args = [
                ("T", TemplateArg::Dtype(t)),
                ("D", TemplateArg::Int(d)),
                ("KB", TemplateArg::Int(kb)),
                ("VB", TemplateArg::Int(vb)),
                ("QN", TemplateArg::Int(4)),
            ];
            Kernel::TqDecode.cuda_dynamic_shared_bytes(&args)
        };
        // Two 256-token chunks of codes, their norms and a spare word.
        assert_eq!(decode(Dtype::F16, 128, 4, 3), 2 * 256 * 112 + 2048 + 16);
        // 41 KB in all at D = 64: no opt-in needed (nor a larger request,
        // which would cost blocks per SM).
        assert_eq!(decode(Dtype::F16, 64, 4, 3), 2 * 256 * 56 + 2048 + 16);
        // 45 KB dynamic and ~15 KB static at D = 96: past MLX's threshold.
        assert_eq!(decode(Dtype::F16, 96, 4, 3), 48001);
        assert_eq!(decode(Dtype::F32, 192, 4, 3), 48001);
        assert_eq!(decode(Dtype::F32, 128, 4, 3), 256 * 112 + 16);
        assert_eq!(super::opted_in(0, 60_000), 0);
        assert_eq!(super::opted_in(60_000, 20_000), 60_000);
    }

    #[test]
    fn only_the_tensor_core_prod_encoder_takes_the_register_bound() {
        let bound = |h: &str| h.contains("__launch_bounds__(256, 2)");
        let tc = |p: i32| vec![("D", TemplateArg::Int(128)), ("TC", TemplateArg::Int(p))];
        assert!(bound(Kernel::TqProdEncode.cuda_header_for(&tc(1))));
        assert!(!bound(Kernel::TqProdEncode.cuda_header_for(&tc(0))));
        assert!(Kernel::TqProdEncode.cuda_header_for(&tc(1)).starts_with(Kernel::TqProdEncode.declaration().cuda_header));
        assert_eq!(Kernel::TqEncode.cuda_header_for(&tc(0)), Kernel::TqEncode.declaration().cuda_header);
    }

    #[test]
    fn kernels_over_sequences_name_each_sequence_input_and_bind_what_the_body_reads() {
        let (inputs, outputs, _) = Kernel::TqDecode.signature(Backend::Cuda, &[("EACH", TemplateArg::Int(3))]);
        assert_eq!(&inputs[..5], ["q", "rot", "k_cent", "v_cent", "k_codes_0"]);
        assert_eq!(inputs.last().map(String::as_str), Some("counters_2"));
        assert_eq!(outputs, ["m_out", "l_out", "acc_out", "out", "counters_out_0", "counters_out_1", "counters_out_2"]);
        let (_, outputs, _) = Kernel::WindowAppend.signature(Backend::Cuda, &[("EACH", TemplateArg::Int(2))]);
        assert_eq!(outputs, ["out_k_0", "out_v_0", "out_k_1", "out_v_1"]);
        // Metal's bodies take no sequences: the declared names, whatever EACH.
        for kernel in [Kernel::TqDecode, Kernel::WindowAppend] {
            let d = kernel.declaration();
            let (inputs, _, body) = kernel.signature(Backend::Metal, &[("EACH", TemplateArg::Int(3))]);
            assert_eq!(inputs, d.inputs.iter().map(|x| x.to_string()).collect::<Vec<_>>());
            assert_eq!(body.as_deref(), d.metal);
        }
        for (backend, kernel, sig) in [(Backend::Cuda, Kernel::TqDecode, &TQ_DECODE_EACH), (Backend::Cuda, Kernel::WindowAppend, &WINDOW_APPEND_EACH)] {
            let d = kernel.declaration();
            let cuda = if backend == Backend::Cuda { d.cuda } else { d.metal }.expect("a body");
            let (inputs, outputs, body) = kernel.signature(backend, &[("EACH", TemplateArg::Int(3))]);
            assert_eq!(inputs.len(), sig.shared.len() + 3 * sig.per_sequence.len(), "{}", d.name);
            assert_eq!(outputs.len(), sig.outputs.len() + 3 * sig.per_sequence_outputs.len(), "{}", d.name);
            // Shared and per-sequence names together are the declared ones.
            let mut each: Vec<&str> = sig.shared.iter().copied().chain(sig.per_sequence.iter().map(|(x, _)| *x)).collect();
            let extra: &[&str] = if backend == Backend::Cuda { d.cuda_inputs } else { &[] };
            let mut declared: Vec<&str> = d.inputs.iter().chain(extra).copied().collect();
            each.sort();
            declared.sort();
            assert_eq!(each, declared, "{}", d.name);
            let body = body.expect("a CUDA body");
            assert!(body.ends_with(cuda));
            let prelude = &body[..body.len() - cuda.len()];
            // Each binding picks among the three sequences, and MLX sees each
            // sequence's shape and strides where the body reads the bound name's.
            for &(name, (shape, strides)) in sig.per_sequence {
                assert!(prelude.contains(&format!("const auto {name} = seq_ == 0 ? {name}_0 : seq_ == 1 ? {name}_1 : {name}_2;")), "{name}");
                for (read, suffix) in [(shape, "shape"), (strides, "strides")] {
                    assert_eq!(prelude.contains(&format!("&{name}_2_{suffix}[0]")), read, "{name}_{suffix}");
                    assert_eq!(cuda.contains(&format!("{name}_{suffix}")), read, "{}: the body and {name}_{suffix}", d.name);
                }
            }
            // One set of arrays: the declared signature and body.
            let (inputs, outputs, body) = kernel.signature(backend, &[("EACH", TemplateArg::Int(0))]);
            let extra_out: &[&str] = if backend == Backend::Cuda { d.cuda_outputs } else { &[] };
            assert_eq!(inputs, d.inputs.iter().chain(extra).map(|x| x.to_string()).collect::<Vec<_>>());
            assert_eq!(outputs, d.outputs.iter().chain(extra_out).map(|x| x.to_string()).collect::<Vec<_>>());
            assert_eq!(body.as_deref(), Some(cuda));
        }
    }
}
