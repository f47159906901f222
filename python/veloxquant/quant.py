"""The quantizers on numpy arrays and ``mlx.core.array``, for notebooks.

Every method of ``docs/QUANTIZERS.md`` behind one class, :class:`Quantizer`,
with a subclass per method that spells out its options::

    import numpy as np
    from veloxquant import quant

    q = quant.TurboQuantMSE(dim=128, bits=4, seed=0)
    x = np.random.default_rng(0).normal(size=(1000, 128)).astype(np.float32)
    enc = q.encode(x)               # Encoded: the bytes a cache stores
    x_hat = q.decode(enc)           # numpy float32 [1000, 128]
    q.bits_per_element(enc)         # 4.125 (+ the shared state over 1000 rows)

    pq = quant.ProductQuantizer(dim=128, bits=8, sub_dim=4).fit(keys)
    pq.save("pq.safetensors")
    same = quant.load("pq.safetensors")

Inputs are ``[n, dim]`` arrays: numpy float16/float32/float64 or
``mx.array`` float16/bfloat16/float32/float64 (copied to float32 on the CPU;
the quantizers here are the reference math, not the fused kernels). NaN or
infinity is a ``ValueError``; another dtype or a non-array a ``TypeError``;
every message starts with the argument at fault.

Outputs are numpy float32, or ``mx.array`` float32 when the input that
produced them was an ``mx.array`` (``decode`` follows the array given to
``encode``; ``output="numpy"`` or ``"mlx"`` overrides).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Union

import mlx.core as mx
import numpy as np

from . import _native

__all__ = [
    "Quantizer",
    "Encoded",
    "TurboQuantMSE",
    "TurboQuantProd",
    "TurboQuantRVQ",
    "OutlierSplit",
    "QJL",
    "ProductQuantizer",
    "KIVIKeys",
    "KIVIValues",
    "load",
    "from_bytes",
    "METHODS",
]

ArrayLike = Union[np.ndarray, mx.array]
PathLike = Union[str, "os.PathLike[str]"]

#: Stored rows of an encoding: ``method``, ``rows``, ``dim``, ``buffers``
#: (``{name: bytes}``), ``buffer(name)`` (numpy uint8) and ``stored_bytes``.
Encoded = _native.Encoded

#: The method names :class:`Quantizer` takes ("outlier" also works for
#: "outlier-split").
METHODS = tuple(_native.QUANT_METHODS)


class Quantizer:
    """One quantization method for vectors of ``dim``.

    ``Quantizer(method, dim, bits, **options)`` builds any method; the
    subclasses below document each one's options. PQ and the outlier split
    need :meth:`fit` before :meth:`encode`.
    """

    def __init__(self, method: str, dim: int, bits: Optional[int] = None, **options) -> None:
        self._q = _native.Quantizer(method, dim, bits, **options)

    @classmethod
    def _wrap(cls, native: "_native.Quantizer") -> "Quantizer":
        obj = cls.__new__(_CLASSES.get(native.method, Quantizer))
        obj._q = native
        return obj

    @property
    def method(self) -> str:
        """The method's name as stored in encodings and artifacts."""
        return self._q.method

    @property
    def dim(self) -> int:
        return self._q.dim

    @property
    def fitted(self) -> bool:
        """Whether :meth:`encode` can run (calibrated, or nothing to calibrate)."""
        return self._q.fitted

    @property
    def shared_bytes(self) -> int:
        """Bytes of the state shared by all rows (codebooks, rotation signs,
        sketch, smoothing factors, channel mask)."""
        return self._q.shared_bytes

    @property
    def config(self) -> Dict[str, str]:
        """The configuration as the artifact stores it (strings)."""
        return self._q.config

    def fit(self, samples: ArrayLike) -> "Quantizer":
        """Calibrates on ``samples [n, dim]`` and returns ``self``. Methods
        without calibration only check the samples."""
        self._q.fit(samples)
        return self

    def encode(self, x: ArrayLike) -> Encoded:
        """Encodes the rows of ``x [n, dim]``."""
        return self._q.encode(x)

    def decode(self, encoded: Encoded, *, output: Optional[str] = None) -> ArrayLike:
        """Float32 ``[rows, dim]`` reconstruction of ``encoded``."""
        return self._q.decode(encoded, output=output)

    def bits_per_element(self, encoded: Optional[Encoded] = None, *, tokens: Optional[int] = None) -> float:
        """Bits per element counting every stored byte plus the shared state
        spread over ``tokens`` rows: ``8 * stored_bytes / (rows * dim) +
        8 * shared_bytes / (tokens * dim)``. With ``encoded``, its bytes and
        ``tokens`` defaulting to its rows; without, a cache of ``tokens``
        rows (default 4096)."""
        return self._q.bits_per_element(encoded, tokens=tokens)

    def estimate_inner_products(self, queries: ArrayLike, encoded: Encoded) -> ArrayLike:
        """``[n_queries, rows]`` unbiased estimates of ``<q, x>``
        (turboquant-prod and qjl; other methods raise ValueError)."""
        return self._q.estimate_inner_products(queries, encoded)

    def to_bytes(self) -> bytes:
        """The calibration artifact (safetensors bytes; the same bytes each time)."""
        return self._q.to_bytes()

    def save(self, path: PathLike) -> None:
        """Writes the calibration artifact to ``path``."""
        self._q.save(os.fspath(path))

    def __repr__(self) -> str:
        r = repr(self._q)
        if type(self) is Quantizer:
            return r
        # The class already names the method.
        return type(self).__name__ + "(" + r.split(", ", 1)[1]


