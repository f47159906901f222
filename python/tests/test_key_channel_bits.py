"""KIVI keys with bits per channel from the first queries (KVConfig.key_channel_bits="query")."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from veloxquant import _native
from veloxquant.cache import KVConfig, VeloxQuantCache, make_prompt_cache, query_channel_widths


@pytest.fixture
def outlier_channels(tiny):
    """Each layer's keys with a few channels 10x larger (real models' keys have such channels; the tiny random
    model's channels are alike, and alike channels rightly get equal widths)."""
    model = tiny[0]
    saved = []
    for layer in model.model.layers:
        proj = layer.self_attn.k_proj
        saved.append((proj, proj.weight))
        scale = mx.where((mx.arange(proj.weight.shape[0]) % 16) < 2, 10.0, 1.0)[:, None]
        proj.weight = (proj.weight * scale).astype(proj.weight.dtype)
    yield
    for proj, w in saved:
        proj.weight = w


def _config(key_channel_bits="query"):
    return KVConfig(key_method="kivi", key_bits=3, value_method="turboquant-mse", value_bits=3, window=8, sinks=0,
                    key_group=32, key_channel_bits=key_channel_bits)


def test_first_chunk_waits_for_its_queries_then_widths_follow_them(tiny, outlier_channels):
    model, _, ids = tiny
    caches = make_prompt_cache(model, _config())
    x = mx.array(ids[:120])[None]
    mx.eval(model(x, cache=caches))
    for c in caches:
        assert isinstance(c, VeloxQuantCache) and c.offset == 120
        widths = c.layer.config["key_widths"]
        d, h = c.layer.config["head_dim"], c.layer.config["n_kv_heads"]
        assert len(widths) == h * d
        for head in range(h):
            row = widths[head * d : (head + 1) * d]
            assert sum(row) == 3 * d and min(row) >= 1 and max(row) <= 8
        assert len(set(widths)) > 1, "the queries weigh channels unequally"
        assert c.layer.compressed_tokens > 0
    # Decoding goes on over the compressed keys.
    for t in ids[120:130]:
        mx.eval(model(mx.array([[t]]), cache=caches))
    assert caches[0].offset == 130


def test_query_widths_beat_uniform_widths_at_equal_bytes(tiny, outlier_channels):
    """The attention output of a layer over its compressed keys, against float16 keys: closer with the widths
    the queries chose, from the same bytes."""
    model, _, ids = tiny

    def run(cfg):
        # A prefix, then chunks of 4 tokens that attend over its compressed keys.
        caches = make_prompt_cache(model, cfg) if cfg is not None else None
        model(mx.array(ids[:96])[None], cache=caches) if caches else None
        if caches is None:
            logits = model(mx.array(ids[:160])[None])[:, 96:]
        else:
            logits = mx.concatenate([model(mx.array(ids[i : i + 4])[None], cache=caches) for i in range(96, 160, 4)], 1)
        return mx.softmax(logits[0].astype(mx.float32), axis=-1), caches

    outs, held = {}, {}
    for how in ("uniform", "query"):
        outs[how], caches = run(_config(key_channel_bits=how))
        held[how] = sum(c.layer.nbytes for c in caches)
    fp16, _ = run(None)

    def kl(p):
        return mx.sum(fp16 * (mx.log(fp16 + 1e-12) - mx.log(p + 1e-12)), axis=-1).mean().item()

    assert kl(outs["query"]) < 0.85 * kl(outs["uniform"]), (kl(outs["query"]), kl(outs["uniform"]))
    # Same codes and scales; the widths' offsets are all the query layers hold more.
    assert held["uniform"] < held["query"] <= held["uniform"] * 1.05


def test_state_keeps_the_widths(tiny, tmp_path):
    model, _, ids = tiny
    caches = make_prompt_cache(model, _config())
    mx.eval(model(mx.array(ids[:100])[None], cache=caches))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    back = load_prompt_cache(path)
    for a, b in zip(caches, back):
        assert b.layer.config["key_widths"] == a.layer.config["key_widths"]
        ka, _ = a.layer.dequantize()
        kb, _ = b.layer.dequantize()
        assert mx.array_equal(ka, kb).item()


