#!/usr/bin/env python3
"""Captures the Metal source that MLX generates around kernel bodies.

MLX on Linux has no Metal back-end, but `mx.export_function` traces a
`metal_kernel` call without running it, and `verbose=True` makes MLX print the
full generated source (header, signature, body, explicit instantiation). This
script records that text for a set of cases into `tests/golden/metal/`:

  <case>.metal        MLX's generated source, byte for byte
  <case>.case         what the Rust test needs to regenerate it
  <case>.body.metal   the body, for cases whose body is not one of metal/*.metal
  <case>.header.metal the header, when the case has one

`tests/metal_golden.rs` regenerates every case with the emulator's wrapper
generator and compares. The kernel cases read their body from metal/*.metal,
so editing a kernel body means running this script again:

    .venv/bin/python scripts/capture_metal_golden.py
"""

import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "metal"

DTYPES = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

# Every attribute MLX detects, in an order different from MLX's, so that the
# golden pins the order MLX emits them in.
ALL_ATTRIBUTES = [
    "threads_per_threadgroup",
    "thread_position_in_grid",
    "threads_per_simdgroup",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "thread_index_in_quadgroup",
    "thread_execution_width",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_grid",
    "simdgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup",
    "quadgroup_index_in_threadgroup",
    "grid_size",
    "grid_origin",
    "dispatch_threads_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup",
    "dispatch_quadgroups_per_threadgroup",
]


def kernel_case(name, kernel, inputs, outputs, template, body=None, header=None):
    """A case whose body (and header) are files of metal/; `body` defaults to
    metal/<kernel>.metal."""
    case = dict(name=name, kernel=kernel, inputs=inputs, outputs=outputs,
                template=template, body_file=f"metal/{body or kernel}.metal")
    if header:
        case["header_file"] = f"metal/{header}"
    return case


