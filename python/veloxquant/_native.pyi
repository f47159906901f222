"""Stubs of the native module ``veloxquant._native``."""

from typing import Literal, Optional

import mlx.core as mx

MLX_VERSION: str

_Policy = Literal["auto", "require", "off"]
_Device = Optional[Literal["cpu", "gpu"]]

def bit_pack(codes: mx.array, bits: int, *, policy: _Policy = "auto", device: _Device = None) -> mx.array: ...
def bit_unpack(
    packed: mx.array, bits: int, n: int, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def vq_quantize(
    x: mx.array, codebook: mx.array, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def gpu_backend() -> Optional[Literal["metal", "cuda"]]: ...
def cached_kernel_count() -> int: ...
