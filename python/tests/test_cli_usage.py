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
from veloxquant.tools import cli

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


# --- 15: --version ---------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    r = run(flag, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"veloxquant {veloxquant.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{veloxquant.__version__}"' in pyproject
    assert "--version" in run("--help", timeout=60).stdout


# --- 6: generate --help names the real default model ---------------------------


def test_generate_help_names_the_default_model():
    r = run("generate", "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    model_help = flat(r.stdout.split("--model MODEL", 2)[2].split("\n  -")[0])
    assert "SmolLM2-135M-Instruct" in model_help
    assert "Llama-3.2-3B" not in r.stdout


# --- 7: veloxquant-only options imply --kv-cache veloxquant ---------------------


def kv_args(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("--quantized-kv-start", type=int, default=5000)
    cli.add_kv_options(p, with_kv_bits=True)
    args = p.parse_args(list(argv))
    cli.validate_kv_args(args)
    return args


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-method", "kivi"],
        ["--kv-value-method", "kivi"],
        ["--kv-value-bits", "3"],
        ["--kv-window", "8"],
        ["--kv-sinks", "0"],
        ["--kv-seed", "3"],
        ["--kv-policy", "off"],
        ["--kv-layers", '{"0": null}'],
        ["--kv-bits", "3", "--kv-window", "8"],
    ],
)
def test_veloxquant_options_imply_the_veloxquant_cache(argv):
    args = kv_args(*argv)
    assert args.kv_cache == "veloxquant" and args.mlx_kv_bits is None
    assert cli.describe_kv(args).startswith("veloxquant keys ")
    if "--kv-bits" in argv:
        assert cli.kv_config_from_args(args).key_bits == 3


def test_kv_defaults_unchanged():
    args = kv_args("--kv-cache", "veloxquant")
    c = cli.kv_config_from_args(args)
    assert (c.key_method, c.key_bits, c.window, c.sinks, c.seed, c.policy) == ("turboquant-mse", 4, 128, 4, 0, "auto")
    # --kv-bits alone keeps mlx_lm's meaning: the float16 cache, quantized later
    args = kv_args("--kv-bits", "4")
    assert args.kv_cache == "fp16" and args.mlx_kv_bits == 4
    assert cli.describe_kv(args) == "fp16, then mlx-quantized 4b from token 5000"
    assert kv_args().kv_cache == "fp16"


@pytest.mark.parametrize("kind", ["fp16", "mlx-quantized"])
@pytest.mark.parametrize("opt, value", [("--kv-method", "kivi"), ("--kv-window", "8"), ("--kv-layers", "{}"), ("--kv-value-bits", "3")])
def test_veloxquant_options_with_another_cache_are_named(kind, opt, value, capsys):
    with pytest.raises(SystemExit) as e:
        kv_args("--kv-cache", kind, opt, value)
    assert e.value.code == 2
    assert f"{opt} applies only to --kv-cache veloxquant" in capsys.readouterr().err


