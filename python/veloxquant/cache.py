"""mlx_lm caches backed by veloxquant's compressed ``LayerCache``.

``make_prompt_cache(model, config)`` builds a model's cache list with a
``VeloxQuantCache`` in every layer that mlx_lm would give a plain ``KVCache``;
sliding-window (``RotatingKVCache``), state-space and other layers keep the
model's own caches. ``install(model, config)`` makes ``model.make_cache`` do the
same, so mlx_lm's own code paths (``generate``, ``stream_generate``, the server)
build veloxquant caches.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    create_attention_mask,
)

from . import attention, distributed
from .batch_cache import VeloxQuantBatchCache
from .model_caches import base_caches, replace_make_cache, restore_make_cache
from .recipe import auto_recipe, outlier_error, query_channel_widths
from .state_files import (
    STATE_KEYS,
    CorruptStateError,
    called_from_save_prompt_cache,
    check_state_checksums,
    file_note,
    state_checksums,
)
from .attention import FUSED_MAX_QUERIES, _up
# DEFAULT_KEY_BITS and default_value_bits: the default recipe (KVConfig without
# key_bits or value_bits; bench's k4v3), the crate's, as LayerCache takes it.
from ._native import CACHE_METHOD_ALIASES, CACHE_METHODS, DEFAULT_KEY_BITS, MAX_KIVI_KEY_GROUP, LayerCache, default_value_bits

_FIELDS = ("key_method", "key_bits", "value_method", "value_bits", "window", "sinks", "seed", "policy", "key_group",
           "key_channel_bits")
# How KIVI keys share their bits among channels.
KEY_CHANNEL_BITS = ("uniform", "query")
# The widths MLX quantizes to: mlx_lm's QuantizedKVCache takes no other.
MLX_QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)
POLICIES = ("auto", "require", "off")
# The cache's methods, in the crate's order (`cache::METHODS`).
METHODS = tuple(CACHE_METHODS)
# Methods that store keys only (attention-score estimators).
KEY_ONLY_METHODS = tuple(m for m, (_, keys_only) in CACHE_METHODS.items() if keys_only)
# protect="auto": a layer whose keys, compressed as configured, change its
# attention output by more than this (relative squared error, measured on its
# first chunk: veloxquant.recipe.outlier_error) keeps float16. SmolLM2-135M's
# layers measure at most 0.02 at 4 bits, 0.09 at 3 and 0.25 at 2 (256
# tokens of English); a layer past this loses much of what it attends to.
AUTO_PROTECT_ERROR = 0.3
# A chunk added before the last one was attended through the cache.
_BYPASSED = (
    "the model's attention bypassed mlx_lm.models.base.scaled_dot_product_attention, so it "
    "did not read the compressed cache; call veloxquant.attention.install() before the model "
    "runs (make_prompt_cache and install do), or use --kv-cache fp16 for this model"
)


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """How veloxquant compresses a model's keys and values.

    The default recipe is TurboQuant-MSE keys at 4 bits and values at 3
    (keys cause nearly all of the loss). Otherwise ``value_method`` and
    ``value_bits`` default to the key settings; key-only methods (``qjl``,
    ``turboquant-prod``, which estimate scores and cannot return values) pair
    by default with ``turboquant-mse`` values at 4 bits.
    ``window``
    recent tokens and ``sinks`` first tokens stay in float16. ``layers`` maps a
    layer index to overrides of these fields (``{"key_bits": 8}``), or to
    ``None`` to leave that layer to the model's own float16 cache.

    ``protect`` lists layers (negative indices count from the last) that keep
    float16, or with ``protect_bits`` get keys and values of that many bits
    (same methods); ``protect="auto"`` keeps float16 the layers whose keys,
    compressed as configured, change their attention output by more than
    ``AUTO_PROTECT_ERROR`` on the first chunk they see (decided before they
    compress anything). :meth:`auto` measures a per-layer recipe instead.

    ``key_group``: tokens of a KIVI key group (one float16 scale and zero
    per channel and group: ``32 / key_group`` bits per element), a multiple
    of 8 from 8 to 1024; other methods ignore it. At equal bits, groups of
    128 disturb attention less than TurboQuant keys
    (``docs/results/key-error-smollm2.md``).

    ``key_channel_bits``: ``"uniform"`` gives every channel of KIVI keys
    ``key_bits``; ``"query"`` gives each channel of each KV head 1 to 8 bits,
    ``key_bits`` on average (the same bytes), where the layer's first chunk
    says a bit removes the most score error (``E[q_c²]·range(k_c)²`` over its
    queries and keys): that chunk waits for its queries before anything is
    compressed. At equal bits it halves KIVI's attention KL on SmolLM2-135M.
    Layers whose keys are not KIVI ignore it.
    """

    key_method: str = "turboquant-mse"
    key_bits: Optional[int] = None
    value_method: Optional[str] = None
    value_bits: Optional[int] = None
    window: int = 128
    sinks: int = 4
    seed: int = 0
    policy: str = "auto"
    layers: Mapping[int, Optional[Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    protect: Union[str, Tuple[int, ...]] = ()
    protect_bits: Optional[int] = None
    key_group: int = 32
    key_channel_bits: str = "uniform"

    def __post_init__(self):
        default_bits = self.key_bits is None
        if default_bits:
            object.__setattr__(self, "key_bits", DEFAULT_KEY_BITS)
        # A method's other names (the crate's aliases) become its name.
        for name in ("key_method", "value_method"):
            v = getattr(self, name)
            if isinstance(v, str) and v in CACHE_METHOD_ALIASES:
                object.__setattr__(self, name, CACHE_METHOD_ALIASES[v])
        if self.value_method is None:
            if self.key_method in KEY_ONLY_METHODS:
                object.__setattr__(self, "value_method", "turboquant-mse")
                if self.value_bits is None:
                    object.__setattr__(self, "value_bits", 4)
            else:
                object.__setattr__(self, "value_method", self.key_method)
        for name in ("key_method", "value_method"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"KVConfig.{name} must be a method name (e.g. 'turboquant-mse'), got {v!r}")
            if v not in METHODS:
                raise ValueError(f"KVConfig.{name}: unknown method {v!r}; choose from {', '.join(METHODS)}")
        for name in ("key_bits", "value_bits"):
            if name == "value_bits" and self.value_bits is None:
                given = None if default_bits else self.key_bits
                object.__setattr__(self, "value_bits", default_value_bits(self.key_method, self.value_method, given))
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16:
                raise ValueError(f"KVConfig.{name} must be an integer from 1 to 16, got {v!r}")
        for name in ("window", "sinks", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KVConfig.{name} must be an integer >= 0, got {v!r}")
        g = self.key_group
        if isinstance(g, bool) or not isinstance(g, int) or not 8 <= g <= MAX_KIVI_KEY_GROUP or g % 8:
            raise ValueError(
                f"KVConfig.key_group must be a multiple of 8 from 8 to {MAX_KIVI_KEY_GROUP} (tokens), got {g!r}"
            )
        if self.key_channel_bits not in KEY_CHANNEL_BITS:
            raise ValueError(f"KVConfig.key_channel_bits must be one of {KEY_CHANNEL_BITS}, got {self.key_channel_bits!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"KVConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.layers, Mapping):
            raise ValueError(f"KVConfig.layers must map layer index -> overrides, got {type(self.layers).__name__}")
        for i, ov in self.layers.items():
            if isinstance(i, bool) or not isinstance(i, int):
                raise ValueError(f"KVConfig.layers keys must be layer indices (int), got {i!r}")
            if ov is None:
                continue
            if not isinstance(ov, Mapping):
                raise ValueError(f"KVConfig.layers[{i}] must be a dict of overrides or None, got {ov!r}")
            bad = set(ov) - set(_FIELDS)
            if bad:
                raise ValueError(f"KVConfig.layers[{i}] has unknown fields {sorted(bad)}; known: {list(_FIELDS)}")
            self.for_layer(i)  # validates the merged settings
        self._check_protect()

    def _check_protect(self) -> None:
        p = self.protect
        if isinstance(p, str):
            if p != "auto":
                raise ValueError(f"KVConfig.protect must be 'auto' or a list of layer indices, got {p!r}")
        elif isinstance(p, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            dup = sorted({i for i in p if list(p).count(i) > 1})
            if dup:
                raise ValueError(f"KVConfig.protect lists layer {dup[0]} more than once")
            object.__setattr__(self, "protect", tuple(p))
        else:
            raise ValueError(f"KVConfig.protect must be 'auto' or a list of layer indices (int), got {p!r}")
        b = self.protect_bits
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 16:
                raise ValueError(f"KVConfig.protect_bits must be an integer from 1 to 16 or None, got {b!r}")
            if p == "auto":
                raise ValueError("KVConfig.protect_bits applies to listed layers; protect='auto' keeps float16")
            if not p:
                raise ValueError("KVConfig.protect_bits needs KVConfig.protect (the layers it applies to)")

    def protected(self) -> Optional[Dict[str, Any]]:
        """A protected layer's overrides: None (float16) or protect_bits."""
        if self.protect_bits is None:
            return None
        return {"key_bits": self.protect_bits, "value_bits": self.protect_bits}

    def resolve(self, n_layers: int) -> "KVConfig":
        """This config for a model of ``n_layers`` layers: listed protected
        layers become ``layers`` entries (negative indices counted from the
        last). ValueError naming ``protect`` for an index out of range, one
        layer named twice, or a layer that ``layers`` configures too."""
        if self.protect == "auto" or not self.protect:
            return self
        layers = dict(self.layers)
        seen = {}
        for i in self.protect:
            if not -n_layers <= i < n_layers:
                raise ValueError(
                    f"KVConfig.protect: layer {i} is out of range for a model of {n_layers} layers "
                    f"(indices {-n_layers} to {n_layers - 1})"
                )
            j = i % n_layers
            if j in seen:
                raise ValueError(f"KVConfig.protect: layers {seen[j]} and {i} are the same layer of {n_layers}")
            seen[j] = i
            if j in layers:
                raise ValueError(f"KVConfig.protect: layer {i} also has KVConfig.layers settings; give it one or the other")
            layers[j] = self.protected()
        return dataclasses.replace(self, layers=layers, protect=(), protect_bits=None)

    @classmethod
    def auto(cls, model, tokens, bits_budget: float = 3.5, context: Optional[int] = None, **settings) -> "KVConfig":
        """A config with a measured recipe per layer (``layers``): one float16
        forward over ``tokens`` (at most veloxquant.recipe.MAX_TOKENS are
        used) collects each layer's keys, values and queries; candidates
        (TurboQuant-MSE keys and values at 2, 3 and 4 bits, KIVI keys at 2,
        3, 4 and 8, and float16) are compared by the error their change of
        the attention output makes in the residual stream, and bits go
        greedily where they remove the most error, keeping the stored bits
        per key/value element within ``bits_budget``. With ``context`` (a
        number of tokens) the budget counts everything the cache stores at
        that length, as ``cache_data_nbytes`` does: codes, norms, scales,
        the float16 sinks and window, key means and the shared rotations and
        codebooks; without, what each compressed token stores, which long
        contexts approach. ``settings`` are the other fields (window, sinks,
        seed, policy; layers that ``protect`` or ``layers`` configure keep
        those settings, and count in the budget). See veloxquant.recipe."""
        return auto_recipe(model, tokens, bits_budget, cls(**settings), context)[0]

    def settings(self) -> Dict[str, Any]:
        """This config's fields (no per-layer overrides)."""
        return {k: getattr(self, k) for k in _FIELDS}

    def layer_kwargs(self) -> Dict[str, Any]:
        """The LayerCache keyword arguments (no per-layer overrides; the
        widths that ``key_channel_bits="query"`` measures are added when the
        layer is made)."""
        d = self.settings()
        del d["key_channel_bits"]
        return d

    def widths_from_queries(self) -> bool:
        """Whether KIVI keys take bits per channel from the first queries."""
        return self.key_channel_bits == "query" and self.key_method == "kivi"

    def for_layer(self, index: int) -> Optional["KVConfig"]:
        """This config with layer ``index``'s overrides; None if the layer is left alone."""
        if index not in self.layers:
            return dataclasses.replace(self, layers={})
        ov = self.layers[index]
        if ov is None:
            return None
        if self.protect == "auto":
            return dataclasses.replace(self.for_layer_of(ov), protect="auto")
        return self.for_layer_of(ov)

    def for_layer_of(self, ov: Mapping[str, Any]) -> "KVConfig":
        """This config's settings with the overrides ``ov`` (no layers, no protect)."""
        base = self.settings()
        # An overridden key setting carries to values unless values are overridden too.
        if "key_method" in ov and "value_method" not in ov:
            base["value_method"] = ov["key_method"]
        if "key_bits" in ov and "value_bits" not in ov:
            base["value_bits"] = ov["key_bits"]
        base.update(ov)
        return KVConfig(**base)

    def to_json(self) -> str:
        d = self.settings()
        d["layers"] = {str(k): (dict(v) if v is not None else None) for k, v in self.layers.items()}
        if self.protect:
            d["protect"] = self.protect if self.protect == "auto" else list(self.protect)
        if self.protect_bits is not None:
            d["protect_bits"] = self.protect_bits
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "KVConfig":
        """The config ``to_json`` wrote; ValueError naming what is wrong otherwise."""
        if not isinstance(s, str):
            raise TypeError(f"KVConfig.from_json: expected a JSON str, got {type(s).__name__}")
        d = json.loads(s)
        if not isinstance(d, dict):
            raise ValueError(f"KVConfig JSON must be an object of settings, got {type(d).__name__}")
        extra = ["layers", "protect", "protect_bits"]
        unknown = set(d) - set(_FIELDS) - set(extra)
        if unknown:
            raise ValueError(f"KVConfig JSON has unknown fields {sorted(unknown)}; known: {list(_FIELDS) + extra}")
        layers = d.get("layers", {})
        if not isinstance(layers, dict) or not all(isinstance(k, str) and k.lstrip("-").isdigit() for k in layers):
            raise ValueError(f"KVConfig JSON: layers must map layer indices to overrides, got {layers!r}")
        d["layers"] = {int(k): v for k, v in layers.items()}
        return cls(**d)

    def check(self) -> "KVConfig":
        """Raise ValueError now if the native cache refuses these settings (e.g. a width the method lacks)."""
        for cfg in [self] + [self.for_layer(i) for i in self.layers]:
            if cfg is None:
                continue
            try:
                LayerCache(64, 1, **cfg.layer_kwargs())
            except (ValueError, TypeError) as e:
                raise ValueError(f"KVConfig {cfg.settings()}: {e}") from None
        if self.protect_bits is not None:
            cfg = self.for_layer_of(self.protected())
            try:
                LayerCache(64, 1, **cfg.layer_kwargs())
            except (ValueError, TypeError) as e:
                raise ValueError(f"KVConfig.protect_bits {self.protect_bits}: {e}") from None
        return self

    @property
    def bits_per_element(self) -> float:
        """Nominal key/value bits per element (ignoring the float16 window and sinks)."""
        return (self.key_bits + self.value_bits) / 2


