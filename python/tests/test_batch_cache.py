"""VeloxQuantBatchCache: batched generation gives each sequence its solo tokens;
merge, extend, filter, extract, padding, masks, state, and errors.

The tiny model's weights are float16: MLX's CPU float16 matmuls compute each
row alone, so a batched forward gives each sequence the logits of its batch-1
forward, bit for bit (measured), and the comparison below is exact up to a
tolerance that only rounding could stay within.
"""

import copy

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache, load_prompt_cache, save_prompt_cache

from veloxquant.batch_cache import VeloxQuantBatchCache
from veloxquant.cache import KVConfig, VeloxQuantCache, cache_nbytes, install, make_prompt_cache, uninstall
from veloxquant.tools.texts import alice

STEP = 16  # prefill step: the longer prompts take several right-padded chunks


@pytest.fixture(scope="module")
def tiny(tiny_model):
    model, tokenizer = load(tiny_model)
    ids = tokenizer.encode(alice()[:4000])
    return model, ids


def _prompts(ids):
    # Of different lengths: several chunks, one chunk, fewer tokens than the
    # fused path's limit, one token; the last two join mid-way.
    return [ids[:40], ids[100:117], ids[200:203], ids[300:360], ids[400:401]]


def _solo(model, prompt, config, n, step=STEP):
    cache = make_prompt_cache(model, config)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, prefill_step_size=step)
    return [(t, lp) for t, lp in steps], cache


def _batched(model, prompts, config, max_tokens, join_at=3, step=STEP):
    """BatchGenerator over prompts[:3] at once, the rest inserted after
    ``join_at`` steps; each sequence's (token, logprobs) and final caches."""
    install(model, config)
    try:
        gen = BatchGenerator(model, max_tokens=max(max_tokens), prefill_batch_size=4, prefill_step_size=step)
        out, caches, batch_types = {}, {}, set()
        for uid in gen.insert(prompts[:join_at], max_tokens=max_tokens[:join_at]):
            out[uid] = []
        steps = 0
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            batch_types |= {type(c).__name__ for c in gen._generation_batch.prompt_cache}
            for r in responses:
                out[r.uid].append((r.token, r.logprobs))
                if r.finish_reason is not None:
                    caches[r.uid] = r.prompt_cache
            steps += 1
            if steps == 3:
                for uid in gen.insert(prompts[join_at:], max_tokens=max_tokens[join_at:]):
                    out[uid] = []
        gen.close()
    finally:
        uninstall(model)
    return [out[u] for u in sorted(out)], [caches[u] for u in sorted(caches)], batch_types


CONFIGS = {
    "turboquant": KVConfig(key_bits=3, window=4, sinks=1),
    "kivi-layer-0": KVConfig(key_bits=3, window=4, sinks=1, layers={0: {"key_method": "kivi", "key_bits": 2}}),
    # One float16 layer (a BatchKVCache in the batch) beside a compressed one,
    # each way round: the first layer's cache makes the mask for both.
    "fp16-layer-1": KVConfig(key_bits=3, window=4, sinks=1, layers={1: None}),
    "fp16-layer-0": KVConfig(key_bits=3, window=4, sinks=1, layers={0: None}),
    "protect-auto": KVConfig(key_bits=2, window=4, sinks=1, protect="auto"),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_batched_greedy_generation_gives_each_sequence_its_solo_tokens(tiny, config):
    model, ids = tiny
    prompts = _prompts(ids)
    max_tokens = [10, 4, 10, 10, 10]  # the second leaves early
    batched, _, batch_types = _batched(model, prompts, config, max_tokens)
    assert "VeloxQuantBatchCache" in batch_types
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        solo, _ = _solo(model, prompt, config, n)
        assert [t for t, _ in batched[i]] == [t for t, _ in solo], f"sequence {i}"
        gap = max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(batched[i], solo))
        assert gap <= 1e-3, f"sequence {i}: logprobs differ by {gap}"


