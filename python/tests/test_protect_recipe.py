"""Protected layers (KVConfig.protect, --kv-protect) and measured recipes (KVConfig.auto, --kv-recipe auto)."""

import argparse

import mlx.core as mx
import pytest
from mlx_lm.generate import generate
from mlx_lm.models.cache import KVCache

from veloxquant import recipe

from veloxquant.tools import cli
from veloxquant.cache import (
    AUTO_PROTECT_ERROR,
    KVConfig,
    VeloxQuantCache,
    cache_data_nbytes,
    install,
    make_prompt_cache,
    uninstall,
)


@pytest.fixture
def hard_layer(tiny):
    """Layer 1's keys scaled up: its attention is sharp, and compressing its keys costs far more."""
    model = tiny[0]
    proj = model.model.layers[1].self_attn.k_proj
    original = proj.weight
    proj.weight = original * 100
    yield 1
    proj.weight = original


def _forward(model, ids, cache):
    mx.eval(model(mx.array(ids)[None], cache=cache))


# --- protect ---------------------------------------------------------------------


@pytest.mark.parametrize("protect", [(-1,), (1,), (-2,)])
def test_protected_layers_keep_float16(tiny, protect):
    model, _, ids = tiny
    caches = make_prompt_cache(model, KVConfig(protect=protect, window=4, sinks=0))
    kept = {p % 2 for p in protect}
    for i, c in enumerate(caches):
        assert (type(c) is KVCache) == (i in kept)
    _forward(model, ids[:40], caches)
    for i, c in enumerate(caches):
        if i not in kept:
            assert c.layer.compressed_tokens > 0


def test_protect_bits_give_those_layers_more_bits(tiny):
    model, _, ids = tiny
    caches = make_prompt_cache(model, KVConfig(key_bits=2, protect=[-2], protect_bits=8, window=4, sinks=0))
    assert all(isinstance(c, VeloxQuantCache) for c in caches)
    assert (caches[0].config.key_bits, caches[0].config.value_bits) == (8, 8)
    assert (caches[1].config.key_bits, caches[1].config.value_bits) == (2, 2)
    _forward(model, ids[:40], caches)
    assert caches[0].nbytes > caches[1].nbytes


