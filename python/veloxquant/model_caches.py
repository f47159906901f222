"""The caches a model makes for itself, kept aside while veloxquant's own are
installed (``veloxquant.cache.install``): mlx_lm's ``make_cache`` of the
model when it has one, else one ``KVCache`` per layer."""

from typing import Any, Callable, List, Optional

from mlx_lm.models.cache import KVCache

# The model's own make_cache (None when it had none) and the kind installed.
_OWN = "_veloxquant_make_cache"
_KIND = "_veloxquant_kind"


def base_caches(model) -> List[Any]:
    """The caches the model makes without veloxquant."""
    if _KIND in model.__dict__:
        original = model.__dict__[_OWN]
    else:
        original = getattr(model, "make_cache", None)
    if original is not None:
        return original()
    return [KVCache() for _ in range(len(model.layers))]


def replace_make_cache(model, kind: str, make_cache: Callable[[], List[Any]]) -> None:
    """Makes ``model.make_cache`` build ``kind``'s caches, keeping the model's own."""
    restore_make_cache(model)
    own = model.make_cache if hasattr(model, "make_cache") else None
    object.__setattr__(model, _OWN, own)
    object.__setattr__(model, _KIND, kind)
    object.__setattr__(model, "make_cache", make_cache)


def restore_make_cache(model) -> None:
    """Undoes :func:`replace_make_cache` (nothing when it was not done)."""
    if _KIND not in model.__dict__:
        return
    own: Optional[Callable] = model.__dict__.pop(_OWN)
    model.__dict__.pop(_KIND)
    model.__dict__.pop("make_cache", None)
    if own is not None and not hasattr(model, "make_cache"):
        object.__setattr__(model, "make_cache", own)