def test_protect_auto_decides_for_each_sequence_as_alone(tiny):
    model, ids = tiny
    proj = model.model.layers[1].self_attn.k_proj
    original = proj.weight
    proj.weight = original * 100  # layer 1's attention turns sharp: its compressed keys cost too much
    try:
        config = KVConfig(key_bits=2, window=4, sinks=1, protect="auto")
        # First chunks of 64, 16 and 2 tokens: the longest shows layer 1's
        # error past the threshold, the shorter ones do not.
        prompts = [ids[:100], ids[100:117], ids[200:203]]
        batched, caches, _ = _batched(model, prompts, config, [6, 6, 6], step=64)
        for i, prompt in enumerate(prompts):
            solo, solo_caches = _solo(model, prompt, config, 6, step=64)
            assert [t for t, _ in batched[i]] == [t for t, _ in solo]
            assert [c.protected for c in caches[i]] == [c.protected for c in solo_caches]
            assert [c.config for c in caches[i]] == [c.config for c in solo_caches]
        assert [[c.protected for c in seq] for seq in caches] == [[False, True], [False, False], [False, False]]
    finally:
        proj.weight = original


def test_left_padding_is_dropped(tiny):
    model, ids = tiny
    config = KVConfig(key_bits=3, window=4, sinks=1)
    prompts = [ids[:20], ids[50:56], ids[80:92]]
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    per_layer = zip(*[make_prompt_cache(model, config) for _ in prompts])
    batch = [VeloxQuantBatchCache(list(caches), left_padding=padding) for caches in per_layer]
    assert batch[0].offset.tolist() == [-p for p in padding]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    logits = model(tokens, cache=batch)[:, -1]
    assert batch[0].offset.tolist() == list(map(len, prompts))
    assert [c.offset for c in batch[0].caches] == list(map(len, prompts))
    solo = []
    for p in prompts:
        cache = make_prompt_cache(model, config)
        solo.append((model(mx.array(p)[None], cache=cache)[:, -1], cache))
    for i in range(len(prompts)):
        assert mx.abs(logits[i] - solo[i][0][0]).max().item() <= 1e-3
    # Decoding on: every sequence as alone.
    nxt = logits.argmax(-1)
    for _ in range(3):
        logits = model(nxt[:, None], cache=batch)[:, -1]
        for i, (_, cache) in enumerate(solo):
            want = model(nxt[i : i + 1, None], cache=cache)[:, -1]
            assert mx.abs(logits[i] - want[0]).max().item() <= 1e-3
        nxt = logits.argmax(-1)


# --- the protocol on synthetic keys ------------------------------------------------


def _kv(t, seed, heads=2):
    k = mx.random.normal((1, heads, t, 64), key=mx.random.key(seed)).astype(mx.float16)
    return k, -k


def _filled(lengths, config=KVConfig(window=8, sinks=2)):
    caches = []
    for i, n in enumerate(lengths):
        c = VeloxQuantCache(config)
        if n:
            c.update_and_fetch(*_kv(n, i))
            c.attention(mx.zeros((1, 4, n, 64), dtype=mx.float16), 0.125, "causal")
        caches.append(c)
    return caches


def _step(batch, chunk, seed=0):
    """One chunk of ``chunk`` tokens for every sequence, then its attention."""
    n = len(batch.caches)
    k = mx.random.normal((n, 2, chunk, 64), key=mx.random.key(seed)).astype(mx.float16)
    batch.update_and_fetch(k, k)
    q = mx.random.normal((n, 4, chunk, 64), key=mx.random.key(seed + 1)).astype(mx.float16)
    return batch.attend_each(q, lambda q, k, v, c, m: c.attention(q, 0.125, m)), k


def _same_mask(ours, theirs, n):
    """Our mask and BatchKVCache's select the same keys ("causal" and None as arrays)."""
    assert isinstance(theirs, mx.array)
    if not isinstance(ours, mx.array):
        width = theirs.shape[-1]
        ours = mx.arange(width - n, width)[:, None] >= mx.arange(width)[None]
    return mx.array_equal(mx.broadcast_to(ours, theirs.shape), theirs).item()


