"""Per-layer recipes measured on the model's own keys, values and queries.

:func:`calibrate` runs one float16 forward over at most ``MAX_TOKENS``
tokens and keeps every attention layer's keys and values, the queries of a
few sampled positions, and the residual stream entering each block at those
positions. :func:`measure` compresses each layer's keys and values with
every candidate and scores it by what the change in the attention output
adds to the residual stream, relative to the stream there:
``|W_o (ô - o)|² / |h|²`` averaged over the sampled positions, where ``o``
is the exact attention output, ``ô`` the one with the candidate's keys (or
values), ``W_o`` the block's output projection and ``h`` the residual
stream entering the block (a model whose blocks lack ``self_attn.o_proj``
falls back to ``|ô - o|² / |o|²``). A change small beside a stream that
earlier layers made large matters little; the same change in the first
layers, whose stream is still small, carries through every later one.
The errors are weighed to count in perplexity: TurboQuant-MSE key errors
``TURBOQUANT_KEY_WEIGHT``, value errors ``VALUE_WEIGHT`` of KIVI key errors
(measured: see there). The stand-ins centre keys on the mean of the first
``MEAN_SHARE`` of the tokens, as the cache fixes the mean on its first
append, so that the drift of later keys from it counts.

The candidates are scored by stand-ins for the cache's codecs written in
MLX operations (:class:`Codecs`), all layers of one shape in one graph: the
cache's own round trip (``LayerCache``) costs about 0.1 s per candidate for
SmolLM2-135M and the whole calibration has to stay near a second on a CPU.
The stand-ins follow the cache's layouts (keys centred by their mean;
TurboQuant-MSE: float16 norm, a seeded orthogonal rotation, the levels of
a unit vector's coordinate the cache's side uses (Lloyd-Max; a uniform grid
for 3-bit values); KIVI keys: per-channel float16
scale and zero over 32-token groups); python/tests checks their error
against the cache's.

:func:`allocate` then raises, greedily, the side of the layer whose next
candidate removes the most error per added bit while the recipe's bits per
element (:class:`Layout`: the bytes a ``LayerCache`` of each candidate pair
stores, the float16 windows, sinks, key means and the shared rotations and
codebooks included when a context length is given) stay within the budget.
``KVConfig.auto`` and ``--kv-recipe auto`` use these.

:func:`outlier_error` is the criterion of ``protect="auto"``: the key error
of one layer at its configured method and bits, through the cache itself,
on the first chunk the layer sees.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import _native, attention
from .model_caches import base_caches

# Key candidates: TurboQuant-MSE and KIVI (per-channel keys) at these bits,
# and float16; value candidates: TurboQuant-MSE, and float16. 8-bit
# TurboQuant is left out: its 256-entry codebook takes the cache most of a
# second to build, and 8-bit KIVI keys cover that step.
# KIVI keys below 8 bits take their bits per channel from the queries
# ("kivi-query": KVConfig.key_channel_bits="query"), which halves their
# attention error at the same bytes; at 8 bits every channel has 8.
KEY_CANDIDATE_BITS = {"turboquant-mse": (2, 3, 4), "kivi-query": (2, 3, 4), "kivi": (8,)}
VALUE_CANDIDATE_BITS = {"turboquant-mse": (2, 3, 4)}
# Calibration tokens: SmolLM2-135M's forward over 128 tokens takes about
# 0.8 s on a 2-core CPU (over 256, twice that), and query positions sampled
# from them per layer.
MAX_TOKENS = 128
MAX_QUERIES = 32
# A calibration shorter than this says little about a layer: generate pads
# a short prompt with the shipped text.
MIN_TOKENS = 96
# Key candidates of at least this many bits are scored through the
# attention linearised around the exact softmax (first order in the score
# changes, no exponentials: a softmax per candidate is most of the
# measurement's time on a CPU). On SmolLM2-135M the first-order error is
# within about 20% of the exact one at 3 bits, off by up to 50% at 2.
LINEAR_FROM_BITS = 3
# What an error through TurboQuant-MSE values weighs beside the same error
# through KIVI keys, in perplexity. Compressing one side of SmolLM2-135M's
# cache at a time (the evaluation at 1024 tokens, prompt 256, window 16,
# sinks 4), 2-bit values raised perplexity by 20 % per unit of this
# module's error (1.60 % for an error of 0.082), KIVI 3- and 4-bit keys by
# 60 %: value noise is spread over directions the later layers mostly
# ignore, while a key error moves attention between tokens. (3-bit values
# moved perplexity by 0.04 %, too little to measure a ratio from.)
VALUE_WEIGHT = 0.33
# The share of the calibration tokens whose mean centres the stand-ins'
# keys. The cache fixes the key mean on its first append (the prompt) and
# keeps it while the context grows; keys drift from it (RoPE turns the
# slow channels), which inflates TurboQuant's per-vector error while KIVI's
# per-group scales follow. With the mean over all the tokens scored, the
# drift is invisible: compressing keys alone in the evaluation (1024 tokens,
# 256-token prompt) the KL of TurboQuant-MSE 3-bit keys is 2.5 times
# KIVI 3-bit's, the score's ratio was 2.1; with the mean of the first
# quarter (the evaluation's prompt share) it is 2.7.
MEAN_SHARE = 0.25
# What an error through TurboQuant-MSE keys weighs beside the same error
# through KIVI keys, in perplexity. This module's error follows the output's
# KL alike for both (KL per unit of error 0.55 to 0.62 at 3 and 4 bits), but
# perplexity moves more per unit of KL for TurboQuant: compressing only the
# keys of SmolLM2-135M (the same evaluation as VALUE_WEIGHT's) perplexity
# rose by 97 and 87 % per unit of error for TurboQuant-MSE 3 and 4 bits, by
# 60 and 60 % for KIVI 3 and 4 bits. (Likely the MSE codebook's shrinkage:
# every key pulled towards the mean alike, the same sign in every layer,
# where KIVI's rounding is unbiased.)
TURBOQUANT_KEY_WEIGHT = 1.5
# KIVI's token group for keys, as the cache stores them.
KIVI_GROUP = 32


class Choice(NamedTuple):  # a tuple: hashed often by the allocation
    method: str  # a LayerCache method, "kivi-query" (KIVI keys, bits per channel from the queries), or "fp16"
    bits: int  # 16 for fp16

    @property
    def label(self) -> str:
        if self.method == "fp16":
            return "fp16"
        return f"{'tq' if self.method == 'turboquant-mse' else self.method}{self.bits}"

    def settings(self, side: str) -> dict:
        """The KVConfig fields of this choice for ``side`` ("key" or "value")."""
        if self.method == "kivi-query":
            return {"key_method": "kivi", "key_bits": self.bits, "key_channel_bits": "query"}
        out = {f"{side}_method": self.method, f"{side}_bits": self.bits}
        if side == "key":
            out["key_channel_bits"] = "uniform"
        return out


FP16 = Choice("fp16", 16)


def key_candidates() -> List[Choice]:
    return [Choice(m, b) for m, bits in KEY_CANDIDATE_BITS.items() for b in bits] + [FP16]


def value_candidates() -> List[Choice]:
    return [Choice(m, b) for m, bits in VALUE_CANDIDATE_BITS.items() for b in bits] + [FP16]


# --- calibration ------------------------------------------------------------------


class _Recorder(KVCache):
    """mlx_lm's float16 cache, also keeping the queries that attend over it
    (the attention dispatch hands them to ``observe_queries``)."""

    def __init__(self, positions: mx.array):
        super().__init__()
        self.positions = positions
        self.queries = None

    def observe_queries(self, queries: mx.array) -> None:
        self.queries = queries[:, :, self.positions, :]


class _Tap:
    """Stands in for a transformer block during the calibration forward,
    keeping the residual stream that enters it at the sampled positions."""

    def __init__(self, block, positions: mx.array):
        self.block, self.positions, self.stream = block, positions, None

    def __call__(self, x, *args, **kwargs):
        self.stream = x[:, self.positions, :]
        return self.block(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.block, name)


@dataclasses.dataclass
class LayerSample:
    index: int
    positions: List[int]  # the sampled query positions
    queries: mx.array  # [B, H, n, D], at the sampled positions
    keys: mx.array  # [B, Hkv, L, D]
    values: mx.array
    stream: Optional[mx.array] = None  # [B, n, hidden]: the residual stream entering the block
    out_proj: Optional[object] = None  # the block's attention output projection (hidden ← H * D)


def query_positions(length: int) -> List[int]:
    """Positions whose queries score the candidates: spread over the last
    three quarters, the last included (the first tokens attend mostly to the
    sinks, which stay float16)."""
    lo = min(length - 1, max(1, length // 4))
    n = min(MAX_QUERIES, length - lo)
    return sorted({length - 1 - (j * (length - 1 - lo)) // max(n - 1, 1) for j in range(n)})


def query_channel_widths(queries: mx.array, keys: mx.array, bits: int) -> List[int]:
    """KIVI keys' bits per channel, ``bits`` on average, for a layer whose
    first chunk has ``queries`` ``[B, Hq, L, D]`` and ``keys`` ``[B, Hkv, T,
    D]``: channel c of KV head h weighs the mean square of c over the queries
    of h's group times the square of the keys' range in c (what a uniform
    quantizer's error there adds to the scores), and the bits go where they
    remove the most (``veloxquant._native.kivi_channel_widths``). A key or
    query that is not finite counts as 0."""
    b, hq, length, d = queries.shape
    hkv = keys.shape[1]
    q = mx.nan_to_num(queries.astype(mx.float32), nan=0.0, posinf=0.0, neginf=0.0).reshape(b, hkv, hq // hkv, length, d)
    energy = mx.mean(q * q, axis=(0, 2, 3))
    k = mx.nan_to_num(keys.astype(mx.float32), nan=0.0, posinf=0.0, neginf=0.0)
    span = mx.max(k, axis=(0, 2)) - mx.min(k, axis=(0, 2))
    return _native.kivi_channel_widths(channel_weights(energy, span).tolist(), bits)


def channel_weights(query_energy: mx.array, key_span: mx.array) -> mx.array:
    """What a uniform quantizer's error in each channel of KIVI keys costs the
    scores: the queries' mean square there times the keys' range squared
    (float32, finite: NaN counts as 0, an overflow as the largest float32)."""
    return mx.nan_to_num(query_energy * key_span * key_span, nan=0.0, posinf=3e38)


def _blocks(model, count: int):
    """The model's transformer blocks, if it lists one per cache."""
    body = getattr(model, "model", model)
    layers = getattr(body, "layers", None)
    return layers if isinstance(layers, list) and len(layers) == count else None


def calibrate(model, tokens: Sequence[int]) -> List[LayerSample]:
    """Every plain-KVCache layer's keys and values over ``tokens`` (at most
    MAX_TOKENS are used), with the queries and the residual stream at
    :func:`query_positions`, from one forward with float16 caches."""
    ids = [int(t) for t in list(tokens)[:MAX_TOKENS]]
    if len(ids) < 2:
        raise ValueError(f"tokens: the calibration needs at least 2 tokens, got {len(ids)}")
    positions = query_positions(len(ids))
    pos = mx.array(positions)
    attention.install()
    caches = base_caches(model)
    recorders = {}
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            caches[i] = recorders[i] = _Recorder(pos)
    if not recorders:
        raise ValueError("the model has no layer with a plain KVCache to calibrate")
    blocks = _blocks(model, len(caches))
    taps = {}
    if blocks is not None:
        for i in recorders:
            taps[i] = blocks[i] = _Tap(blocks[i], pos)
    # The transformer without its output head, whose logits nothing here reads.
    body = getattr(model, "model", None)
    body = body if callable(body) else model
    try:
        body(mx.array(ids)[None], cache=caches)
    finally:
        for i, tap in taps.items():
            blocks[i] = tap.block
    out = []
    for i, r in recorders.items():
        if r.queries is None:
            raise ValueError(
                f"layer {i}: its attention bypassed mlx_lm's scaled_dot_product_attention, so its queries "
                "could not be observed"
            )
        tap = taps.get(i)
        proj = getattr(getattr(tap.block, "self_attn", None), "o_proj", None) if tap is not None else None
        stream = tap.stream if proj is not None else None
        out.append(LayerSample(i, positions, r.queries, r.keys[..., : r.offset, :], r.values[..., : r.offset, :], stream, proj))
    mx.eval([(s.queries, s.keys, s.values) + ((s.stream,) if s.stream is not None else ()) for s in out])
    return out


# --- codec stand-ins -------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _nearest_level_table(head_dim: int, bits: int, keys: bool) -> Tuple[mx.array, float, float]:
    """The nearest codebook level on a fine uniform grid (4096 points over
    ±8 standard deviations of a coordinate): one rounding and one lookup per
    coordinate instead of a comparison per level. It differs from the exact
    nearest level only within half a grid step of a midpoint."""
    levels = _native.turboquant_levels(head_dim, bits, keys)
    lo = -min(1.0, 8 / math.sqrt(head_dim))
    n = 4096
    step = -2 * lo / (n - 1)
    grid = mx.arange(n, dtype=mx.float32) * step + lo
    lv = mx.array(levels)
    table = lv[mx.argmin(mx.abs(grid[:, None] - lv[None, :]), axis=1)]
    return table, lo, step


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int, seed: int) -> mx.array:
    """A seeded random orthogonal matrix (the error of TurboQuant-MSE does not
    depend on which rotation, only that it spreads each vector evenly)."""
    import numpy as np

    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((head_dim, head_dim)))
    return mx.array((q * np.sign(np.diag(r))).astype(np.float32))