class _FirstChunk(NamedTuple):
    """A layer's first prefill chunk, held until it attends over itself."""

    keys: mx.array
    values: mx.array

    def attend(self, queries: mx.array, scale: float, mask, float32: bool) -> mx.array:
        q, k, v = queries, self.keys, self.values
        if float32:
            q, k, v, mask = (_up(a) for a in (q, k, v, mask))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.astype(queries.dtype)


class VeloxQuantCache(_BaseCache):
    """One attention layer's keys and values, held compressed by a ``LayerCache``.

    The compressed store is created on the first ``update_and_fetch`` (head
    size and KV heads come from the keys). Attention must go through
    :func:`veloxquant.attention.scaled_dot_product_attention`, which mlx_lm's
    ``scaled_dot_product_attention`` dispatches to once
    :func:`veloxquant.attention.install` ran (``make_prompt_cache`` does it).
    """

    # What a pipeline stage tied to this cache (see ``keys``); a class default
    # too, for copies made without __init__.
    _after: Optional[mx.array] = None
    # (config, its JSON): mlx_lm reads the state after every prefill chunk,
    # and the config changes only by assignment (a KVConfig is frozen).
    _config_json: Optional[Tuple["KVConfig", str]] = None
    # The attention dispatch attends a sequence over this cache.
    veloxquant_attention = attention.ONE

    def __init__(self, config: Optional[KVConfig] = None):
        config = config if config is not None else KVConfig()
        if not isinstance(config, KVConfig):
            raise TypeError(f"config must be a veloxquant.KVConfig, got {type(config).__name__}")
        self.config = config.for_layer(-1) if config.layers else config
        self.layer = None
        self._attended = True
        self._framed = None
        self._after = None
        # protect="auto": the first chunk, held until its queries arrive
        # (observe_queries) and the layer is found to need float16 or not.
        self._pending = None
        # The measured key error behind that decision, and the decision.
        self.outlier_error: Optional[float] = None
        self.protected = False

    # --- mlx_lm cache interface -------------------------------------------
    @property
    def offset(self) -> int:
        if self._pending is not None:
            return int(self._pending[0].shape[2])
        return 0 if self.layer is None else int(self.layer.offset)

    def size(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys and values must be [batch, kv_heads, tokens, head_dim], got {keys.shape} and {values.shape}"
            )
        if keys.shape[:3] != values.shape[:3] or keys.shape[-1] != values.shape[-1]:
            raise ValueError(
                f"veloxquant needs keys and values of one shape, got {keys.shape} and {values.shape}"
            )
        if self._pending is not None:
            raise RuntimeError(
                "the model's attention bypassed mlx_lm.models.base.scaled_dot_product_attention, so the "
                "cache never saw its queries; call veloxquant.attention.install() before the model runs"
            )
        if self.layer is None and (self.config.protect == "auto" or self.config.widths_from_queries()):
            # Nothing is compressed until the first queries decide this layer's layout.
            self._pending = (keys, values)
            return keys, values
        return self._store(keys, values)

    def observe_queries(self, queries: mx.array) -> None:
        """Called by the attention dispatch with each chunk's queries, before it
        attends: under protect="auto" the first one decides the layer's layout."""
        if self._pending is None:
            return
        keys, values = self._pending
        self._pending = None
        if self.config.protect == "auto":
            self.outlier_error = outlier_error(queries, keys, values, self.config)
            self.protected = self.outlier_error > AUTO_PROTECT_ERROR
            # From here the config says what the layer holds (a saved state's config too).
            fp16 = dict(key_method="fp16", key_bits=16, value_method="fp16", value_bits=16) if self.protected else {}
            self.config = dataclasses.replace(self.config, protect=(), **fp16)
        widths = query_channel_widths(queries, keys, self.config.key_bits) if self.config.widths_from_queries() else None
        self._store(keys, values, widths)

    def _store(self, keys: mx.array, values: mx.array, key_widths: Optional[List[int]] = None):
        if self.layer is None:
            _, n_kv, _, head_dim = keys.shape
            kwargs = self.config.layer_kwargs()
            if key_widths is not None:
                kwargs["key_widths"] = key_widths
            self.layer = LayerCache(head_dim, n_kv, **kwargs)
        elif not self._attended:
            raise RuntimeError(_BYPASSED)
        self._attended = False
        # Decode: the fused attention reads the codes. Prefill: MLX's SDPA
        # over a transient buffer of the history and the chunk in the cache's
        # frame, taken before the chunk is compressed. Either way the chunk
        # itself is returned, only to satisfy the protocol: the attention
        # never reads it, and even a lazy graph of the dequantized history
        # would cost more host time a chunk than the buffer (`dequantize()`
        # gives it). A model that attended over the returned arrays instead
        # of through the dispatch is caught by the check above at its next call.
        if keys.shape[2] <= FUSED_MAX_QUERIES:
            self._framed = None
            self.layer.append(keys, values)
        elif self.layer.offset == 0:
            # A first chunk has no history: it attends over its own keys and
            # values as they came, as a float16 cache's does, with none of
            # the frame's query and output products or their transients.
            self._framed = _FirstChunk(keys, values)
            self.layer.append(keys, values)
        else:
            self._framed = self.layer.framed_append(keys, values)
        return keys, values

    def attention(self, queries: mx.array, scale: float, mask=None, float32: bool = False) -> mx.array:
        """The chunk just added attending over the cache; ``float32``: a
        prefill chunk's products in float32 (the output in the cache's dtype)."""
        if self.layer is None:
            raise RuntimeError("VeloxQuantCache.attention called before any keys were added")
        self._attended = True
        if isinstance(mask, str) and mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an mx.array, got {mask!r}")
        framed, self._framed = self._framed, None
        if isinstance(framed, _FirstChunk):
            return framed.attend(queries, scale, mask, float32)
        if framed is not None:
            return self.layer.attend_framed(queries, framed[0], framed[1], scale, mask, float32=float32)
        return self.layer.attention(queries, scale, mask)

    def decoding(self) -> bool:
        """Whether the chunk just added was one decode token the layer holds
        (nothing pending, no framed prefill buffer): what ``attention_each`` takes."""
        return self.layer is not None and self._pending is None and self._framed is None

    @staticmethod
    def attention_each(caches: Sequence["VeloxQuantCache"], queries: mx.array, scale: float) -> mx.array:
        """One decode query per cache (row ``b`` of ``queries`` over ``caches[b]``),
        attended in one call of the native layers (``LayerCache.attention_each``)."""
        out = LayerCache.attention_each([c.layer for c in caches], queries, scale)
        for c in caches:
            c._attended = True
        return out

    @staticmethod
    def append_each(caches: Sequence["VeloxQuantCache"], keys: mx.array, values: mx.array) -> None:
        """One decode token per cache (row ``b`` of ``keys`` and ``values`` into
        ``caches[b]``), appended in one call of the native layers
        (``LayerCache.append_each``). Each cache must hold tokens already and
        have attended its last chunk, as ``update_and_fetch`` requires."""
        for c in caches:
            if c.layer is None or c._pending is not None:
                raise RuntimeError("VeloxQuantCache.append_each: every cache must hold its prompt already")
            if not c._attended:
                raise RuntimeError(_BYPASSED)
        LayerCache.append_each([c.layer for c in caches], keys, values)
        for c in caches:
            c._attended, c._framed = False, None

    @property
    def state(self):
        # Arrays are lazy views of the used slots: mlx_lm evaluates the state
        # after every prefill chunk, which must copy nothing. Checksums need
        # the bytes, so they are added only when mlx_lm's save_prompt_cache
        # asks for the state to write it to a file.
        if called_from_save_prompt_cache():
            return self.checksummed_state()
        return self._state_parts()

    def _state_parts(self) -> Dict[str, Any]:
        if self._config_json is None or self._config_json[0] is not self.config:
            self._config_json = (self.config, self.config.to_json())
        state: Dict[str, Any] = {"config": self._config_json[1]}
        if self.layer is not None:
            arrays, layout = self.layer.state_parts()
            state["layout"] = json.dumps(layout, sort_keys=True)
            if arrays:
                if self._after is not None:
                    # Evaluating the state runs what the model tied to the cache (keys' setter).
                    name = next(iter(arrays))
                    arrays[name] = mx.depends(arrays[name], self._after)
                state["arrays"] = arrays
        return state

    # mlx_lm's pipeline stages tie their send of the hidden state to the last
    # layer's cache (``cache.keys = mx.depends(cache.keys, h)``) so that the
    # prefill's ``mx.eval(c.state)`` runs it; the cache holds no float16 keys,
    # so ``keys`` is a token array that carries such a dependency into ``state``.
    @property
    def keys(self) -> mx.array:
        return self._after if self._after is not None else mx.array(0, dtype=mx.int32)

    @keys.setter
    def keys(self, value: mx.array) -> None:
        if not isinstance(value, mx.array):
            raise TypeError(f"VeloxQuantCache.keys: expected an mlx.core.array dependency, got {type(value).__name__}")
        self._after = value

    def checksummed_state(self) -> Dict[str, Any]:
        """``state`` plus ``"crc32"``: a CRC-32 of the config, of the layout and of
        each array (name, dtype, shape and bytes), which ``from_state`` checks.

        Evaluates the arrays and reads their bytes on the host. mlx_lm's
        ``save_prompt_cache`` gets this state; call it to save a state some
        other way.
        """
        state = self._state_parts()
        state["crc32"] = json.dumps(state_checksums(state), sort_keys=True)
        return state

    @state.setter
    def state(self, v):
        if not isinstance(v, Mapping) or not isinstance(v.get("config"), str):
            raise ValueError(
                "VeloxQuantCache.state: expected a dict with a 'config' JSON string "
                f"(written by this version of veloxquant), got {type(v).__name__}"
            )
        unknown = set(v) - set(STATE_KEYS)
        if unknown:
            raise CorruptStateError(
                f"VeloxQuantCache.state{file_note()}: unknown entries {sorted(map(str, unknown))} "
                f"(expected {list(STATE_KEYS)}): the state is corrupt or was not written by veloxquant"
            )
        if "crc32" in v:
            check_state_checksums(v)
        try:
            self.config = KVConfig.from_json(v["config"])
            layout = json.loads(v["layout"]) if "layout" in v else None
            if layout is not None and not (
                isinstance(layout, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in layout.items())
            ):
                raise ValueError(f"the layout must be a JSON object of strings, got {layout!r}")
        except (ValueError, TypeError) as e:
            raise ValueError(f"VeloxQuantCache.state: the config or layout is not valid: {e}") from None
        arrays = v.get("arrays", {})
        if not isinstance(arrays, Mapping):
            raise TypeError(f"VeloxQuantCache.state: 'arrays' must be a dict of mlx.core.array, got {type(arrays).__name__}")
        self._attended, self._framed, self._pending, self._after = True, None, None, None
        # A state keeps the decided config, not the measurement behind it.
        self.__dict__.setdefault("outlier_error", None)
        self.__dict__.setdefault("protected", False)
        self.layer = None if layout is None else LayerCache.from_state_parts(dict(arrays), layout)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if self.layer is None:
            return 0
        return int(self.layer.trim(n))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def empty(self) -> bool:
        return self.layer is None or self.offset == 0

    @property
    def nbytes(self) -> int:
        return 0 if self.layer is None else int(self.layer.nbytes)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.config = self.config  # frozen
        new._attended, new._framed, new._pending, new._after = True, None, None, None
        new.outlier_error, new.protected = self.outlier_error, self.protected
        # MLX arrays are immutable: the copy takes the same arrays, no bytes move.
        new.layer = None if self.layer is None else type(self.layer).from_state_parts(*self.layer.state_parts())
        return new

    @classmethod
    def concat(cls, caches: Sequence["VeloxQuantCache"]) -> "VeloxQuantCache":
        """One cache whose batch rows are those of ``caches``, one after
        another: caches of one config holding the same number of tokens in
        the same layout, as prompts of one length prefilled a group at a
        time (``veloxquant bench --prefill-batch``). Sequences of different
        lengths join through :meth:`merge` instead. The arrays are copied
        (lazily): drop the parts to free theirs."""
        caches = list(caches)
        if not caches or not all(isinstance(c, VeloxQuantCache) for c in caches):
            raise TypeError("VeloxQuantCache.concat: caches must be a non-empty list of VeloxQuantCache")
        if any(c.layer is None or c._pending is not None for c in caches):
            raise ValueError("VeloxQuantCache.concat: every cache must hold tokens (a prefilled prompt)")
        states = [c._state_parts() for c in caches]
        layouts = [json.loads(st["layout"]) for st in states]
        first = {k: v for k, v in layouts[0].items() if k != "batch"}
        for i, (st, lay) in enumerate(zip(states, layouts)):
            if st["config"] != states[0]["config"]:
                raise ValueError(f"VeloxQuantCache.concat: cache {i}'s config differs from cache 0's")
            other = {k: v for k, v in lay.items() if k != "batch"}
            if other != first:
                diff = sorted(k for k in set(other) | set(first) if other.get(k) != first.get(k))
                raise ValueError(f"VeloxQuantCache.concat: cache {i} differs from cache 0 in {', '.join(diff)}")
        layout = dict(layouts[0], batch=str(sum(int(lay["batch"]) for lay in layouts)))
        names = states[0].get("arrays", {})
        arrays = {name: mx.concatenate([st["arrays"][name] for st in states], axis=0) for name in names}
        out = cls(KVConfig.from_json(states[0]["config"]))
        out.state = {"config": states[0]["config"], "layout": json.dumps(layout, sort_keys=True), "arrays": arrays}
        return out

    @classmethod
    def merge(cls, caches):
        """A batch of these sequences' caches (mlx_lm's batching calls it on
        one of them): see veloxquant.batch_cache."""
        return VeloxQuantBatchCache.merge(caches)

    def __repr__(self):
        c = self.config
        return (
            f"VeloxQuantCache(keys={c.key_method}/{c.key_bits}b, values={c.value_method}/{c.value_bits}b, "
            f"window={c.window}, sinks={c.sinks}, offset={self.offset}, nbytes={self.nbytes})"
        )