def test_merge_filter_extend_follow_batch_kv_cache():
    lengths = [5, 0, 12]
    ours = VeloxQuantCache.merge(_filled(lengths))
    kv = []
    for i, n in enumerate(lengths):
        c = KVCache()
        if n:
            c.update_and_fetch(*_kv(n, i))
        kv.append(c)
    theirs = BatchKVCache.merge(kv)
    assert isinstance(ours, VeloxQuantBatchCache) and len(ours.caches) == 3
    assert ours.offset.tolist() == theirs.offset.tolist() == lengths
    assert ours.size() == theirs.size() == 12

    def both(step, *a, **k):
        getattr(ours, step)(*a, **k)
        getattr(theirs, step)(*a, **k)
        for n in (1, 3):
            assert _same_mask(ours.make_mask(n), theirs.make_mask(n), n), (step, n)

    # A right-padded prompt: 4, 1 and 6 real tokens of 6.
    both("prepare", lengths=[4, 1, 6], right_padding=[2, 5, 0])
    _, k = _step(ours, 6)
    theirs.update_and_fetch(k, k)
    both("finalize")
    assert [c.offset for c in ours.caches] == [9, 1, 18]
    assert ours.offset.tolist() == theirs.offset.tolist() == [9, 1, 18]
    both("filter", [2, 0])
    assert [c.offset for c in ours.caches] == [18, 9]
    other, other_kv = VeloxQuantCache.merge(_filled([3])), BatchKVCache.merge([KVCache()])
    other_kv.update_and_fetch(*_kv(3, 0))
    ours.extend(other)
    theirs.extend(other_kv)
    assert ours.offset.tolist() == theirs.offset.tolist() == [18, 9, 3]
    for n in (1, 4):
        assert _same_mask(ours.make_mask(n), theirs.make_mask(n), n)


def test_right_padding_is_never_stored_and_padded_queries_get_zeros():
    batch = VeloxQuantCache.merge(_filled([0, 0]))
    batch.prepare(lengths=[3, 10], right_padding=[7, 0])
    out, _ = _step(batch, 10)
    batch.finalize()
    assert [c.offset for c in batch.caches] == [3, 10]
    assert mx.all(out[0, :, 3:] == 0).item() and not mx.all(out[0, :, :3] == 0).item()
    # A right-padded prompt in two chunks: the first sequence's tokens end in the first.
    batch.prepare(lengths=[2, 12], right_padding=[10, 0])
    _step(batch, 8)
    _step(batch, 4, seed=5)
    batch.finalize()
    assert [c.offset for c in batch.caches] == [5, 22]


def test_extract_is_a_copy_of_one_sequence():
    batch = VeloxQuantCache.merge(_filled([4, 9]))
    one = batch.extract(1)
    assert type(one) is VeloxQuantCache and one.offset == 9
    _step(batch, 1)
    assert one.offset == 9 and batch.caches[1].offset == 10
    a = one.layer.dequantize()[0]
    b = batch.caches[1].layer.dequantize()[0][:, :, :9]
    assert mx.array_equal(a, b).item()


def test_state_round_trips_in_memory_and_through_mlx_lm_files(tmp_path):
    batch = VeloxQuantCache.merge(_filled([4, 0, 30]))
    batch.prepare(lengths=[2, 3, 3], right_padding=[1, 0, 0])
    _step(batch, 3)
    batch.finalize()
    twin = VeloxQuantBatchCache.from_state(batch.state)
    f = str(tmp_path / "batch.safetensors")
    save_prompt_cache(f, [batch])
    (loaded,) = load_prompt_cache(f)
    size, mask = batch.size(), batch.make_mask(2)
    outs = []
    for b in (batch, twin, loaded):
        assert type(b) is VeloxQuantBatchCache
        assert b.offset.tolist() == [6, 3, 33] and b.size() == size
        assert _same_mask(b.make_mask(2), mask, 2)
        outs.append(_step(b, 1, seed=3)[0])
    assert mx.array_equal(outs[0], outs[1]).item() and mx.array_equal(outs[0], outs[2]).item()