def tq_cases():
    """The TurboQuant cache kernels with the names, input order and template
    arguments src/kernels/turboquant.rs gives MLX, including inputs small
    enough for constant memory (a 1-element placeholder rotation, 2- and
    4-entry codebooks, short params and partials)."""
    out = []
    enc_in = lambda t, d, b, rot, had=False: [
        ("x", t, (37, d)), ("rotation", "float32", ((d,) if had else (d, d)) if rot else (1,)),
        ("centroids", "float32", (1 << b,))]
    enc_out = [("codes", "uint8"), ("norms", "float16")]
    enc_t = lambda t, d, b, rot, had=False: [("T", "dtype", t), ("D", "int", d), ("B_BITS", "int", b),
                                            ("ROTATE", "bool", rot), ("HADAMARD", "bool", had)]
    for b in [1, 2, 3, 4, 8]:
        out.append(kernel_case(f"tq_encode_float32_d128_b{b}", "veloxquant_tq_encode",
                               enc_in("float32", 128, b, True), enc_out, enc_t("float32", 128, b, True),
                               body="tq_encode", header="tq_norm.h"))
    for t, d, b in [("float16", 64, 3), ("bfloat16", 256, 4), ("float32", 80, 2)]:
        out.append(kernel_case(f"tq_encode_{t}_d{d}_b{b}_norotate", "veloxquant_tq_encode",
                               enc_in(t, d, b, False), enc_out, enc_t(t, d, b, False), body="tq_encode", header="tq_norm.h"))
    out.append(kernel_case("tq_encode_float16_d96_b8", "veloxquant_tq_encode",
                           enc_in("float16", 96, 8, True), enc_out, enc_t("float16", 96, 8, True),
                           body="tq_encode", header="tq_norm.h"))
    out.append(kernel_case("tq_encode_float16_d128_b4_hadamard", "veloxquant_tq_encode",
                           enc_in("float16", 128, 4, True, True), enc_out, enc_t("float16", 128, 4, True, True),
                           body="tq_encode", header="tq_norm.h"))

    def dec(name, t, d, kb, vb, hq, hkv, qn, n_comp, n_win, n_sink, causal):
        inputs = [
            ("q", t, (1, hq, 1, d)), ("rot", "float32", (d, d)),
            ("k_codes", "uint8", (1, hkv, 256, d * kb // 8)), ("k_norms", "float16", (1, hkv, n_comp)),
            ("k_cent", "float32", (1 << kb,)),
            ("v_codes", "uint8", (1, hkv, 256, d * vb // 8)), ("v_norms", "float16", (1, hkv, 256)),
            ("v_cent", "float32", (1 << vb,)),
            ("win_k", t, (1, hkv, n_win, d)), ("win_v", t, (1, hkv, 68, d))]
        outputs = [("m_out", "float32"), ("l_out", "float32"), ("acc_out", "float32")]
        template = [("T", "dtype", t), ("D", "int", d), ("KB", "int", kb), ("VB", "int", vb), ("QN", "int", qn),
                    ("TPT", "int", min(16, 1 << max(0, (d // 8 - 1).bit_length()))), ("N_SINK", "int", n_sink), ("CAUSAL", "bool", causal), ("SCALE", "int", 1040187392)]
        out.append(kernel_case(name, "veloxquant_tq_decode", inputs, outputs, template, body="tq_decode"))

    dec("tq_decode_float16_d128_k4v3_qn4", "float16", 128, 4, 3, 32, 8, 4, 300, 40, 4, True)
    dec("tq_decode_bfloat16_d64_k4v2_qn3", "bfloat16", 64, 4, 2, 9, 3, 3, 50, 9, 0, False)
    # No compressed token yet: a zero-size view of the key norms (constant memory).
    dec("tq_decode_float32_d256_k1v2_qn1", "float32", 256, 1, 2, 1, 1, 1, 0, 3, 3, True)

    def red(name, t, d, rows, splits):
        inputs = [("part_m", "float32", (rows, splits)), ("part_l", "float32", (rows, splits)),
                  ("part_acc", "float32", (rows, splits, d)), ("rot_v", "float32", (d, d))]
        out.append(kernel_case(name, "veloxquant_tq_reduce", inputs, [("out", t)],
                               [("T", "dtype", t), ("D", "int", d), ("ROTATE", "bool", True)], body="tq_reduce"))

    red("tq_reduce_float32_d128", "float32", 128, 8, 3)
    red("tq_reduce_float16_d64", "float16", 64, 40, 1)
    red("tq_reduce_bfloat16_d256", "bfloat16", 256, 16, 2)
    # A single row of a single split: the partials are in constant memory.
    red("tq_reduce_float32_d64_small", "float32", 64, 1, 1)
    return out


def cases():
    out = []
    for b in [1, 2, 3, 4, 8]:
        out.append(kernel_case(
            f"bit_pack_b{b}", "bit_pack",
            [("codes", "uint8", (4, 16)), ("params", "uint32", (3,))],
            [("packed", "uint8")], [("B_BITS", "int", b)]))
        out.append(kernel_case(
            f"bit_unpack_b{b}", "bit_unpack",
            [("packed", "uint8", (4, 2 * b)), ("params", "uint32", (3,))],
            [("codes", "uint8")], [("B_BITS", "int", b)]))
    # A row of fewer than 8 codes: MLX moves `codes` into constant memory.
    out.append(kernel_case(
        "bit_pack_b3_small", "bit_pack",
        [("codes", "uint8", (1, 5)), ("params", "uint32", (3,))],
        [("packed", "uint8")], [("B_BITS", "int", 3)]))
    for t in ["float32", "float16", "bfloat16"]:
        for d in [2, 4, 8]:
            out.append(kernel_case(
                f"vq_quantize_{t}_d{d}", "vq_quantize",
                [("x", t, (16, d)), ("codebook", t, (8, d)), ("params", "uint32", (2,))],
                [("indices", "uint32")], [("T", "dtype", t), ("D", "int", d)]))

    out.append(dict(
        name="shape_strides_ndim",
        inputs=[("x", "float32", (2, 3, 4)), ("y", "int32", (5, 2)), ("z", "float16", (9,))],
        outputs=[("out", "float32")],
        template=[("T", "dtype", "float32")],
        body=(
            "// y_ndim is read, y's shape and strides are not; z's names never appear.\n"
            "uint i = thread_position_in_grid.x;\n"
            "int max_shape = x_strides[0] > 0 ? x_ndim : y_ndim;  // `max_shape` adds x_shape\n"
            "out[i] = T(x[i]) + T(max_shape) + T(z[0]);\n"
        )))
    out.append(dict(
        name="scalar_input",
        inputs=[("x", "float32", (16,)), ("s", "float32", ())],
        outputs=[("out", "float32")],
        template=[("T", "dtype", "float32")],
        body=(
            "// s_shape is never emitted: s is 0-d and passed by reference.\n"
            "uint i = thread_position_in_grid.x;\n"
            "out[i] = x[i] * s;\n"
        )))
    out.append(dict(
        name="small_inputs",
        inputs=[("a", "float32", (7,)), ("b", "float32", (8,)), ("c", "int32", (1, 1)), ("d", "uint8", (0,))],
        outputs=[("out", "float32")],
        template=[("T", "dtype", "float32")],
        body="uint i = thread_position_in_grid.x;\nout[i] = a[i % 7] + b[i] + T(c[0]);\n"))
    out.append(dict(
        name="all_attributes",
        inputs=[("x", "float32", (64,))],
        outputs=[("out", "float32")],
        template=[("T", "dtype", "float32")],
        body="".join(f"// {a}\n" for a in ALL_ATTRIBUTES)
        + "out[thread_position_in_grid.x] = x[thread_position_in_grid.x];\n"))
    out.append(dict(
        name="some_attributes",
        inputs=[("x", "float16", (64,))],
        outputs=[("out", "float16")],
        template=[("T", "dtype", "float16")],
        body=(
            "uint lid = thread_index_in_threadgroup;\n"
            "uint gid = threadgroup_position_in_grid.x * threads_per_threadgroup.x + lid;\n"
            "out[gid] = x[gid] + T(simdgroup_index_in_threadgroup);\n"
        )))
    out.append(dict(
        name="atomic_outputs",
        inputs=[("x", "uint32", (64,))],
        outputs=[("count", "uint32"), ("total", "float32")],
        atomic_outputs=True,
        template=[("T", "dtype", "uint32")],
        body=(
            "uint i = thread_position_in_grid.x;\n"
            "atomic_fetch_add_explicit(count, x[i], memory_order_relaxed);\n"
            "atomic_fetch_add_explicit(total, float(x[i]), memory_order_relaxed);\n"
        )))
    out.append(dict(
        name="header_and_templates",
        inputs=[("x", "bfloat16", (32,)), ("w", "int64", (32,))],
        outputs=[("out", "bfloat16"), ("flag", "bool")],
        template=[("T", "dtype", "bfloat16"), ("N", "int", -7), ("FLAG", "bool", True), ("U", "dtype", "int64")],
        header=(
            "// helpers shared by the kernel\n"
            "template <typename T>\n"
            "inline T twice(T v) {\n"
            "  return v + v;\n"
            "}\n"
        ),
        body=(
            "uint i = thread_position_in_grid.x;\n"
            "out[i] = twice(x[i]) + T(float(N) * float(w[i]));\n"
            "flag[i] = FLAG;\n"
        )))
    out.append(dict(
        name="no_template_args",
        inputs=[("x", "float32", (16,)), ("y", "float32", (16,))],
        outputs=[("out", "float32")],
        body="uint i = thread_position_in_grid.x;\nout[i] = x[i] + y[i];"))
    # MLX's known bug: two outputs, a shape buffer and no attribute put the
    # closing `) {` after the first output. The generator reproduces it.
    out.append(dict(
        name="two_outputs_no_attribute",
        inputs=[("x", "float32", (16,))],
        outputs=[("a", "float32"), ("b", "float32")],
        body="a[0] = x[0] + float(x_shape[0]);\nb[0] = x[1];\n"))
    out.extend(tq_cases())
    return out


def capture(case):
    kernel = mx.fast.metal_kernel(
        name=case.get("kernel", case["name"]),
        input_names=[n for n, _, _ in case["inputs"]],
        output_names=[n for n, _ in case["outputs"]],
        source=case["source"],
        header=case.get("header", ""),
        atomic_outputs=case.get("atomic_outputs", False),
    )
    template = []
    for name, kind, value in case.get("template", []):
        template.append((name, DTYPES[value] if kind == "dtype" else value))

    def fn(*args):
        kwargs = {}
        if template:
            kwargs["template"] = template
        return kernel(
            inputs=list(args),
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(4,)] * len(case["outputs"]),
            output_dtypes=[DTYPES[t] for _, t in case["outputs"]],
            verbose=True,
            **kwargs,
        )

    args = [mx.zeros(shape, dtype=DTYPES[t]) for _, t, shape in case["inputs"]]
    # MLX prints from C++ through std::cout, so capture file descriptor 1.
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "stdout.txt")
        sys.stdout.flush()
        saved = os.dup(1)
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 1)
            try:
                mx.export_function(os.path.join(tmp, "k.mlxfn"), fn, *args)
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
        text = Path(log_path).read_bytes().decode()
    # MLX writes: "Generated source code for `NAME`:\n```\n" SOURCE "\n```\n"
    # (std::endl after the source). Only that framing is stripped.
    m = re.fullmatch(r"Generated source code for `[^`]*`:\n```\n(.*)\n```\n", text, re.S)
    if not m:
        raise SystemExit(f"{case['name']}: unexpected output from MLX:\n{text}")
    return m.group(1)


def write_case(case):
    name = case["name"]
    lines = [f"kernel {case.get('kernel', name)}"]
    for n, t, shape in case["inputs"]:
        dims = ",".join(str(s) for s in shape) if shape else "scalar"
        lines.append(f"input {n} {t} {dims}")
    for n, t in case["outputs"]:
        lines.append(f"output {n} {t}")
    for n, kind, value in case.get("template", []):
        if kind == "bool":
            value = "true" if value else "false"
        lines.append(f"template {n} {kind} {value}")
    lines.append(f"atomic_outputs {'true' if case.get('atomic_outputs') else 'false'}")
    if "header_file" in case:
        lines.append(f"header_file {case['header_file']}")
    elif "header" in case:
        (OUT / f"{name}.header.metal").write_bytes(case["header"].encode())
        lines.append(f"header_file tests/golden/metal/{name}.header.metal")
    if "body_file" in case:
        lines.append(f"body_file {case['body_file']}")
    else:
        (OUT / f"{name}.body.metal").write_bytes(case["body"].encode())
        lines.append(f"body_file tests/golden/metal/{name}.body.metal")
    (OUT / f"{name}.case").write_bytes(("\n".join(lines) + "\n").encode())


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for case in cases():
        if "header_file" in case:
            case["header"] = (ROOT / case["header_file"]).read_text()
        if "body_file" in case:
            case["source"] = (ROOT / case["body_file"]).read_text()
        else:
            case["source"] = case["body"]
        source = capture(case)
        (OUT / f"{case['name']}.metal").write_bytes(source.encode())
        write_case(case)
        print(f"{case['name']}: {len(source)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
