#!/usr/bin/env python3
"""Compiles the quantizer and TurboQuant codec CUDA kernel bodies with NVRTC, without a GPU.

Each body is wrapped the way MLX's `cuda_kernel` wraps it (docs: the kernel
contract), body and header taken from the crate as it hands them to MLX
(`cargo run --example kernel_sources`: comments dropped, the generated codec
ids, the declared header files): MLX's device utilities (cuda/nvrtc's
stand-ins, as the library compiles its kernels for MLX's kernel cache),
the kernel's header, then
`__global__ void NAME(inputs..., outputs...)` in `mlx::core::cu` with the
template arguments as the first body lines. Every listed instantiation
must compile to sm_90a machine code (the H100 and H200), so
that ptxas limits such as static shared memory are checked too. `--verbose`
prints ptxas's registers, spills and shared memory per instantiation;
`--cubin OUT` writes each instantiation's machine code to OUT, to be read
with `nvdisasm -c` (PyPI's nvidia-cuda-nvdisasm). `--loop-stats NVDISASM`
(with `--cubin`) prints, for each instantiation, the instructions of the
innermost loop holding its tensor-core products (HMMA), by opcode: the
count of a decode step's instructions, as ptxas emits them, without a GPU.
`--only K=V,...` keeps the instantiations with those template arguments.

    python3 scripts/gpu/cuda-compile-check.py [--fetch] [--nvrtc DIR] [--all] [--verbose] [--cubin OUT]
        [--loop-stats NVDISASM] [--only K=V,...] [kernel ...]

DIR holds NVRTC and the CUDA headers as NVIDIA's wheels lay them out
(`include/`, `lib/libnvrtc.so.13`); default .device/nvrtc/cu13. `--fetch`
downloads nvidia-cuda-nvrtc, nvidia-cuda-runtime and nvidia-cuda-cccl 13.0
from PyPI and unpacks them there first.
"""

import argparse
import ctypes
import itertools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

# What the library hands NVRTC in place of MLX's device headers when it
# compiles its kernels into MLX's kernel cache (mlx-c/src/cuda_disk_cache.cpp).
NVRTC_HEADERS = {
    "mlx/backend/cuda/device/utils.cuh": ROOT / "cuda/nvrtc/utils.cuh",
    "cooperative_groups.h": ROOT / "cuda/nvrtc/cooperative_groups.h",
}
# MLX's own headers (utils.cuh includes its device/config.h).
MLX_INCLUDE = ROOT / ".venv/lib/python3.11/site-packages/mlx/include"

ELEMENT = ["float", "__half", "__nv_bfloat16"]

