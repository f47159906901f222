"""Stubs of the native module ``veloxquant._native``."""

import os
from typing import Dict, List, Literal, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

MLX_VERSION: str
MAX_KIVI_KEY_GROUP: int  # the longest KIVI key group a cache takes (tokens)
DEFAULT_KEY_BITS: int  # the default recipe's key bits (TurboQuant-MSE K4/V3)
DEFAULT_VALUE_BITS: int  # the default recipe's value bits
# The cache's methods: name -> (supported bits, or None where bits are ignored; keys only).
CACHE_METHODS: Dict[str, Tuple[Optional[list[int]], bool]]
CACHE_METHOD_ALIASES: Dict[str, str]
# The kernels' argument ranges.
SUPPORTED_BITS: list[int]
PROD_BITS: list[int]
PQ_BITS: list[int]
PQ_SUB_DIMS: list[int]
VQ_DIMS: list[int]
MAX_CODEBOOK_SIZE: int

_Policy = Literal["auto", "require", "off"]
_Device = Optional[Literal["cpu", "gpu"]]

def sphere_codebook(dim: int, bits: int) -> list[float]:
    """TurboQuant-MSE's Lloyd-Max levels for a rotated, normalised coordinate (ascending)."""
    ...
def turboquant_levels(dim: int, bits: int, keys: bool) -> list[float]:
    """The levels a cache's TurboQuant-MSE keys or values quantize a rotated, normalised
    coordinate with (ascending): Lloyd-Max, or the uniform grid of 3-bit values."""
    ...
def default_value_bits(key_method: str, value_method: str, key_bits: Optional[int] = None) -> int:
    """The values' bits when a configuration gives none: DEFAULT_VALUE_BITS
    where no key bits are given and both methods are turboquant-mse, else
    the keys' bits (DEFAULT_KEY_BITS where not given)."""
    ...

def kivi_channel_widths(weights: Sequence[Sequence[float]], bits: int) -> List[int]:
    """KIVI keys' bits per channel (1 to 8, `bits` on average per KV head) from
    `weights` `[kv_heads][head_dim]`, what an error in each channel costs the
    scores; flat, the `key_widths` of a `LayerCache`."""
    ...
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
) -> tuple[mx.array, Optional[mx.array]]: ...
def pq_decode(
    codes: mx.array,
    codebook: mx.array,
    bits: int,
    d: int,
    dtype: _Float,
    *,
    codes_hi: Optional[mx.array] = None,
    policy: _Policy = "auto",
    device: _Device = None,
) -> mx.array: ...
def tq_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids: mx.array,
    bits: int,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> tuple[mx.array, mx.array]: ...
def tq_prod_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids: Optional[mx.array],
    sketch: mx.array,
    bits: int,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> tuple[Optional[mx.array], mx.array, mx.array, Optional[mx.array]]: ...
