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

from typing import Optional, Union

import mlx.core as mx

from . import _native

Device = Union[None, str, "mx.DeviceType", "mx.Device", "mx.Stream"]

__all__ = ["bit_pack", "bit_unpack", "vq_quantize", "SUPPORTED_BITS", "VQ_DIMS", "MAX_CODEBOOK_SIZE"]

SUPPORTED_BITS = (1, 2, 3, 4, 8)
VQ_DIMS = (2, 4, 8)
MAX_CODEBOOK_SIZE = 4096


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