def test_deepcopy_trim_nbytes_empty():
    batch = VeloxQuantCache.merge(_filled([6, 11]))
    twin = copy.deepcopy(batch)
    _step(batch, 1)
    assert [c.offset for c in twin.caches] == [6, 11] and [c.offset for c in batch.caches] == [7, 12]
    assert batch.is_trimmable() and batch.trim(2) == 2
    assert [c.offset for c in batch.caches] == [5, 10] and batch.offset.tolist() == [5, 10]
    assert batch.nbytes == sum(c.nbytes for c in batch.caches) > 0
    shared = batch.caches[0].layer.shared_nbytes
    assert cache_nbytes([batch]) == batch.nbytes + shared
    assert not batch.empty() and VeloxQuantCache.merge(_filled([0, 0])).empty()


# --- errors ---------------------------------------------------------------------------


def test_bad_batch_indices_are_named():
    batch = VeloxQuantCache.merge(_filled([2, 3]))
    with pytest.raises(IndexError, match=r"^batch_indices: sequence 2 is out of range for a batch of 2"):
        batch.filter([0, 2])
    with pytest.raises(ValueError, match=r"^batch_indices lists a sequence more than once: \[1, 1\]"):
        batch.filter([1, 1])
    with pytest.raises(TypeError, match=r"^batch_indices must be sequence indices"):
        batch.filter([0.5])
    with pytest.raises(IndexError, match=r"^idx: sequence -1 is out of range"):
        batch.extract(-1)
    assert len(batch.caches) == 2


def test_mismatched_caches_are_refused():
    with pytest.raises(TypeError, match=r"^caches\[1\] must be a VeloxQuantCache, got KVCache"):
        VeloxQuantCache.merge([VeloxQuantCache(), KVCache()])
    with pytest.raises(ValueError, match=r"^caches\[1\] has other settings than caches\[0\]"):
        VeloxQuantCache.merge([VeloxQuantCache(KVConfig(window=8)), VeloxQuantCache(KVConfig(window=16))])
    with pytest.raises(ValueError, match=r"^caches\[1\] has other settings"):
        VeloxQuantCache.merge([VeloxQuantCache(KVConfig(key_bits=4)), VeloxQuantCache(KVConfig(key_bits=2))])
    c = VeloxQuantCache()
    with pytest.raises(ValueError, match=r"^caches\[1\] is caches\[0\]: each sequence needs a cache of its own"):
        VeloxQuantCache.merge([c, c])
    wide = VeloxQuantCache(KVConfig(window=8, sinks=2))
    wide.update_and_fetch(*_kv(2, 0, heads=4))
    with pytest.raises(ValueError, match=r"caches of \(kv heads, head size\) \[\(2, 64\), \(4, 64\)\]"):
        VeloxQuantCache.merge(_filled([2]) + [wide])
    # protect="auto" may leave a layer float16 in one sequence and not in another.
    fp16 = VeloxQuantCache(KVConfig(key_method="fp16", key_bits=16))
    assert len(VeloxQuantCache.merge([VeloxQuantCache(KVConfig(protect="auto")), fp16, VeloxQuantCache()]).caches) == 3
    batch = VeloxQuantCache.merge(_filled([2]))
    with pytest.raises(TypeError, match=r"^extend: other must be a VeloxQuantBatchCache, got BatchKVCache"):
        batch.extend(BatchKVCache([0]))


