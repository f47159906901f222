"""The offline default model: conversion from GGUF, tokenizer, perplexity, KV-cache decoding."""

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from veloxquant.tools import eval as ev
from veloxquant.tools import models


def llama_cpp_permute(w, n_head):
    # What llama.cpp's convert_hf_to_gguf.py does to attn_q/attn_k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(192 * 5, dtype=np.float32).reshape(192, 5)
    back = models._unpermute(mx.array(llama_cpp_permute(w, 3)), 3)
    np.testing.assert_array_equal(np.array(back), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_converted_directory(smollm):
    path = models.default_model_path()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["tie_word_embeddings"] and cfg["rope_theta"] == 100000.0
    model, _ = smollm
    assert model.model.embed_tokens.weight.dtype == mx.float16


def test_tokenizer_round_trip_and_chat_template(smollm):
    _, tok = smollm
    text = "The with statement, 2024 edition: naïve café."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # digits are split one by one, as in SmolLM2's own tokenizer
    assert len(tok.encode("2024")) == 4
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == 2


def test_perplexity_on_english_text(smollm):
    # ~20 is expected; the row permutation left in place gives ~270.
    model, tok = smollm
    ids = mx.array(tok.encode(ev.english_text())[:129])[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    ppl = math.exp(nn.losses.cross_entropy(logits, ids[:, 1:]).mean().item())
    assert 8 < ppl < 40, ppl


def test_kv_cache_decode_matches_full_forward(smollm):
    model, tok = smollm
    ids = mx.array(tok.encode(ev.english_text("with"))[:80])[None]
    full = model(ids).argmax(-1)[0]
    cache = make_prompt_cache(model)
    first = model(ids[:, :64], cache=cache).argmax(-1)[0]
    steps = [model(ids[:, i : i + 1], cache=cache).argmax(-1)[0, 0] for i in range(64, 80)]
    got = mx.concatenate([first, mx.stack(steps)])
    assert got.tolist() == full.tolist()


def test_convert_rejects_other_architectures(tmp_path):
    bad = tmp_path / "x.gguf"
    mx.save_gguf(str(bad), {"w": mx.zeros((2,))}, {"general.architecture": "mamba"})
    with pytest.raises(ValueError, match="only the llama and gemma3 architectures .* found .mamba"):
        models.convert_gguf(bad, tmp_path / "out", progress=lambda m: None)


def test_missing_gguf_env_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("VELOXQUANT_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="VELOXQUANT_GGUF"):
        models.find_gguf()