@pytest.mark.parametrize("value, needle", [("x", "'x' is not valid JSON"), ("[1]", "expected a JSON object mapping layer indices")])
def test_bad_kv_layers_json_names_the_option_and_the_form(value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        kv_args("--kv-layers", value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --kv-layers: {needle}" in err and '{"0": null, "5": {"key_bits": 8}}' in err
    assert "invalid loads value" not in err


def test_help_keeps_the_displayed_defaults():
    r = run("generate", "--help", timeout=60)
    text = flat(r.stdout)
    for shown in ("(default: turboquant-mse)", "(default: 128)", "(default: 4)", "(default: 0)", "(default: auto)"):
        assert shown in text


def test_generate_kv_window_alone_is_veloxquant(tiny_model):
    r = run("generate", "--model", tiny_model, "--prompt", "hi", "--max-tokens", "2", "--kv-window", "8")
    assert r.returncode == 0, r.stderr
    assert "(veloxquant keys turboquant-mse/4b, values turboquant-mse/3b, window 8, sinks 4)" in r.stdout


def test_compare_checks_veloxquant_options_against_caches():
    r = run("compare", "--caches", "fp16,mlx-quantized", "--kv-method", "kivi", timeout=60)
    one_line_error(r, "--kv-method", "--caches")
    r = run("compare", "--kv-cache", "veloxquant", timeout=60)
    one_line_error(r, "--kv-cache", "--caches")


# --- 9: a wrong model path is one line --------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve", "compare", "eval"])
def test_missing_model_path_is_one_line(command, tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = run(command, "--model", missing, timeout=60)
    one_line_error(r, f"--model: {missing}: no such directory")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_missing_draft_model_is_one_line(tmp_path, tiny_model):
    missing = str(tmp_path / "no-such-draft")
    r = run("generate", "--model", tiny_model, "--draft-model", missing, timeout=60)
    one_line_error(r, f"--draft-model: {missing}: no such directory")


def test_model_path_errors(tmp_path):
    from veloxquant.tools import models

    with pytest.raises(models.ModelPathError, match="no config.json"):
        models.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(models.ModelPathError, match="no .safetensors"):
        models.load(str(tmp_path))
    with pytest.raises(models.ModelPathError, match="is a file"):
        models.resolve_model(str(tmp_path / "config.json"))
    with pytest.raises(models.ModelPathError, match="no such directory"):
        models.resolve_model("./not/a/model")
    assert issubclass(models.ModelPathError, ValueError)


def test_unknown_hub_model_offline_is_one_line(tmp_path):
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    r = run("generate", "--model", "nobody-veloxquant/no-such-model", timeout=60, env=env)
    one_line_error(r, "--model: nobody-veloxquant/no-such-model: no such directory", "Hugging Face cache")


# --- 19: eval --methods ---------------------------------------------------------


@pytest.mark.parametrize("methods", ["bogus", "turboquant-mse,bogus"])
def test_eval_unknown_method_is_an_error(methods):
    r = run("eval", "--methods", methods, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--methods: unknown bogus" in r.stderr and "turboquant-mse, kivi, pq" in r.stderr
    assert "Traceback" not in r.stderr


def test_eval_bits_no_method_takes_is_an_error_before_the_model_loads():
    # A sweep skips widths a method lacks (pq has no 3 bits); one with no
    # compressed row left fails at once, naming the widths the methods take.
    r = run("eval", "--methods", "turboquant-mse,pq", "--bits", "9,5/3", timeout=60)
    one_line_error(r, "--bits: 9,5/3 fits none of --methods turboquant-mse,pq", "pq: [1, 2, 4]")
    r = run("eval", "--methods", "kivi/fp16", "--bits", "7", timeout=60)
    one_line_error(r, "--bits", "kivi/fp16: [1, 2, 3, 4, 8]/any")


def test_eval_methods_are_the_cache_methods():
    # eval and KVConfig take the methods from the crate (_native.CACHE_METHODS).
    from veloxquant import LayerCache
    from veloxquant.cache import KEY_ONLY_METHODS, METHODS

    from veloxquant._native import CACHE_METHODS

    for m in METHODS:
        bits = CACHE_METHODS[m][0]
        LayerCache(64, 1, key_method=m, key_bits=4 if bits is None or 4 in bits else bits[-1])
    with pytest.raises(ValueError, match='is not one of "fp16", "turboquant-mse"') as e:
        LayerCache(64, 1, key_method="bogus")
    assert all(f'"{m}"' in str(e.value) for m in METHODS) and str(e.value).count('"') == 2 * len(METHODS) + 2
    assert set(KEY_ONLY_METHODS) == {"qjl", "turboquant-prod"}
    for m in KEY_ONLY_METHODS:
        with pytest.raises(ValueError, match="stores keys only"):
            LayerCache(64, 1, value_method=m, value_bits=4)


# --- 20 and 4: --prompt-cache-file -----------------------------------------------


def test_missing_prompt_cache_file_is_one_line(tmp_path):
    missing = str(tmp_path / "nope.safetensors")
    r = run("generate", "--prompt-cache-file", missing, timeout=60)
    one_line_error(r, f"--prompt-cache-file: {missing}: no such file")


@pytest.mark.parametrize("content", [b"garbage", b""])
def test_garbage_prompt_cache_file_is_one_line(tmp_path, content):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    r = run("generate", "--prompt-cache-file", str(bad), timeout=60)
    one_line_error(r, f"--prompt-cache-file: {bad} is not a prompt cache")
    # a safetensors file that is not a prompt cache (model weights, say)
    mx.save_safetensors(str(bad), {"w": mx.zeros((2,))}, {"format": "mlx"})
    r = run("generate", "--prompt-cache-file", str(bad), timeout=60)
    one_line_error(r, f"--prompt-cache-file: {bad} is not a prompt cache")


def save_prompt_cache_file(path, model_dir, caches_for):
    """Fill ``caches_for(model)`` with a prompt through the tiny model and save it as mlx_lm.cache_prompt does."""
    import mlx_lm
    from mlx_lm.models.cache import save_prompt_cache

    model, tok = mlx_lm.load(model_dir)
    caches = caches_for(model)
    model(mx.array(tok.encode("The with statement wraps a block of code. " * 4))[None], cache=caches)
    save_prompt_cache(str(path), caches, {"model": model_dir, "tokenizer_config": "{}"})
    return caches


def test_veloxquant_prompt_cache_file_uses_its_settings(tiny_model, tmp_path):
    from veloxquant.cache import KVConfig, make_prompt_cache

    f = tmp_path / "prompt.safetensors"
    cfg = KVConfig(key_method="kivi", key_bits=4, value_method="turboquant-mse", value_bits=3, window=8, sinks=0)
    save_prompt_cache_file(f, tiny_model, lambda m: make_prompt_cache(m, cfg))
    r = run("generate", "--prompt-cache-file", str(f), "--prompt", "Why?", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "(veloxquant keys kivi/4b, values turboquant-mse/3b, window 8, sinks 0)" in r.stdout, r.stdout
    assert "install()" not in r.stderr and "RuntimeWarning" not in r.stderr, r.stderr
    # options that agree with the file are accepted, others named
    r = run("generate", "--prompt-cache-file", str(f), "--kv-method", "kivi", "--prompt", "Why?", "--max-tokens", "1")
    assert r.returncode == 0, r.stderr
    one_line_error(run("generate", "--prompt-cache-file", str(f), "--kv-window", "64", timeout=60), "--kv-window 64", "window 8")
    one_line_error(run("generate", "--prompt-cache-file", str(f), "--kv-cache", "fp16", timeout=60), "--kv-cache fp16", "veloxquant caches")


def test_prompt_cache_config_round_trips_per_layer_settings(tiny_model, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    from veloxquant.cache import KVConfig, make_prompt_cache

    f = tmp_path / "layers.safetensors"
    cfg = KVConfig(key_bits=3, window=4, sinks=1, layers={1: {"key_method": "kivi", "key_bits": 2}})
    save_prompt_cache_file(f, tiny_model, lambda m: make_prompt_cache(m, cfg))
    got = cli.prompt_cache_config(load_prompt_cache(str(f)))
    assert [got.for_layer(i).settings() for i in range(2)] == [cfg.for_layer(i).settings() for i in range(2)]
    cfg = KVConfig(window=4, layers={0: None})
    save_prompt_cache_file(f, tiny_model, lambda m: make_prompt_cache(m, cfg))
    got = cli.prompt_cache_config(load_prompt_cache(str(f)))
    assert got.for_layer(0) is None and got.for_layer(1).settings() == cfg.for_layer(1).settings()


def test_fp16_prompt_cache_file_is_not_labelled_veloxquant(tiny_model, tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    f = tmp_path / "fp16.safetensors"
    save_prompt_cache_file(f, tiny_model, make_prompt_cache)
    r = run("generate", "--prompt-cache-file", str(f), "--prompt", "Why?", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "bytes held (fp16)" in r.stdout
    one_line_error(run("generate", "--prompt-cache-file", str(f), "--kv-method", "kivi", timeout=60), "--kv-method", "fp16 caches")
    other = shutil.copytree(tiny_model, tmp_path / "other-model")
    one_line_error(
        run("generate", "--prompt-cache-file", str(f), "--model", str(other), timeout=60),
        f"--model {other}: --prompt-cache-file was saved with the model {tiny_model}",
    )


# --- 12 and 22: the server --------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_lists_its_model_without_a_hub_cache(tiny_model, tmp_path):
    import os

    port = _free_port()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "no-hub-cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "veloxquant", "serve", "--model", tiny_model, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("server did not start: " + (proc.stdout.read() if proc.poll() is not None else ""))
                time.sleep(0.5)
        models = json.loads(body)
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [str(Path(tiny_model).resolve())]
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
        assert health == {"status": "ok"}
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert "CacheNotFound" not in out and "Traceback" not in out, out


def test_serve_exits_when_the_model_cannot_load(tmp_path):
    # Passes the path checks (config.json, .safetensors) but mlx_lm cannot load it.
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (bad / "model.safetensors").write_bytes(b"not weights")
    port = _free_port()
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant", "serve", "--model", str(bad), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"--model {bad}: the model could not be loaded" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "generation thread died" not in r.stderr, r.stderr


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