def test_protect_round_trips_through_json():
    for c in (KVConfig(protect=[0, -1], protect_bits=8), KVConfig(protect="auto")):
        assert KVConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"protect": [0, 0]}, r"protect lists layer 0 more than once"),
        ({"protect": "some"}, r"protect must be 'auto' or a list"),
        ({"protect": [0.5]}, r"protect must be 'auto' or a list"),
        ({"protect": [True]}, r"protect must be 'auto' or a list"),
        ({"protect_bits": 8}, r"protect_bits needs KVConfig.protect"),
        ({"protect": [0], "protect_bits": 0}, r"protect_bits must be an integer from 1 to 16"),
        ({"protect": "auto", "protect_bits": 8}, r"protect_bits applies to listed layers"),
    ],
)
def test_bad_protect_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"protect": [2]}, r"protect: layer 2 is out of range for a model of 2 layers \(indices -2 to 1\)"),
        ({"protect": [-3]}, r"protect: layer -3 is out of range"),
        ({"protect": [0, -2]}, r"protect: layers 0 and -2 are the same layer"),
        ({"protect": [1], "layers": {1: {"key_bits": 8}}}, r"protect: layer 1 also has KVConfig.layers settings"),
    ],
)
def test_protect_out_of_range_or_ambiguous_for_the_model(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_prompt_cache(tiny[0], KVConfig(**kwargs))


def test_protect_bits_the_method_lacks_are_named():
    with pytest.raises(ValueError, match=r"protect_bits 5: .*5 is not supported by kivi"):
        KVConfig(key_method="kivi", protect=[0], protect_bits=5).check()


def test_auto_protects_the_outlying_layer_only(tiny, hard_layer):
    model, _, ids = tiny
    caches = make_prompt_cache(model, KVConfig(key_bits=3, protect="auto", window=4, sinks=0))
    _forward(model, ids, caches)
    errors = [c.outlier_error for c in caches]
    assert errors[hard_layer] > AUTO_PROTECT_ERROR > 10 * errors[1 - hard_layer], errors
    assert [c.protected for c in caches] == [i == hard_layer for i in range(2)]
    # The protected layer holds float16, the other compresses, and both read on.
    assert caches[hard_layer].config.key_method == "fp16" and caches[hard_layer].layer.compressed_tokens == 0
    assert caches[1 - hard_layer].layer.compressed_tokens > 0
    _forward(model, ids[:1], caches)
    assert caches[0].offset == len(ids) + 1


def test_auto_protects_nothing_in_an_ordinary_model(tiny):
    model, _, ids = tiny
    caches = make_prompt_cache(model, KVConfig(protect="auto", window=4, sinks=0))
    _forward(model, ids, caches)
    assert not any(c.protected for c in caches)


# --- automatic recipe --------------------------------------------------------------


def _elements(model, n):
    # Keys and values of every layer at n tokens: 1 KV head of 64 in the tiny model.
    return 2 * 64 * n * len(model.model.layers)


@pytest.mark.parametrize("budget, window, sinks", [(8.0, 4, 0), (9.0, 16, 4), (10.0, 16, 4), (8.5, 4, 2)])
def test_auto_at_a_context_stays_within_the_budget_the_evaluation_measures(tiny, budget, window, sinks):
    # Two layers of one 64-wide head at 200 tokens: the shared rotation (its
    # float32 matrix, and the float16 ones into and out of the frame) and
    # codebooks (~33 KB a set) cost about 5 bits per element here.
    model, _, ids = tiny
    cfg, r = recipe.auto_recipe(model, ids, budget, KVConfig(window=window, sinks=sinks), context=len(ids))
    caches = make_prompt_cache(model, cfg)
    _forward(model, ids, caches)
    measured = 8 * cache_data_nbytes(caches) / _elements(model, len(ids))
    assert measured <= budget + 1e-9
    assert measured == pytest.approx(r.bits_per_element, rel=1e-9)
    assert budget - measured < 1.5  # spends it


@pytest.mark.parametrize("budget", [2.6, 2.75, 3.0, 3.25, 3.5])
def test_allocation_counts_each_shared_set_once_across_many_layers(budget):
    # Thirty layers whose errors favour different pairs: the recipe's total,
    # shared tables included, is what its pairs cost counted afresh.
    import random

    rng = random.Random(0)
    errors = [
        recipe.LayerErrors(
            i, 3, 64,
            {c: (0.0 if c == recipe.FP16 else rng.uniform(0.5, 2) * 4.0 ** -c.bits) for c in recipe.key_candidates()},
            {c: (0.0 if c == recipe.FP16 else rng.uniform(0.5, 2) * 4.0 ** -c.bits) for c in recipe.value_candidates()},
        )
        for i in range(30)
    ]
    layout = recipe.Layout(window=16, sinks=4, seed=0, context=1024)
    r = recipe.allocate(errors, budget, layout)
    elements = 30 * 2 * 3 * 64 * 1024
    total = sum(layout.pair_bits(64, *p) for p in r.choices.values()) / 30
    total += sum(layout.shared_bits(64, *p, elements) for p in set(r.choices.values()))
    assert r.bits_per_element == pytest.approx(total) and total <= budget + 1e-9


def _random_errors(layers, seed):
    import random

    rng = random.Random(seed)
    return [
        recipe.LayerErrors(
            i, 1, 64,
            {c: (0.0 if c == recipe.FP16 else rng.uniform(0.3, 3) * 4.0 ** -c.bits) for c in recipe.key_candidates()},
            {c: (0.0 if c == recipe.FP16 else rng.uniform(0.3, 3) * 4.0 ** -c.bits) for c in recipe.value_candidates()},
        )
        for i in range(layers)
    ]


@pytest.mark.parametrize("budget", [3.0, 3.5, 4.0, 4.5])
def test_allocation_leaves_no_layer_a_pair_another_beats_on_error_and_bits(budget):
    # Without shared tables (no context) a layer's pair is never beaten on
    # both error and bits by another of its pairs: KIVI 3-bit keys (4 bits
    # with their scales) are cheaper than TurboQuant 4-bit ones (4.25 with
    # the norm), so which is better must decide.
    errors = _random_errors(12, 1)
    layout = recipe.Layout(window=16, sinks=4, seed=0)
    r = recipe.allocate(errors, budget, layout)
    for e in errors:
        k, v = r.choices[e.index]
        here = (e.keys[k] + e.values[v], layout.pair_bits(64, k, v))
        for k2 in e.keys:
            for v2 in e.values:
                err, b = e.keys[k2] + e.values[v2], layout.pair_bits(64, k2, v2)
                assert not (err < here[0] - 1e-12 and b <= here[1] + 1e-12), (e.index, (k, v), (k2, v2))
    assert r.bits_per_element <= budget + 1e-9


def test_allocation_is_near_the_exhaustive_optimum():
    # Three layers, every combination of their pairs: the allocation's total
    # error within 2% of the best recipe within the budget.
    import itertools

    errors = _random_errors(3, 2)
    layout = recipe.Layout(window=16, sinks=4, seed=0)
    pairs = [[(k, v) for k in e.keys for v in e.values] for e in errors]
    for budget in (2.8, 3.3, 3.9, 4.6):
        best = min(
            sum(e.keys[k] + e.values[v] for e, (k, v) in zip(errors, combo))
            for combo in itertools.product(*pairs)
            if sum(layout.pair_bits(64, *p) for p in combo) / 3 <= budget + 1e-9
        )
        r = recipe.allocate(errors, budget, layout)
        assert sum(r.error.values()) <= best * 1.02 + 1e-12, budget


def test_auto_recipe_names_a_config_that_is_not_one(tiny):
    model, _, ids = tiny
    with pytest.raises(TypeError, match="config must be a veloxquant.KVConfig, got dict"):
        recipe.auto_recipe(model, ids, 3.0, {"window": 4})


def test_auto_without_a_context_counts_what_each_compressed_token_stores(tiny):
    model, _, ids = tiny
    cfg, r = recipe.auto_recipe(model, ids, 3.0, KVConfig(window=4, sinks=0))
    assert r.bits_per_element <= 3.0 and r.context is None and "of compressed tokens" in r.summary()
    # Two long fills of the chosen caches differ by exactly the recipe's bits per element.
    sizes = []
    for n in (512, 1024):
        caches = make_prompt_cache(model, cfg)
        x = mx.random.normal((1, 1, n, 64)).astype(mx.float16)
        for c in caches:
            c.update_and_fetch(x, x)
        sizes.append(8 * cache_data_nbytes(caches))
    assert (sizes[1] - sizes[0]) / (_elements(model, 1024) - _elements(model, 512)) == pytest.approx(r.bits_per_element)


def test_layout_counts_the_float16_window_and_shared_tables():
    tq3 = recipe.Choice("turboquant-mse", 3)
    long = recipe.Layout(window=16, sinks=4, seed=0).pair_bits(64, tq3, tq3)
    assert long == pytest.approx((3 * 64 + 16) / 64)  # codes and a float16 norm per token and head
    short = recipe.Layout(window=16, sinks=4, seed=0, context=100)
    # 20 float16 tokens of 100 on top of the codes, and the key mean.
    assert short.pair_bits(64, tq3, tq3) == pytest.approx((80 * long + 20 * 16) / 100 + 32 / 2 / 100)
    assert short.shared_bits(64, tq3, tq3, elements=10**6) > 0
    assert recipe.Layout(16, 4, 0).shared_bits(64, tq3, tq3, elements=10**6) == 0
    with pytest.raises(ValueError, match=r"context must be a number of tokens >= 1 or None, got 0"):
        recipe.Layout(16, 4, 0, context=0)


def test_stand_in_codecs_match_the_cache():
    # Keys with channel offsets as real keys have; the cache's round trip against the stand-ins.
    mx.random.seed(1)
    offset = mx.random.normal((1, 2, 1, 64)) * 4
    keys = (mx.random.normal((1, 2, 101, 64)) + offset).astype(mx.float16)
    values = mx.random.normal((1, 2, 101, 64)).astype(mx.float16)
    codecs = recipe.Codecs(keys, values, sinks=4, seed=0)

    def rel(x, ref):  # over the 96 tokens after the sinks, which both compress
        d = (x[:, :, 4:100] - ref[:, :, 4:100]).astype(mx.float32)
        return (mx.sum(d * d) / mx.sum(ref[:, :, 4:100].astype(mx.float32) ** 2)).item()

    for m, b in [("turboquant-mse", 2), ("turboquant-mse", 3), ("turboquant-mse", 4), ("kivi", 2), ("kivi", 3)]:
        c = recipe.Choice(m, b)
        k, v = recipe._round_trip(keys, values, c, c if m == "turboquant-mse" else recipe.FP16, sinks=4, seed=0)
        assert rel(codecs.keys_as(c), keys) == pytest.approx(rel(k, keys), rel=0.15 if m == "turboquant-mse" else 1e-3), c
        if m == "turboquant-mse":
            assert rel(codecs.values_as(c), values) == pytest.approx(rel(v, values), rel=0.15), c
        assert (codecs.keys_as(c)[:, :, :4] == keys[:, :, :4].astype(mx.float32)).all()  # sinks exact


def test_stand_in_keys_centre_on_a_first_share_as_the_cache_on_its_first_append():
    # Keys drifting along the context: the cache keeps the mean of its first append
    # (here the first quarter), and TurboQuant's error grows with the drift from it.
    mx.random.seed(2)
    n = 128
    drift = mx.linspace(0, 6, n)[None, None, :, None] * mx.random.normal((1, 2, 1, 64))
    keys = (mx.random.normal((1, 2, n, 64)) + drift).astype(mx.float16)
    values = mx.random.normal((1, 2, n, 64)).astype(mx.float16)
    from veloxquant import LayerCache

    def rel(x):  # over the tokens after the sinks and before the one exact recent token
        ref = keys[:, :, 4 : n - 1].astype(mx.float32)
        d = x[:, :, 4 : n - 1].astype(mx.float32) - ref
        return (mx.sum(d * d) / mx.sum(ref * ref)).item()

    share = recipe.Codecs(keys, values, sinks=4, seed=0, mean_share=0.25)
    whole = recipe.Codecs(keys, values, sinks=4, seed=0)
    layer = LayerCache(64, 2, key_method="turboquant-mse", key_bits=3, value_method="fp16", value_bits=16,
                                 window=1, sinks=4, seed=0)
    layer.append(keys[:, :, : n // 4], values[:, :, : n // 4])
    layer.append(keys[:, :, n // 4 :], values[:, :, n // 4 :])
    cached = rel(layer.dequantize()[0])
    tq3 = recipe.Choice("turboquant-mse", 3)
    assert rel(share.keys_as(tq3)) == pytest.approx(cached, rel=0.15)
    assert rel(whole.keys_as(tq3)) < 0.7 * cached  # the mean of every token hides the drift
    # KIVI's per-group scales follow the drift: its error does not depend on the mean.
    kivi3 = recipe.Choice("kivi", 3)
    assert rel(share.keys_as(kivi3)) == pytest.approx(rel(whole.keys_as(kivi3)), rel=0.05)


def test_errors_weigh_a_layer_by_its_share_of_the_residual_stream(tiny):
    model, _, ids = tiny
    before = recipe.measure(recipe.calibrate(model, ids), sinks=0)
    proj = model.model.layers[0].self_attn.o_proj
    original = proj.weight
    proj.weight = original * 3
    try:
        samples = recipe.calibrate(model, ids)
        after = recipe.measure(samples, sinks=0)
    finally:
        proj.weight = original
    c = recipe.Choice("turboquant-mse", 2)
    # Layer 0's attention adds three times as much to the stream, and so does its error
    # (the relative error of the attention output itself is unchanged).
    assert after[0].keys[c] == pytest.approx(9 * before[0].keys[c], rel=0.05)
    assert samples[0].stream is not None and samples[0].out_proj is proj


def test_auto_gives_the_harder_layer_more_key_bits(tiny, hard_layer):
    model, _, ids = tiny
    cfg = KVConfig.auto(model, ids, bits_budget=3.5, window=4, sinks=0)
    layout = recipe.Layout(window=4, sinks=0, seed=0)
    key_bits = []
    for i in range(2):
        c = cfg.for_layer(i)
        key = recipe.FP16 if c is None or c.key_method == "fp16" else recipe.Choice(c.key_method, c.key_bits)
        key_bits.append(layout.pair_bits(64, key, recipe.FP16))
    assert key_bits[hard_layer] > key_bits[1 - hard_layer], cfg.layers


def test_auto_keeps_protected_layers(tiny):
    model, _, ids = tiny
    cfg, r = recipe.auto_recipe(model, ids, 10.0, KVConfig(protect=[-1], window=4, sinks=0))
    assert cfg.for_layer(1) is None and r.choices[1] == (recipe.FP16, recipe.FP16)
    assert r.bits_per_element <= 10.0


def test_greedy_generation_with_an_auto_recipe(tiny):
    model, tokenizer, ids = tiny
    cfg = KVConfig.auto(model, ids, bits_budget=3.0, window=4, sinks=0)
    install(model, cfg)
    try:
        text = generate(model, tokenizer, ids[:60], max_tokens=8)
    finally:
        uninstall(model)
    assert isinstance(text, str) and text


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, ids: KVConfig.auto(m, ids, bits_budget=2.0), r"bits_budget 2 is below the cheapest recipe's 2.250"),
        (lambda m, ids: KVConfig.auto(m, ids, bits_budget="3"), r"bits_budget must be a number"),
        (lambda m, ids: KVConfig.auto(m, ids[:1]), r"tokens: the calibration needs at least 2 tokens"),
        (lambda m, ids: KVConfig.auto(m, ids, protect="auto"), r"protect='auto' cannot be combined"),
        (lambda m, ids: KVConfig.auto(m, ids, protect=[5]), r"protect: layer 5 is out of range"),
    ],
)
def test_bad_auto_arguments_are_named(tiny, call, message):
    model, _, ids = tiny
    with pytest.raises(ValueError, match=message):
        call(model, ids)


# --- command line ------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(prog="t")
    cli.add_kv_options(p, with_kv_bits=True)
    args = p.parse_args(argv)
    cli.validate_kv_args(args)
    return args


def test_cli_options_make_the_config():
    args = _parse(["--kv-protect", "0,-1", "--kv-protect-bits", "8"])
    cfg = cli.kv_config_from_args(args)
    assert args.kv_cache == "veloxquant" and cfg.protect == (0, -1) and cfg.protect_bits == 8
    assert "protect 0,-1 at 8b" in cli.describe_kv(args)
    args = _parse(["--kv-recipe", "auto", "--kv-bits-budget", "3"])
    assert "recipe auto within 3 bits/el" in cli.describe_kv(args)
    assert cli.kv_config_from_args(_parse(["--kv-protect", "auto"])).protect == "auto"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-protect", "0,x"], "argument --kv-protect: expected 'auto' or comma-separated layer indices"),
        (["--kv-protect", "1,1"], "argument --kv-protect: layer 1 is listed more than once"),
        (["--kv-protect", ""], "argument --kv-protect: expected 'auto'"),
        (["--kv-bits-budget", "x", "--kv-recipe", "auto"], "argument --kv-bits-budget: expected bits per element"),
        (["--kv-bits-budget", "0.5", "--kv-recipe", "auto"], "argument --kv-bits-budget: expected bits per element"),
        (["--kv-recipe", "manual"], "argument --kv-recipe: invalid choice"),
        (["--kv-protect-bits", "8"], "--kv-protect-bits: needs --kv-protect"),
        (["--kv-protect", "auto", "--kv-protect-bits", "8"], "--kv-protect-bits: --kv-protect auto keeps"),
        (["--kv-protect", "0", "--kv-protect-bits", "0"], "--kv-protect-bits: KVConfig.protect_bits must be"),
        (["--kv-protect", "0", "--kv-protect-bits", "5", "--kv-method", "kivi"], "--kv-protect-bits: KVConfig.protect_bits 5"),
        (["--kv-bits-budget", "3"], "--kv-bits-budget: applies to --kv-recipe auto"),
        (["--kv-recipe", "auto", "--kv-protect", "auto"], "--kv-protect auto: --kv-recipe auto already"),
        (["--kv-cache", "fp16", "--kv-protect", "0"], "--kv-protect applies only to --kv-cache veloxquant"),
    ],
)
def test_cli_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    said = str(e.value.code) + capsys.readouterr().err
    assert message in said, said


