"""VeloxQuantCache in mlx_lm: config, dispatch, generation, deepcopy, save/load, trim, errors."""

import copy
import dataclasses
import sys
import types

import mlx.core as mx
import mlx_lm
import mlx_lm.models.base as base
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from veloxquant import attention
from veloxquant._native import LayerCache
from veloxquant.cache import (
    CorruptStateError,
    KVConfig,
    VeloxQuantCache,
    cache_nbytes,
    install,
    make_mlx_quantized_cache,
    make_prompt_cache,
    uninstall,
)


# --- config -------------------------------------------------------------------


def test_config_defaults_and_layer_overrides():
    c = KVConfig(key_bits=3, layers={0: None, 2: {"key_bits": 8}, 3: {"value_bits": 2}})
    assert (c.value_method, c.value_bits) == ("turboquant-mse", 3)
    assert c.for_layer(0) is None
    assert (c.for_layer(2).key_bits, c.for_layer(2).value_bits) == (8, 8)
    assert (c.for_layer(3).key_bits, c.for_layer(3).value_bits) == (3, 2)
    assert c.for_layer(1).settings() == c.settings()
    assert KVConfig.from_json(c.to_json()) == c


def test_default_recipe_is_k4v3_and_given_key_bits_carry_to_values():
    c = KVConfig()
    assert (c.key_method, c.key_bits, c.value_method, c.value_bits) == ("turboquant-mse", 4, "turboquant-mse", 3)
    assert KVConfig(key_method="mse").value_bits == 3
    assert KVConfig(value_method="turboquant-mse").value_bits == 3
    # Bits given for the keys go to the values too; so do other methods' defaults.
    assert (KVConfig(key_bits=4).value_bits, KVConfig(key_bits=8).value_bits) == (4, 8)
    assert (KVConfig(key_method="kivi").key_bits, KVConfig(key_method="kivi").value_bits) == (4, 4)
    assert KVConfig(key_method="kivi", value_method="turboquant-mse").value_bits == 4
    assert KVConfig(value_bits=2).key_bits == 4
    assert KVConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("methods", [{}, {"key_method": "kivi"}, {"value_method": "kivi"}, {"key_method": "affine", "value_method": "affine"}])
@pytest.mark.parametrize("key_bits", [None, 2, 8])
def test_kvconfig_and_layer_cache_take_the_same_value_bits(methods, key_bits):
    # One rule (the crate's default_value_bits) for both entry points.
    bits = {} if key_bits is None else {"key_bits": key_bits}
    c = KVConfig(**methods, **bits)
    layer = LayerCache(64, 2, **methods, **bits)
    assert (layer.config["key_bits"], layer.config["value_bits"]) == (c.key_bits, c.value_bits)


def test_key_only_methods_pair_with_turboquant_values():
    c = KVConfig(key_method="qjl", key_bits=1)
    assert (c.value_method, c.value_bits) == ("turboquant-mse", 4)
    c = KVConfig(key_method="turboquant-prod", key_bits=3, value_bits=2)
    assert (c.value_method, c.value_bits) == ("turboquant-mse", 2)
    c = KVConfig(key_method="qjl", key_bits=2, value_method="kivi")
    assert (c.value_method, c.value_bits) == ("kivi", 2)


def test_method_aliases_become_the_crates_names():
    # "prod" is keys-only under its alias too: its values take TurboQuant-MSE.
    c = KVConfig(key_method="prod", key_bits=3, value_bits=2)
    assert (c.key_method, c.value_method) == ("turboquant-prod", "turboquant-mse")
    c = KVConfig(key_method="mse", value_method="rvq", key_bits=4, value_bits=3).check()
    assert (c.key_method, c.value_method) == ("turboquant-mse", "turboquant-rvq")
    assert KVConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"key_bits": 0}, "key_bits"),
        ({"value_bits": 2.5}, "value_bits"),
        ({"window": -1}, "window"),
        ({"sinks": True}, "sinks"),
        ({"policy": "fast"}, "policy"),
        ({"key_method": ""}, "key_method"),
        ({"key_method": "bogus"}, "key_method: unknown method 'bogus'"),
        ({"value_method": "zip"}, "value_method: unknown method 'zip'"),
        ({"layers": {"0": None}}, "layers"),
        ({"layers": {1: {"bitz": 3}}}, "unknown fields"),
    ],
)
def test_config_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        KVConfig(**kwargs)