def make_prompt_cache(model, config: Optional[KVConfig] = None) -> List[Any]:
    """The model's cache list with ``VeloxQuantCache`` in its full-attention layers.

    Layers whose mlx_lm cache is not a plain ``KVCache`` (sliding windows,
    recurrent state, ...) keep it, and so do layers that ``config.layers``
    maps to None. Raises ValueError when no layer is left to compress or when
    the model's attention does not go through mlx_lm's dispatch.
    """
    config = config if config is not None else KVConfig()
    if not isinstance(config, KVConfig):
        raise TypeError(f"config must be a veloxquant.KVConfig, got {type(config).__name__}")
    config.check()
    attention.install()
    attention.check_model(model)
    caches = base_caches(model)
    # A pipeline stage holds some of the layers: the config names layers
    # model-wide.
    first, total = distributed.layer_span(model, len(caches))
    config = config.resolve(total)
    n = 0
    for i, c in enumerate(caches):
        layer_cfg = config.for_layer(first + i)
        if type(c) is KVCache and layer_cfg is not None:
            caches[i] = VeloxQuantCache(layer_cfg)
            n += 1
    if n == 0:
        kinds = sorted({type(c).__name__ for c in caches})
        raise ValueError(
            f"no layer of this model has a plain KVCache for veloxquant to replace (its caches: {kinds})"
        )
    return caches