def test_cli_protect_out_of_range_names_the_option(tiny):
    with pytest.raises(SystemExit, match=r"^--kv-protect: KVConfig.protect: layer 7 is out of range"):
        cli.install_kv_cache(tiny[0], _parse(["--kv-protect", "7"]))
    uninstall(tiny[0])


def test_calibration_tokens_pad_a_short_prompt(tiny):
    tokenizer = tiny[1]
    short = cli.calibration_tokens(tokenizer, [1, 2, 3])
    assert short[:3] == [1, 2, 3] and recipe.MIN_TOKENS <= len(short) <= recipe.MAX_TOKENS
    long = list(range(1000))
    assert cli.calibration_tokens(tokenizer, long) == long[: recipe.MAX_TOKENS]


def test_generate_prints_the_recipe_and_protected_layers(smollm):
    import subprocess
    import sys

    def run(*extra):
        r = subprocess.run(
            [sys.executable, "-m", "veloxquant", "generate", "--prompt", "Why is the sky blue?", "--max-tokens", "3", *extra],
            capture_output=True, text=True, timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = run("--kv-recipe", "auto", "--kv-bits-budget", "3")
    line = next(x for x in out.splitlines() if x.startswith("KV recipe (calibrated in "))
    bits = float(line.split("): ")[1].split(" bits/el")[0])
    assert bits <= 3.0 and "0" in line.split("bits/el of compressed tokens; ")[1]
    assert "(veloxquant recipe auto within 3 bits/el" in out
    out = run("--kv-protect", "0,-1", "--kv-protect-bits", "8")
    assert "protect 0,-1 at 8b" in out
    out = run("--kv-protect", "auto")
    assert "KV protect auto: float16 layers" in out


def test_eval_rows_of_one_side_go_by_its_bits():
    from veloxquant.tools.eval import default_specs

    bits = [(4, 4), (3, 3), (3, 2), (2, 2)]
    specs = default_specs(["kivi/fp16", "fp16/turboquant-mse", "kivi/turboquant-mse"], bits, 16, 4, [])
    labels = [s.label for s in specs]
    # 3/2 repeats 3 for float16 values, and 3 for float16 keys.
    assert labels[:4] == ["fp16", "kivi/fp16-4", "kivi/fp16-3", "kivi/fp16-2"]
    assert labels[4:7] == ["fp16/turboquant-mse-4", "fp16/turboquant-mse-3", "fp16/turboquant-mse-2"]
    assert labels[7:] == ["kivi/turboquant-mse-4", "kivi/turboquant-mse-3", "kivi/turboquant-mse-k3v2", "kivi/turboquant-mse-2"]
    assert all(s.value_bits == 16 and s.value_method == "fp16" for s in specs[1:4])
    assert [(s.bits, s.value_bits) for s in specs[4:7]] == [(16, 4), (16, 3), (16, 2)]


def test_eval_plots_auto_recipes_apart_labelled_by_budget():
    from veloxquant.tools.eval import CacheSpec, bits_label, family

    auto = CacheSpec("recipe-auto-3.5", "veloxquant", bits=4, method="turboquant-mse", bits_budget=3.5)
    uniform = CacheSpec("turboquant-mse-4", "veloxquant", bits=4, method="turboquant-mse")
    assert (family(auto), bits_label(auto)) == ("recipe-auto", "≤3.5b")
    assert (family(uniform), bits_label(uniform)) == ("turboquant-mse", "4b")
