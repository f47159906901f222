"""What a new user meets on the command line: --version, help, option errors,
wrong model paths, prompt-cache files, the server's /v1/models and start-up,
and the README's snippets.

Commands that load a model use a tiny random-weight Llama (2 layers, the
default model's tokenizer), so each subprocess starts in seconds.
"""

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest

import veloxquant
from veloxquant import cli

ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=180, env=None):
    return subprocess.run(
        [sys.executable, "-m", "veloxquant", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def flat(text):
    """Help text on one line, with argparse's wrapping (also at hyphens) undone."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def one_line_error(r, *needles):
    """Exit status 2 and a short message naming ``needles``, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with random float16 weights and the default model's tokenizer."""
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


# --- 15: --version ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    r = run(flag, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"veloxquant {veloxquant.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{veloxquant.__version__}"' in pyproject
    assert "--version" in run("--help", timeout=60).stdout


# --- 19: eval --methods ---------------------------------------------------------


@pytest.mark.parametrize("methods", ["bogus", "turboquant-mse,bogus"])
def test_eval_unknown_method_is_an_error(methods):
    r = run("eval", "--methods", methods, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--methods: unknown bogus" in r.stderr and "turboquant-mse, kivi, pq" in r.stderr
    assert "Traceback" not in r.stderr


def test_eval_methods_are_the_cache_methods():
    from veloxquant import LayerCache, eval as ev

    for m in ev.METHODS:
        LayerCache(64, 1, key_method=m, key_bits=4)
    with pytest.raises(ValueError, match='is not one of "fp16", "turboquant-mse"'):
        LayerCache(64, 1, key_method="bogus")


# --- 14: every README snippet runs ------------------------------------------------


def readme_snippets():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_has_python_snippets():
    assert len(readme_snippets()) >= 2


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_readme_snippet_runs(index, capsys):
    code = readme_snippets()[index]
    ns = {"__name__": f"readme_snippet_{index}"}
    with mx.stream(mx.cpu):
        exec(compile(code, f"README.md python block {index}", "exec"), ns)
        arrays = [v for v in ns.values() if isinstance(v, mx.array)]
        mx.eval(*arrays)  # MLX is lazy: run what the snippet built
    assert arrays
