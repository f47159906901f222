"""The command line: generate, serve (a real HTTP request on loopback), compare, eval, errors."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


PROMPT = "What is the capital of France?"


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "veloxquant", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module", autouse=True)
def converted(smollm):
    # The session fixture converts the model once; subprocesses then find it.
    return smollm


@pytest.mark.parametrize(
    "extra, kind",
    [
        ([], "fp16"),
        (["--kv-cache", "mlx-quantized", "--kv-bits", "8"], "mlx-quantized 8b"),
        (["--kv-cache", "veloxquant", "--kv-bits", "4", "--kv-window", "8"], "veloxquant keys turboquant-mse/4b"),
        (
            ["--kv-cache", "veloxquant", "--kv-method", "kivi", "--kv-value-method", "turboquant-mse", "--kv-window", "8"],
            "veloxquant keys kivi/4b, values turboquant-mse/4b",
        ),
    ],
)
def test_generate(extra, kind):
    r = run("generate", "--prompt", PROMPT, "--max-tokens", "6", "--temp", "0", *extra)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    text = out.split("=" * 10)[1].strip()
    # the 135M model's answer changes under 8-bit keys already: only fp16 is pinned
    assert ("Paris" in text) if kind == "fp16" else text
    assert f"({kind}" in out
    for line in ("Prefill: ", "Decode: 6 tokens", "KV cache: ", "Peak memory: "):
        assert line in out
    kv = int(out.split("KV cache: ")[1].split(" bytes")[0].replace(",", ""))
    assert kv > 0


def test_generate_quiet_prints_only_the_text():
    r = run("generate", "--prompt", PROMPT, "--max-tokens", "3", "--verbose", "False")
    assert r.returncode == 0, r.stderr
    assert "KV cache" not in r.stdout and r.stdout.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--kv-cache", "zip"], "--kv-cache: invalid choice"),
        (["generate", "--kv-cache", "mlx-quantized", "--kv-bits", "7"], "--kv-bits for mlx-quantized must be"),
        (["generate", "--kv-bits", "9"], "--kv-bits for mlx_lm's quantized cache (--kv-bits without --kv-cache) must be"),
        (["generate", "--kv-cache", "fp16", "--kv-value-bits", "3"], "--kv-value-bits applies only to --kv-cache veloxquant"),
        (["generate", "--kv-cache", "veloxquant", "--kv-window", "-2"], "window must be an integer >= 0"),
        (["generate", "--kv-cache", "veloxquant", "--kv-key-group", "12"], "key_group must be a multiple of 8"),
        (["compare", "--caches", "fp16,gz"], "--caches: unknown"),
        (["eval", "--needle-depths", "2"], "--needle-depths: depths must be between 0 and 1"),
        (["eval", "--kv-window", "8", "--chunk", "16"], "--chunk 16 exceeds --kv-window 8"),
        (["nosuch"], "unknown command 'nosuch'"),
    ],
)
def test_bad_arguments_are_named(args, message):
    r = run(*args, timeout=120)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_generate_bad_method_is_named():
    r = run("generate", "--kv-cache", "veloxquant", "--kv-method", "bogus", timeout=120)
    assert r.returncode != 0 and "--kv-method" in r.stderr and "bogus" in r.stderr


def test_help_lists_mlx_lm_and_kv_options():
    r = run("generate", "--help", timeout=120)
    assert r.returncode == 0
    for opt in ("--max-tokens", "--draft-model", "--prompt-cache-file", "--kv-cache", "--kv-method", "--kv-bits", "--kv-value-bits", "--kv-window"):
        assert opt in r.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "extra",
    [[], ["--kv-cache", "veloxquant", "--kv-window", "8"]],
    ids=["fp16", "veloxquant"],
)
def test_serve_answers_a_request(extra):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "veloxquant", "serve", "--host", "127.0.0.1", "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError("server did not start: " + (proc.stdout.read() if proc.poll() is not None else ""))
                time.sleep(0.5)
        body = json.dumps(
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}
        ).encode()
        for _ in range(2):  # the second request reuses (copies and trims) the cached prompt
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            reply = json.loads(urllib.request.urlopen(req, timeout=180).read())
            content = reply["choices"][0]["message"]["content"]
            assert ("Paris" in content) if not extra else content.strip()
            assert reply["usage"]["completion_tokens"] == 6
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_example_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "examples", "compress_layer.ipynb")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert (tmp_path / "layer_error.png").stat().st_size > 1000


def test_eval_writes_table_and_plots(tmp_path):
    r = run(
        "eval", "--tokens", "96", "--prefix", "16", "--chunk", "16", "--bits", "4", "--mlx-bits", "",
        "--needle-lengths", "", "--out", str(tmp_path), timeout=600,
    )
    assert r.returncode == 0, r.stderr
    # A progress bar within each configuration (95 tokens fed); no warning
    # that the whole text (cut into pieces before the model sees it) is long.
    for label in ("fp16", "turboquant-mse-4"):
        assert any(label in line and "95/95" in line for line in r.stderr.replace("\r", "\n").splitlines()), r.stderr
    assert "Token indices sequence length" not in r.stderr and "longer than the specified maximum" not in r.stderr
    table = (tmp_path / "results.md").read_text()
    assert "| fp16 |" in table and "| turboquant-mse-4 |" in table and "bits/el stored" in table
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    fp16, tq = results[0], results[1]
    assert fp16["ppl"] > 1 and fp16["top1"] == 1.0 and fp16["kl"] == 0.0
    # Stored bits count the data of the tokens held: float16's are 16; the
    # compressed cache's lie above its 4-bit codes (norms, 16 to 32 window
    # tokens in float16, rotation and codebooks at 96 tokens) and below 16.
    # Held bits add the capacity allocated ahead (float16's 256-token steps).
    assert fp16["bits_per_element"] == pytest.approx(16.0)
    assert 4 < tq["bits_per_element"] < 16 and tq["data_bytes"] <= tq["kv_bytes"]
    assert fp16["held_bits_per_element"] > 16
    assert tq["kv_bytes"] / fp16["kv_bytes"] == pytest.approx(
        tq["held_bits_per_element"] / fp16["held_bits_per_element"], rel=1e-6
    )
    # The last chunks read part of their history from codes; float16 none.
    assert 0 < tq["compressed_share"] < 1 and fp16["compressed_share"] == 0
    assert 0 < tq["top1"] <= 1 and tq["kl"] > 0
    rows = [json.loads(line) for line in (tmp_path / "quality.jsonl").read_text().splitlines()]
    assert [x["recipe"] for x in rows] == ["fp16", "turboquant-mse-4"]
    assert rows[0]["delta_ppl_pct"] == 0 and rows[1]["delta_ppl_pct"] == pytest.approx(100 * (tq["ppl"] / fp16["ppl"] - 1))
    assert {"model", "tokens", "bits_per_element", "ppl", "kl", "top1", "needle"} <= set(rows[1])
    for png in ("perplexity.png", "top1.png", "kl.png", "pareto.png"):
        assert (tmp_path / png).stat().st_size > 1000