# --- dispatch -----------------------------------------------------------------


def test_dispatch_is_idempotent_and_reaches_imported_modules():
    import mlx_lm.models.llama as llama

    attention.install()
    first = base.scaled_dot_product_attention
    attention.install()
    assert base.scaled_dot_product_attention is first
    assert llama.scaled_dot_product_attention is first
    assert attention.installed()


def test_dispatch_leaves_other_caches_alone():
    attention.install()
    q, k, v = (mx.random.normal((1, 2, 5, 8)) for _ in range(3))
    got = base.scaled_dot_product_attention(q, k, v, cache=KVCache(), scale=0.3, mask="causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    assert mx.allclose(got, want).item()


def test_model_bypassing_the_dispatch_is_refused():
    mod = types.ModuleType("fake_bypass_model")
    sys.modules[mod.__name__] = mod

    class Model:
        layers = [object()]

        def named_modules(self):
            return []

    Model.__module__ = mod.__name__
    with pytest.raises(ValueError, match="does not call mlx_lm.models.base.scaled_dot_product_attention"):
        attention.check_model(Model())


# --- with the model -----------------------------------------------------------


def _prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)


def test_mlx_quantized_cache_from_first_token(smollm):
    model, _ = smollm
    caches = make_mlx_quantized_cache(model, bits=8)
    assert all(type(c) is QuantizedKVCache and c.bits == 8 for c in caches)
    with pytest.raises(ValueError, match="bits"):
        make_mlx_quantized_cache(model, bits=7)


def test_install_and_uninstall(smollm):
    model, _ = smollm
    install(model, kind="mlx-quantized", bits=4)
    assert all(isinstance(c, QuantizedKVCache) for c in mlx_lm.models.cache.make_prompt_cache(model))
    uninstall(model)
    assert all(type(c) is KVCache for c in mlx_lm.models.cache.make_prompt_cache(model))
    with pytest.raises(ValueError, match="kind"):
        install(model, kind="fp8")


def test_hybrid_models_keep_their_other_caches(smollm):
    model, _ = smollm
    orig = model.make_cache
    try:
        object.__setattr__(model, "make_cache", lambda: [RotatingKVCache(16)] + [KVCache() for _ in model.layers[1:]])
        caches = make_prompt_cache(model, KVConfig(layers={1: None}))
        assert type(caches[0]) is RotatingKVCache and type(caches[1]) is KVCache
        assert all(isinstance(c, VeloxQuantCache) for c in caches[2:])
        object.__setattr__(model, "make_cache", lambda: [RotatingKVCache(16) for _ in model.layers])
        with pytest.raises(ValueError, match="no layer of this model has a plain KVCache"):
            make_prompt_cache(model)
    finally:
        model.__dict__.pop("make_cache", None)
    assert model.make_cache == orig


def test_fp16_method_generates_like_mlx_lm(smollm):
    model, tok = smollm
    prompt = _prompt(tok)
    want = mlx_lm.generate(model, tok, prompt, max_tokens=6)
    install(model, KVConfig(key_method="fp16", window=0, sinks=0))
    try:
        got = mlx_lm.generate(model, tok, prompt, max_tokens=6)
        assert isinstance(mlx_lm.models.cache.make_prompt_cache(model)[0], VeloxQuantCache)
    finally:
        uninstall(model)
    assert got == want


@pytest.fixture
def filled(smollm):
    model, tok = smollm
    caches = make_prompt_cache(model, KVConfig(key_bits=4, window=8, sinks=2))
    ids = mx.array(_prompt(tok))[None]
    model(ids, cache=caches)
    return model, caches, ids


def _next_logits(model, caches, token=28):
    return model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)


def test_compressed_cache_is_smaller():
    c = VeloxQuantCache(KVConfig(key_bits=4, value_bits=3, window=1, sinks=0))
    k = mx.random.normal((1, 3, 512, 64)).astype(mx.float16)
    out_k, out_v = c.update_and_fetch(k, k)
    assert c.offset == 512 and out_k.shape == k.shape
    # about 3.5 bits per element plus norms, against 16
    assert 3.5 <= 8 * c.nbytes / (2 * k.size) < 4.0
    assert mx.abs(out_k - k).mean().item() < 0.2


