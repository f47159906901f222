"""Shared fixtures: the default model, converted once, and a tiny random-weight model with its tokenizer
(CPU forwards are slow: keep token counts small)."""

import json
import shutil

import pytest


@pytest.fixture(scope="session")
def smollm():
    from veloxquant.tools import models

    return models.load()


def write_tiny_llama(out, dtype=None, matrix_scale: float = 1.0, model_type: str = "llama", **shape) -> str:
    """A random-weight Llama (or another mlx_lm architecture of the same
    config keys, ``model_type``; Qwen2's head size is hidden / heads) with
    ``shape`` overriding the sizes below, saved in ``out`` with the default
    model's tokenizer; weights cast to ``dtype`` if given and 2-D matrices
    other than the embedding scaled by ``matrix_scale``."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    Model, ModelArgs = arch.Model, arch.ModelArgs

    from veloxquant.tools import models

    src = models.default_model_path()
    big = json.loads((src / "config.json").read_text())
    config = {
        "model_type": model_type,
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
        **shape,
    }
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
    weights = {
        k: v * matrix_scale if matrix_scale != 1.0 and v.ndim == 2 and "embed" not in k else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with random float16 weights and the default model's tokenizer."""
    import mlx.core as mx

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), dtype=mx.float16)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The tiny model loaded (its own per module, which a test may change), its tokenizer, and the token ids
    of the first 200 tokens of the shipped text."""
    from mlx_lm import load

    from veloxquant.tools.texts import alice

    model, tokenizer = load(tiny_model)
    return model, tokenizer, tokenizer.encode(alice()[:4000])[:200]