def test_bad_padding_and_chunks_are_named():
    batch = VeloxQuantCache.merge(_filled([2, 0]))
    with pytest.raises(ValueError, match=r"^left_padding can only be added to an empty"):
        batch.prepare(left_padding=[1, 1])
    with pytest.raises(ValueError, match=r"^left_padding must list one count per sequence \(2\), got \[1\]"):
        VeloxQuantCache.merge(_filled([0, 0])).prepare(left_padding=[1])
    with pytest.raises(ValueError, match=r"^prepare: right_padding needs lengths"):
        batch.prepare(right_padding=[1, 0])
    with pytest.raises(ValueError, match=r"^lengths must be integers >= 0, got \[1, -1\]"):
        batch.prepare(lengths=[1, -1])
    with pytest.raises(ValueError, match=r"with batch 2, got \(3, 2, 1, 64\)"):
        batch.update_and_fetch(*(mx.zeros((3, 2, 1, 64)),) * 2)
    with pytest.raises(RuntimeError, match=r"attention without a chunk just added"):
        batch.attend_each(mx.zeros((2, 4, 1, 64)), None)
    with pytest.raises(ValueError, match="attention sinks"):
        import mlx_lm.models.base as base

        from veloxquant import attention

        attention.install()
        _step(batch, 1)
        k = mx.zeros((2, 2, 1, 64), dtype=mx.float16)
        batch.update_and_fetch(k, k)
        base.scaled_dot_product_attention(mx.zeros((2, 4, 1, 64)), k, k, batch, 1.0, None, sinks=mx.zeros((4,)))


def _layer_holding(n, **kw):
    from veloxquant import LayerCache

    c = LayerCache(64, 2, window=16, sinks=4, device="cpu", **kw)
    c.append(*(mx.random.normal((1, 2, n, 64)).astype(mx.float16) for _ in range(2)))
    return c


@pytest.mark.parametrize("kw", [{}, {"key_method": "kivi", "key_bits": 4}], ids=["turboquant", "kivi-keys"])
def test_attention_each_equals_each_sequence_alone(kw):
    # One operation for the batch (TurboQuant), or sequence by sequence
    # (another method): either way each row is its cache's own attention.
    from veloxquant import LayerCache

    mx.random.seed(3)
    caches = [_layer_holding(n, **kw) for n in (5, 40, 300, 777)]
    q = mx.random.normal((4, 8, 1, 64)).astype(mx.float16)
    out = LayerCache.attention_each(caches, q, 0.125)
    want = mx.concatenate([c.attention(q[i : i + 1], 0.125) for i, c in enumerate(caches)], axis=0)
    assert out.shape == (4, 8, 1, 64)
    assert mx.array_equal(out, want).item()


def test_batch_decode_appends_and_attends_in_one_call(tiny, monkeypatch):
    # A decode step of every sequence goes through append_each and
    # attention_each once a layer.
    model, ids = tiny
    caches = []
    for p in (ids[:40], ids[100:117]):
        c = make_prompt_cache(model, KVConfig())
        model(mx.array(p)[None], cache=c)
        caches.append(c)
    batch = [VeloxQuantBatchCache.merge([a, b]) for a, b in zip(*caches)]
    calls = []
    for name in ("append_each", "attention_each"):
        each = getattr(VeloxQuantCache, name)
        spy = lambda *a, name=name, each=each: calls.append((name, len(a[0]))) or each(*a)  # noqa: E731
        monkeypatch.setattr(VeloxQuantCache, name, staticmethod(spy))
    mx.eval(model(mx.array([[1], [2]]), cache=batch))
    assert calls == [("append_each", 2), ("attention_each", 2)] * len(batch)