@pytest.mark.parametrize("tokens", [1, 77, 300, 1000])
def test_a_short_or_long_context_holds_no_more_than_float16(tokens):
    # SmolLM2-135M's layer shape; mlx_lm's float16 KVCache as the reference.
    c, fp16 = VeloxQuantCache(KVConfig()), KVCache()
    k = mx.random.normal((1, 3, tokens, 64), key=mx.random.key(tokens)).astype(mx.float16)
    c.update_and_fetch(k, k)
    fp16.update_and_fetch(k, k)
    assert c.nbytes <= fp16.nbytes, (c.nbytes, fp16.nbytes)
    # Decoding on: still no more than float16 (mlx_lm grows it by 256 tokens).
    for i in range(40):
        t = k[:, :, :1] + i
        c._attended = True
        c.update_and_fetch(t, t)
        fp16.update_and_fetch(t, t)
        assert c.nbytes <= fp16.nbytes, (tokens + i + 1, c.nbytes, fp16.nbytes)


def test_cache_nbytes_counts_the_shared_rotation_and_codebooks_once():
    caches = [VeloxQuantCache(KVConfig(key_bits=4, window=8, sinks=2)) for _ in range(3)]
    plain = KVCache()
    k = mx.random.normal((1, 2, 40, 64), key=mx.random.key(7)).astype(mx.float16)
    for c in caches:
        c.update_and_fetch(k, k)
    plain.update_and_fetch(k, k)
    (shared_id,) = {c.layer.shared_id for c in caches}
    assert shared_id is not None and caches[0].layer.shared_nbytes > 0
    own = sum(c.nbytes for c in caches) + plain.nbytes
    assert cache_nbytes(caches + [plain, VeloxQuantCache()]) == own + caches[0].layer.shared_nbytes


def test_compressed_attention_is_close(filled, smollm):
    model, caches, ids = filled
    ref = mlx_lm.models.cache.make_prompt_cache(model)
    model(ids, cache=ref)
    a, b = _next_logits(model, caches), _next_logits(model, ref)
    # 4-bit keys and values keep the next token among the float16 cache's top 5
    assert b.argmax().item() in mx.argsort(-a)[:5].tolist()
    assert caches[0].offset == ids.shape[1] + 1 and not caches[0].empty()


def test_deepcopy_is_independent(filled):
    model, caches, ids = filled
    twin = copy.deepcopy(caches)
    # The copy holds the same tokens, in stores sized for them (no more
    # than the original, which grew while they came).
    assert [c.offset for c in twin] == [c.offset for c in caches]
    assert all(0 < a.nbytes <= b.nbytes for a, b in zip(twin, caches))
    a = _next_logits(model, caches)
    assert twin[0].offset == ids.shape[1]  # the copy did not see the new token
    b = _next_logits(model, twin)
    assert mx.allclose(a, b, atol=1e-3).item()


