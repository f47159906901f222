"""The fused kernels on ``mlx.core.array``.

Every function builds lazy arrays in MLX's graph: nothing is copied or
evaluated until ``mx.eval`` (or a use that needs the values), and the results
feed further ``mx`` ops, also under ``mx.compile``.

``policy`` picks the implementation: ``"auto"`` (the fused kernel where the
stream's back-end has one, else the reference graph of plain MLX ops),
``"require"`` (the fused kernel or an error) or ``"off"`` (the reference
graph). ``device`` is ``None`` (MLX's default device), ``"cpu"``, ``"gpu"``,
or an ``mx.Device`` / ``mx.Stream``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import _native

Device = Union[None, str, "mx.DeviceType", "mx.Device", "mx.Stream"]

__all__ = [
    "bit_pack",
    "bit_unpack",
    "vq_quantize",
    "scalar_quantize",
    "scalar_dequantize",
    "kivi_quantize",
    "kivi_dequantize",
    "qjl_encode",
    "qjl_score",
    "pq_encode",
    "pq_decode",
    "tq_encode",
    "tq_prod_encode",
    "tq_prod_decode",
    "tq_rvq_encode",
    "tq_rvq_decode",
    "pending_primitives",
    "SUPPORTED_BITS",
    "PQ_BITS",
    "PROD_BITS",
    "VQ_DIMS",
    "PQ_SUB_DIMS",
    "MAX_CODEBOOK_SIZE",
]

# The kernels' argument ranges as the crate defines them.
SUPPORTED_BITS = tuple(_native.SUPPORTED_BITS)
VQ_DIMS = tuple(_native.VQ_DIMS)
MAX_CODEBOOK_SIZE = _native.MAX_CODEBOOK_SIZE
PQ_SUB_DIMS = tuple(_native.PQ_SUB_DIMS)
PQ_BITS = tuple(_native.PQ_BITS)
PROD_BITS = tuple(_native.PROD_BITS)


def _device(device: Device) -> Optional[str]:
    if device is None or isinstance(device, str):
        return device
    if isinstance(device, mx.Stream):
        device = device.device
    if isinstance(device, mx.Device):
        device = device.type
    if isinstance(device, mx.DeviceType):
        return "cpu" if device == mx.DeviceType.cpu else "gpu"
    raise TypeError(
        f"device: expected None, 'cpu', 'gpu', mx.cpu, mx.gpu, mx.Device or mx.Stream, got {type(device).__name__}"
    )


def bit_pack(codes: mx.array, bits: int, *, policy: str = "auto", device: Device = None) -> mx.array:
    """Packs uint8 ``codes [..., n]`` of ``bits`` bits (1, 2, 3, 4 or 8; only
    the low ``bits`` bits are kept) densely into uint8 ``[..., ceil(n*bits/8)]``.
    Code ``i`` of a row occupies bits ``[i*bits, (i+1)*bits)`` of a
    little-endian bit stream."""
    return _native.bit_pack(codes, bits, policy=policy, device=_device(device))


def bit_unpack(packed: mx.array, bits: int, n: int, *, policy: str = "auto", device: Device = None) -> mx.array:
    """Inverse of :func:`bit_pack`: uint8 ``[..., ceil(n*bits/8)]`` to ``n`` codes."""
    return _native.bit_unpack(packed, bits, n, policy=policy, device=_device(device))


def vq_quantize(x: mx.array, codebook: mx.array, *, policy: str = "auto", device: Device = None) -> mx.array:
    """Index (uint32) of the centroid of ``codebook [K, d]`` nearest to each
    vector of ``x [..., d]`` (d in 2, 4, 8; K up to 4096; float32, float16 or
    bfloat16, both the same). Distances are float32; ties go to the lowest
    index. The result has shape ``x.shape[:-1]``."""
    return _native.vq_quantize(x, codebook, policy=policy, device=_device(device))


def _dtype(dtype: "mx.Dtype") -> str:
    for name in ("float32", "float16", "bfloat16"):
        if dtype == getattr(mx, name):
            return name
    return str(dtype).rsplit(".", 1)[-1]


def scalar_quantize(x: mx.array, codebook: mx.array, bits: int, *, policy: str = "auto", device: Device = None) -> mx.array:
    """Codes of ``x [..., d]`` (float32/float16/bfloat16) against the sorted
    float32 ``codebook [2**bits]`` (nearest entry; a value on a boundary goes
    to the lower one), packed along the last axis as :func:`bit_pack` does:
    uint8 ``[..., ceil(d*bits/8)]``."""
    return _native.scalar_quantize(x, codebook, bits, policy=policy, device=_device(device))


def scalar_dequantize(
    packed: mx.array, codebook: mx.array, bits: int, d: int, dtype: "mx.Dtype" = mx.float32, *, policy: str = "auto", device: Device = None
) -> mx.array:
    """``codebook[code]`` for the ``d`` packed codes of each row, as ``dtype``."""
    return _native.scalar_dequantize(packed, codebook, bits, d, _dtype(dtype), policy=policy, device=_device(device))


def kivi_quantize(
    x: mx.array, bits: int, group: int, mode: str = "keys", *, policy: str = "auto", device: Device = None
) -> tuple:
    """KIVI group quantization of ``x [N, D]``: ``(codes uint8 [N, ceil(D*bits/8)],
    scales float16, zeros float16)``; ``mode="keys"``: per channel over groups of
    ``group`` tokens (scales ``[ceil(N/group), D]``), ``"values"``: per token over
    groups of ``group`` channels, a multiple of 8 (scales ``[N, D/group]``)."""
    return _native.kivi_quantize(x, bits, group, mode, policy=policy, device=_device(device))


def kivi_dequantize(
    packed: mx.array,
    scales: mx.array,
    zeros: mx.array,
    bits: int,
    group: int,
    mode: str,
    d: int,
    dtype: "mx.Dtype" = mx.float32,
    *,
    policy: str = "auto",
    device: Device = None,
) -> mx.array:
    """``zero + scale * code`` for the output of :func:`kivi_quantize`, as ``dtype``."""
    return _native.kivi_dequantize(
        packed, scales, zeros, bits, group, mode, d, _dtype(dtype), policy=policy, device=_device(device)
    )


def qjl_encode(k: mx.array, sketch: mx.array, *, policy: str = "auto", device: Device = None) -> tuple:
    """QJL encoding of keys ``k [..., D]`` with the float32 sketch ``S [m, D]``:
    ``(signs uint8 [..., ceil(m/8)], norms float16 [...])``, bit r set where
    ``(S k)_r >= 0``. On CUDA, float16 keys with D and m multiples of 16
    (D <= 128, 64 <= m <= 256) are projected on the tensor cores: a sign may
    then differ from the CPU's where ``(S k)_r`` is within float32 rounding
    of zero."""
    return _native.qjl_encode(k, sketch, policy=policy, device=_device(device))


def qjl_score(
    q: mx.array, sketch: mx.array, signs: mx.array, norms: mx.array, *, policy: str = "auto", device: Device = None
) -> mx.array:
    """QJL estimates of ``<q_i, k_t>`` for queries ``q [Q, D]`` against encoded
    keys: float32 ``[Q, N]`` = ``sqrt(pi/2)/m * |k| * <S q, sign(S k)>``."""
    return _native.qjl_score(q, sketch, signs, norms, policy=policy, device=_device(device))


def pq_encode(
    x: mx.array, codebook: mx.array, bits: int, *, policy: str = "auto", device: Device = None
) -> Tuple[mx.array, Optional[mx.array]]:
    """Product quantization of ``x [..., D]``: the nearest entry of the float32
    ``codebook [K, s]`` (s in 2, 4, 8; K <= 2**bits, bits 1..12) for each of
    the D/s sub-vectors, in ``ProductQuantizer``'s layout: ``(codes, codes_hi)``,
    ``codes`` uint8 ``[..., ceil(D/s*lo/8)]`` holding the low ``lo`` bits and
    ``codes_hi`` the remaining ``hi`` bits (``None`` for 1, 2, 3, 4 and 8 bits;
    ``lo, hi = 4, bits-4`` for 5..7 and ``8, bits-8`` for 9..12). On CUDA,
    float16 and bfloat16 inputs (up to 10 bits, 9 at s = 8) are searched on
    the tensor cores, whose codes may differ from the exact search's at
    near-ties."""
    return _native.pq_encode(x, codebook, bits, policy=policy, device=_device(device))


def pq_decode(
    codes: mx.array,
    codebook: mx.array,
    bits: int,
    d: int,
    dtype: "mx.Dtype" = mx.float32,
    *,
    codes_hi: Optional[mx.array] = None,
    policy: str = "auto",
    device: Device = None,
) -> mx.array:
    """The codebook entries of packed PQ codes (both planes of
    :func:`pq_encode`), as ``dtype`` ``[..., d]``."""
    return _native.pq_decode(
        codes, codebook, bits, d, _dtype(dtype), codes_hi=codes_hi, policy=policy, device=_device(device)
    )


def tq_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids: mx.array,
    bits: int,
    *,
    policy: str = "auto",
    device: Device = None,
) -> Tuple[mx.array, mx.array]:
    """The cache's TurboQuant-MSE encoder, one fused kernel per call: ``(codes,
    norms)`` for ``x [..., d]`` (d a multiple of 8 up to 256), the ``bits``-bit
    codes (1, 2, 3, 4 or 8) of ``R x/|x|`` in the sorted float32 ``centroids``,
    packed as :func:`bit_pack` packs them, and ``|x|`` in float16. ``rotation``
    is ``R`` (float32 ``[d, d]``), the +-1 signs ``s`` of a Hadamard rotation
    (float32 ``[d]``, d a power of two: ``R u = H (s * u) / sqrt(d)``, applied
    by butterflies), or None for vectors rotated already. The CPU and Metal
    kernels, and CUDA's for float32 ``x``, agree bit for bit; for float16 or
    bfloat16 ``x`` with a rotation at d = 64 or 128 CUDA rotates on the tensor
    cores, so a code may differ from the CPU's at a near-tie."""
    return _native.tq_encode(x, rotation, centroids, bits, policy=policy, device=_device(device))


