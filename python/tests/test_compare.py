"""``veloxquant compare`` (the main job) on a tiny random-weight model: the three
caches, the shipped text as the default prompt, the KV curve, the windows
line, the PNG, the summary and the progress bar."""

import json
import subprocess
import sys

from veloxquant.tools import texts


def test_shipped_text_is_long_real_prose():
    from veloxquant.tools import models

    text = texts.alice()
    assert text.startswith("ALICE'S ADVENTURES IN WONDERLAND") and text.rstrip().endswith("THE END")
    assert "Project Gutenberg" not in text
    _, tokenizer = models.load()
    head = texts.leading_tokens(text, tokenizer.encode, 3000)
    n = len(tokenizer.encode(head))
    assert 2800 <= n <= 3000 and head.endswith(texts.paragraphs(head)[-1])


def test_compare_three_caches_curve_plot_summary(tiny_model, tmp_path):  # noqa: F811
    png, js = tmp_path / "kv.png", tmp_path / "kv.json"
    r = subprocess.run(
        [sys.executable, "-m", "veloxquant", "compare", "--model", tiny_model, "--tokens", "400",
         "--max-tokens", "6", "--prefill-step-size", "64", "--kv-window", "32", "--plot", str(png), "--json", str(js)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Alice's Adventures in Wonderland" in out
    for kind in ("fp16", "mlx-quantized", "veloxquant"):
        assert f"| {kind} | " in out and f"--- {kind} (" in out
    assert "veloxquant's float16 windows hold the first 4 tokens (sinks) and the last" in out
    assert "window 32" in out
    assert out.rstrip().splitlines()[-1].startswith("Summary. After ")
    assert f"Figure: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[veloxquant] veloxquant: 100%" in r.stderr and "tok/s" in r.stderr  # the progress bar
    assert "Token indices sequence length" not in r.stderr  # the book is not tokenized whole
    data = json.loads(js.read_text())
    assert 200 <= data["prompt_tokens"] <= 400  # whole paragraphs
    rows = {row["cache"]: row for row in data["rows"]}
    assert set(rows) == {"fp16", "mlx-quantized", "veloxquant"}
    for row in rows.values():
        tokens = [n for n, _ in row["curve"]]
        assert tokens == sorted(tokens) and tokens[0] == 64 and len(tokens) >= 7
        assert row["curve"][-1][1] == row["kv_bytes"] > 0
    assert rows["mlx-quantized"]["kv_bytes"] < rows["fp16"]["kv_bytes"]


def test_compare_rejects_a_tiny_token_budget():
    r = subprocess.run([sys.executable, "-m", "veloxquant", "compare", "--tokens", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tokens must be >= 16" in r.stderr


def test_progress_without_tqdm(monkeypatch, capsys):
    from veloxquant.tools.compare import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    bar = Progress("fp16", 10)
    bar.to(4, "prefill")
    bar.to(10, "decode")
    bar.close()
    err = capsys.readouterr().err
    assert "\r[veloxquant] fp16: prefill 4/10 tokens" in err and "decode 10/10 tokens" in err
    assert err.endswith("\n")
