"""Shared fixtures: the default model, converted once (CPU forwards are slow: keep token counts small)."""

import pytest


def has_layer_cache() -> bool:
    import veloxquant._native as n

    return hasattr(n, "LayerCache")


needs_layer_cache = pytest.mark.skipif(
    not has_layer_cache(), reason="this build of veloxquant._native has no LayerCache"
)


@pytest.fixture(scope="session")
def smollm():
    from veloxquant import models

    return models.load()