# kernel: (inputs, outputs, template axes), the inputs and outputs with their
# element types (their names must be the kernel's declared ones, checked
# against the crate's). An input or output typed "T" takes the
# instantiation's element type. Bodies and headers come from the crate
# (examples/kernel_sources.rs).
KERNELS = {
    "bit_pack": ([("codes", "uint8_t"), ("params", "uint32_t")],
                 [("packed", "uint8_t")], {"B_BITS": [1, 2, 3, 4, 5, 8]}),
    "bit_unpack": ([("packed", "uint8_t"), ("params", "uint32_t")],
                   [("codes", "uint8_t")], {"B_BITS": [1, 2, 3, 4, 5, 8]}),
    "scalar_quantize": ([("x", "T"), ("codebook", "float"), ("params", "uint32_t")], [("packed", "uint8_t")],
                        [{"T": ELEMENT, "B_BITS": [1, 3, 4, 8], "ITEMS": [4], "TABLE": [False]},
                         {"T": ["__half", "__nv_bfloat16"], "B_BITS": [4, 1, 2, 3, 5, 8], "ITEMS": [4], "TABLE": [True]}]),
    "scalar_dequantize": ([("packed", "uint8_t"), ("codebook", "float"), ("params", "uint32_t")], [("y", "T")],
                          {"T": ELEMENT, "B_BITS": [1, 3, 4, 8]}),
    "framed_dequantize": ([("window", "T"), ("codes", "uint8_t"), ("norms", "__half"), ("table", "float"), ("chunk", "T"),
                           ("params", "uint32_t")], [("out", "T")],
                          {"T": ELEMENT, "D": [64, 96, 128], "B_BITS": [1, 2, 3, 4, 8]}),
    "store_write": ([(f"{side}_{n}", ty) for side in "kv" for n, ty in (("codes", "uint8_t"), ("norms", "__half"),
                                                                        ("new_codes", "uint8_t"), ("new_norms", "__half"))]
                    + [("params", "uint32_t")],
                    [(f"{side}_{n}", ty) for side in "kv" for n, ty in (("out_codes", "uint8_t"), ("out_norms", "__half"))], {}),
    "key_mean": ([("keys", "T"), ("rotation", "float")], [("mean", "float"), ("offset", "T")],
                 {"T": ELEMENT, "D": [128, 64, 256, 96, 40], "ROTATE": [True, False], "FRAME": [16, 32], "TG": [1024]}),
    "kivi_quantize": ([("x", "T"), ("params", "uint32_t")],
                      [("packed", "uint8_t"), ("scales", "__half"), ("zeros", "__half")],
                      {"T": ELEMENT, "B_BITS": [1, 2, 3, 4, 8], "PER_CHANNEL": [True, False]}),
    "kivi_dequantize": ([("packed", "uint8_t"), ("scales", "__half"), ("zeros", "__half"), ("params", "uint32_t")],
                        [("y", "T")], {"T": ELEMENT, "B_BITS": [1, 2, 3, 4, 8], "PER_CHANNEL": [True, False], "ITEMS": [4]}),
    "qjl_encode": ([("k", "T"), ("sketch", "float"), ("params", "uint32_t")],
                   [("signs", "uint8_t"), ("norms", "__half")],
                   {"T,TC_D,TC_M": [(t, 0, 0) for t in ELEMENT]
                    + [("__half", dd, mm) for dd, mm in [(128, 256), (128, 128), (64, 64), (96, 160), (16, 64)]]}),
    "qjl_sketch_query": ([("q", "T"), ("sketch", "float"), ("params", "uint32_t")],
                         [("sq", "float")], {"T": ELEMENT}),
    "qjl_score": ([("sq", "float"), ("signs", "uint8_t"), ("norms", "__half"), ("params", "uint32_t")],
                  [("scores", "float")], {}),
    "vq_quantize": ([("x", "T"), ("codebook", "T"), ("params", "uint32_t")],
                    [("indices", "uint32_t")], {"T": ELEMENT, "D": [2, 4, 8]}),
    "pq_encode": ([("x", "T"), ("codebook", "float"), ("params", "uint32_t")],
                  [("packed", "uint8_t"), ("packed_hi", "uint8_t")],
                  [{"T": ELEMENT, "S": [2, 4, 8], "C_BITS": [4, 8, 10], "STAGED": [True, False], "TC": [False]},
                   {"T": ["__half", "__nv_bfloat16"], "S,C_BITS": [(4, 8), (4, 10), (2, 10), (8, 9), (8, 1), (2, 5), (4, 4)],
                    "STAGED": [False], "TC": [True]}]),
    "pq_decode": ([("packed", "uint8_t"), ("packed_hi", "uint8_t"), ("codebook", "float"), ("params", "uint32_t")],
                  [("y", "T")], {"T": ELEMENT, "S": [2, 4, 8], "C_BITS": [3, 4, 5, 6, 8, 10, 12], "TABLE_BYTES,ITEMS,QUADS": [(4096, 16, 0), (16384, 1, 4), (0, 2, 0)]}),
    "tq_encode": ([("x", "T"), ("rotation", "float"), ("centroids", "float")],
                  [("codes", "uint8_t"), ("norms", "__half")],
                  [{"T": ELEMENT, "D": [128, 64, 256], "B_BITS": [4, 1, 3], "ROTATE": [True, False],
                    "HADAMARD": [False, True], "TC": [0], "TABLE": [False]},
                   {"TC": [1, 2], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B_BITS": [4, 1, 2, 3, 8],
                    "ROTATE": [True], "HADAMARD": [False, True], "TABLE": [False]},
                   {"TC": [1, 2], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B_BITS": [4, 3],
                    "ROTATE": [True], "HADAMARD": [False, True], "TABLE": [True]}]),
    "tq_decode": ([("q", "T"), ("rot", "float"), ("k_codes", "uint8_t"), ("k_norms", "__half"), ("k_cent", "float"),
                   ("v_codes", "uint8_t"), ("v_norms", "__half"), ("v_cent", "float"), ("win_k", "T"), ("win_v", "T"),
                   ("counters", "uint32_t")],
                  [("m_out", "float"), ("l_out", "float"), ("acc_out", "float"), ("out", "T"), ("counters_out", "uint32_t")],
                  [{"T": ELEMENT, "D": [128, 64, 256], "KB": [4, 2], "VB": [4, 3], "QN": [1, 4], "TPT": [16, 8, 32],
                    "N_SINK": [4, 0], "CAUSAL": [False, True], "SCALE": [1040187392], "ROTATED": [False, True],
                    "REDUCE": [False, True], "VARIANT": [6, 14, 0, 1, 2, 3, 7, 8, 15, 30, 62], "EACH": [0]},
                   # the default recipe (K4/V3) at Llama's head sizes and GQA groups
                   {"T": ["__half"], "D": [128, 64], "KB": [4], "VB": [3], "QN": [4, 3, 2], "TPT": [16, 8],
                    "N_SINK": [4], "CAUSAL": [False], "SCALE": [1040187392], "ROTATED": [True, False],
                    "REDUCE": [True, False], "VARIANT": [6, 14, 0, 1, 2, 3, 7, 8, 15, 30, 62], "EACH": [0]},
                   # other head sizes and bits: unaligned code words, single-entry tables, the scalar path
                   {"T": ["__half"], "D": [96, 80, 72], "KB": [8, 3, 1], "VB": [8, 5, 1], "QN": [4], "TPT": [16],
                    "N_SINK": [4], "CAUSAL": [True], "SCALE": [1040187392], "ROTATED": [False], "REDUCE": [False],
                    "VARIANT": [6, 14, 0], "EACH": [0]}]),
    # tq_decode over four sequences' own caches (EACH = 4), the default recipe
    "tq_decode_each": ([("q", "T"), ("rot", "float"), ("k_cent", "float"), ("v_cent", "float")]
                       + [(f"{n}_{i}", ty) for i in range(4) for n, ty in (
                           ("k_codes", "uint8_t"), ("k_norms", "__half"), ("v_codes", "uint8_t"), ("v_norms", "__half"),
                           ("win_k", "T"), ("win_v", "T"), ("counters", "uint32_t"))],
                       [("m_out", "float"), ("l_out", "float"), ("acc_out", "float"), ("out", "T")]
                       + [(f"counters_out_{i}", "uint32_t") for i in range(4)],
                       {"T": ["__half", "__nv_bfloat16"], "D": [128, 64], "KB": [4], "VB": [3], "QN": [4], "TPT": [16, 8],
                        "N_SINK": [4], "CAUSAL": [False], "SCALE": [1040187392], "ROTATED": [False],
                        "REDUCE": [True, False], "VARIANT": [30, 62, 14], "EACH": [4]}),
    # window_append over four sequences' own windows (EACH = 4)
    "window_append_each": ([("key_frame", "T"), ("value_frame", "T")]
                           + [(f"{n}_{i}", "T") for i in range(4)
                              for n in ("keys", "values", "key_offset", "win_k", "win_v", "filled")],
                           [(f"{n}_{i}", "T") for i in range(4) for n in ("out_k", "out_v")],
                           {"T": ELEMENT, "D": [128, 64], "OFFSET": [True, False], "ROTATE_V": [True, False], "EACH": [4]}),
    "tq_rotate": ([("q", "T"), ("rot", "float")], [("out", "float")],
                  {"T": ELEMENT, "D": [128, 64, 256, 96], "QR": [4, 1], "SCALE": [1040187392]}),
    "tq_reduce": ([("part_m", "float"), ("part_l", "float"), ("part_acc", "float"), ("rot_v", "float")],
                  [("out", "T")], {"T": ELEMENT, "D": [128, 64, 256, 96], "ROTATE": [True, False]}),
    "window_append": ([("keys", "T"), ("values", "T"), ("key_frame", "T"), ("value_frame", "T"),
                       ("key_offset", "T"), ("win_k", "T"), ("win_v", "T"), ("filled", "T")],
                      [("out_k", "T"), ("out_v", "T")],
                      {"T": ELEMENT, "D": [128, 64, 256, 96], "OFFSET": [True, False], "ROTATE_V": [True, False]}),
    # The attention kernels: sizes in two carriers (kernels::split_sizes).
    "kv_attention": ([("qf", "float"), ("k_codes", "uint8_t"), ("k_scales", "__half"), ("k_zeros", "__half"),
                      ("k_table", "float"), ("v_codes", "uint8_t"), ("v_scales", "__half"), ("v_zeros", "__half"),
                      ("v_table", "float"), ("win_k", "T"), ("win_v", "T"), ("mask", "float"),
                      ("params", "uint32_t"), ("params_hi", "uint32_t")],
                     [("m_out", "float"), ("l_out", "float"), ("acc_out", "float")],
                     [{"T": ELEMENT, "D": [128, 64], "KM,KB,KG,QF": [("KV_KIVI_PER_CHANNEL", 2, 32, 128), ("KV_DENSE", 16, 1, 128),
                                                          ("KV_QJL", 1, 256, 256), ("KV_FP8", 8, 1, 128)],
                       "VM,VB,VG": [("KV_KIVI_PER_TOKEN", 2, 32), ("KV_PRODUCT_QUANTIZED", 8, 4),
                                    ("KV_TURBOQUANT_MSE", 4, 1), ("KV_FP8", 8, 1), ("KV_TURBOQUANT_UNIFORM", 3, 1)], "QN": [4, 1],
                       "STAGE": [False]},
                      # Staged sides (TurboQuant, FP8), and a staged side beside one that is not.
                      {"STAGE": [True], "T": ELEMENT, "D": [128, 64, 256],
                       "KM,KB,KG,QF": [("KV_TURBOQUANT_MSE", 4, 1, 128), ("KV_TURBOQUANT_UNIFORM", 1, 1, 128),
                                       ("KV_FP8", 8, 1, 128), ("KV_KIVI_PER_CHANNEL", 2, 32, 128)],
                       "VM,VB,VG": [("KV_TURBOQUANT_MSE", 3, 1), ("KV_TURBOQUANT_UNIFORM", 2, 1), ("KV_FP8", 8, 1),
                                    ("KV_KIVI_PER_TOKEN", 2, 32)], "QN": [4, 1, 16]}]),
    "tq_prod_encode": ([("x", "T"), ("rotation", "float"), ("centroids", "float"), ("sketch", "float"),
                        ("params", "uint32_t")],
                       [("codes", "uint8_t"), ("signs", "uint8_t"), ("norms", "__half"), ("residual_norms", "__half")],
                       [{"T": ELEMENT, "D": [128, 64, 256], "B_BITS": [4, 1, 2], "ROTATE": [True, False],
                         "HADAMARD": [False, True], "TC": [0]},
                        {"TC": [1, 2], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B_BITS": [4, 2, 3, 5, 9],
                         "ROTATE": [True], "HADAMARD": [False, True]}]),
    "tq_prod_decode": ([("codes", "uint8_t"), ("signs", "uint8_t"), ("norms", "__half"), ("residual_norms", "__half"),
                        ("rotation", "float"), ("centroids", "float"), ("sketch", "float"), ("params", "uint32_t")],
                       [("y", "T")],
                       [{"T": ELEMENT, "D": [128, 64, 256], "B_BITS": [4, 1, 2], "ROTATE": [True, False],
                         "HADAMARD": [False, True], "TC": [False]},
                        {"TC": [True], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B_BITS": [4, 1, 2, 9],
                         "ROTATE": [True, False], "HADAMARD": [False, True]}]),
    "tq_rvq_encode": ([("x", "T"), ("rotation", "float"), ("centroids1", "float"), ("centroids2", "float"),
                       ("params", "uint32_t")],
                      [("codes1", "uint8_t"), ("codes2", "uint8_t"), ("norms", "__half")],
                      [{"T": ELEMENT, "D": [128, 64, 256], "B1_BITS": [2, 1, 4], "B2_BITS": [2, 1, 4],
                        "ROTATE": [True, False], "HADAMARD": [False, True], "TC": [0], "TABLE": [False]},
                       {"TC": [1, 2], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B1_BITS": [2, 1, 4, 8],
                        "B2_BITS": [2, 3, 4, 8], "ROTATE": [True], "HADAMARD": [False, True], "TABLE": [False]},
                       {"TC": [1, 2], "T": ["__half", "__nv_bfloat16"], "D": [128, 64], "B1_BITS": [3, 4],
                        "B2_BITS": [2, 1], "ROTATE": [True], "HADAMARD": [False, True], "TABLE": [True]}]),
    "tq_rvq_decode": ([("codes1", "uint8_t"), ("codes2", "uint8_t"), ("norms", "__half"), ("rotation", "float"),
                       ("centroids1", "float"), ("centroids2", "float"), ("params", "uint32_t")],
                      [("y", "T")],
                      [{"T": ELEMENT, "D": [128, 64, 256], "B1_BITS": [2, 1, 4], "B2_BITS": [2, 1, 4],
                        "ROTATE": [True, False], "HADAMARD": [False, True], "TC": [False], "ROWS": [False]},
                       {"TC": [True], "ROWS": [False], "T": ["__half", "__nv_bfloat16"], "D": [128, 64],
                        "B1_BITS": [2, 1, 8], "B2_BITS": [2, 4, 8], "ROTATE": [True], "HADAMARD": [False]},
                       {"ROWS": [True], "TC": [False], "T": ELEMENT, "D": [128, 64, 32], "B1_BITS": [2, 1, 3, 8],
                        "B2_BITS": [2, 3, 4, 8], "ROTATE": [True], "HADAMARD": [True]},
                       {"ROWS": [True], "TC": [False], "T": ELEMENT, "D": [128, 96, 32], "B1_BITS": [2, 3],
                        "B2_BITS": [2, 1], "ROTATE": [False], "HADAMARD": [False]}]),
}


