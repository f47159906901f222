"""Shared fixtures: the default model, converted once (CPU forwards are slow: keep token counts small)."""

import pytest


@pytest.fixture(scope="session")
def smollm():
    from veloxquant import models

    return models.load()
