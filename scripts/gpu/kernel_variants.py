"""Times CUDA kernel bodies side by side on the GPU, in one run: the library's
memory-bound quantizer kernels (through ``veloxquant.kernels``), the same
bodies launched by hand through ``mx.fast.cuda_kernel`` with other template
arguments, grids or stores, and kernels that only move bytes (the ceiling a
body can reach in this harness). Each variant's output is checked equal to
the library's before it is timed.

    PYTHONPATH=<mlx cuda + veloxquant> python3 scripts/gpu/kernel_variants.py [--n N] [--rounds R] [--only TEXT]

Every variant is timed once per round, in turn, so that the GPU's drift falls
on all alike; a round's figure is the median of 5 samples of 20 back-to-back
calls, per call, timed two ways: "built" times building the 20 lazy graphs
and evaluating them (as ``quant_kernels_bench`` does), "eval" builds them
first and times the evaluation alone; "build" is the host's time to build one
call's graph. The table gives the median over the
rounds. GB/s counts the bytes the variant's row reads and writes (its inputs
and outputs). ``--only`` keeps the variants whose name contains TEXT.
"""

import argparse
import pathlib
import statistics
import time

import mlx.core as mx
import numpy as np

import veloxquant.kernels as K

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMON = "".join((ROOT / "cuda" / h).read_text() for h in ("vq_access.cuh", "quant_load.cuh", "quant_common.cuh"))
HBM = 4.8e12
D = 128

# Streaming (evict-first) stores of 16 and 8 bytes, for the variants that
# write their output with them.
STREAMING = r"""
__device__ __forceinline__ void vq_store8_cs(__half* p, const float* v) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
  __stcs(reinterpret_cast<uint4*>(p), raw);
}
template <int S, typename T>
__device__ __forceinline__ void vq_copy_n_cs(const T* src, T* dst) {
  constexpr int BYTES = S * int(sizeof(T));
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) __stcs(reinterpret_cast<uint4*>(dst) + i, reinterpret_cast<const uint4*>(src)[i]);
  } else if constexpr (BYTES == 8) {
    __stcs(reinterpret_cast<uint2*>(dst), *reinterpret_cast<const uint2*>(src));
  } else {
    vq_copy_n<S>(src, dst);
  }
}
"""


# qjl_score's loop over keys with the next key's words requested before
# this key's sums (rows of whole 16-byte words); the sums and stores are the
# body's own.
QJL_PREFETCH_HEAD = r"""if (wide) {
  uint4 next[QS_WORDS / 4] = {};
  __half next_norm = __float2half(0.0f);
  auto fetch = [&](uint32_t key) {
    if (key < n) {
      const uint4* src = reinterpret_cast<const uint4*>(signs + uint64_t(key) * nbytes);
#pragma unroll
      for (uint32_t w = 0; w < QS_WORDS / 4; ++w) {
        if (w * 16 < nbytes) {
          next[w] = src[w];
        }
      }
      next_norm = norms[key];
    }
  };
  uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  fetch(t);
  for (; t < n; t += stride) {
    uint32_t bits[QS_WORDS];
#pragma unroll
    for (uint32_t w = 0; w < QS_WORDS / 4; ++w) {
      bits[4 * w] = next[w].x;
      bits[4 * w + 1] = next[w].y;
      bits[4 * w + 2] = next[w].z;
      bits[4 * w + 3] = next[w].w;
    }
    const float scale = __fmul_rn(base, __half2float(next_norm));
    fetch(t + stride);
"""


def qjl_prefetch(src):
    """qjl_score's body with QJL_PREFETCH_HEAD's loop before its own."""
    sums = src[src.index("    float acc[8];\n"):src.index("    continue;\n")]
    return edit(src, QJL_LOOP, QJL_PREFETCH_HEAD + sums + "  }\n  return;\n}\n" + QJL_LOOP)


QJL_LOOP = "for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride) {"
QJL_NO_SUMS = ("qjl_table_sums<4, QS_WORDS>(acc, bits, m, tab_base);",
               "for (uint32_t w = 0; w < QS_WORDS; ++w) acc[0] += float(__popc(bits[w]));")