def make_mlx_quantized_cache(model, bits: int = 4, group_size: int = 64) -> List[Any]:
    """mlx_lm's affine ``QuantizedKVCache`` from the first token in every plain KVCache layer."""
    if bits not in MLX_QUANTIZED_BITS:
        raise ValueError(f"bits for mlx's quantized KV cache must be one of {', '.join(map(str, MLX_QUANTIZED_BITS))}, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    caches = base_caches(model)
    return [
        QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in caches
    ]


def install(model, config: Optional[KVConfig] = None, kind: str = "veloxquant", **kwargs):
    """Make ``model.make_cache()`` build veloxquant caches (or ``kind="mlx-quantized"``).

    Every mlx_lm path that calls ``make_prompt_cache(model)`` then uses them.
    Returns the model. ``kind="fp16"`` restores the model's own caches.
    """
    if kind not in ("veloxquant", "mlx-quantized", "fp16"):
        raise ValueError(f"kind must be 'veloxquant', 'mlx-quantized' or 'fp16', got {kind!r}")
    restore_make_cache(model)
    if kind == "fp16":
        return model
    if kind == "veloxquant":
        config = config if config is not None else KVConfig()
        make_prompt_cache(model, config)  # fail now, not at the first request

        def make_cache():
            return make_prompt_cache(model, config)
    else:
        bits, group = kwargs.get("bits", 4), kwargs.get("group_size", 64)
        make_mlx_quantized_cache(model, bits, group)

        def make_cache():
            return make_mlx_quantized_cache(model, bits, group)

    replace_make_cache(model, kind, make_cache)
    return model


def uninstall(model):
    """Undo :func:`install`."""
    restore_make_cache(model)
    return model


def _shared_nbytes(caches) -> int:
    """Bytes of the rotations and codebooks veloxquant layers share, once per
    shared set (layers of one head size, seed, methods and bits hold the same
    arrays)."""
    total, seen = 0, set()
    for c in _each_sequence(caches):
        layer = getattr(c, "layer", None) if isinstance(c, VeloxQuantCache) else None
        if layer is not None and layer.shared_id is not None and layer.shared_id not in seen:
            seen.add(layer.shared_id)
            total += layer.shared_nbytes
    return total


def _each_sequence(caches):
    """The caches, with a batch cache's per-sequence caches in its place."""
    for c in caches:
        if isinstance(c, VeloxQuantBatchCache):
            yield from c.caches
        else:
            yield c


def cache_nbytes(caches) -> int:
    """Bytes held by a list of caches: the sum of their ``nbytes``, plus the
    rotation and codebooks that veloxquant layers share, counted once per
    shared set."""
    return int(sum(c.nbytes for c in caches) + _shared_nbytes(caches))


def cache_data_nbytes(caches) -> int:
    """Bytes a list of caches stores for the tokens it holds, without the
    capacity allocated ahead: veloxquant's codes, norms, scales, windows and
    means (``LayerCache.data_nbytes``) plus the shared rotations and codebooks
    once per set, mlx_lm's float16 and quantized caches' rows up to their
    offset. Other caches count what they hold."""
    total = _shared_nbytes(caches)
    for c in _each_sequence(caches):
        if isinstance(c, VeloxQuantCache):
            total += 0 if c.layer is None else c.layer.data_nbytes
            continue
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None or not hasattr(c, "offset"):
            total += getattr(c, "nbytes", 0)
            continue
        for side in (keys, values):
            # A quantized side is a tuple (codes, scales, biases), each with
            # its token rows on axis 2.
            for a in side if isinstance(side, (tuple, list)) else (side,):
                total += a.nbytes // a.shape[2] * c.offset if a.shape[2] else 0
    return int(total)


# mlx_lm's load_prompt_cache rebuilds caches by class name from its module globals.
_mlx_cache.VeloxQuantCache = VeloxQuantCache

# The batch of these caches (mlx_lm's merge) holds VeloxQuantCache objects.
VeloxQuantBatchCache.sequence_class = VeloxQuantCache