def instantiations(axes, every):
    """Every combination of the axes, or (the default) each value of each
    axis once, the other axes at their first value."""
    if not axes:  # a body without template arguments: one instantiation
        return [{}]
    if every:
        return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    first = {k: v[0] for k, v in axes.items()}
    seen, out = set(), []
    for k, values in axes.items():
        for v in values:
            args = {**first, k: v}
            key = tuple(args.items())
            if key not in seen:
                seen.add(key)
                out.append(args)
    return out


def flat_args(args):
    """An instantiation's arguments one by one: an axis named "A,B" takes
    (a, b) values, arguments valid only together."""
    return [(n, x) for k, v in args.items() for n, x in (zip(k.split(","), v) if "," in k else [(k, v)])]


def template_lines(args):
    out = []
    for k, v in flat_args(args):
        if k == "T":
            out.append(f"using T = {v};")
        elif isinstance(v, bool):
            out.append(f"constexpr bool {k} = {'true' if v else 'false'};")
        else:
            out.append(f"constexpr int {k} = {v};")
    return "\n".join(out)


def crate_sources(out: pathlib.Path, by_include: bool):
    """Every CUDA kernel's body, header and argument names as the crate hands
    them to MLX, written to `out` by examples/kernel_sources.rs (with
    `by_include`, as `#include` lines of files it writes)."""
    env = dict(os.environ)
    env.setdefault("VELOXQUANT_PYTHON", str(ROOT / ".venv/bin/python"))
    subprocess.run(["cargo", "run", "--release", "--quiet", "--example", "kernel_sources", "--", str(out)]
                   + (["--by-include"] if by_include else []), cwd=ROOT, env=env, check=True)