def body(name):
    return (ROOT / "cuda" / f"{name}.cu").read_text()


def edit(text, old, new):
    """`text` with `old` (which must occur) replaced by `new`."""
    assert old in text, f"variant edit: {old!r} not in the body"
    return text.replace(old, new)


def timed(make, repeat=20, samples=5):
    """(built, eval, build) median seconds per call: the graphs built and
    evaluated, built first and evaluated, and building one alone."""

    def sample():
        t0 = time.perf_counter()
        outs = [make() for _ in range(repeat)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        return (t1 - t0) / repeat, (time.perf_counter() - t1) / repeat

    mx.eval(make())
    mx.synchronize()
    # A sample builds its graphs, then evaluates them: built = build + eval.
    parts = [sample() for _ in range(samples)]
    return (statistics.median(b + e for b, e in parts), statistics.median(e for _, e in parts),
            statistics.median(b for b, _ in parts))


def params(*values):
    """Sizes as the library's CUDA bodies take them: the shape [0, v0, v1, ...]
    of an empty uint32 array (``kernels::sizes``)."""
    return mx.array(np.zeros((0, *values), dtype=np.uint32))


class Raw:
    """A body launched by hand: `mx.fast.cuda_kernel` with the library's header."""

    def __init__(self, name, source, inputs, outputs, extra_header=""):
        self.make = lambda: mx.fast.cuda_kernel(
            name=name, input_names=inputs, output_names=outputs, source=source, header=COMMON + extra_header
        )
        self.kernel = None

    def __call__(self, inputs, template, threads, block, shape, dtype):
        # Made at first use, so that a failure is the row's.
        self.kernel = self.kernel or self.make()
        return self.kernel(
            inputs=inputs,
            template=template,
            grid=(threads, 1, 1),
            threadgroup=(block, 1, 1),
            output_shapes=[shape],
            output_dtypes=[dtype],
        )[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.n
    mx.random.seed(7)
    x = (mx.random.uniform(shape=(n, D)) * 2 - 1).astype(mx.float16)
    mx.eval(x)
    rows = []

    def row(name, make, nbytes, expect=None):
        if args.only and not any(o in name for o in args.only):
            return
        try:
            if expect is not None and not mx.array_equal(make(), expect).item():
                print(f"{name}: output differs from the library's; left out", flush=True)
                return
            mx.eval(make())
        except Exception as e:  # a variant that does not compile or launch
            print(f"{name}: failed ({str(e).splitlines()[0][:200]}); left out", flush=True)
            return
        rows.append((name, make, nbytes))

    xb = x.nbytes
    row("mlx x + x", lambda: x + x, 2 * xb)
    row("mlx zeros_like(x)", lambda: mx.zeros_like(x), xb)
    row("mlx sum(x)", lambda: mx.sum(x, axis=-1), xb)

    # Byte movers: 16-byte stores of zeros, one per thread or four.
    n16 = xb // 16
    fill = Raw("vx_fill", "const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;\n"
               "if (i < N16) reinterpret_cast<uint4*>(y)[i] = make_uint4(0, 0, 0, 0);", ["x"], ["y"])
    fill_cs = Raw("vx_fill_cs", "const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;\n"
                  "if (i < N16) __stcs(reinterpret_cast<uint4*>(y) + i, make_uint4(0, 0, 0, 0));", ["x"], ["y"])
    fill4 = Raw("vx_fill4", "const uint64_t b = uint64_t(blockIdx.x) * blockDim.x * 4 + threadIdx.x;\n"
                "#pragma unroll\nfor (int k = 0; k < 4; ++k) { const uint64_t i = b + k * blockDim.x;\n"
                "if (i < N16) reinterpret_cast<uint4*>(y)[i] = make_uint4(0, 0, 0, 0); }", ["x"], ["y"])
    one = mx.zeros((1,), dtype=mx.float16)
    for blk in (256, 1024):
        row(f"fill 16 B/thread, blocks of {blk}", lambda b=blk: fill([one], [("N16", n16)], n16, b, x.shape, mx.float16), xb)
    row("fill 16 B/thread streaming", lambda: fill_cs([one], [("N16", n16)], n16, 256, x.shape, mx.float16), xb)
    row("fill 4 x 16 B/thread", lambda: fill4([one], [("N16", n16)], n16 // 4, 256, x.shape, mx.float16), xb)
    copy = Raw("vx_copy", "const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;\n"
               "if (i < N16) reinterpret_cast<uint4*>(y)[i] = reinterpret_cast<const uint4*>(x)[i];", ["x"], ["y"])
    row("copy 16 B/thread", lambda: copy([x], [("N16", n16)], n16, 256, x.shape, mx.float16), 2 * xb, expect=x)
    # 4 bytes in, 16 out: the traffic of scalar_dequantize at 4 bits, no table.
    words = mx.zeros((n16,), dtype=mx.uint32)
    expand = Raw("vx_expand", "const uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;\n"
                 "if (i < N16) { const uint32_t w = x[i]; reinterpret_cast<uint4*>(y)[i] = make_uint4(w, w, w, w); }",
                 ["x"], ["y"])
    row("expand 4 B to 16 B/thread", lambda: expand([words], [("N16", n16)], n16, 256, x.shape, mx.float16),
        words.nbytes + xb)

    # scalar_dequantize b = 4: 4 bytes of codes in, 16 bytes out per thread.
    cb = mx.array(sorted((i - 7.5) / 8 for i in range(16)), dtype=mx.float32)
    packed = K.scalar_quantize(x, cb, 4)
    mx.eval(packed)
    want = K.scalar_dequantize(packed, cb, 4, D, mx.float16)
    mx.eval(want)
    sdq_bytes = packed.nbytes + want.nbytes
    row("scalar_dequantize (library)", lambda: K.scalar_dequantize(packed, cb, 4, D, mx.float16), sdq_bytes)
    src = body("scalar_dequantize")
    sdq = Raw("vx_sdq", src, ["packed", "codebook", "params"], ["y"])
    sdq_cs = Raw("vx_sdq_cs", edit(src, "vq_store8(y + t * 8, v);", "vq_store8_cs(y + t * 8, v);"),
                 ["packed", "codebook", "params"], ["y"], STREAMING)
    groups = n * D // 8
    p_fixed = params(n, D, packed.shape[1])
    tmpl = [("T", mx.float16), ("B_BITS", 4)]
    row("scalar_dequantize body, sizes in an empty array's shape, made per call",
        lambda: sdq([packed, cb, params(n, D, packed.shape[1])], tmpl, groups, 256, want.shape, mx.float16), sdq_bytes, want)
    row("scalar_dequantize body, sizes in an empty array's shape, made once",
        lambda: sdq([packed, cb, p_fixed], tmpl, groups, 256, want.shape, mx.float16), sdq_bytes, want)
    row("scalar_dequantize body, streaming stores",
        lambda: sdq_cs([packed, cb, p_fixed], tmpl, groups, 256, want.shape, mx.float16), sdq_bytes, want)
    for blk in (128, 512, 1024):
        row(f"scalar_dequantize body, blocks of {blk}",
            lambda b=blk: sdq([packed, cb, p_fixed], tmpl, groups, b, want.shape, mx.float16), sdq_bytes, want)
    # MLX copies the header and body into a new source string on every call:
    # the same body with 32 and 96 KB of comment lines added to its header
    # prices that copy in the "build us" column.
    for kb in (32, 96):
        padding = ("// " + "x" * 60 + "\n") * (kb * 1024 // 64)
        sdq_pad = Raw(f"vx_sdq_pad{kb}", src, ["packed", "codebook", "params"], ["y"], padding)
        row(f"scalar_dequantize body, header + {kb} KB of comments",
            lambda k=sdq_pad: k([packed, cb, p_fixed], tmpl, groups, 256, want.shape, mx.float16), sdq_bytes, want)

    # KIVI b = 2, G = 32: keys per channel, values per token.
    for mode in ("keys", "values"):
        kc, ks, kz = K.kivi_quantize(x, 2, 32, mode)
        mx.eval(kc, ks, kz)
        kq_bytes = xb + kc.nbytes + ks.nbytes + kz.nbytes
        row(f"kivi_quantize {mode} (library)", lambda m=mode: K.kivi_quantize(x, 2, 32, m), kq_bytes)
        want = K.kivi_dequantize(kc, ks, kz, 2, 32, mode, D, mx.float16)
        mx.eval(want)
        row(f"kivi_dequantize {mode} (library)",
            lambda m=mode, a=(kc, ks, kz): K.kivi_dequantize(*a, 2, 32, m, D, mx.float16), kq_bytes, want)
        src = body("kivi_dequantize")
        kd = Raw("vx_kd", src, ["packed", "scales", "zeros", "params"], ["y"])
        kd_cs = Raw("vx_kd_cs", edit(src, "vq_store8(y + (uint64_t(row) * groups + g) * 8, v);",
                                     "vq_store8_cs(y + (uint64_t(row) * groups + g) * 8, v);"),
                    ["packed", "scales", "zeros", "params"], ["y"], STREAMING)
        kp = params(n, D, kc.shape[1], 32)
        for label, kern in (("", kd), (", streaming", kd_cs)):
            for items in (1, 2, 4, 8):
                threads = -(-n // items) * (D // 8)
                tm = [("T", mx.float16), ("B_BITS", 2), ("PER_CHANNEL", mode == "keys"), ("ITEMS", items)]
                row(f"kivi_dequantize {mode} body, {items} rows/thread{label}",
                    lambda tm=tm, th=threads, kn=kern, a=(kc, ks, kz): kn([*a, kp], tm, th, 256, want.shape, mx.float16),
                    kq_bytes, want)
    sq_bytes = xb + packed.nbytes
    row("scalar_quantize (library)", lambda: K.scalar_quantize(x, cb, 4), sq_bytes)

    # pq_decode s = 4, K = 256 (a 2 KB table) and K = 1024 (8 KB).
    for kk, bits in ((256, 8), (1024, 10)):
        pcb = mx.random.uniform(shape=(kk, 4)) * 2 - 1
        codes, codes_hi = K.pq_encode(x, pcb, bits)
        mx.eval(codes, codes_hi) if codes_hi is not None else mx.eval(codes)
        want = K.pq_decode(codes, pcb, bits, D, mx.float16, codes_hi=codes_hi)
        mx.eval(want)
        hi = codes_hi if codes_hi is not None else mx.zeros((1,), dtype=mx.uint8)
        nb_hi = codes_hi.shape[1] if codes_hi is not None else 0
        pq_bytes = codes.nbytes + (codes_hi.nbytes if codes_hi is not None else 0) + want.nbytes
        row(f"pq_decode K={kk} (library)",
            lambda: K.pq_decode(codes, pcb, bits, D, mx.float16, codes_hi=codes_hi), pq_bytes)
        src = body("pq_decode")
        pq = Raw("vx_pq", src, ["packed", "packed_hi", "codebook", "params"], ["y"])
        pq_cs = Raw("vx_pq_cs", edit(edit(src, "vq_copy_n<QUAD>(e[k], dst);", "vq_copy_n_cs<QUAD>(e[k], dst);"),
                                      "vq_copy_n<S>(e[k], dst);", "vq_copy_n_cs<S>(e[k], dst);"),
                    ["packed", "packed_hi", "codebook", "params"], ["y"], STREAMING)
        pp = params(n, D, kk, codes.shape[1], nb_hi)
        items_total = n * (D // 4)
        quads = items_total // 4
        base = [("T", mx.float16), ("S", 4), ("C_BITS", bits)]
        staged = 4096 if kk * 4 * 2 <= 4096 else 16384
        for label, kern in (("", pq), (", streaming", pq_cs)):
            for items in (4, 8, 16, 32):
                row(f"pq_decode K={kk} body, staged, {items} items/thread{label}",
                    lambda it=items, kn=kern: kn([codes, hi, pcb, pp], base + [("TABLE_BYTES", staged), ("ITEMS", it), ("QUADS", 0)],
                                                 -(-items_total // it), 256, want.shape, mx.float16), pq_bytes, want)
            for qd, blocks in ((4, 1024), (4, 2048), (2, 2048), (8, 1024)):
                threads = min(-(-quads // qd), blocks * 256)
                row(f"pq_decode K={kk} body, quads {qd}/thread, {blocks} blocks{label}",
                    lambda q=qd, th=threads, kn=kern: kn([codes, hi, pcb, pp], base + [("TABLE_BYTES", 16384), ("ITEMS", 1), ("QUADS", q)],
                                                         th, 256, want.shape, mx.float16), pq_bytes, want)

    # qjl_score m = 256, Q = 4.
    sketch = mx.random.normal(shape=(256, D))
    signs, norms = K.qjl_encode(x, sketch)
    q4 = (mx.random.uniform(shape=(4, D)) * 2 - 1).astype(mx.float16)
    mx.eval(sketch, signs, norms, q4)
    want = K.qjl_score(q4, sketch, signs, norms)
    mx.eval(want)
    qjl_bytes = signs.nbytes + norms.nbytes + want.nbytes
    row("qjl_score m=256 Q=4 (library)", lambda: K.qjl_score(q4, sketch, signs, norms), qjl_bytes)
    # The library's two kernels by hand: S q alone, and both with the score
    # kernel's grid capped at other sizes.
    sq_kernel = Raw("vx_qjl_sq", body("qjl_sketch_query"), ["q", "sketch", "params"], ["sq"])
    sq_params = params(4, D, 256)

    def make_sq():
        return sq_kernel([q4, sketch, sq_params], [("T", mx.float16)], 4 * 256, 256, (4, 256), mx.float32)

    sq_out = make_sq()
    mx.eval(sq_out)
    row("qjl_sketch_query alone (Q=4, m=256)", make_sq, q4.nbytes + sketch.nbytes + sq_out.nbytes)
    score_params = params(n, 256, signs.shape[1], 4)
    src = body("qjl_score")
    prefetch = qjl_prefetch(src)
    score_in = ["sq", "signs", "norms", "params"]
    scorers = {
        "": Raw("vx_qjl_score", src, score_in, ["scores"]),
        ", next key prefetched": Raw("vx_qjl_prefetch", prefetch, score_in, ["scores"]),
        ", diagnostic: no table sums": Raw("vx_qjl_nosums", edit(src, *QJL_NO_SUMS), score_in, ["scores"]),
        ", next key prefetched, diagnostic: no table sums":
            Raw("vx_qjl_prefetch_nosums", edit(prefetch, *QJL_NO_SUMS), score_in, ["scores"]),
    }
    for label, kern in scorers.items():
        for blocks, threads in ((264, 256), (528, 256), (1056, 256), (132, 1024)):
            row(f"qjl_score both kernels{label}, {blocks} blocks of {threads}",
                lambda b=blocks, th=threads, k=kern: k(
                    [make_sq(), signs, norms, score_params], [], min(n, b * th), th, want.shape, mx.float32),
                qjl_bytes, None if "diagnostic" in label else want)

    # Every variant once per round, in turn, so that the GPU's drift falls on all alike.
    times = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, make, _ in rows:
            try:
                times[name].append(timed(make))
            except RuntimeError as e:
                raise RuntimeError(f"{name}: {e}") from e
    print(f"N = {n}, d = {D}, float16; ms per call: each round the median of 5 samples of 20 calls; "
          f"{args.rounds} rounds, their median")
    print("| variant | built ms | built % of HBM | build us | eval ms (each round) | eval ms | eval GB/s | eval % of HBM |")
    print("|---|---|---|---|---|---|---|---|")
    for name, _, nbytes in rows:
        built = statistics.median(b for b, _, _ in times[name])
        build = statistics.median(b for _, _, b in times[name])
        each = [e for _, e, _ in times[name]]
        ev = statistics.median(each)
        print(f"| {name} | {built * 1e3:.4f} | {100 * nbytes / built / HBM:.1f}% | {build * 1e6:.1f} | "
              f"{', '.join(f'{e * 1e3:.4f}' for e in each)} | {ev * 1e3:.4f} | "
              f"{nbytes / ev / 1e9:.1f} | {100 * nbytes / ev / HBM:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
