"""A fast BLAS for MLX's Linux CPU wheel.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS and LAPACK it bundles
in ``mlx_cpu.libs/libblas-*.so``: its float32 matmul runs at 2 to 3 GFLOP/s
on a 2-core x86_64 machine, and every matmul of a model on the CPU
goes through it. OpenBLAS exports the same CBLAS and LAPACK symbols; loaded
into the process's global symbol scope before ``mlx.core`` is imported, it is
what libmlx binds to, since the dynamic loader looks in the global scope
before a library's own dependencies. Matmul is then about 10x faster, with
the same results up to float32 rounding.

``import veloxquant`` does this (:func:`enable`) when all of these hold:

- Linux, and mlx is a wheel with a bundled reference BLAS (``mlx_cpu.libs``);
- ``mlx.core`` is not imported yet (import veloxquant first, or see below);
- an OpenBLAS is found: ``$VELOXQUANT_BLAS`` when it names a file, else
  ``libopenblas.so.0`` through the dynamic loader's search (Debian and Ubuntu:
  ``apt-get install libopenblas0-pthread``, which ``scripts/setup.sh`` does);
- ``VELOXQUANT_BLAS`` is not ``reference`` (the opt-out).

A program that imports mlx before veloxquant can get the same library with
``LD_PRELOAD=libopenblas.so.0``. :func:`status` says which library serves
``cblas_sgemm`` and why; :func:`describe` adds a measured matmul speed;
``veloxquant doctor`` prints it.

BLAS serves float32 only: MLX's CPU matmul of float16 and bfloat16 arrays
runs its own portable loops (about 2 GFLOP/s here, whatever the BLAS), and so
does its CPU attention. :func:`use_float32_compute` makes a float16 model's
matmuls and attention compute in float32 on the CPU while its activations,
and so its KV cache, stay float16: weights are held in float32 (twice their
float16 bytes), inputs cast up, outputs cast back. ``veloxquant generate``,
``compare`` and ``eval`` apply it on the CPU when the fast BLAS is active
(:func:`float32_compute_wanted`; ``VELOXQUANT_CPU_FLOAT32=0`` opts out).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import importlib.util
import os
import sys
import time
from typing import List, Optional

ENV = "VELOXQUANT_BLAS"
FLOAT32_ENV = "VELOXQUANT_CPU_FLOAT32"
OPT_OUT = ("reference", "off", "0", "no")
OPENBLAS_NAMES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp.so.0")
INSTALL_HINT = "apt-get install libopenblas0-pthread (bash scripts/setup.sh does)"

# What enable() did, for status(): the library it loaded, or why it did not.
_loaded: Optional[str] = None
_why_not: Optional[str] = None


@dataclasses.dataclass
class BlasStatus:
    fast: bool  # an optimised BLAS (not the reference one) serves MLX's matmul
    name: str  # "OpenBLAS 0.3.21 ...", "reference BLAS bundled with mlx", ...
    library: Optional[str]  # the file that serves cblas_sgemm
    note: str = ""  # why the reference BLAS is in use, and what to do

    def line(self) -> str:
        where = f" ({self.library})" if self.library else ""
        return f"{self.name}{where}" + (f"; {self.note}" if self.note else "")


def bundled_blas() -> List[str]:
    """The reference BLAS libraries an installed mlx wheel ships (``mlx_cpu.libs/libblas-*.so``)."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for where in spec.submodule_search_locations:  # a namespace package: mlx/ may appear twice
        found += glob.glob(os.path.join(os.path.dirname(where), "mlx*.libs", "libblas*.so*"))
    return sorted(set(found))


def find_openblas() -> Optional[str]:
    """``$VELOXQUANT_BLAS`` when it names a file, else the first OpenBLAS the dynamic loader finds."""
    want = os.environ.get(ENV, "")
    if want and want.lower() not in OPT_OUT:
        return want if os.path.isfile(want) else None
    for name in OPENBLAS_NAMES:
        try:
            ctypes.CDLL(name, mode=os.RTLD_LOCAL)
        except OSError:
            continue
        return name
    return None