def tq_prod_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids: Optional[mx.array],
    sketch: mx.array,
    bits: int,
    *,
    policy: str = "auto",
    device: Device = None,
) -> Tuple[Optional[mx.array], mx.array, mx.array, Optional[mx.array]]:
    """TurboQuant-Prod encoding of ``x [..., d]`` (d a multiple of 8 up to 256;
    bits in 1, 2, 3, 4, 5, 9) in one fused kernel: ``(codes, signs, norms,
    residual_norms)``, the buffers of ``TurboQuantProd``'s encoding. ``rotation``
    is the float32 ``[d, d]`` matrix, or a Hadamard rotation's float32 signs
    ``[d]`` (d a power of two; butterflies, as :func:`tq_encode`), ``None``
    when ``x`` is rotated already,
    ``centroids`` the sorted float32 codebook ``[2**(bits-1)]`` (``None`` at 1
    bit, where ``codes`` and ``residual_norms`` are ``None`` too), ``sketch``
    the float32 ``[d, d]`` QJL matrix. The CPU and Metal kernels, and CUDA's
    for float32 ``x``, agree bit for bit; for float16 or bfloat16 ``x`` CUDA
    sums the products by fma, so a code or sign may differ from the CPU's at
    a near-tie."""
    return _native.tq_prod_encode(x, rotation, centroids, sketch, bits, policy=policy, device=_device(device))