def test_widths_from_queries_that_are_not_finite():
    q = mx.random.normal((1, 4, 16, 64))
    k = mx.random.normal((1, 2, 16, 64))
    q = mx.where(mx.arange(64) == 3, mx.array(float("nan")), q)
    widths = query_channel_widths(q, k, 4)
    assert len(widths) == 128 and sum(widths) == 4 * 128
    # Zero weights everywhere: every channel the same bits.
    assert query_channel_widths(mx.zeros((1, 2, 4, 64)), k, 3) == [3] * 128


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: KVConfig(key_method="kivi", key_channel_bits="some"), "key_channel_bits"),
        (lambda: _native.kivi_channel_widths([[1.0] * 64], 9), "bits"),
        (lambda: _native.kivi_channel_widths([[1.0] * 64, [1.0] * 60], 3), "weights"),
        (lambda: _native.kivi_channel_widths("no", 3), "weights"),
        (lambda: _native.kivi_channel_widths([[math.nan] * 64], 3), "weights"),
        (lambda: _native.LayerCache(64, 1, key_method="kivi", key_bits=3, key_widths=[3] * 63), "key_widths"),
        (lambda: _native.LayerCache(64, 1, key_method="kivi", key_bits=3, key_widths=[300] * 64), "key_widths"),
        (lambda: _native.LayerCache(64, 1, key_bits=3, key_widths=[3] * 64), "key_widths"),
        (lambda: _native.LayerCache(64, 1, key_method="kivi", key_bits=3, key_widths="abc"), "key_widths"),
    ],
)
def test_bad_widths_name_the_argument(call, name):
    with pytest.raises((ValueError, TypeError), match=name):
        call()


def test_recipe_stand_in_matches_the_cache_with_the_same_widths():
    from veloxquant import recipe
    from veloxquant import LayerCache

    mx.random.seed(3)
    scale = mx.where(mx.arange(64) < 6, 8.0, 1.0)
    keys = (mx.random.normal((1, 2, 101, 64)) * scale).astype(mx.float16)
    values = mx.random.normal((1, 2, 101, 64)).astype(mx.float16)
    energy = mx.random.uniform(shape=(1, 2, 64)) * mx.where(mx.arange(64) % 5 == 0, 10.0, 1.0)
    codecs = recipe.Codecs(keys, values, sinks=4, seed=0, query_energy=energy)
    got = codecs.keys_as(recipe.Choice("kivi-query", 3))
    # The widths the stand-in gave, into the cache itself.
    span = mx.max(codecs.centred, axis=2) - mx.min(codecs.centred, axis=2)
    widths = _native.kivi_channel_widths((energy * span * span).reshape(2, 64).tolist(), 3)
    assert len(set(widths)) > 2
    layer = LayerCache(64, 2, key_method="kivi", key_bits=3, key_widths=widths, value_method="fp16",
                                 value_bits=16, window=1, sinks=4, seed=0)
    layer.append(keys, values)
    k, _ = layer.dequantize()

    def rel(x):  # the tokens both compress: after the sinks, before the cache's recent token
        d = (x[:, :, 4:100] - keys[:, :, 4:100]).astype(mx.float32)
        return (mx.sum(d * d) / mx.sum(keys[:, :, 4:100].astype(mx.float32) ** 2)).item()

    assert rel(got) == pytest.approx(rel(k), rel=1e-3)
    # And below uniform 3-bit KIVI's error where the queries look.
    uniform = codecs.keys_as(recipe.Choice("kivi", 3))
    weighted = lambda x: mx.sum(energy[:, :, None, :] * (x[:, :, 4:100] - keys[:, :, 4:100].astype(mx.float32)) ** 2).item()  # noqa: E731
    assert weighted(got) < 0.8 * weighted(uniform)


def test_auto_recipe_can_choose_query_widths(tiny, outlier_channels):
    model, _, ids = tiny
    cfg = KVConfig.auto(model, ids[:128], bits_budget=3.5, window=8, sinks=0)
    chosen = [cfg.for_layer(i) for i in range(len(model.model.layers))]
    assert all(c is not None for c in chosen)
    # Whatever it chose, each layer's config builds and runs.
    caches = make_prompt_cache(model, cfg)
    mx.eval(model(mx.array(ids[:64])[None], cache=caches))
    for c, layer_cfg in zip(caches, chosen):
        if layer_cfg.widths_from_queries():
            assert c.layer.config["key_widths"] is not None