def openblas_coretype() -> Optional[str]:
    """The OpenBLAS kernels for this x86_64 CPU by its instruction sets, when the user did not choose.

    OpenBLAS picks kernels by CPU model; a model newer than its release (the
    project machine's Xeon, model 207, with OpenBLAS 0.3.21) falls back to
    the SSE3 kernels of 2004's Prescott, 5x slower than the AVX-512 ones
    this CPU runs. ``OPENBLAS_CORETYPE`` set by the user wins.
    """
    if "OPENBLAS_CORETYPE" in os.environ or os.uname().machine != "x86_64":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(row.split(":", 1)[1].split()) for row in f if row.startswith("flags")), set())
    except OSError:
        return None
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def enable() -> Optional[str]:
    """Load OpenBLAS into the global symbol scope so that libmlx binds to it.

    Returns what was loaded, or None (then :func:`status` says why). Call it
    before ``mlx.core`` is imported; ``import veloxquant`` does.
    """
    global _loaded, _why_not
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux"):
        _why_not = "not Linux: mlx uses the platform's BLAS"
        return None
    want = os.environ.get(ENV, "")
    if want.lower() in OPT_OUT:
        _why_not = f"{ENV}={want} keeps the reference BLAS"
        return None
    if not bundled_blas():
        _why_not = "this mlx does not bundle the reference BLAS"
        return None
    if "mlx.core" in sys.modules:
        _why_not = (
            "mlx.core was imported before veloxquant, so libmlx had bound the bundled BLAS; "
            "import veloxquant first, or run with LD_PRELOAD=libopenblas.so.0"
        )
        return None
    core = openblas_coretype()
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core  # read by OpenBLAS when it loads
    lib = find_openblas()
    if lib is None and core is not None:
        del os.environ["OPENBLAS_CORETYPE"]
    if lib is None:
        _why_not = (
            f"{ENV}={want} is not a file" if want else f"no OpenBLAS found: {INSTALL_HINT}"
        )
        return None
    try:
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError as e:
        _why_not = f"{lib} could not be loaded: {e}"
        return None
    _loaded = lib
    return lib


def _mapped_file(addr: int) -> Optional[str]:
    """The file mapped at ``addr`` in this process (Linux's /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for row in f:
                parts = row.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return parts[5].strip() if len(parts) == 6 else None
    except OSError:
        pass
    return None


def status() -> BlasStatus:
    """Which BLAS serves MLX's CPU matmul in this process, and why.

    libmlx resolves ``cblas_sgemm`` in the global scope first (the program,
    LD_PRELOAD, libraries loaded with RTLD_GLOBAL), then among its own
    dependencies; so the global scope's ``cblas_sgemm``, when there is one,
    is the one it calls.
    """
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, "the platform's BLAS", None, _why_not or "")
    glob_scope = ctypes.CDLL(None)
    try:
        sgemm = ctypes.cast(glob_scope.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        sgemm = None
    if sgemm is not None:
        lib = _mapped_file(sgemm)
        name = "a BLAS in the global scope"
        try:
            get_config = glob_scope.openblas_get_config
            get_config.restype = ctypes.c_char_p
            name = get_config().decode(errors="replace").strip()
            threads = glob_scope.openblas_get_num_threads()
            name += f", {threads} thread{'s' if threads != 1 else ''}"
        except AttributeError:
            pass
        fast = not any(os.path.basename(lib or "") == os.path.basename(b) for b in bundled_blas())
        return BlasStatus(fast, name, lib, "" if fast else "the reference BLAS")
    bundled = bundled_blas()
    if bundled:
        note = _why_not or (
            "mlx.core was imported before veloxquant; import veloxquant first, or run with "
            "LD_PRELOAD=libopenblas.so.0"
        )
        return BlasStatus(False, "the reference BLAS bundled with mlx[cpu] (~10x slower matmul)", bundled[0], note)
    return BlasStatus(False, "the BLAS libmlx was built against", None, _why_not or "")


def matmul_gflops(n: int = 768, seconds: float = 0.3) -> float:
    """Measured float32 matmul GFLOP/s of an n x n product on MLX's CPU device."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up (OpenBLAS starts its threads)
        reps, t0 = 0, time.perf_counter()
        while True:
            mx.eval(a @ b)
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds or reps >= 50:
                break
    return 2.0 * n**3 * reps / dt / 1e9


