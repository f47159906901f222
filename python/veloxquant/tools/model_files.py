"""The files of a converted model: where they live (``$VELOXQUANT_HOME``),
how a directory is written whole, and whether a conversion is current.
Shared by the default model's conversion (``models``) and Gemma 3's
(``gemma3``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import mlx.core as mx

# Bump when the converted files change, so stale conversions are redone.
CONVERSION_VERSION = 1


def home() -> Path:
    """Root of veloxquant's local files (``$VELOXQUANT_HOME`` or ``~/.cache/veloxquant``)."""
    env = os.environ.get("VELOXQUANT_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "veloxquant"


def say(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[veloxquant] {msg}", file=sys.stderr, flush=True)


def write_model_dir(out_dir: Path, weights: dict, config: dict, tokenizer_json: str, tok_config: dict,
                    progress: Callable[[str], None] = say) -> Path:
    """An mlx_lm model directory at ``out_dir``, written whole or not at all
    (a temporary directory beside it, renamed in place)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, {"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"model ready: {out_dir}")
    return out_dir


def is_current(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    conv = cfg.get("veloxquant_conversion", {})
    return conv.get("version") == CONVERSION_VERSION and (path / "model.safetensors").is_file()


def converted_model(name: str, find: Callable, convert: Callable, progress: Callable[[str], None] = say) -> Path:
    """``<home>/models/<name>``, converted first from the GGUF that ``find``
    gives unless a current conversion is there."""
    path = home() / "models" / name
    if not is_current(path):
        convert(find(progress), path, progress)
    return path


def tokenizer_config(tokens, bos: int, eos: int, unk: int, pad: int, max_length: int, chat_template=None, **extra) -> dict:
    """A converted model's ``tokenizer_config.json``: a fast tokenizer (from
    its ``tokenizer.json``) and its special tokens, given by id."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[unk],
        "pad_token": tokens[pad],
        **extra,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
