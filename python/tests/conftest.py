"""Shared fixtures: the default model, converted once, and a tiny random-weight model with its tokenizer
(CPU forwards are slow: keep token counts small)."""

import json
import shutil

import pytest


@pytest.fixture(scope="session")
def smollm():
    from veloxquant import models

    return models.load()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with random float16 weights and the default model's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    from veloxquant import models

    src = models.default_model_path()
    out = tmp_path_factory.mktemp("tiny-llama")
    big = json.loads((src / "config.json").read_text())
    config = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": big["vocab_size"],
        "tie_word_embeddings": True,
        "bos_token_id": big["bos_token_id"],
        "eos_token_id": big["eos_token_id"],
    }
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return str(out)
