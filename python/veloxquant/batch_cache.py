"""mlx_lm's batch-cache protocol over veloxquant caches, for ``BatchGenerator``
and the server's continuous batching.

A ``VeloxQuantBatchCache`` holds one batch-1 ``VeloxQuantCache`` per sequence
and stores only each sequence's real tokens in it: the left padding of a
merged batch and the right padding of a batched prompt are dropped, so every
sequence's cache (its compressed store, its protect="auto" decision) evolves
as it would alone, and greedy decoding gives each sequence its solo tokens.
The attention dispatch attends each sequence's queries over its own cache.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from . import attention
from .state_files import called_from_save_prompt_cache

if TYPE_CHECKING:  # for annotations only: veloxquant.cache imports this module
    from .cache import VeloxQuantCache


class VeloxQuantBatchCache(_BaseCache):
    """One attention layer's caches for a batch of sequences: ``caches[i]``
    holds sequence ``i``'s tokens (without padding).

    ``left_padding[i]`` tokens at the front of sequence ``i``'s next input
    are padding and are dropped (as ``BatchKVCache``'s constructor
    argument; only for empty caches). ``offset`` is the position of each
    sequence's next token, as ``BatchKVCache`` counts it.
    """

    # The attention dispatch attends each sequence over its own cache.
    veloxquant_attention = attention.EACH
    # The per-sequence cache class, VeloxQuantCache: veloxquant.cache, which
    # builds on this module, sets it when it is imported.
    sequence_class: Optional[type] = None

    @property
    def _sequences(self) -> type:
        if self.sequence_class is None:
            raise RuntimeError("VeloxQuantBatchCache needs veloxquant.cache imported: it defines the sequences' cache")
        return self.sequence_class

    def __init__(self, caches: Sequence[VeloxQuantCache], left_padding: Optional[Sequence[int]] = None):
        caches = list(caches)
        _check_caches("caches", caches, self._sequences)
        self.caches = caches
        self._drop = [0] * len(caches)  # left padding still to come, per sequence
        # The layout a BatchKVCache of the same tokens would have (its _idx and
        # left_padding): make_mask gives its mask, for float16 layers beside this one.
        lengths = [c.offset for c in caches]
        self._idx = max(lengths, default=0)
        self._pad = [self._idx - n for n in lengths]
        self._real = None  # during a right-padded prompt: real tokens still to come, per sequence
        self._right = None  # that prompt's right padding
        self._chunk = None  # the last update: per sequence (start, end, keys, values) or None
        self._offsets = None
        if left_padding is not None:
            self.prepare(left_padding=left_padding)

    # --- mlx_lm cache interface -------------------------------------------
    @property
    def offset(self) -> mx.array:
        if self._offsets is None:
            self._offsets = mx.array([c.offset - d for c, d in zip(self.caches, self._drop)])
        return self._offsets

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Stores each sequence's real tokens of the chunk in its own cache.
        Returns ``keys, values`` unchanged: the attention dispatch reads each
        sequence's cache (a model attending over the returned arrays itself
        is stopped by the caches at its next call)."""
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[0] != len(self.caches):
            raise ValueError(
                f"keys and values must be [batch, kv_heads, tokens, head_dim] with batch {len(self.caches)}, "
                f"got {keys.shape} and {values.shape}"
            )
        n = keys.shape[2]
        if n == 1 and self._real is None and not any(self._drop) and all(c.decoding() for c in self.caches):
            # A decode step: every sequence's token in one call. The chunk's
            # arrays stand in for what each update_and_fetch would return
            # (the attention reads the caches).
            self._sequences.append_each(self.caches, keys, values)
            self._chunk = [(0, 1, keys, values)] * len(self.caches)
            self._idx += 1
            self._offsets = None
            return keys, values
        self._chunk = []
        for i, c in enumerate(self.caches):
            start = min(self._drop[i], n)
            end = n if self._real is None else start + min(n - start, self._real[i])
            self._drop[i] -= start
            if self._real is not None:
                self._real[i] -= end - start
            if end > start:
                k, v = c.update_and_fetch(keys[i : i + 1, :, start:end], values[i : i + 1, :, start:end])
                self._chunk.append((start, end, k, v))
            else:
                self._chunk.append(None)
        self._idx += n
        self._offsets = None
        return keys, values

    def attend_each(self, queries: mx.array, attend: Callable[..., mx.array], scale: Optional[float] = None) -> mx.array:
        """Attention of the last chunk's queries, sequence by sequence:
        ``attend(q, keys, values, cache, mask)`` with sequence ``i``'s queries
        of its real tokens, what its cache's ``update_and_fetch`` returned,
        its cache and a causal mask. Padded query positions get zeros. A
        decode step of every sequence, given ``scale``, attends in one call
        (``LayerCache.attention_each``)."""
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            raise RuntimeError("VeloxQuantBatchCache: attention without a chunk just added (update_and_fetch)")
        B, H, n, D = queries.shape
        if B != len(chunk):
            raise ValueError(f"queries: batch {B}, but the cache holds {len(chunk)} sequences")
        if scale is not None and n == 1 and all(
            part is not None and c.decoding() for c, part in zip(self.caches, chunk)
        ):
            return self._sequences.attention_each(self.caches, queries, scale)
        outs = []
        for i, (c, part) in enumerate(zip(self.caches, chunk)):
            if part is None:
                outs.append(mx.zeros((1, H, n, D), dtype=queries.dtype))
                continue
            start, end, k, v = part
            q = queries[i : i + 1, :, start:end]
            c.observe_queries(q)
            out = attend(q, k, v, c, "causal" if end - start > 1 else None)
            if (start, end) != (0, n):
                out = mx.pad(out, [(0, 0), (0, 0), (start, n - end), (0, 0)])
            outs.append(out)
        return outs[0] if B == 1 else mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        # This cache's attention does not read the mask; a model may give it to
        # float16 layers (BatchKVCache) beside this one, so it is theirs.
        if not any(self._pad):
            return create_attention_mask(N, offset=self._idx, return_array=return_array, window_size=window_size)
        return create_causal_mask(N, offset=self._idx, left_padding=mx.array(self._pad), window_size=window_size)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """``left_padding``: tokens to drop at the front of each (empty)
        sequence's input. ``lengths`` and ``right_padding``: the next prompt
        holds ``lengths[i]`` real tokens of sequence ``i``, then padding."""
        if left_padding is not None:
            left_padding = _per_sequence("left_padding", left_padding, len(self.caches))
            if not self.empty():
                raise ValueError("left_padding can only be added to an empty VeloxQuantBatchCache")
            self._drop = [d + p for d, p in zip(self._drop, left_padding)]
            self._pad = [d + p for d, p in zip(self._pad, left_padding)]
            self._offsets = None
        if right_padding is not None and max(_per_sequence("right_padding", right_padding, len(self.caches))) > 0:
            if lengths is None:
                raise ValueError("prepare: right_padding needs lengths (each sequence's real tokens)")
            self._right = _per_sequence("right_padding", right_padding, len(self.caches))
        if lengths is not None:
            self._real = _per_sequence("lengths", lengths, len(self.caches))

    def finalize(self):
        """Ends a right-padded prompt: the padding was never stored."""
        if self._right is not None:
            self._pad = [p + r for p, r in zip(self._pad, self._right)]
        self._real = self._right = None

    def filter(self, batch_indices):
        """Keeps the sequences ``batch_indices`` (in that order)."""
        idx = _indices("batch_indices", batch_indices, len(self.caches))
        self.caches = [self.caches[i] for i in idx]
        self._drop = [self._drop[i] for i in idx]
        self._pad = [self._pad[i] for i in idx]
        if self._real is not None:
            self._real = [self._real[i] for i in idx]
        if self._right is not None:
            self._right = [self._right[i] for i in idx]
        shift = min(self._pad, default=0)
        self._idx -= shift
        self._pad = [p - shift for p in self._pad]
        self._chunk, self._offsets = None, None

    def extend(self, other: "VeloxQuantBatchCache"):
        """Appends ``other``'s sequences (and takes their caches)."""
        if not isinstance(other, VeloxQuantBatchCache):
            raise TypeError(f"extend: other must be a VeloxQuantBatchCache, got {type(other).__name__}")
        if (self._real is None) != (other._real is None) or self._right is not None or other._right is not None:
            raise ValueError("extend: one of the batches is within a right-padded prompt (prepare without finalize)")
        _check_caches("extend: caches", self.caches + other.caches, self._sequences)
        idx = max(self._idx, other._idx)
        self._pad = [p + idx - self._idx for p in self._pad] + [p + idx - other._idx for p in other._pad]
        self._idx = idx
        self.caches = self.caches + other.caches
        self._drop = self._drop + other._drop
        if self._real is not None:
            self._real = self._real + other._real
        self._chunk, self._offsets = None, None

    def extract(self, idx: int) -> VeloxQuantCache:
        """A copy of sequence ``idx``'s cache (shares its arrays, no bytes move)."""
        (i,) = _indices("idx", [idx], len(self.caches))
        return copy.deepcopy(self.caches[i])

    @classmethod
    def merge(cls, caches: Sequence[VeloxQuantCache]) -> "VeloxQuantBatchCache":
        """A batch of the sequences ``caches`` (one per sequence, batch 1);
        the batch takes them, so each must be a separate object."""
        return cls(caches)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Removes the last ``n`` tokens of every sequence (fewer from one
        that holds fewer). Returns how many positions the batch lost."""
        n = min(self._idx, n)
        for c in self.caches:
            c.trim(min(n, c.offset))
        self._idx -= n
        self._offsets = None
        return n

    @property
    def state(self) -> Dict[str, Any]:
        saving = called_from_save_prompt_cache()
        layout = {"drop": self._drop, "pad": self._pad, "idx": self._idx}
        return {
            "sequences": [c.checksummed_state() if saving else c._state_parts() for c in self.caches],
            "batch": json.dumps(layout, sort_keys=True),
        }

    @state.setter
    def state(self, v):
        if not isinstance(v, dict) or not isinstance(v.get("batch"), str) or not isinstance(v.get("sequences"), list):
            raise ValueError(
                "VeloxQuantBatchCache.state: expected a dict with 'sequences' (a list of VeloxQuantCache "
                f"states) and 'batch' (a JSON string), got {v!r:.200}"
            )
        layout = json.loads(v["batch"])
        if not isinstance(layout, dict) or set(layout) != {"drop", "pad", "idx"}:
            raise ValueError(f"VeloxQuantBatchCache.state: 'batch' must hold drop, pad and idx, got {layout!r}")
        caches = [self._sequences.from_state(s) for s in v["sequences"]]
        for name in ("drop", "pad"):
            layout[name] = _per_sequence(f"state's {name}", layout[name], len(caches))
        self.__init__(caches)
        self._drop, self._pad, self._idx = layout["drop"], layout["pad"], int(layout["idx"])

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.caches = [copy.deepcopy(c, memo) for c in self.caches]
        for name in ("_drop", "_pad", "_real", "_right"):
            v = getattr(self, name)
            setattr(new, name, None if v is None else list(v))
        new._chunk, new._offsets = None, None
        return new

    def __repr__(self):
        return f"VeloxQuantBatchCache({len(self.caches)} sequences, tokens={[c.offset for c in self.caches]}, nbytes={self.nbytes})"


def _check_caches(name: str, caches: List[Any], sequence_class: type) -> None:
    """A batch holds separate VeloxQuantCache objects of one layer's settings."""
    seen: Dict[int, int] = {}
    for i, c in enumerate(caches):
        if not isinstance(c, sequence_class):
            raise TypeError(f"{name}[{i}] must be a VeloxQuantCache, got {type(c).__name__}")
        if id(c) in seen:
            raise ValueError(f"{name}[{i}] is {name}[{seen[id(c)]}]: each sequence needs a cache of its own")
        seen[id(c)] = i
    keys = [_settings_key(c) for c in caches]
    for i, k in enumerate(keys[1:], 1):
        if k[0] != keys[0][0] or (k[1] is not None and keys[0][1] is not None and k[1] != keys[0][1]):
            raise ValueError(
                f"{name}[{i}] has other settings than {name}[0] ({caches[i].config.settings()} and "
                f"{caches[0].config.settings()}): a batch holds one layer's caches"
            )
    shapes = {(c.layer.config["n_kv_heads"], c.layer.config["head_dim"]) for c in caches if c.layer is not None}
    if len(shapes) > 1:
        raise ValueError(
            f"{name}: caches of (kv heads, head size) {sorted(shapes)}: a batch holds one layer's caches"
        )


