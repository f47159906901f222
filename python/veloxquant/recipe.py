"""Per-layer recipes measured on the model's own keys, values and queries.

:func:`calibrate` runs one float16 forward over a few hundred tokens and
keeps every attention layer's keys, values and queries. :func:`measure`
compresses them with each candidate (through a ``LayerCache``, so the error
is the cache's own: centring, rotation, float16 norms and scales) and
measures the **attention-output error**: for sampled query positions,
``|softmax(q K̂ᵀ) V - softmax(q Kᵀ) V|² / |softmax(q Kᵀ) V|²`` with the keys
compressed and exact values, and ``|A V̂ - A V|² / |A V|²`` for values.
:func:`allocate` then raises, greedily, the side of the layer whose next
candidate removes the most error per added bit, while the average bits per
element (the bytes each codec really stores: codes, norms, KIVI scales and
zeros) stays within the budget. ``KVConfig.auto`` and ``--kv-recipe auto``
use these.

:func:`outlier_error` is the criterion of ``protect="auto"``: the key error
of one layer at its configured method and bits, measured as above on the
first chunk the layer sees.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

# Key candidates: TurboQuant-MSE and KIVI (per-channel keys) at these bits,
# and float16; value candidates: TurboQuant-MSE at these bits, and float16.
CANDIDATE_BITS = (2, 3, 4, 8)
KEY_METHODS = ("turboquant-mse", "kivi")
VALUE_METHODS = ("turboquant-mse",)
# Calibration tokens (SmolLM2-135M's forward over 256 tokens takes about a
# second on a 2-core CPU; 512 took four times that), and query positions
# sampled from them per layer.
MAX_TOKENS = 256
MAX_QUERIES = 64
# A calibration shorter than this says little about a layer: generate pads
# a short prompt with the shipped text.
MIN_TOKENS = 128
# KIVI's token group (keys) and largest channel group (values), as the cache stores them.
_KIVI_GROUP = 32
# Widths whose error is extrapolated, not measured: each bit beyond
# MEASURED_BITS divides the squared error by 4, as for any fine uniform or
# Lloyd-Max quantizer; SmolLM2-135M measures 8-bit errors of 1e-4 to 1e-5,
# which no allocation can tell from zero, and 8-bit TurboQuant's 256-entry
# codebook would take most of the calibration's time.
MEASURED_BITS = 4


@dataclasses.dataclass(frozen=True)
class Choice:
    method: str  # a LayerCache method, or "fp16"
    bits: int  # 16 for fp16

    @property
    def label(self) -> str:
        if self.method == "fp16":
            return "fp16"
        return f"{'tq' if self.method == 'turboquant-mse' else self.method}{self.bits}"


FP16 = Choice("fp16", 16)


def stored_bits(method: str, bits: int, head_dim: int, keys: bool) -> float:
    """Bits the cache stores per compressed element of one side (codes and
    their norms or scales), as its codecs lay them out."""
    packed = 8 * math.ceil(head_dim * bits / 8)  # codes of one token and head, bit-packed to bytes
    if method == "fp16":
        return 16.0
    if method == "turboquant-mse":
        return (packed + 16) / head_dim  # a float16 norm per token and head
    if method == "kivi":
        if keys:  # float16 scale and zero per channel per group of 32 tokens
            return packed / head_dim + 32 / _KIVI_GROUP
        group = next((g for g in (32, 24, 16, 8) if head_dim % g == 0), 8)
        return packed / head_dim + 32 / group  # float16 scale and zero per channel group
    raise ValueError(f"stored_bits: no layout known for method {method!r}")


def key_candidates() -> List[Choice]:
    return [Choice(m, b) for m in KEY_METHODS for b in CANDIDATE_BITS] + [FP16]


def value_candidates() -> List[Choice]:
    return [Choice(m, b) for m in VALUE_METHODS for b in CANDIDATE_BITS] + [FP16]


# --- calibration ------------------------------------------------------------------


class _Recorder(KVCache):
    """mlx_lm's float16 cache, also keeping the queries that attend over it
    (the attention dispatch hands them to ``observe_queries``)."""

    def __init__(self):
        super().__init__()
        self.queries = None

    def observe_queries(self, queries: mx.array) -> None:
        self.queries = queries if self.queries is None else mx.concatenate([self.queries, queries], axis=2)


@dataclasses.dataclass
class LayerSample:
    index: int
    queries: mx.array  # [B, H, L, D]
    keys: mx.array  # [B, Hkv, L, D]
    values: mx.array


def calibrate(model, tokens: Sequence[int]) -> List[LayerSample]:
    """Every plain-KVCache layer's keys, values and queries over ``tokens``
    (at most MAX_TOKENS are used), from one forward with float16 caches."""
    from . import attention
    from .cache import _base_caches

    ids = [int(t) for t in list(tokens)[:MAX_TOKENS]]
    if len(ids) < 2:
        raise ValueError(f"tokens: the calibration needs at least 2 tokens, got {len(ids)}")
    attention.install()
    caches = _base_caches(model)
    recorders = {}
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            caches[i] = recorders[i] = _Recorder()
    if not recorders:
        raise ValueError("the model has no layer with a plain KVCache to calibrate")
    # The transformer without its output head, whose logits nothing here reads.
    body = getattr(model, "model", None)
    body = body if callable(body) else model
    mx.eval(body(mx.array(ids)[None], cache=caches))
    out = []
    for i, r in recorders.items():
        if r.queries is None:
            raise ValueError(
                f"layer {i}: its attention bypassed mlx_lm's scaled_dot_product_attention, so its queries "
                "could not be observed"
            )
        out.append(LayerSample(i, r.queries, r.keys[..., : r.offset, :], r.values[..., : r.offset, :]))
    return out


# --- errors -----------------------------------------------------------------------


class _Attention:
    """Exact attention of sampled queries, per batch row (here: per layer), to
    compare compressed keys and values against."""

    def __init__(self, queries: mx.array, keys: mx.array, values: mx.array):
        B, H, L, D = queries.shape
        hkv = keys.shape[1]
        n = min(MAX_QUERIES, L)
        # Positions spread over the sequence, the last included: later
        # queries see more of the compressed history.
        pos = sorted({L - 1 - (j * (L - 1)) // max(n - 1, 1) for j in range(n)})
        self.scale = D**-0.5
        # [B, Hkv, rep * n, D]: a KV head with the query heads that read it.
        q = queries[:, :, mx.array(pos), :].astype(mx.float32)
        self.q = q.reshape(B, hkv, (H // hkv) * len(pos), D)
        p = mx.array(pos * (H // hkv))[:, None]
        self.mask = mx.where(mx.arange(L)[None, :] <= p, 0.0, -mx.inf)  # causal
        self.values = values.astype(mx.float32)
        self.weights = self._weights(keys)
        self.out = self.weights @ self.values
        self.norm = mx.maximum(self._per_row(self.out * self.out), 1e-30)

    @staticmethod
    def _per_row(x: mx.array) -> mx.array:
        return mx.sum(x.reshape(x.shape[0], -1), axis=1)

    def _weights(self, keys: mx.array) -> mx.array:
        k = keys.astype(mx.float32)
        return mx.softmax(self.scale * (self.q @ k.swapaxes(-1, -2)) + self.mask, axis=-1)

    def key_error(self, keys: mx.array) -> mx.array:
        """Per row: |softmax(q K̂ᵀ) V - softmax(q Kᵀ) V|² / |softmax(q Kᵀ) V|²."""
        d = self._weights(keys) @ self.values - self.out
        return self._per_row(d * d) / self.norm

    def value_error(self, values: mx.array) -> mx.array:
        """Per row: |A V̂ - A V|² / |A V|²."""
        d = self.weights @ (values.astype(mx.float32) - self.values)
        return self._per_row(d * d) / self.norm


def _round_trip(keys: mx.array, values: mx.array, key: Choice, value: Choice, sinks: int, seed: int):
    """``keys`` and ``values`` after the cache compressed them (all but the
    sinks and one recent token), decoded. Each batch row is centred and
    scaled on its own, so rows may be different layers."""
    from .cache import _layer_cache_class

    _, hkv, _, d = keys.shape
    layer = _layer_cache_class()(
        d, hkv, key_method=key.method, key_bits=key.bits, value_method=value.method, value_bits=value.bits,
        window=1, sinks=sinks, seed=seed,
    )
    layer.append(keys, values)
    return layer.dequantize()


def outlier_error(queries: mx.array, keys: mx.array, values: mx.array, config) -> float:
    """Attention-output error of ``keys`` compressed as ``config`` says
    (values exact), the largest over the batch."""
    att = _Attention(queries, keys, values)
    k, _ = _round_trip(keys, values, Choice(config.key_method, config.key_bits), FP16, config.sinks, config.seed)
    return float(mx.max(att.key_error(k)).item())


@dataclasses.dataclass
class LayerErrors:
    index: int
    elements: int  # key (= value) elements per token
    head_dim: int
    keys: Dict[Choice, float]
    values: Dict[Choice, float]


def measure(samples: Sequence[LayerSample], sinks: int = 4, seed: int = 0) -> List[LayerErrors]:
    """Each layer's key and value errors for every candidate. Layers of one
    shape are stacked along the batch: one cache round trip per candidate."""
    groups: Dict[tuple, List[LayerSample]] = {}
    for s in samples:
        groups.setdefault((s.queries.shape, s.keys.shape), []).append(s)
    measured = lambda c: c != FP16 and c.bits <= MEASURED_BITS  # noqa: E731
    kc, vc = [c for c in key_candidates() if measured(c)], [c for c in value_candidates() if measured(c)]
    out = {}
    for group in groups.values():
        cat = lambda name: mx.concatenate([getattr(s, name) for s in group], axis=0)  # noqa: E731
        keys, values = cat("keys"), cat("values")
        att = _Attention(cat("queries"), keys, values)
        kerr, verr = {}, {}
        # One round trip per key candidate, carrying a value candidate along.
        for j, key in enumerate(kc):
            value = vc[j] if j < len(vc) else FP16
            k, v = _round_trip(keys, values, key, value, sinks, seed)
            kerr[key] = att.key_error(k)
            if value != FP16:
                verr[value] = att.value_error(v)
            mx.eval(kerr[key], *verr.values())
        _, hkv, _, d = keys.shape
        for r, s in enumerate(group):
            ke = {c: float(e[r].item()) for c, e in kerr.items()}
            ve = {c: float(e[r].item()) for c, e in verr.items()}
            for table, cands in ((ke, key_candidates()), (ve, value_candidates())):
                for c in cands:
                    if c == FP16:
                        table[c] = 0.0
                    elif c not in table:
                        table[c] = table[Choice(c.method, MEASURED_BITS)] * 4.0 ** (MEASURED_BITS - c.bits)
            out[s.index] = LayerErrors(s.index, hkv * d, d, ke, ve)
    return [out[s.index] for s in samples]


# --- allocation -------------------------------------------------------------------


@dataclasses.dataclass
class Recipe:
    """What :func:`allocate` chose: per layer, the key and value choices."""

    choices: Dict[int, Tuple[Choice, Choice]]
    bits: Dict[int, float]  # per layer: mean of its key and value stored bits per element
    error: Dict[int, float]  # per layer: key error + value error
    bits_per_element: float  # over all compressed layers, weighted by their elements

    def overrides(self) -> Dict[int, Optional[dict]]:
        """``KVConfig.layers`` entries: None for a float16 layer."""
        out = {}
        for i, (k, v) in self.choices.items():
            if k == FP16 and v == FP16:
                out[i] = None
            else:
                out[i] = {"key_method": k.method, "key_bits": k.bits, "value_method": v.method, "value_bits": v.bits}
        return out

    def lines(self) -> List[str]:
        return [
            f"layer {i}: keys {k.label}, values {v.label} ({self.bits[i]:.2f} bits/el, error {self.error[i]:.2e})"
            for i, (k, v) in sorted(self.choices.items())
        ]

    def summary(self) -> str:
        """One line: runs of layers with the same choice."""
        runs: List[List] = []
        for i, (k, v) in sorted(self.choices.items()):
            label = f"k {k.label} v {v.label}"
            if runs and runs[-1][2] == label and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i, label])
        parts = [f"{a}{'-' + str(b) if b != a else ''}: {lab}" for a, b, lab in runs]
        return f"{self.bits_per_element:.2f} bits/el; " + "; ".join(parts)


def allocate(
    errors: Sequence[LayerErrors], bits_budget: float, fixed: Optional[Dict[int, Tuple[Choice, Choice]]] = None
) -> Recipe:
    """Greedy: every side starts at its cheapest candidate; then, while the
    budget allows, the upgrade with the most error removed per added bit is
    taken. ``fixed`` layers keep the given choices (their bits count)."""
    if isinstance(bits_budget, bool) or not isinstance(bits_budget, (int, float)) or not math.isfinite(bits_budget):
        raise ValueError(f"bits_budget must be a number of bits per element, got {bits_budget!r}")
    fixed = dict(fixed or {})
    cost = {}  # (layer, side, choice) -> stored bits
    for e in errors:
        for side, table in (("k", e.keys), ("v", e.values)):
            for c in table:
                cost[e.index, side, c] = stored_bits(c.method, c.bits, e.head_dim, side == "k")
    # cur[(layer, side)] = choice
    cur = {}
    for e in errors:
        if e.index in fixed:
            cur[e.index, "k"], cur[e.index, "v"] = fixed[e.index]
            for side, c in zip("kv", fixed[e.index]):
                cost.setdefault((e.index, side, c), stored_bits(c.method, c.bits, e.head_dim, side == "k"))
        else:
            cur[e.index, "k"] = min(e.keys, key=lambda c: (cost[e.index, "k", c], e.keys[c]))
            cur[e.index, "v"] = min(e.values, key=lambda c: (cost[e.index, "v", c], e.values[c]))
    weight = {e.index: e.elements for e in errors}
    total_w = 2 * sum(weight.values())
    spent = sum(weight[i] * cost[i, s, c] for (i, s), c in cur.items())
    limit = bits_budget * total_w
    if spent > limit * (1 + 1e-9):
        raise ValueError(
            f"bits_budget {bits_budget:g} is below the cheapest recipe's {spent / total_w:.3f} bits/element"
        )
    by_index = {e.index: e for e in errors}
    while True:
        best = None
        for (i, side), c in cur.items():
            if i in fixed:
                continue
            table = by_index[i].keys if side == "k" else by_index[i].values
            for n, err in table.items():
                extra = weight[i] * (cost[i, side, n] - cost[i, side, c])
                gain = table[c] - err
                if extra <= 0 or gain <= 0 or spent + extra > limit * (1 + 1e-9):
                    continue
                rate = gain / extra
                if best is None or rate > best[0]:
                    best = (rate, i, side, n, extra)
        if best is None:
            break
        _, i, side, n, extra = best
        cur[i, side] = n
        spent += extra
    choices, bits, err = {}, {}, {}
    for e in errors:
        k, v = cur[e.index, "k"], cur[e.index, "v"]
        choices[e.index] = (k, v)
        bits[e.index] = (cost[e.index, "k", k] + cost[e.index, "v", v]) / 2
        err[e.index] = e.keys.get(k, 0.0) + e.values.get(v, 0.0)
    return Recipe(choices, bits, err, spent / total_w)


def auto_recipe(model, tokens: Sequence[int], bits_budget: float = 3.5, config=None) -> Tuple[object, Recipe]:
    """The KVConfig of :meth:`KVConfig.auto`, and the recipe it holds."""
    from .cache import KVConfig

    config = config if config is not None else KVConfig()
    if not isinstance(config, KVConfig):
        raise TypeError(f"config must be a veloxquant.KVConfig, got {type(config).__name__}")
    if config.protect == "auto":
        raise ValueError("protect='auto' cannot be combined with an automatic recipe, which already picks float16 layers")
    samples = calibrate(model, tokens)
    resolved = config.resolve(_layer_count(model))
    fixed = {}
    for s in samples:
        if s.index in resolved.layers:
            c = resolved.for_layer(s.index)
            fixed[s.index] = (FP16, FP16) if c is None else (Choice(c.key_method, c.key_bits), Choice(c.value_method, c.value_bits))
    errors = measure(samples, config.sinks, config.seed)
    recipe = allocate(errors, bits_budget, fixed)
    layers = dict(resolved.layers)
    layers.update({i: ov for i, ov in recipe.overrides().items() if i not in fixed})
    return dataclasses.replace(resolved, layers=layers), recipe


def _layer_count(model) -> int:
    from .cache import _base_caches

    return len(_base_caches(model))