def tq_prod_decode(
    codes: Optional[mx.array],
    signs: mx.array,
    norms: mx.array,
    residual_norms: Optional[mx.array],
    rotation: Optional[mx.array],
    centroids: Optional[mx.array],
    sketch: mx.array,
    bits: int,
    dtype: _Float,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> mx.array: ...
def tq_rvq_encode(
    x: mx.array,
    rotation: Optional[mx.array],
    centroids1: mx.array,
    centroids2: mx.array,
    bits1: int,
    bits2: int,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> tuple[mx.array, mx.array, mx.array]: ...
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
    dtype: _Float,
    *,
    policy: _Policy = "auto",
    device: _Device = None,
) -> mx.array: ...
def pending_primitives(arrays: Sequence[mx.array]) -> list[str]: ...
def gpu_backend() -> Optional[Literal["metal", "cuda"]]: ...
def cached_kernel_count() -> int: ...

# ---- quantizers (src/python/quant.rs); documented in veloxquant.quant

_Rows = Union[np.ndarray, mx.array]

QUANT_METHODS: Tuple[str, ...]

class Encoded:
    def __init__(self, method: str, rows: int, dim: int, buffers: Dict[str, bytes]) -> None: ...
    @property
    def method(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def stored_bytes(self) -> int: ...
    @property
    def buffers(self) -> Dict[str, bytes]: ...
    def buffer(self, name: str) -> np.ndarray: ...
    def __eq__(self, other: object) -> bool: ...

class Quantizer:
    def __init__(
        self,
        method: str,
        dim: int,
        bits: Optional[int] = None,
        *,
        seed: Optional[int] = None,
        rotation: Optional[Literal["hadamard", "dense"]] = None,
        orthogonal: Optional[bool] = None,
        residual_bits: Optional[int] = None,
        sketch_rows: Optional[int] = None,
        sub_dim: Optional[int] = None,
        smooth: Optional[bool] = None,
        rotate: Optional[bool] = None,
        max_iters: Optional[int] = None,
        tol: Optional[float] = None,
        n_outliers: Optional[int] = None,
        outlier_bits: Optional[int] = None,
        group: Optional[int] = None,
    ) -> None: ...
    @property
    def method(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def fitted(self) -> bool: ...
    @property
    def shared_bytes(self) -> int: ...
    @property
    def config(self) -> Dict[str, str]: ...
    def fit(self, samples: _Rows) -> None: ...
    def encode(self, x: _Rows) -> Encoded: ...
    def decode(self, encoded: Encoded, *, output: Optional[Literal["numpy", "mlx"]] = None) -> _Rows: ...
    def bits_per_element(self, encoded: Optional[Encoded] = None, *, tokens: Optional[int] = None) -> float: ...
    def estimate_inner_products(self, queries: _Rows, encoded: Encoded) -> _Rows: ...
    def to_bytes(self) -> bytes: ...
    def save(self, path: Union[str, os.PathLike[str]]) -> None: ...
    @staticmethod
    def from_bytes(data: bytes) -> Quantizer: ...
    @staticmethod
    def load(path: Union[str, os.PathLike[str]]) -> Quantizer: ...

_Method = Literal["fp16", "turboquant-mse", "kivi", "pq", "qjl", "turboquant-prod", "turboquant-rvq"]

class LayerCache:
    """One attention layer's compressed key/value cache.

    Keys and values each have their own method and bits (docs/CACHE_API.md):
    ``"fp16"`` (the uncompressed control, bits ignored), ``"turboquant-mse"``
    (1, 2, 3, 4 or 8 bits), ``"kivi"`` (1, 2, 3, 4 or 8 bits), ``"pq"``
    (1, 2 or 4 bits per element), ``"turboquant-rvq"`` (2 to 5 bits: ``bits - 1``
    then 1 on the residual), and for keys only the unbiased score estimators
    ``"qjl"`` (1 to 4 sketch bits per element) and ``"turboquant-prod"``
    (2 to 5 bits: ``bits - 1`` MSE bits + 1 QJL sign bit). ``key_group``:
    tokens of a KIVI key group (a float16 scale and zero per channel and
    group), a multiple of 8 from 8 to 1024. ``key_widths``: KIVI keys' bits
    per channel, ``n_kv_heads * head_dim`` widths of 1 to 8, each head's
    adding up to ``head_dim * key_bits`` (``kivi_channel_widths``); None
    gives every channel ``key_bits``. Without bits the cache takes the
    default recipe, keys at 4 bits and values at 3; ``value_bits`` otherwise
    defaults to ``key_bits``.

    A cache may be made, used and dropped on any thread. MLX streams are per
    thread: work a cache queued on one thread must be evaluated there before
    another thread uses it.
    """

    def __init__(
        self,
        head_dim: int,
        n_kv_heads: int,
        key_method: _Method = "turboquant-mse",
        key_bits: int = 4,
        value_method: _Method = "turboquant-mse",
        value_bits: Optional[int] = None,
        window: int = 128,
        sinks: int = 4,
        seed: int = 0,
        policy: _Policy = "auto",
        device: _Device = None,
        key_group: int = 32,
        key_widths: Optional[Sequence[int]] = None,
    ) -> None: ...
    def append(self, keys: mx.array, values: mx.array) -> None: ...
    def attention(
        self, queries: mx.array, scale: float, mask: Union[None, Literal["causal"], mx.array] = None
    ) -> mx.array:
        """Attention over the cache. `mask`: None, "causal", or an mx.array
        (boolean, true attends; or additive) broadcastable to
        `[B, n_heads, L, offset]`."""
    def framed_with(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The history and the chunk `keys`/`values` about to be appended, in
        the cache's frame: a prefill chunk's transient buffer for
        `attend_framed`. Call before `append`."""
    def framed_append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """`framed_with`, then `append` of the same chunk (the chunk enters
        the cache's frame once): a prefill chunk's path."""
    def attend_framed(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: Union[None, Literal["causal"], mx.array] = None,
        float32: bool = False,
    ) -> mx.array:
        """Attention of `queries` over `framed_with`'s buffer with MLX's SDPA;
        `float32`: the products in float32, the output in the cache's dtype."""
    @staticmethod
    def attention_each(caches: Sequence["LayerCache"], queries: mx.array, scale: float) -> mx.array:
        """Decode attention of a batch, row `b` of `queries` `[B, n_heads, 1,
        head_dim]` over `caches[b]`; one operation for TurboQuant caches of
        one configuration (on CUDA one launch per 16 caches; Metal attends
        cache by cache)."""
    @staticmethod
    def append_each(caches: Sequence["LayerCache"], keys: mx.array, values: mx.array) -> None:
        """A decode step of a batch: row `b` of `keys` and `values` `[B,
        kv_heads, tokens, head_dim]` appended to `caches[b]`; one operation
        for caches of one configuration whose tokens join their windows (on
        CUDA one launch per 16 caches; Metal appends cache by cache)."""
    @property
    def offset(self) -> int: ...
    @property
    def compressed_tokens(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_nbytes(self) -> int:
        """Bytes of the data stored for the tokens held (codes, norms, scales,
        float16 window rows, the keys' mean); ``nbytes`` less this is
        allocated capacity."""
    @property
    def shared_nbytes(self) -> int:
        """Bytes of the rotation and codebooks, held once by every layer with
        the same ``shared_id``."""
    @property
    def shared_id(self) -> Optional[int]:
        """Identifies the shared rotation and codebooks (None before the
        first append): layers with equal ids hold the same arrays."""
    def trim(self, n: int) -> int: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes, device: _Device = None) -> "LayerCache": ...
    def dequantize(self) -> tuple[mx.array, mx.array]: ...
    @property
    def config(self) -> dict: ...