def _f16(x: mx.array) -> mx.array:
    return x.astype(mx.float16).astype(mx.float32)


class Codecs:
    """Keys and values of stacked layers ``[B, Hkv, L, D]`` after a
    candidate's compression, decoded, in float32: the first ``sinks`` tokens
    exact (the cache keeps them float16), the rest compressed."""

    def __init__(self, keys: mx.array, values: mx.array, sinks: int, seed: int, mean_share: float = 1.0,
                 query_energy: Optional[mx.array] = None):
        self.sinks = min(sinks, keys.shape[2] - 1)
        # [B, Hkv, D]: the mean square of each channel over the queries that
        # read a KV head, which sets "kivi-query" keys' bits per channel.
        self.query_energy = query_energy
        self._channel_weights = None
        self.keys = keys.astype(mx.float32)
        self.values = values.astype(mx.float32)
        # The cache stores keys minus their mean over its first append, kept
        # for every later token: here the first ``mean_share`` of the tokens
        # stand for that append.
        first = max(1, round(keys.shape[2] * mean_share))
        self.mean = mx.mean(self.keys[:, :, :first], axis=2, keepdims=True)
        self.centred = self.keys[:, :, self.sinks :] - self.mean
        self.rotation = _rotation(keys.shape[-1], seed)
        self._rotated = {}

    def _polar(self, side: str):
        """A side's compressed tokens as float16 norms and rotated unit
        vectors, once for every width."""
        if side not in self._rotated:
            x = self.centred if side == "k" else self.values[:, :, self.sinks :]
            norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
            unit = ((x / mx.maximum(norm, 1e-30)).reshape(-1, x.shape[-1]) @ self.rotation.T).reshape(x.shape)
            self._rotated[side] = (_f16(norm), unit)
        return self._rotated[side]

    def _turboquant(self, side: str, bits: int) -> mx.array:
        norm, unit = self._polar(side)
        table, lo, step = _nearest_level_table(unit.shape[-1], bits, side == "k")
        j = mx.clip(mx.round((unit - lo) / step), 0, table.size - 1).astype(mx.uint32)
        y = table[j]
        return norm * (y.reshape(-1, unit.shape[-1]) @ self.rotation).reshape(unit.shape)

    @staticmethod
    def _kivi_keys(x: mx.array, bits, levels: Optional[mx.array] = None) -> mx.array:
        # Min/max per channel over groups of KIVI_GROUP tokens; a last partial
        # group is padded with its last token, which moves neither. `levels`
        # [B, Hkv, D]: each channel's 2^width - 1 (else 2^bits - 1 for all).
        b, h, n, d = x.shape
        pad = -n % KIVI_GROUP
        if pad:
            x = mx.concatenate([x, mx.repeat(x[:, :, -1:], pad, axis=2)], axis=2)
        g = x.reshape(b, h, -1, KIVI_GROUP, d)
        top = float(2**bits - 1) if levels is None else levels[:, :, None, None, :]
        lo, hi = _f16(mx.min(g, axis=3, keepdims=True)), mx.max(g, axis=3, keepdims=True)
        scale = _f16((hi - lo) / top)
        codes = mx.clip(mx.round((g - lo) / mx.maximum(scale, 1e-30)), 0, top)
        return (lo + scale * codes).reshape(b, h, -1, d)[:, :, :n]

    def _query_levels(self, bits: int) -> mx.array:
        """Each channel's levels for "kivi-query" keys of ``bits``: the
        widths the cache would give them (:func:`query_channel_widths`'s
        weights, over every calibration token)."""
        if self.query_energy is None:
            raise ValueError("kivi-query keys need the queries' channel energy")
        b, h, d = self.query_energy.shape
        if self._channel_weights is None:  # read once (a sync) for every width
            span = mx.max(self.centred, axis=2) - mx.min(self.centred, axis=2)
            self._channel_weights = channel_weights(self.query_energy, span).reshape(b * h, d).tolist()
        widths = _native.kivi_channel_widths(self._channel_weights, bits)
        return (2.0 ** mx.array(widths, dtype=mx.float32) - 1).reshape(b, h, d)

    def keys_as(self, c: Choice) -> mx.array:
        if c == FP16:
            return self.keys
        if c.method == "turboquant-mse":
            dec = self._turboquant("k", c.bits)
        elif c.method == "kivi":
            dec = self._kivi_keys(self.centred, c.bits)
        elif c.method == "kivi-query":
            dec = self._kivi_keys(self.centred, c.bits, self._query_levels(c.bits))
        else:
            raise ValueError(f"no stand-in for {c.method} keys")
        return mx.concatenate([self.keys[:, :, : self.sinks], dec + self.mean], axis=2)

    def values_as(self, c: Choice) -> mx.array:
        if c == FP16:
            return self.values
        if c.method != "turboquant-mse":
            raise ValueError(f"no stand-in for {c.method} values")
        return mx.concatenate([self.values[:, :, : self.sinks], self._turboquant("v", c.bits)], axis=2)