def source(name, spec, args, crate: pathlib.Path):
    inputs, outputs, _ = spec
    declared = (crate / f"{name}.args").read_text().splitlines()
    listed = [" ".join(n for n, _ in inputs), " ".join(n for n, _ in outputs)]
    if listed != declared:
        sys.exit(f"{name}: this script lists {listed}, the crate declares {declared}")
    t = args.get("T", "float")
    body = (crate / f"{name}.cu").read_text()
    params = []
    for n, ty in inputs:
        params.append(f"    const {t if ty == 'T' else ty}* {n}")
        # MLX adds an input's shape, strides and rank when the body names any.
        if any(f"{n}_{k}" in body for k in ("shape", "strides", "ndim")):
            params += [f"    const __grid_constant__ Shape {n}_shape", f"    const __grid_constant__ Strides {n}_strides",
                       f"    const __grid_constant__ int {n}_ndim"]
    params += [f"    {t if ty == 'T' else ty}* {n}" for n, ty in outputs]
    # Kernel::header: the tensor-core instantiations (TC > 0) may take another.
    tensor_cores = crate / f"{name}.tc.cuh"
    header = (tensor_cores if args.get("TC", 0) > 0 and tensor_cores.exists() else crate / f"{name}.cuh").read_text()
    return (
        '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
        + header
        + f"\nnamespace mlx::core::cu {{\n__global__ void veloxquant_{name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + template_lines(args)
        + "\n"
        + body
        + "\n}\n}\n"
    )