def test_save_and_load_prompt_cache_compressed(filled, tmp_path):
    model, caches, ids = filled
    f = str(tmp_path / "cache.safetensors")
    save_prompt_cache(f, caches, {"note": "x"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta["note"] == "x"
    assert all(type(c) is VeloxQuantCache for c in loaded)
    assert [c.offset for c in loaded] == [c.offset for c in caches]
    assert loaded[3].config == caches[3].config
    # what is saved is the compressed state, not float16 keys and values
    import os

    assert os.path.getsize(f) < sum(c.nbytes + c.layer.shared_nbytes for c in caches) + 256 * 1024
    a, b = _next_logits(model, caches), _next_logits(model, loaded)
    assert mx.allclose(a, b, atol=1e-3).item()


def test_trim(filled):
    model, caches, ids = filled
    n = ids.shape[1]
    assert caches[0].is_trimmable()
    assert mlx_lm.models.cache.trim_prompt_cache(caches, 5) == 5
    assert all(c.offset == n - 5 for c in caches)
    assert caches[0].make_mask(3) == "causal" and caches[0].make_mask(1) is None


@pytest.mark.parametrize(
    "state, error, message",
    [
        ({"config": "[1]"}, ValueError, r"^VeloxQuantCache.state: the config or layout is not valid: KVConfig JSON must be an object"),
        ({"config": "3"}, ValueError, r"KVConfig JSON must be an object of settings, got int"),
        ({"config": '{"foo": 1}'}, ValueError, r"KVConfig JSON has unknown fields \['foo'\]; known: \['key_method'"),
        ({"config": '{"layers": [1]}'}, ValueError, r"KVConfig JSON: layers must map layer indices to overrides"),
        ({"config": '{"layers": {"x": null}}'}, ValueError, r"KVConfig JSON: layers must map layer indices to overrides"),
        ({"config": '{"key_bits": "4"}'}, ValueError, r"KVConfig.key_bits must be an integer from 1 to 16, got '4'"),
        ({"config": "{}", "layout": "[1]"}, ValueError, r"the layout must be a JSON object of strings, got \[1\]"),
        ({"config": "{}", "layout": '{"format": 1}'}, ValueError, r"the layout must be a JSON object of strings"),
        ({"config": "{}", "layout": "{}", "arrays": [1]}, TypeError, r"^VeloxQuantCache.state: 'arrays' must be a dict of mlx.core.array, got list"),
        ({"config": "{}", "layout": '{"version": "2"}'}, ValueError, r"^state: no format field"),
    ],
)
def test_a_bad_state_names_what_is_wrong(state, error, message):
    c = VeloxQuantCache()
    with pytest.raises(error, match=message):
        c.state = state


def test_trim_takes_a_whole_number_of_tokens():
    c = VeloxQuantCache(KVConfig(window=8, sinks=2))
    k = mx.zeros((1, 2, 20, 64), dtype=mx.float16)
    c.update_and_fetch(k, k)
    with pytest.raises(TypeError, match=r"^n: expected an int, got float"):
        c.trim(1.5)
    with pytest.raises(ValueError, match=r"^n: -1 is out of range"):
        c.trim(-1)
    assert c.offset == 20 and c.trim(5) == 5 and c.offset == 15


def test_cache_errors():
    with pytest.raises(TypeError, match="KVConfig"):
        VeloxQuantCache({"key_bits": 4})
    c = VeloxQuantCache()
    assert c.empty() and c.offset == 0 and c.nbytes == 0
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        c.update_and_fetch(mx.zeros((2, 3, 4)), mx.zeros((2, 3, 4)))
    with pytest.raises(RuntimeError, match="before any keys"):
        c.attention(mx.zeros((1, 1, 1, 64)), 1.0)


# --- prefill, decode and state --------------------------------------------------


def _chunks(shapes, seed=0):
    mx.random.seed(seed)
    for t in shapes:
        k, v = (mx.random.normal((1, 2, t, 64)).astype(mx.float16) for _ in range(2))
        yield k, v, mx.random.normal((1, 4, t, 64)).astype(mx.float16)


@pytest.mark.parametrize("method", ["turboquant-mse", "kivi", "fp16"])
def test_prefill_chunk_attends_its_own_tokens_exactly_and_the_history_as_stored(method):
    cache = VeloxQuantCache(KVConfig(key_method=method, key_bits=4, value_bits=3, window=16, sinks=2))
    for keys, values, q in _chunks([40, 30, 24]):
        # What the cache reconstructs of the history, then the chunk as given.
        held = cache.layer.dequantize() if cache.offset else None
        got_k, got_v = cache.update_and_fetch(keys, values)
        assert got_k is keys and got_v is values  # the protocol's return: the chunk, never read
        got = cache.attention(q, 0.125, "causal")
        k_all, v_all = (keys, values) if held is None else (mx.concatenate([h, x], axis=2) for h, x in zip(held, (keys, values)))
        want = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=0.125, mask="causal")
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 1e-2
    assert cache.offset == 94


def test_a_model_that_skips_the_dispatch_is_stopped_at_its_next_call():
    cache = VeloxQuantCache(KVConfig(window=16, sinks=2))
    (keys, values, q), (k1, v1, _) = _chunks([20, 1])
    cache.update_and_fetch(keys, values)
    with pytest.raises(RuntimeError, match="bypassed"):
        cache.update_and_fetch(k1, v1)


def test_state_is_lazy_arrays_and_round_trips_through_mlx_lm_files(tmp_path):
    cache = VeloxQuantCache(KVConfig(key_bits=4, value_bits=3, window=16, sinks=2))
    for keys, values, q in _chunks([40, 1]):
        cache.update_and_fetch(keys, values)
        cache.attention(q, 0.125, "causal")
    state = cache.state
    arrays = state["arrays"]
    # Only the used slots: 40 + 1 tokens, 2 sinks and 16 recent in float16.
    assert arrays["k_codes"].shape[2] + arrays["win_k"].shape[2] == 41
    assert all(isinstance(a, mx.array) for a in arrays.values())
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    assert loaded.offset == cache.offset and loaded.config == cache.config
    assert mx.array_equal(loaded.attention(q, 0.125), cache.attention(q, 0.125)).item()
    with pytest.raises(ValueError, match="config"):
        VeloxQuantCache.from_state((mx.zeros((3,), mx.uint8), "{}"))


def test_state_config_follows_a_reassigned_config():
    # The state's config JSON is kept between reads; a new config (protect="auto"
    # decides one from the first queries) must show in the next state.
    cache = VeloxQuantCache(KVConfig(key_bits=4, value_bits=3, window=16, sinks=2))
    for keys, values, q in _chunks([40]):
        cache.update_and_fetch(keys, values)
        cache.attention(q, 0.125, "causal")
    assert cache.state["config"] == cache.config.to_json()
    other = dataclasses.replace(cache.config, seed=7)
    cache.config = other
    assert KVConfig.from_json(cache.state["config"]) == other


# --- defect 2: a prompt-cache file with flipped bits or cut short is refused ----


def _saved_prompt_cache(tmp_path):
    cache = VeloxQuantCache(KVConfig(key_bits=4, value_bits=3, window=16, sinks=2))
    for keys, values, q in _chunks([60, 1]):
        cache.update_and_fetch(keys, values)
        cache.attention(q, 0.125, "causal")
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(str(path), [cache], {"note": "x"})
    return cache, path, path.read_bytes()


def _tensor_spans(data):
    """Name -> (start, end) of each tensor's bytes in a safetensors file."""
    import json
    import struct

    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}


