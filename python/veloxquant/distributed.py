"""Tensor-parallel runs under ``mlx.launch``: the group, the model's
sharding, and KV cache bytes summed over ranks.

Each rank's attention keeps n_kv_heads / N heads after sharding, and its
caches are built from those shapes, so every rank holds the compressed cache
of its own heads only. Rotations and codebooks depend on the head size and
the seed alone (not on a head's index), so every rank quantizes a head exactly
as one process would."""

from typing import Optional


def group():
    """The distributed group when this process is one of several
    (``mlx.launch -n N``), else None."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def shard_model(model, group) -> None:
    """Split ``model``'s attention heads and MLP across ``group`` by tensor
    parallelism (mlx_lm's ``model.shard``), then materialize its weights."""
    import mlx.core as mx

    kind = type(model).__module__
    if not hasattr(model, "shard"):
        raise ValueError(f"model: {kind} has no tensor-parallel shard(), so it cannot run on {group.size()} ranks")
    n = group.size()
    for i, layer in enumerate(getattr(model, "layers", [])):
        attn = getattr(layer, "self_attn", None)
        for name, what in (("n_heads", "query heads"), ("n_kv_heads", "KV heads")):
            heads = getattr(attn, name, None)
            if heads is not None and heads % n:
                raise ValueError(f"model: layer {i} has {heads} {what}, which do not divide among {n} ranks")
    model.shard(group)
    mx.eval(model.parameters())
    # Every rank finishes loading before the first collective of the forward.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def total_nbytes(nbytes: int, group) -> int:
    """``nbytes`` summed over the ranks of ``group`` (every rank must call it)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    # mlx_lm's generate_step leaves the forward of one token past the last
    # still running, with its own all_sums on this group: a sum started
    # meanwhile would interleave with them on the ring and read garbage.
    mx.synchronize(generation_stream)
    return int(mx.distributed.all_sum(mx.array(nbytes, dtype=mx.int64), group=group, stream=mx.cpu).item())


def is_main(g: Optional[object]) -> bool:
    """Whether this process prints: the only one, or rank 0 of a group."""
    return g is None or g.rank() == 0