def describe(measure: bool = True) -> str:
    """One line: the BLAS in use, and its measured matmul speed."""
    s = status()
    line = "CPU BLAS: " + s.line()
    if measure:
        line += f"; float32 matmul {matmul_gflops():.1f} GFLOP/s"
    return line


def warning() -> Optional[str]:
    """A line for the command line when MLX's CPU matmul runs through the reference BLAS, else None."""
    if not bundled_blas():
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    s = status()
    if s.fast:
        return None
    return f"CPU matmul through {s.name}: {s.note}"



# --- float32 compute of a float16 model on the CPU ------------------------------

_HALF = ("float16", "bfloat16")


def _is_half(a) -> bool:
    return str(a.dtype).rsplit(".", 1)[-1] in _HALF


def float32_compute_wanted() -> bool:
    """True on MLX's CPU device with an optimised BLAS active, unless ``VELOXQUANT_CPU_FLOAT32=0``."""
    if os.environ.get(FLOAT32_ENV, "").lower() in ("0", "off", "no", "false"):
        return False
    import mlx.core as mx

    return mx.default_device() == mx.cpu and status().fast


@functools.lru_cache(maxsize=None)
def _float32_modules():
    import mlx.core as mx
    import mlx.nn as nn

    class Float32Linear(nn.Module):
        """A Linear layer whose weights are float32: sgemm on the CPU, the input's dtype out."""

        def __init__(self, linear):
            super().__init__()
            self.weight = linear.weight.astype(mx.float32)
            if "bias" in linear:
                self.bias = linear.bias.astype(mx.float32)

        def __call__(self, x):
            y = x.astype(mx.float32) @ self.weight.T
            if "bias" in self:
                y = y + self.bias
            return y.astype(x.dtype)

    class Float32Embedding(nn.Module):
        """An Embedding whose table is float32; lookups return the original dtype."""

        def __init__(self, embedding):
            super().__init__()
            self.dtype = embedding.weight.dtype
            self.weight = embedding.weight.astype(mx.float32)

        def __call__(self, x):
            return self.weight[x].astype(self.dtype)

        def as_linear(self, x):
            return (x.astype(mx.float32) @ self.weight.T).astype(x.dtype)

    return Float32Linear, Float32Embedding


def use_float32_compute(model, max_fraction: float = 0.5) -> int:
    """Compute ``model``'s float16/bfloat16 Linear and Embedding layers, and
    attention through mlx_lm's dispatch, in float32 on the CPU.

    Activations keep the model's dtype, so KV caches hold what they would
    hold otherwise. Quantized layers are left alone. Does nothing (returns
    0) when the float32 weights would take more than ``max_fraction`` of
    the machine's memory. Returns the number of layers converted.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map_with_path

    from . import attention

    Float32Linear, Float32Embedding = _float32_modules()

    def wanted(m) -> bool:
        return type(m) in (nn.Linear, nn.Embedding) and _is_half(m.weight)

    found = [m for _, m in model.named_modules() if wanted(m)]
    extra = sum(sum(v.size for _, v in tree_flatten(m.parameters())) for m in found) * 4
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    if not found or (ram and extra > max_fraction * ram):
        return 0

    def convert(_path, m):
        if not wanted(m):
            return m
        return Float32Linear(m) if type(m) is nn.Linear else Float32Embedding(m)

    model.update_modules(tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module))
    mx.eval(model.parameters())  # convert now, not inside the first forward pass
    attention.install()
    attention.set_cpu_float32(True)
    return len(found)


def maybe_float32_compute(model) -> Optional[str]:
    """:func:`use_float32_compute` when :func:`float32_compute_wanted`; a phrase saying so, else None."""
    if not float32_compute_wanted() or not use_float32_compute(model):
        return None
    return "float32 compute of the float16 model (weights held in float32, activations and caches float16)"