@pytest.mark.parametrize(
    "kw", [{}, {"key_method": "kivi", "key_bits": 4}, {"value_method": "fp16"}], ids=["turboquant", "kivi-keys", "fp16-values"]
)
def test_append_each_equals_each_sequence_alone(kw):
    # Decode tokens of a batch appended in one call hold, cache by cache,
    # what appending each alone holds: through windows filling, a flush due
    # (the 300-token cache's window fills) and sinks still filling (2 tokens).
    from veloxquant import LayerCache
    from veloxquant.kernels import pending_primitives

    mx.random.seed(5)
    lengths = (2, 5, 40, 300, 777)
    ones = [_layer_holding(n, **kw) for n in lengths]
    mx.random.seed(5)
    alone = [_layer_holding(n, **kw) for n in lengths]
    for step in range(30):
        k, v = (mx.random.normal((len(lengths), 2, 1, 64)).astype(mx.float16) for _ in range(2))
        LayerCache.append_each(ones, k, v)
        for i, c in enumerate(alone):
            c.append(k[i : i + 1], v[i : i + 1])
    q = mx.random.normal((1, 8, 1, 64)).astype(mx.float16)
    for a, b in zip(ones, alone):
        assert a.offset == b.offset and a.nbytes == b.nbytes
        assert mx.array_equal(a.attention(q, 0.125), b.attention(q, 0.125)).item()
        for x, y in zip(a.dequantize(), b.dequantize()):
            assert mx.array_equal(x, y).item()
    # Every sequence's token joins its window: one operation for the batch.
    ready = [_layer_holding(n, **kw) for n in (20, 33, 50)]
    held = lambda c: [a for a in c.state_parts()[0].values() if isinstance(a, mx.array)]  # noqa: E731
    for c in ready:
        mx.eval(held(c))
    k = mx.random.normal((3, 2, 1, 64)).astype(mx.float16)
    LayerCache.append_each(ready, k, k)
    ops = pending_primitives([a for c in ready for a in held(c)])
    assert ops.count("veloxquant_window_append_each") == 1 and "veloxquant_window_append" not in ops, ops
    # A sequence whose sinks are still filling takes the general path; the
    # others' tokens still join their windows in one operation.
    mixed = [_layer_holding(n, **kw) for n in (20, 2, 33)]
    for c in mixed:
        mx.eval(held(c))
    LayerCache.append_each(mixed, k, k)
    ops = pending_primitives([a for c in (mixed[0], mixed[2]) for a in held(c)])
    assert ops.count("veloxquant_window_append_each") == 1 and "veloxquant_window_append" not in ops, ops


def test_append_each_names_bad_arguments():
    from veloxquant import LayerCache

    caches = [_layer_holding(20), _layer_holding(30)]
    with pytest.raises(ValueError, match="keys"):
        LayerCache.append_each(caches, *[mx.zeros((3, 2, 1, 64), dtype=mx.float16)] * 2)
    with pytest.raises(ValueError, match="keys"):
        LayerCache.append_each(caches, *[mx.zeros((2, 3, 1, 64), dtype=mx.float16)] * 2)
    with pytest.raises(ValueError, match="caches"):
        LayerCache.append_each([], *[mx.zeros((0, 2, 1, 64), dtype=mx.float16)] * 2)
    with pytest.raises(RuntimeError, match="cache 1 is in use"):
        LayerCache.append_each([caches[0], caches[0]], *[mx.zeros((2, 2, 1, 64), dtype=mx.float16)] * 2)
    with pytest.raises(TypeError):
        LayerCache.append_each([object()], *[mx.zeros((1, 2, 1, 64), dtype=mx.float16)] * 2)


def test_attention_each_names_bad_arguments():
    from veloxquant import LayerCache

    caches = [_layer_holding(20), _layer_holding(30)]
    with pytest.raises(ValueError, match="queries"):
        LayerCache.attention_each(caches, mx.zeros((3, 8, 1, 64), dtype=mx.float16), 0.125)
    with pytest.raises(ValueError, match="queries"):
        LayerCache.attention_each(caches, mx.zeros((2, 8, 2, 64), dtype=mx.float16), 0.125)
    with pytest.raises(ValueError, match="not a multiple of the cache's 2 KV heads"):
        LayerCache.attention_each(caches, mx.zeros((2, 5, 1, 64), dtype=mx.float16), 0.125)
    with pytest.raises(ValueError, match="queries"):
        LayerCache.attention_each(caches, mx.zeros((2, 8, 1, 32), dtype=mx.float16), 0.125)
    with pytest.raises(ValueError, match="caches"):
        LayerCache.attention_each([], mx.zeros((0, 8, 1, 64), dtype=mx.float16), 0.125)
    with pytest.raises(ValueError, match="scale"):
        LayerCache.attention_each(caches, mx.zeros((2, 8, 1, 64), dtype=mx.float16), float("nan"))
    with pytest.raises(TypeError):
        LayerCache.attention_each([object()], mx.zeros((1, 8, 1, 64), dtype=mx.float16), 0.125)
