"""Greedy generation with veloxquant's cache in one process or, under
``mlx.launch -n N``, tensor or pipeline parallel; rank 0 writes the tokens and
the KV bytes as JSON. Used by test_distributed.py.

usage: distributed_generate.py MODEL OUT_JSON PROMPT_TOKENS MAX_TOKENS [tensor|pipeline]
"""

import json
import sys

import veloxquant  # noqa: F401  (before mlx: it picks the CPU BLAS)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from veloxquant import distributed
from veloxquant.cache import KVConfig, cache_nbytes, make_prompt_cache

# A short window and few sinks, so that most of the prompt is compressed.
CONFIG = KVConfig(window=8, sinks=4)


def main(model_path: str, out: str, prompt_tokens: int, max_tokens: int, parallel: str) -> None:
    group = distributed.group()
    model, tokenizer = load(model_path, lazy=group is not None)
    if group is not None:
        distributed.shard_model(model, group, parallel)
    vocab = model.args.vocab_size
    prompt = mx.array([(i * 7919 + 13) % vocab for i in range(prompt_tokens)])
    cache = make_prompt_cache(model, CONFIG)
    tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=max_tokens)]
    kv = cache_nbytes(cache)
    # cache_nbytes counts the rotation and codebooks once per process.
    shared = kv - sum(c.nbytes for c in cache)
    result = {
        "tokens": tokens,
        "ranks": 1 if group is None else group.size(),
        "kv_heads": [layer.self_attn.n_kv_heads for layer in model.layers],
        "layers": len(cache),
        "kv_bytes": kv,
        "shared_bytes": shared,
        "kv_bytes_total": kv if group is None else distributed.total_nbytes(kv, group),
    }
    if distributed.is_main(group):
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "tensor")
