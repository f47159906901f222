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
_Float = Literal["float32", "float16", "bfloat16"]

def scalar_quantize(
    x: mx.array, codebook: mx.array, bits: int, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def scalar_dequantize(
    packed: mx.array, codebook: mx.array, bits: int, d: int, dtype: _Float, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def kivi_quantize(
    x: mx.array, bits: int, group: int, mode: Literal["keys", "values"], *, policy: _Policy = "auto", device: _Device = None
) -> tuple[mx.array, mx.array, mx.array]: ...
def kivi_dequantize(
    packed: mx.array,
    scales: mx.array,
    zeros: mx.array,
    bits: int,
    group: int,
    mode: Literal["keys", "values"],
    d: int,
    dtype: _Float,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> mx.array: ...
def qjl_encode(
    k: mx.array, sketch: mx.array, *, policy: _Policy = "auto", device: _Device = None
) -> tuple[mx.array, mx.array]: ...
def qjl_score(
    q: mx.array, sketch: mx.array, signs: mx.array, norms: mx.array, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def pq_encode(
    x: mx.array, codebook: mx.array, bits: int, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def pq_decode(
    packed: mx.array, codebook: mx.array, bits: int, d: int, dtype: _Float, *, policy: _Policy = "auto", device: _Device = None
) -> mx.array: ...
def gpu_backend() -> Optional[Literal["metal", "cuda"]]: ...
def cached_kernel_count() -> int: ...