class TurboQuantMSE(Quantizer):
    """TurboQuant-MSE: random rotation, then a ``bits``-bit Lloyd–Max code
    per coordinate (bits 1, 2, 3, 4, 8) and an f16 norm per row.
    ``rotation``: "hadamard" (dim a power of two, or 12 or 20 times one)
    or "dense" (any dim)."""

    def __init__(self, dim: int, bits: int, *, rotation: str = "hadamard", seed: int = 0) -> None:
        super().__init__("turboquant-mse", dim, bits, rotation=rotation, seed=seed)


class TurboQuantProd(Quantizer):
    """TurboQuant-Prod: MSE at ``bits - 1`` bits plus a 1-bit QJL sketch of
    the residual (bits 1..5, 9); inner products with decoded rows are
    unbiased. ``orthogonal=False`` gives the paper's i.i.d. sketch."""

    def __init__(
        self, dim: int, bits: int, *, rotation: str = "hadamard", seed: int = 0, orthogonal: bool = True
    ) -> None:
        super().__init__("turboquant-prod", dim, bits, rotation=rotation, seed=seed, orthogonal=orthogonal)


class TurboQuantRVQ(Quantizer):
    """Two scalar stages: ``bits`` with the sphere codebook, then
    ``residual_bits`` on the residual (each 1, 2, 3, 4, 8)."""

    def __init__(
        self, dim: int, bits: int, residual_bits: int, *, rotation: str = "hadamard", seed: int = 0
    ) -> None:
        super().__init__("turboquant-rvq", dim, bits, residual_bits=residual_bits, rotation=rotation, seed=seed)


class OutlierSplit(Quantizer):
    """The ``n_outliers`` channels of largest mean square on the samples
    given to :meth:`fit` get TurboQuant-MSE at ``outlier_bits``; the rest
    at ``bits``. Defaults: ``n_outliers = dim // 4``, ``outlier_bits =
    bits + 1`` (at dim 128 and bits 2: 32 channels at 3 bits + 96 at 2, 2.5
    bits/element stored)."""

    def __init__(
        self,
        dim: int,
        bits: int,
        *,
        outlier_bits: Optional[int] = None,
        n_outliers: Optional[int] = None,
        rotation: str = "hadamard",
        seed: int = 0,
    ) -> None:
        super().__init__(
            "outlier-split",
            dim,
            bits,
            outlier_bits=outlier_bits,
            n_outliers=n_outliers,
            rotation=rotation,
            seed=seed,
        )


class QJL(Quantizer):
    """QJL: the signs of a seeded ``sketch_rows x dim`` Gaussian projection
    (default ``sketch_rows = dim``) and an f16 norm; ``orthogonal=True``
    orthogonalizes the sketch rows (lower variance, still unbiased)."""

    def __init__(
        self, dim: int, sketch_rows: Optional[int] = None, *, orthogonal: bool = False, seed: int = 0
    ) -> None:
        super().__init__("qjl", dim, None, sketch_rows=sketch_rows, orthogonal=orthogonal, seed=seed)


class ProductQuantizer(Quantizer):
    """VecInfer-style PQ: sub-vectors of ``sub_dim`` (2, 4, 8) replaced by
    ``bits``-bit indices (1..12) into one k-means codebook, trained by
    :meth:`fit`. Keys: ``smooth=True`` (per-channel λ from the samples);
    values: ``smooth=False``. ``rotate``: Hadamard rotation first."""

    def __init__(
        self,
        dim: int,
        bits: int = 8,
        sub_dim: int = 4,
        *,
        smooth: bool = True,
        rotate: bool = True,
        seed: int = 0,
        max_iters: int = 25,
        tol: float = 1e-4,
    ) -> None:
        super().__init__(
            "pq", dim, bits, sub_dim=sub_dim, smooth=smooth, rotate=rotate, seed=seed, max_iters=max_iters, tol=tol
        )


class KIVIKeys(Quantizer):
    """KIVI keys: asymmetric min/max per channel over groups of ``group``
    tokens (bits 1, 2, 3, 4, 8; f16 scale and zero per group and channel)."""

    def __init__(self, dim: int, bits: int, group: int = 32) -> None:
        super().__init__("kivi-keys", dim, bits, group=group)


class KIVIValues(Quantizer):
    """KIVI values: asymmetric min/max per token over groups of ``group``
    channels (``group`` divides ``dim``)."""

    def __init__(self, dim: int, bits: int, group: int = 32) -> None:
        super().__init__("kivi-values", dim, bits, group=group)


_CLASSES = {
    "turboquant-mse": TurboQuantMSE,
    "turboquant-prod": TurboQuantProd,
    "turboquant-rvq": TurboQuantRVQ,
    "outlier-split": OutlierSplit,
    "qjl": QJL,
    "pq": ProductQuantizer,
    "kivi-keys": KIVIKeys,
    "kivi-values": KIVIValues,
}


def load(path: PathLike) -> Quantizer:
    """The quantizer saved at ``path``, as its method's class. A truncated,
    corrupt or foreign file raises ValueError; a missing one FileNotFoundError."""
    return Quantizer._wrap(_native.Quantizer.load(os.fspath(path)))


def from_bytes(data: bytes) -> Quantizer:
    """The quantizer an artifact's bytes (:meth:`Quantizer.to_bytes`) describe."""
    return Quantizer._wrap(_native.Quantizer.from_bytes(data))
