"""The attention dispatch: mlx_lm's ``scaled_dot_product_attention`` learns veloxquant caches.

mlx_lm's model modules import the function by name (``from .base import
scaled_dot_product_attention``), so replacing it in ``mlx_lm.models.base`` alone
would miss models already imported. :func:`install` wraps it once and puts the
wrapper in ``base`` and in every loaded ``mlx_lm.models.*`` module that holds the
original; later imports take the wrapper from ``base``. Calls with any other
cache go to the original function unchanged. A ``VeloxQuantBatchCache`` is
attended sequence by sequence, each sequence's queries over its own cache.

:func:`set_cpu_float32` (``veloxquant.blas.use_float32_compute`` calls it)
makes the dispatch compute float16/bfloat16 attention in float32 on MLX's
CPU device, where MLX's half-precision matmuls are portable loops and its
float32 ones BLAS: queries, keys and values (mlx_lm's quantized scales and
biases) are cast up and the output cast back; a prefill chunk over mlx_lm's
quantized cache attends over its dequantized keys and values. A veloxquant
cache's prefill chunk attends with MLX's SDPA over the cache's own buffer
(the history decoded in the cache's frame in one pass, then the chunk), in
float32 there. Decode steps keep the cache's fused kernels.
"""

from __future__ import annotations

import sys
from typing import Optional

import mlx.core as mx

_MARK = "_veloxquant_dispatch"
_cpu_float32 = False


def set_cpu_float32(on: bool = True) -> None:
    """Compute half-precision attention in float32 on the CPU device (see the module's doc)."""
    global _cpu_float32
    _cpu_float32 = bool(on)


def _float32_here(queries) -> bool:
    return _cpu_float32 and queries.dtype in (mx.float16, mx.bfloat16) and mx.default_device() == mx.cpu


def _up(a):
    return a.astype(mx.float32) if isinstance(a, mx.array) and a.dtype in (mx.float16, mx.bfloat16) else a


def _sdpa_float32(original, queries, keys, values, cache, scale, mask, sinks):
    if isinstance(keys, (tuple, list)):  # mlx_lm's QuantizedKVCache: (codes, scales, biases)
        keys, values = tuple(_up(a) for a in keys), tuple(_up(a) for a in values)
        if queries.shape[2] > 8 and sinks is None:
            # Prefill: dequantize and use SDPA, the arithmetic of mlx_lm's two
            # quantized_matmuls, whose CPU loops take ~5x longer on a chunk.
            g, b = cache.group_size, cache.bits
            keys = mx.dequantize(*keys, group_size=g, bits=b)
            values = mx.dequantize(*values, group_size=g, bits=b)
            out = mx.fast.scaled_dot_product_attention(_up(queries), keys, values, scale=scale, mask=_up(mask))
            return out.astype(queries.dtype)
    else:
        keys, values = _up(keys), _up(values)
    out = original(_up(queries), keys, values, cache=cache, scale=scale, mask=_up(mask), sinks=_up(sinks))
    return out.astype(queries.dtype)


def _refuse_sinks(sinks):
    if sinks is not None:
        raise ValueError(
            "veloxquant caches do not support attention sinks (learned per-head logits); "
            "use --kv-cache fp16 or mlx-quantized for this model"
        )


# Chunks longer than this attend through MLX's SDPA over a transient
# dequantized buffer (prefill); shorter ones (decode, speculative
# verification) through the fused kernels reading the codes.
FUSED_MAX_QUERIES = 8

# How a veloxquant cache class asks to be attended (its class attribute
# ``veloxquant_attention``): ``ONE``, a sequence over its own cache
# (``attention``); ``EACH``, a batch whose sequences each have their own
# (``attend_each``). The dispatch reads the mark, so that it imports no cache.
ONE, EACH = "one", "each"


def _wrap(original):
    def attend(queries, keys, values, cache, scale, mask):
        # One sequence over its VeloxQuantCache. A prefill chunk attends over
        # the cache's framed buffer (the history decoded in the cache's frame
        # in one pass, then the chunk); on the CPU with float32 compute its
        # products run in float32.
        return cache.attention(queries, scale, mask, float32=_float32_here(queries))

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale: float, mask: Optional[mx.array], sinks: Optional[mx.array] = None
    ) -> mx.array:
        how = getattr(type(cache), "veloxquant_attention", None)
        if how == EACH:
            # Each sequence over its own cache, as it would attend alone.
            _refuse_sinks(sinks)
            return cache.attend_each(queries, lambda q, k, v, c, m: attend(q, k, v, c, scale, m), scale)
        observe = getattr(cache, "observe_queries", None)
        if observe is not None:
            # A calibration's recorder, or a cache that decides its layout from the first queries.
            observe(queries)
        if how == ONE:
            _refuse_sinks(sinks)
            return attend(queries, keys, values, cache, scale, mask)
        if _float32_here(queries):
            return _sdpa_float32(original, queries, keys, values, cache, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _MARK, original)
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def install() -> None:
    """Install the dispatch (idempotent; rescans mlx_lm modules imported since)."""
    import mlx_lm.models.base as base

    current = base.scaled_dot_product_attention
    if getattr(current, _MARK, None) is None:
        base.scaled_dot_product_attention = _wrap(current)
    wrapper = base.scaled_dot_product_attention
    original = getattr(wrapper, _MARK)
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.") and getattr(mod, "scaled_dot_product_attention", None) is original:
            mod.scaled_dot_product_attention = wrapper


def installed() -> bool:
    import mlx_lm.models.base as base

    return getattr(base.scaled_dot_product_attention, _MARK, None) is not None


def check_model(model) -> None:
    """Raise ValueError unless some module defining ``model``'s layers calls the dispatch.

    A model whose attention calls ``mx.fast.scaled_dot_product_attention``
    itself would otherwise run on dequantized keys and values (the cache
    warns when that happens at run time).
    """
    import mlx_lm.models.base as base

    wrapper = base.scaled_dot_product_attention
    modules = {type(model).__module__}
    for _, m in model.named_modules():
        modules.add(type(m).__module__)
    for name in modules:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is wrapper:
            return
    raise ValueError(
        f"{type(model).__module__}.{type(model).__name__}: its attention does not call "
        "mlx_lm.models.base.scaled_dot_product_attention, so veloxquant cannot compute it on "
        "compressed keys and values; use --kv-cache fp16 or mlx-quantized for this model"
    )