def compile_one(nvrtc, include, src, label, verbose=False, cubin=None):
    prog = ctypes.c_void_p()
    n = len(NVRTC_HEADERS)
    names = (ctypes.c_char_p * n)(*(k.encode() for k in NVRTC_HEADERS))
    bodies = (ctypes.c_char_p * n)(*(p.read_bytes() for p in NVRTC_HEADERS.values()))
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), label.encode(), n, bodies, names)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    opts = [b"--gpu-architecture=sm_90a", b"--device-as-default-execution-space", f"-I{MLX_INCLUDE}".encode(),
            f"-I{include}".encode(), f"-I{include}/cccl".encode()]
    if verbose:
        opts.append(b"--ptxas-options=-v")
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc == 0 and cubin is not None:
        size_bin = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size_bin))
        code = ctypes.create_string_buffer(size_bin.value)
        nvrtc.nvrtcGetCUBIN(prog, code)
        cubin.write_bytes(code.raw)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def loop_stats(nvdisasm: str, cubin: pathlib.Path) -> str:
    """The innermost loop around the machine code's HMMA instructions: its
    length and its opcodes by count (one line)."""
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            ins.append((addr, m.group(2)))
    mma = [a for a, t in ins if "HMMA" in t]
    if not mma:
        return "no HMMA"
    best = None  # the backward branch spanning every HMMA that starts last
    for addr, text in ins:
        b = re.search(r"BRA\s.*?(L_x_\d+)", text)
        if b and addr >= max(mma) and labels.get(b.group(1), 1 << 62) <= min(mma):
            start = labels[b.group(1)]
            if best is None or start > best[0]:
                best = (start, addr)
    if best is None:
        return "HMMA outside a loop"
    body = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins if best[0] <= a <= best[1]]
    counts = sorted(((body.count(op), op) for op in set(body)), reverse=True)
    return f"loop of {len(body)} instructions: " + ", ".join(f"{op} {n}" for n, op in counts)


