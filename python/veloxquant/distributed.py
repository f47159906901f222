"""Runs under ``mlx.launch``: the group, the model's sharding (tensor or
pipeline parallel), and KV cache bytes summed over ranks.

Tensor parallel: each rank's attention keeps n_kv_heads / N heads, and its
caches are built from those shapes, so every rank holds the compressed cache
of its own heads only. Pipeline parallel: each rank runs a contiguous share
of the layers (mlx_lm's ``pipeline``) and holds their caches only.
Rotations and codebooks depend on the head size and the seed alone (not on a
head's or a layer's index), so every rank quantizes a head exactly as one
process would."""

from typing import Optional


def launched_rank() -> Optional[int]:
    """This process's rank when ``mlx.launch`` started it (``MLX_RANK``),
    without joining the group: a process that starts the members (``bench``'s
    workers) must leave the group's ports to them."""
    import os

    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None and rank.strip().isdigit() else None


def group():
    """The distributed group when this process is one of several
    (``mlx.launch -n N``), else None."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return None
    g = mx.distributed.init()
    return g if g.size() > 1 else None


PARALLEL = ("tensor", "pipeline")


def shard_model(model, group, parallel: str = "tensor") -> None:
    """Split ``model`` across ``group``: its attention heads and MLP by tensor
    parallelism (mlx_lm's ``model.shard``) or its layers by pipeline
    (``model.model.pipeline``), then materialize this rank's weights."""
    import mlx.core as mx

    kind = type(model).__module__
    n = group.size()
    if parallel == "pipeline":
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ValueError(f"model: {kind} has no pipeline(), so it cannot run as a pipeline on {n} ranks")
        layers = len(inner.layers)
        if layers < n:
            raise ValueError(f"model: its {layers} layers cannot fill a pipeline of {n} ranks")
        inner.pipeline(group)
    elif parallel == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"model: {kind} has no tensor-parallel shard(), so it cannot run on {n} ranks")
        for i, layer in enumerate(getattr(model, "layers", [])):
            attn = getattr(layer, "self_attn", None)
            for name, what in (("n_heads", "query heads"), ("n_kv_heads", "KV heads")):
                heads = getattr(attn, name, None)
                if heads is not None and heads % n:
                    raise ValueError(f"model: layer {i} has {heads} {what}, which do not divide among {n} ranks")
        model.shard(group)
    else:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    mx.eval(model.parameters())
    # Every rank finishes loading before the first collective of the forward.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def layer_span(model, count: int):
    """``(first, total)``: the model-wide index of the first of ``count``
    cache layers this process holds, and the model's layer count (a pipeline
    stage holds layers ``first .. first + count - 1`` of ``total``)."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return int(inner.start_idx), int(model.args.num_hidden_layers)
    return 0, count


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