# --- errors -----------------------------------------------------------------------


class _Attention:
    """Exact attention of sampled queries over stacked layers (one per batch
    row), to compare compressed keys and values against."""

    def __init__(self, queries: mx.array, positions: Sequence[int], keys: mx.array, values: mx.array):
        B, H, n, D = queries.shape
        hkv, L = keys.shape[1], keys.shape[2]
        self.shape = (B, hkv, H // hkv, n, D)
        self.scale = D**-0.5
        # [B, Hkv, rep * n, D]: a KV head with the query heads that read it.
        self.q = queries.astype(mx.float32).reshape(B, hkv, (H // hkv) * n, D)
        p = mx.array(list(positions) * (H // hkv))[:, None]
        self.mask = mx.where(mx.arange(L)[None, :] <= p, 0.0, -mx.inf)  # causal
        self.keys = keys.astype(mx.float32)
        self.values = values.astype(mx.float32)
        self.weights = self._weights(keys)
        self.out = self.weights @ self.values

    def _weights(self, keys: mx.array) -> mx.array:
        k = keys.astype(mx.float32)
        return mx.softmax(self.scale * (self.q @ k.swapaxes(-1, -2)) + self.mask, axis=-1)

    def key_change(self, keys: mx.array, linear: bool = False) -> mx.array:
        """softmax(q K̂ᵀ) V - softmax(q Kᵀ) V; ``linear``: to first order in
        the score changes, A (ds - (A ds)) V."""
        if not linear:
            return self._weights(keys) @ self.values - self.out
        ds = self.scale * (self.q @ (keys.astype(mx.float32) - self.keys).swapaxes(-1, -2))
        a = self.weights * ds
        return a @ self.values - mx.sum(a, axis=-1, keepdims=True) * self.out

    def value_change(self, values: mx.array) -> mx.array:
        """A V̂ - A V."""
        return self.weights @ (values.astype(mx.float32) - self.values)

    def heads_last(self, x: mx.array) -> mx.array:
        """[B, Hkv, rep * n, D] -> [B, n, H * D], the heads in the order the
        output projection reads them."""
        _, hkv, rep, n, D = self.shape
        B = x.shape[0]
        return x.reshape(B, hkv, rep, n, D).transpose(0, 3, 1, 2, 4).reshape(B, n, hkv * rep * D)


def _out_proj_matrix(proj) -> Optional[mx.array]:
    """An attention output projection as a float32 matrix [H * D, hidden]
    (a float or quantized mlx Linear), or None."""
    w = getattr(proj, "weight", None)
    if w is None:
        return None
    if "scales" in proj:
        w = mx.dequantize(w, proj.scales, proj.get("biases"), proj.group_size, proj.bits)
    return w.astype(mx.float32).T


class _Scorer:
    """Each layer's error for changes of the attention output of stacked
    layers: ``|W_o (ô - o)|² / |h|²``, the change the residual stream takes
    relative to the stream entering the block, averaged over the sampled
    positions; ``|ô - o|² / |o|²`` for a layer without a projection or
    stream to measure against."""

    def __init__(self, att: _Attention, samples: Sequence[LayerSample]):
        self.att = att
        proj = [_out_proj_matrix(s.out_proj) if s.stream is not None else None for s in samples]
        self.residual = all(p is not None for p in proj)
        if self.residual:
            self.proj = mx.stack(proj)  # [B, H * D, hidden]
            h = mx.concatenate([s.stream for s in samples], axis=0).astype(mx.float32)
            self.norm = mx.maximum(mx.sum(h * h, axis=-1), 1e-30)  # [B, n]
        else:
            o = att.out
            self.norm = mx.maximum(mx.sum(o.reshape(o.shape[0], -1) ** 2, axis=1), 1e-30)

    def __call__(self, changes: Sequence[mx.array]) -> List[mx.array]:
        """Per change ([B, Hkv, rep * n, D]): each layer's error, [B]. The
        changes go through the projections in one product."""
        if not self.residual:
            return [mx.sum(c.reshape(c.shape[0], -1) ** 2, axis=1) / self.norm for c in changes]
        d = mx.concatenate([self.att.heads_last(c) for c in changes], axis=1)  # [B, changes * n, H * D]
        y = d @ self.proj
        e = (mx.sum(y * y, axis=-1)).reshape(d.shape[0], len(changes), -1) / self.norm[:, None, :]
        return list(mx.mean(e, axis=2).T)


@dataclasses.dataclass
class LayerErrors:
    index: int
    kv_heads: int
    head_dim: int
    keys: Dict[Choice, float]
    values: Dict[Choice, float]


def measure(samples: Sequence[LayerSample], sinks: int = 4, seed: int = 0) -> List[LayerErrors]:
    """Each layer's key and value errors for every candidate. Layers of one
    shape are stacked along the batch and scored in one graph."""
    groups: Dict[tuple, List[LayerSample]] = {}
    for s in samples:
        groups.setdefault((s.queries.shape, s.keys.shape), []).append(s)
    out = {}
    for group in groups.values():
        cat = lambda name: mx.concatenate([getattr(s, name) for s in group], axis=0)  # noqa: E731
        keys, values = cat("keys"), cat("values")
        queries = cat("queries")
        att = _Attention(queries, group[0].positions, keys, values)
        b, h, n, d = queries.shape
        energy = mx.mean(mx.square(queries.astype(mx.float32)).reshape(b, keys.shape[1], -1, n, d), axis=(2, 3))
        codecs = Codecs(keys, values, sinks, seed, MEAN_SHARE, energy)
        score = _Scorer(att, group)
        kc = [c for c in key_candidates() if c != FP16]
        vc = [c for c in value_candidates() if c != FP16]
        changes = [att.key_change(codecs.keys_as(c), linear=c.bits >= LINEAR_FROM_BITS) for c in kc]
        changes += [att.value_change(codecs.values_as(c)) for c in vc]
        errors = score(changes)
        kerr = {c: (TURBOQUANT_KEY_WEIGHT if c.method == "turboquant-mse" else 1.0) * e for c, e in zip(kc, errors[: len(kc)])}
        verr = {c: VALUE_WEIGHT * e for c, e in zip(vc, errors[len(kc) :])}
        mx.eval(kerr, verr)
        _, hkv, _, d = keys.shape
        kerr = {c: e.tolist() for c, e in kerr.items()}
        verr = {c: e.tolist() for c, e in verr.items()}
        for r, s in enumerate(group):
            ke = {c: e[r] for c, e in kerr.items()}
            ve = {c: e[r] for c, e in verr.items()}
            ke[FP16] = ve[FP16] = 0.0
            out[s.index] = LayerErrors(s.index, hkv, d, ke, ve)
    return [out[s.index] for s in samples]


# --- the cache's own round trip (protect="auto") ------------------------------------


def _round_trip(keys: mx.array, values: mx.array, key: Choice, value: Choice, sinks: int, seed: int):
    """``keys`` and ``values`` after the cache compressed them (all but the
    sinks and one recent token), decoded. Each batch row is centred and
    scaled on its own, so rows may be different layers."""
    _, hkv, _, d = keys.shape
    layer = _native.LayerCache(
        d, hkv, key_method=key.method, key_bits=key.bits, value_method=value.method, value_bits=value.bits,
        window=1, sinks=sinks, seed=seed,
    )
    layer.append(keys, values)
    return layer.dequantize()


def outlier_error(queries: mx.array, keys: mx.array, values: mx.array, config) -> float:
    """Attention-output error |ô - o|² / |o|² of ``keys`` compressed as
    ``config`` says (values exact), the largest over the batch, from the
    queries of the last MAX_QUERIES * 2 positions or fewer, spread."""
    L = queries.shape[2]
    n = min(2 * MAX_QUERIES, L)
    positions = sorted({L - 1 - (j * (L - 1)) // max(n - 1, 1) for j in range(n)})
    att = _Attention(queries[:, :, mx.array(positions), :], positions, keys, values)
    k, _ = _round_trip(keys, values, Choice(config.key_method, config.key_bits), FP16, config.sinks, config.seed)
    change = att.key_change(k)
    o = att.out
    per_row = lambda x: mx.sum(x.reshape(x.shape[0], -1) ** 2, axis=1)  # noqa: E731
    return float(mx.max(per_row(change) / mx.maximum(per_row(o), 1e-30)).item())


# --- bits -------------------------------------------------------------------------


class Layout:
    """Bits per element of a layer's candidate pairs as a ``LayerCache`` of
    these settings stores them: at ``context`` tokens (as after appending
    them at once) everything it stores for them (codes, norms, scales, the
    float16 sinks and window, the key mean) and, once per set of layers with
    the same pair, the shared rotation and codebooks; with ``context`` None,
    what each compressed token adds (codes and their side data), which every
    long context approaches."""

    # Two long contexts of the same window occupancy: their difference is
    # what compressed tokens alone cost.
    _FAR = (8192, 16384)

    def __init__(self, window: int, sinks: int, seed: int, context: Optional[int] = None):
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise ValueError(f"context must be a number of tokens >= 1 or None, got {context!r}")
        self.window, self.sinks, self.seed, self.context = window, sinks, seed, context

    def pair_bits(self, head_dim: int, key: Choice, value: Choice) -> float:
        """Stored bits per key/value element of a layer with this pair."""
        if key == FP16 and value == FP16:
            return 16.0  # mlx_lm's float16 cache
        if self.context is None:
            lo, hi = (self._bytes(head_dim, key, value, n)[0] for n in self._FAR)
            return 8 * (hi - lo) / (2 * head_dim * (self._FAR[1] - self._FAR[0]))
        return 8 * self._bytes(head_dim, key, value, self.context)[0] / (2 * head_dim * self.context)

    def shared_bits(self, head_dim: int, key: Choice, value: Choice, elements: int) -> float:
        """The pair's shared rotation and codebooks, in bits per element of a
        model holding ``elements`` key and value elements; 0 without a context."""
        if self.context is None or (key == FP16 and value == FP16):
            return 0.0
        return 8 * self._bytes(head_dim, key, value, self.context)[1] / elements

    def _bytes(self, head_dim: int, key: Choice, value: Choice, tokens: int) -> Tuple[int, int]:
        return _layer_bytes(head_dim, key, value, self.window, self.sinks, self.seed, tokens)


@functools.lru_cache(maxsize=4096)
def _layer_bytes(head_dim, key, value, window, sinks, seed, tokens) -> Tuple[int, int]:
    """(data bytes, shared bytes) of a one-head ``LayerCache`` holding
    ``tokens`` tokens appended at once; its arrays are never evaluated."""
    # "kivi-query" keys store what KIVI keys do, and their offsets per channel.
    widths = {"key_widths": [key.bits] * head_dim} if key.method == "kivi-query" else {}
    layer = _native.LayerCache(
        head_dim, 1, key_method="kivi" if widths else key.method, key_bits=key.bits, value_method=value.method,
        value_bits=value.bits, window=window, sinks=sinks, seed=seed, **widths,
    )
    z = mx.zeros((1, 1, tokens, head_dim), dtype=mx.float16)
    layer.append(z, z)
    return layer.data_nbytes, layer.shared_nbytes


# --- allocation -------------------------------------------------------------------


@dataclasses.dataclass
class Recipe:
    """What :func:`allocate` chose: per layer, the key and value choices."""

    choices: Dict[int, Tuple[Choice, Choice]]
    bits: Dict[int, float]  # per layer: stored bits per key/value element (Layout.pair_bits)
    error: Dict[int, float]  # per layer: key error + value error
    bits_per_element: float  # over the layers given, weighted by their elements, shared tables included
    context: Optional[int] = None  # Layout.context the bits count at

    def overrides(self) -> Dict[int, Optional[dict]]:
        """``KVConfig.layers`` entries: None for a float16 layer."""
        out = {}
        for i, (k, v) in self.choices.items():
            if k == FP16 and v == FP16:
                out[i] = None
            else:
                out[i] = {**k.settings("key"), **v.settings("value")}
        return out

    def lines(self) -> List[str]:
        return [
            f"layer {i}: keys {k.label}, values {v.label} ({self.bits[i]:.2f} bits/el, error {self.error[i]:.2e})"
            for i, (k, v) in sorted(self.choices.items())
        ]

    def summary(self) -> str:
        """One line: the bits, then runs of layers with the same choice."""
        runs: List[List] = []
        for i, (k, v) in sorted(self.choices.items()):
            label = f"k {k.label} v {v.label}"
            if runs and runs[-1][2] == label and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i, label])
        parts = [f"{a}{'-' + str(b) if b != a else ''}: {lab}" for a, b, lab in runs]
        at = f"at {self.context} tokens" if self.context is not None else "of compressed tokens"
        return f"{self.bits_per_element:.2f} bits/el {at}; " + "; ".join(parts)


def allocate(
    errors: Sequence[LayerErrors], bits_budget: float, layout: Optional[Layout] = None,
    fixed: Optional[Dict[int, Tuple[Choice, Choice]]] = None,
) -> Recipe:
    """Greedy: every side starts at its cheapest candidate; then, while the
    budget allows, the upgrade with the most error removed per added bit is
    taken (a pair no other layer uses yet adds its shared tables to the
    cost). ``fixed`` layers keep the given choices (their bits count)."""
    if isinstance(bits_budget, bool) or not isinstance(bits_budget, (int, float)) or not math.isfinite(bits_budget):
        raise ValueError(f"bits_budget must be a number of bits per element, got {bits_budget!r}")
    layout = layout if layout is not None else Layout(window=128, sinks=4, seed=0)
    fixed = dict(fixed or {})
    by_index = {e.index: e for e in errors}
    weight = {e.index: 2 * e.kv_heads * e.head_dim for e in errors}  # key and value elements per token
    total_w = sum(weight.values())
    elements = total_w * (layout.context or 1)

    # The layout's figures per (head size, pair), looked up in the loop below.
    pair_bits: Dict[tuple, float] = {}
    set_bits: Dict[tuple, float] = {}

    def table_key(i, pair):
        return (by_index[i].head_dim,) + tuple(pair)

    def bits(i, pair):
        key = table_key(i, pair)
        if key not in pair_bits:
            pair_bits[key] = layout.pair_bits(*key)
        return pair_bits[key]

    def table_bits(i, pair) -> float:
        key = table_key(i, pair)
        if key not in set_bits:
            set_bits[key] = layout.shared_bits(*key, elements)
        return set_bits[key]

    cur: Dict[int, Tuple[Choice, Choice]] = {}
    for e in errors:
        if e.index in fixed:
            cur[e.index] = tuple(FP16 if c.method == "fp16" else c for c in fixed[e.index])
            continue
        k = min(e.keys, key=lambda c: (bits(e.index, (c, FP16)), e.keys[c]))
        v = min(e.values, key=lambda c: (bits(e.index, (k, c)), e.values[c]))
        cur[e.index] = (k, v)
    # Layers per shared set in use: a set costs its tables once.
    users = collections.Counter(table_key(i, p) for i, p in cur.items())
    spent = sum(weight[i] * bits(i, p) for i, p in cur.items()) / total_w
    spent += sum(table_bits(i, p) for i, p in {table_key(i, p): (i, p) for i, p in cur.items()}.values())
    if spent > bits_budget * (1 + 1e-9):
        raise ValueError(f"bits_budget {bits_budget:g} is below the cheapest recipe's {spent:.3f} bits/element")
    limit = bits_budget * (1 + 1e-9)

    def upgrades(i) -> List[tuple]:
        """Layer i's upgrades that remove error: (rate, pair, extra bits), best rate first."""
        e, (k, v) = by_index[i], cur[i]
        here = bits(i, (k, v))
        freed = table_bits(i, (k, v)) if users[table_key(i, (k, v))] == 1 else 0.0
        out = []
        for side, table, now in (("k", e.keys, k), ("v", e.values, v)):
            for n, err in table.items():
                gain = table[now] - err
                if gain <= 0:
                    continue
                pair = (n, v) if side == "k" else (k, n)
                added = 0.0 if users[table_key(i, pair)] else table_bits(i, pair)
                extra = weight[i] * (bits(i, pair) - here) / total_w + added - freed
                if extra > 0:
                    out.append((gain / extra, pair, extra))
        return sorted(out, key=lambda u: -u[0])

    free = [i for i in cur if i not in fixed]
    options = {i: upgrades(i) for i in free}
    while True:
        best = None
        for i in free:
            for rate, pair, extra in options[i]:
                if spent + extra <= limit:
                    if best is None or rate > best[0]:
                        best = (rate, i, pair, extra)
                    break
        if best is None:
            break
        _, i, pair, extra = best
        old, new = table_key(i, cur[i]), table_key(i, pair)
        users[old] -= 1
        users[new] += 1
        cur[i] = pair
        spent += extra
        # A set coming into use, going out of it, or gaining or losing its
        # last but one user changes what other layers' upgrades add or free.
        if users[old] <= 1 or users[new] <= 2:
            options = {j: upgrades(j) for j in free}
        else:
            options[i] = upgrades(i)
    # The total afresh (the loop added increments).
    spent = sum(weight[i] * bits(i, p) for i, p in cur.items()) / total_w
    spent += sum(table_bits(i, p) for i, p in {table_key(i, p): (i, p) for i, p in cur.items()}.values())
    return Recipe(
        dict(cur),
        {i: bits(i, p) for i, p in cur.items()},
        {i: by_index[i].keys.get(p[0], 0.0) + by_index[i].values.get(p[1], 0.0) for i, p in cur.items()},
        spent,
        layout.context,
    )


def auto_recipe(
    model, tokens: Sequence[int], bits_budget: float, config, context: Optional[int] = None
) -> Tuple[object, Recipe]:
    """The KVConfig of :meth:`KVConfig.auto`, and the recipe it holds
    (``config``: a ``veloxquant.cache.KVConfig`` with the other settings)."""
    if not all(hasattr(config, a) for a in ("resolve", "for_layer", "widths_from_queries")):
        raise TypeError(f"config must be a veloxquant.KVConfig, got {type(config).__name__}")
    if config.protect == "auto":
        raise ValueError("protect='auto' cannot be combined with an automatic recipe, which already picks float16 layers")
    layout = Layout(config.window, config.sinks, config.seed, context)
    samples = calibrate(model, tokens)
    resolved = config.resolve(_layer_count(model))
    fixed = {}
    for s in samples:
        if s.index in resolved.layers:
            c = resolved.for_layer(s.index)
            fixed[s.index] = (FP16, FP16) if c is None else (
                _choice("kivi-query" if c.widths_from_queries() else c.key_method, c.key_bits),
                _choice(c.value_method, c.value_bits),
            )
    errors = measure(samples, config.sinks, config.seed)
    recipe = allocate(errors, bits_budget, layout, fixed)
    layers = dict(resolved.layers)
    layers.update({i: ov for i, ov in recipe.overrides().items() if i not in fixed})
    return dataclasses.replace(resolved, layers=layers), recipe


def _choice(method: str, bits: int) -> Choice:
    return FP16 if method == "fp16" else Choice(method, bits)


def _layer_count(model) -> int:
    return len(base_caches(model))