def tq_prod_decode(
    codes: Optional[mx.array],
    signs: mx.array,
    norms: mx.array,
    residual_norms: Optional[mx.array],
    rotation: Optional[mx.array],
    centroids: Optional[mx.array],
    sketch: mx.array,
    bits: int,
    dtype: "mx.Dtype" = mx.float32,
    *,
    policy: str = "auto",
    device: Device = None,
) -> mx.array:
    """Inverse of :func:`tq_prod_encode`: ``|x| R^T (c[code] + sqrt(pi/2)/d *
    |r| * S^T z)`` as ``dtype`` ``[..., d]``, z the +-1 signs; ``rotation``
    as the encoder's (``[d, d]``, Hadamard signs ``[d]``, or None). On CUDA a
    float16 or bfloat16 output at d = 64 or 128 takes ``S^T z`` (and, with a
    ``[d, d]`` rotation, ``R^T`` too) from the tensor cores: values may then
    differ from the CPU's by the output's rounding."""
    return _native.tq_prod_decode(
        codes, signs, norms, residual_norms, rotation, centroids, sketch, bits, _dtype(dtype),
        policy=policy, device=_device(device),
    )


def tq_rvq_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids1: mx.array,
    centroids2: mx.array,
    bits1: int,
    bits2: int,
    *,
    policy: str = "auto",
    device: Device = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """TurboQuant-RVQ encoding of ``x [..., d]`` in one fused kernel: ``(codes1,
    codes2, norms)``, the codes of the rotated unit vector in ``centroids1``
    (``bits1`` bits) and of its residual in ``centroids2`` (``bits2``), each
    width 1, 2, 3, 4 or 8, as ``TurboQuantRvq``'s encoding. ``rotation`` is
    the float32 ``[d, d]`` matrix, a Hadamard rotation's float32 signs ``[d]``
    (d a power of two; butterflies), or ``None`` for vectors rotated
    already. Parity as :func:`tq_encode`: on CUDA, float16 or bfloat16 ``x``
    with a rotation at d = 64 or 128 is rotated on the tensor cores, and a
    code may differ from the CPU's at a near-tie."""
    return _native.tq_rvq_encode(x, rotation, centroids1, centroids2, bits1, bits2, policy=policy, device=_device(device))


def tq_rvq_decode(
    codes1: mx.array,
    codes2: mx.array,
    norms: mx.array,
    rotation: Optional[mx.array],
    centroids1: mx.array,
    centroids2: mx.array,
    bits1: int,
    bits2: int,
    d: int,
    dtype: "mx.Dtype" = mx.float32,
    *,
    policy: str = "auto",
    device: Device = None,
) -> mx.array:
    """Inverse of :func:`tq_rvq_encode`: ``|x| R^T (centroids1[a] + centroids2[b])``
    as ``dtype`` ``[..., d]``; ``rotation`` as the encoder's (``[d, d]``,
    Hadamard signs ``[d]``, or None). On CUDA a float16 or bfloat16 output at
    d = 64 or 128 with a ``[d, d]`` rotation takes ``R^T`` from the tensor
    cores: values may then differ from the CPU's by the output's rounding."""
    return _native.tq_rvq_decode(
        codes1, codes2, norms, rotation, centroids1, centroids2, bits1, bits2, d, _dtype(dtype),
        policy=policy, device=_device(device),
    )


def pending_primitives(arrays: Sequence[mx.array]) -> List[str]:
    """Names of the primitives MLX would run to evaluate ``arrays``: one per
    graph node not evaluated yet (a kernel with several outputs counts once),
    inputs first. Evaluates nothing; counts the launches an operation adds."""
    return _native.pending_primitives(list(arrays))