def test_state_has_checksums_only_when_saved(tmp_path):
    cache, path, data = _saved_prompt_cache(tmp_path)
    # mlx_lm evaluates `state` after every prefill chunk: no checksum (no bytes read) there.
    assert set(cache.state) == {"config", "layout", "arrays"}
    # What save_prompt_cache wrote carries one for the config, the layout and each array.
    spans = _tensor_spans(data)
    assert "0.crc32" in spans
    import json

    sums = json.loads(cache.checksummed_state()["crc32"])
    assert set(sums) == {"config", "layout"} | {f"arrays.{k}" for k in cache.state["arrays"]}
    (loaded,) = load_prompt_cache(str(path))
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    assert mx.array_equal(loaded.attention(q, 0.125), cache.attention(q, 0.125)).item()
    # An in-memory state is checked too, and entries it does not know are refused.
    state = cache.checksummed_state()
    VeloxQuantCache.from_state(state)
    state["arrays"] = dict(state["arrays"], k_norms=state["arrays"]["k_norms"] * 2)
    with pytest.raises(CorruptStateError, match="'arrays.k_norms' does not match its CRC-32"):
        VeloxQuantCache.from_state(state)
    with pytest.raises(CorruptStateError, match="unknown entries"):
        VeloxQuantCache.from_state(dict(cache.state, crc33="{}"))