def fetch(dest: pathlib.Path):
    wheels = ["nvidia-cuda-nvrtc==13.0.*", "nvidia-cuda-runtime==13.0.*", "nvidia-cuda-cccl==13.0.*"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *wheels], check=True)
        for w in pathlib.Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(w) as z:
                for name in z.namelist():
                    if name.startswith("nvidia/cu13/"):
                        target = dest / name[len("nvidia/cu13/"):]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(z.read(name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", default=str(ROOT / ".device/nvrtc/cu13"))
    ap.add_argument("--all", action="store_true", help="every combination of template arguments")
    ap.add_argument("--fetch", action="store_true", help="download NVRTC and the CUDA headers into --nvrtc")
    ap.add_argument("--verbose", action="store_true", help="print ptxas's resource use")
    ap.add_argument("--cubin", type=pathlib.Path, help="write each instantiation's machine code here")
    ap.add_argument("--loop-stats", metavar="NVDISASM", help="with --cubin: the HMMA loop's instructions by opcode")
    ap.add_argument("--only", default="", help="K=V,...: only instantiations with these template arguments")
    ap.add_argument("--by-include", action="store_true",
                    help="compile each source as MLX receives it: #include lines of the files the crate writes")
    ap.add_argument("kernels", nargs="*")
    a = ap.parse_args()
    base = pathlib.Path(a.nvrtc)
    if a.fetch:
        fetch(base)
    # NVRTC opens its builtins library by name: load it first, globally.
    ctypes.CDLL(str(base / "lib/libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(base / "lib/libnvrtc.so.13"))
    crate = pathlib.Path(tempfile.mkdtemp(prefix="kernel_sources_"))
    crate_sources(crate, a.by_include)
    failed = 0
    for name in a.kernels or KERNELS:
        spec = KERNELS[name]
        # Template axes: one family, or a list of families whose arguments
        # are valid only within each.
        families = spec[2] if isinstance(spec[2], list) else [spec[2]]
        only = dict(kv.split("=", 1) for kv in a.only.split(",") if kv)
        for args in [x for axes in families for x in instantiations(axes, a.all)]:
            flat = dict(flat_args(args))
            if any(str(flat.get(k)) != v for k, v in only.items()):
                continue
            label = f"{name}{args}"
            cubin = None
            if a.cubin is not None:
                a.cubin.mkdir(parents=True, exist_ok=True)
                cubin = a.cubin / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".cubin")
            rc, log = compile_one(nvrtc, base / "include", source(name, spec, args, crate), name + ".cu", a.verbose, cubin)
            if a.verbose and rc == 0:
                print(f"{label}\n{log}")
            if a.loop_stats and cubin is not None and rc == 0:
                print(f"{label}: {loop_stats(a.loop_stats, cubin)}")
            if rc != 0:
                failed += 1
                print(f"FAIL {label}\n{log}")
                break
        else:
            print(f"ok   {name}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