def _settings_key(c: VeloxQuantCache):
    """The settings sequences of one layer share. Methods and bits are left
    out for a cache whose protect="auto" decision may have made them fp16."""
    cfg = c.config
    fixed = (cfg.window, cfg.sinks, cfg.seed, cfg.policy, cfg.key_group)
    if cfg.protect == "auto" or cfg.key_method == cfg.value_method == "fp16":
        return fixed, None
    return fixed, (cfg.key_method, cfg.key_bits, cfg.value_method, cfg.value_bits)


def _per_sequence(name: str, v, n: int) -> List[int]:
    if isinstance(v, mx.array):
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise ValueError(f"{name} must list one count per sequence ({n}), got {v!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{name} must be integers >= 0, got {list(v)}")
    return list(v)


def _indices(name: str, v, n: int) -> List[int]:
    if isinstance(v, mx.array):
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise TypeError(f"{name} must be sequence indices (ints), got {v!r}")
    for i in v:
        if not 0 <= i < n:
            raise IndexError(f"{name}: sequence {i} is out of range for a batch of {n}")
    if len(set(v)) != len(v):
        raise ValueError(f"{name} lists a sequence more than once: {list(v)}")
    return list(v)


# mlx_lm's load_prompt_cache rebuilds caches by class name from its module globals.
_mlx_cache.VeloxQuantBatchCache = VeloxQuantBatchCache
