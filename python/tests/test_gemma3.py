"""Gemma 3 GGUF conversion (veloxquant.tools.gemma3) on a tiny file written
here with llama.cpp's own writer: the converted model must compute what
mlx_lm's gemma3_text computes from the original weights, its tokenizer must
put <bos> first, and the compressed cache must run in its global layers."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm import load
from mlx_lm.models import gemma3_text

from veloxquant.cache import KVConfig, VeloxQuantCache, make_prompt_cache
from veloxquant.tools import gemma3, models

# Six layers: Gemma 3's five sliding-window layers, then one global.
HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN, WINDOW = 64, 6, 2, 32, 128, 16
# llama.cpp's names, and mlx_lm's, of a layer's tensors and their [out, in] shapes.
LAYER = {
    "attn_q": ((HEADS * HEAD_DIM, HIDDEN), "self_attn.q_proj"),
    "attn_k": ((HEAD_DIM, HIDDEN), "self_attn.k_proj"),
    "attn_v": ((HEAD_DIM, HIDDEN), "self_attn.v_proj"),
    "attn_output": ((HIDDEN, HEADS * HEAD_DIM), "self_attn.o_proj"),
    "attn_q_norm": ((HEAD_DIM,), "self_attn.q_norm"),
    "attn_k_norm": ((HEAD_DIM,), "self_attn.k_norm"),
    "attn_norm": ((HIDDEN,), "input_layernorm"),
    "post_attention_norm": ((HIDDEN,), "post_attention_layernorm"),
    "ffn_norm": ((HIDDEN,), "pre_feedforward_layernorm"),
    "post_ffw_norm": ((HIDDEN,), "post_feedforward_layernorm"),
    "ffn_gate": ((FFN, HIDDEN), "mlp.gate_proj"),
    "ffn_up": ((FFN, HIDDEN), "mlp.up_proj"),
    "ffn_down": ((HIDDEN, FFN), "mlp.down_proj"),
}
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "\u2581a", "\u2581b", "ab", "\u2581ab"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, the original weights in mlx_lm's names)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types([3, 3, 3, 2] + [1] * (len(TOKENS) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    original = {}

    def put(gguf_name, mlx_name, shape, quant=None):
        norm = len(shape) == 1
        x = (rng.normal(0.0, 0.2, shape) if norm else rng.normal(0.0, 0.05, shape)).astype(np.float32)
        stored = x + 1.0 if norm else x  # llama.cpp stores Gemma's norms plus one
        if quant is None:
            w.add_tensor(gguf_name, stored)
        else:
            data = gguf.quants.quantize(stored, quant)
            w.add_tensor(gguf_name, data, raw_dtype=quant)
            x = gguf.quants.dequantize(data, quant)
        original[mlx_name] = x

    put("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), HIDDEN))
    put("output_norm.weight", "model.norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        for kind, (shape, name) in LAYER.items():
            # Q5_0, which mx.load cannot read: the gguf package's path.
            quant = Q.Q5_0 if kind == "ffn_up" else None
            put(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{name}.weight", shape, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, original


def test_converted_gemma3_computes_what_mlx_lm_computes_from_the_original(tiny, tmp_path):
    path, original = tiny
    out = models.convert_gguf(path, tmp_path / "model", progress=lambda _: None)
    model, tokenizer = load(str(out))
    assert type(model).__module__.endswith("gemma3_text")
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
        num_attention_heads=HEADS, head_dim=HEAD_DIM, num_key_value_heads=1, vocab_size=len(TOKENS),
        sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
    )
    ref = gemma3_text.Model(args)
    weights = ref.sanitize({k: mx.array(v).astype(mx.bfloat16) for k, v in original.items()})  # ties lm_head
    ref.load_weights(list(weights.items()))
    x = mx.array([[2, 7, 8, 5, 6, 9, 10, 4] * 4])
    got, want = model(x).astype(mx.float32), ref(x).astype(mx.float32)
    assert mx.allclose(got, want, atol=1e-2, rtol=1e-2).item(), mx.abs(got - want).max().item()
    # The tokenizer puts <bos> first, which Gemma needs.
    ids = tokenizer.encode("ab a")
    assert ids[0] == 2 and len(ids) > 1
    # veloxquant compresses the global layer; the sliding ones keep mlx_lm's
    # rotating float16 cache.
    cache = make_prompt_cache(model)
    assert [type(c).__name__ for c in cache] == ["RotatingKVCache"] * 5 + ["VeloxQuantCache"]
    prompt = mx.array([[2] + [5, 6, 9, 10, 7, 8] * 8])
    logits = model(prompt, cache=cache)
    logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    assert logits.shape == (1, 1, len(TOKENS)) and mx.all(mx.isfinite(logits)).item()
    assert cache[-1].offset == prompt.shape[1] + 1


def test_compressed_cache_runs_at_head_dim_256_with_one_kv_head():
    # Gemma 3's global layers: head_dim 256, one KV head, four query heads.
    c = VeloxQuantCache(KVConfig())
    k = mx.random.normal((1, 1, 300, 256), key=mx.random.key(1)).astype(mx.float16)
    v = mx.random.normal((1, 1, 300, 256), key=mx.random.key(2)).astype(mx.float16)
    c.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 300, 256), key=mx.random.key(3)).astype(mx.float16)
    out = c.attention(q, 256**-0.5, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=256**-0.5, mask="causal")
    err = (mx.linalg.norm((out - want).astype(mx.float32)) / mx.linalg.norm(want.astype(mx.float32))).item()
    assert err < 1e-2  # a first chunk attends over itself as it came
    # A decode step reads the codes: it matches SDPA over what the cache holds.
    k1 = mx.random.normal((1, 1, 1, 256), key=mx.random.key(4)).astype(mx.float16)
    c.update_and_fetch(k1, k1)
    q1 = mx.random.normal((1, 4, 1, 256), key=mx.random.key(5)).astype(mx.float16)
    out1 = c.attention(q1, 256**-0.5)
    held_k, held_v = c.layer.dequantize()
    want1 = mx.fast.scaled_dot_product_attention(q1, held_k, held_v, scale=256**-0.5)
    err1 = (mx.linalg.norm((out1 - want1).astype(mx.float32)) / mx.linalg.norm(want1.astype(mx.float32))).item()
    assert held_k.shape == (1, 1, 301, 256) and err1 < 1e-2


def test_convert_refuses_another_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float16))
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(np.zeros((8, 32), np.float32), Q.Q5_0), raw_dtype=Q.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="qwen2"):
        models.convert_gguf(path, tmp_path / "out", progress=lambda _: None)


def test_gemma3_model_name_resolves_through_the_download(monkeypatch, tmp_path):
    # The named model converts from the assembled GGUF in <home>/downloads.
    monkeypatch.setenv("VELOXQUANT_HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(gemma3, "find_gguf", lambda progress=None: seen.append("find") or tmp_path / "x.gguf")
    monkeypatch.setattr(gemma3, "convert", lambda g, out, progress=None: seen.append((g.name, out.name)) or out)
    assert models.resolve_model("gemma-3-270m") == str(tmp_path / "models" / "gemma-3-270m")
    assert seen == ["find", ("x.gguf", "gemma-3-270m")]
