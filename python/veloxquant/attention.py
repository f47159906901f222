"""The attention dispatch: mlx_lm's ``scaled_dot_product_attention`` learns veloxquant caches.

mlx_lm's model modules import the function by name (``from .base import
scaled_dot_product_attention``), so replacing it in ``mlx_lm.models.base`` alone
would miss models already imported. :func:`install` wraps it once and puts the
wrapper in ``base`` and in every loaded ``mlx_lm.models.*`` module that holds the
original; later imports take the wrapper from ``base``. Calls with any other
cache go to the original function unchanged.
"""

from __future__ import annotations

import sys
from typing import Optional

import mlx.core as mx

_MARK = "_veloxquant_dispatch"


def _wrap(original):
    from .cache import VeloxQuantCache

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale: float, mask: Optional[mx.array], sinks: Optional[mx.array] = None
    ) -> mx.array:
        if isinstance(cache, VeloxQuantCache):
            if sinks is not None:
                raise ValueError(
                    "veloxquant caches do not support attention sinks (learned per-head logits); "
                    "use --kv-cache fp16 or mlx-quantized for this model"
                )
            return cache.attention(queries, scale, mask)
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