def test_prompt_cache_file_with_flipped_bits_is_refused(tmp_path):
    import random

    cache, path, data = _saved_prompt_cache(tmp_path)
    spans = _tensor_spans(data)
    bad = tmp_path / "bad.safetensors"
    rng = random.Random(0)
    for name, (start, end) in sorted(spans.items()):
        # veloxquant's arrays, and the low byte of a character of the config,
        # layout and checksum strings (mlx_lm saves each as int32 codes).
        step = 4 if name in ("0.config", "0.layout", "0.crc32") else 1
        for pos in sorted({start, (start + end) // 2 // step * step, end - step}) + [
            rng.randrange(start, end, step) for _ in range(8)
        ]:
            b = bytearray(data)
            b[pos] ^= 1 << rng.randrange(7)
            bad.write_bytes(bytes(b))
            # The error names the file and the entry (any, when the checksums themselves changed).
            entry = "" if name == "0.crc32" else f".*'{name[2:]}'"
            with pytest.raises(CorruptStateError, match=f"file {bad}{entry}"):
                load_prompt_cache(str(bad))
    # Any other bit of the file: refused too (by mx.load, mlx_lm or the checksums), never loaded.
    for _ in range(100):
        b = bytearray(data)
        b[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        bad.write_bytes(bytes(b))
        with pytest.raises(Exception):
            load_prompt_cache(str(bad))


def test_prompt_cache_file_cut_short_is_refused(tmp_path, capsys):
    from veloxquant.tools import cli

    cache, path, data = _saved_prompt_cache(tmp_path)
    bad = tmp_path / "bad.safetensors"
    ends = sorted(end for _, end in _tensor_spans(data).values())
    for cut in [20, 100, ends[0] - 1, ends[len(ends) // 2], len(data) - 1]:
        bad.write_bytes(data[:cut])
        with pytest.raises(RuntimeError, match="incomplete download or corrupt file"):
            load_prompt_cache(str(bad))
        with pytest.raises(SystemExit) as e:
            cli.load_prompt_cache_file(str(bad))
        assert e.value.code == 2
        assert f"--prompt-cache-file: {bad} is cut short or corrupt" in capsys.readouterr().err
    b = bytearray(data)
    start, end = _tensor_spans(data)["0.arrays.k_codes"]
    b[start + 5] ^= 4
    bad.write_bytes(bytes(b))
    with pytest.raises(SystemExit):
        cli.load_prompt_cache_file(str(bad))
    err = capsys.readouterr().err
    assert f"--prompt-cache-file: {bad} is corrupt" in err and "'arrays.k_codes' does not match" in err


def test_concat_joins_equal_length_batches_as_one_cache():
    # Two groups of prompts of one length, prefilled apart, then decoded as one batch:
    # every row attends and appends as it does in its own group.
    cfg = KVConfig(key_bits=4, value_bits=3, window=16, sinks=2)
    parts = [VeloxQuantCache(cfg), VeloxQuantCache(cfg)]
    mx.random.seed(3)
    for b, c in zip((1, 2), parts):
        for t in (40, 30):
            k, v = (mx.random.normal((b, 2, t, 64)).astype(mx.float16) for _ in range(2))
            c.update_and_fetch(k, v)
            c.attention(mx.random.normal((b, 4, t, 64)).astype(mx.float16), 0.125, "causal")
    whole = VeloxQuantCache.concat(parts)
    # The parts' tokens, without the capacity they held ahead.
    assert whole.offset == 70 and whole.layer.nbytes <= sum(c.layer.nbytes for c in parts)
    for got, *want in zip(whole.layer.dequantize(), *(c.layer.dequantize() for c in parts)):
        # The same codes; the decode's products may round differently at another batch size.
        assert mx.allclose(got, mx.concatenate(want, axis=0), rtol=1e-3, atol=1e-3).item()
    k, v, q = (mx.random.normal((3, h, 1, 64)).astype(mx.float16) for h in (2, 2, 4))
    whole.update_and_fetch(k, v)
    out = whole.attention(q, 0.125)
    want = []
    for c, (lo, hi) in zip(parts, ((0, 1), (1, 3))):
        c.update_and_fetch(k[lo:hi], v[lo:hi])
        want.append(c.attention(q[lo:hi], 0.125))
    assert mx.abs(out.astype(mx.float32) - mx.concatenate(want, axis=0).astype(mx.float32)).max().item() < 1e-3
    # Different lengths or configs are refused, naming what differs.
    short = VeloxQuantCache(cfg)
    short.update_and_fetch(*(mx.zeros((1, 2, 20, 64), dtype=mx.float16),) * 2)
    short.attention(mx.zeros((1, 4, 20, 64), dtype=mx.float16), 0.125, "causal")
    with pytest.raises(ValueError, match="differs from cache 0 in .*compressed"):
        VeloxQuantCache.concat([parts[0], short])
    with pytest.raises(ValueError, match="must hold tokens"):
        VeloxQuantCache.concat([parts[0], VeloxQuantCache(cfg)])
    with pytest.raises(TypeError, match="non-empty list"):
        VeloxQuantCache.concat([])


def test_fp8_stores_a_byte_an_element_and_a_scale_a_token():
    """``fp8`` (float8 e4m3 codes, a float16 scale per token): the error of
    e4m3's 3 mantissa bits, between 8- and 4-bit affine codes, in a byte an
    element, and the fused attention of the codes."""
    mx.random.seed(2)
    b, hkv, hq, t, d = 1, 2, 8, 300, 128
    k, v = (mx.random.normal((b, hkv, t, d)).astype(mx.float16) for _ in range(2))
    q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
    scale = d**-0.5

    def rel(a, r):
        return (mx.linalg.norm((a - r).astype(mx.float32)) / mx.linalg.norm(r.astype(mx.float32))).item()

    def cache(method, bits, n=t):
        c = VeloxQuantCache(KVConfig(key_method=method, value_method=method, key_bits=bits, value_bits=bits, window=16, sinks=0))
        c.update_and_fetch(k[:, :, :n], v[:, :, :n])
        c.attention(mx.zeros((b, hq, n, d), mx.float16), scale, "causal")
        return c

    c = cache("fp8", 8)
    kd, vd = c.layer.dequantize()
    # e4m3 rounds to 3 mantissa bits: about 2.5% RMS on Gaussian tokens (the
    # last 16, the float16 window, left out).
    fp8_err = rel(kd[:, :, :-16], k[:, :, :-16])
    assert 0.01 < fp8_err < 0.035 and 0.01 < rel(vd[:, :, :-16], v[:, :, :-16]) < 0.035
    affine = {bits: rel(cache("affine", bits).layer.dequantize()[0][:, :, :-16], k[:, :, :-16]) for bits in (8, 4)}
    assert affine[8] < fp8_err < 0.5 * affine[4]
    decoded = mx.fast.scaled_dot_product_attention(q, kd.astype(mx.float16), vd.astype(mx.float16), scale=scale)
    assert rel(c.attention(q, scale), decoded) < 2e-3
    # 32 more compressed tokens hold 32 * (D codes + a float16 scale) bytes a head and side.
    held = [cache("fp8", 8, n).layer.data_nbytes for n in (t - 32, t)]
    assert held[1] - held[0] == 32 * hkv * 2 * (d + 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_method_stores_what_mlx_lm_quantized_cache_does(bits):
    """``affine`` keeps mlx_lm's QuantizedKVCache layout (per token, a float16
    scale and zero per 64 channels) inside veloxquant's cache: as many bytes
    per token, about its error, and the fused attention of the codes."""
    mx.random.seed(1)
    b, hkv, hq, t, d = 1, 2, 8, 300, 128
    k, v = (mx.random.normal((b, hkv, t, d)).astype(mx.float16) for _ in range(2))
    q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
    scale = d**-0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    def rel(a, r):
        return (mx.linalg.norm((a - r).astype(mx.float32)) / mx.linalg.norm(r.astype(mx.float32))).item()

    c = VeloxQuantCache(KVConfig(key_method="affine", value_method="affine", key_bits=bits, value_bits=bits, window=16, sinks=0))
    c.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    c.attention(mx.zeros((b, hq, t - 1, d), mx.float16), scale, "causal")
    c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    fused = c.attention(q, scale)
    kd, vd = c.layer.dequantize()
    decoded = mx.fast.scaled_dot_product_attention(q, kd.astype(mx.float16), vd.astype(mx.float16), scale=scale)
    assert rel(fused, decoded) < 2e-3

    theirs = QuantizedKVCache(group_size=64, bits=bits)
    kq, vq = theirs.update_and_fetch(k, v)
    mlx_err = rel(
        mx.fast.scaled_dot_product_attention(
            q, mx.dequantize(*kq, group_size=64, bits=bits), mx.dequantize(*vq, group_size=64, bits=bits), scale=scale
        ),
        ref,
    )
    assert rel(fused, ref) < 1.5 * mlx_err
    # Bytes per compressed token and head: codes, then a scale and a zero per group.
    per_token = sum(a.nbytes for a in (*kq, *vq)) // (hkv * t)
    assert per_token == 2 * (d * bits // 8 + 2 * 2 * d // 64)
    # Two prompts 32 tokens apart: the longer holds 32 more compressed tokens.
    held = []
    for n in (t, t + 32):
        kn, vn = (mx.random.normal((b, hkv, n, d)).astype(mx.float16) for _ in range(2))
        c = VeloxQuantCache(KVConfig(key_method="affine", value_method="affine", key_bits=bits, value_bits=bits))
        c.update_and_fetch(kn, vn)
        c.attention(mx.zeros((b, hq, n, d), mx.float16), scale, "causal")
        held.append(c.layer.data_nbytes)
    assert held[1] - held[0] == 32 * hkv * per_token
