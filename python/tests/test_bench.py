"""`veloxquant bench`: a real run at the tiny shape (every configuration in its
own worker), the report files, argument errors and failing configurations."""

import json
import subprocess
import sys

import pytest

from veloxquant import _native
from veloxquant.tools import bench

REQUIRED = ("device", "device_name", "mlx", "shape", "context", "batch", "cache", "recipe", "prefill_s",
            "decode_tok_s", "decode_tok_s_per_seq", "kv_bytes", "peak_bytes", "error", "command")
VQ = "veloxquant:k4v3:w32"  # a 32-token float16 window: most of a 300-token prompt is compressed


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "veloxquant", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run("--shape", "tiny", "--contexts", "96,300", "--batch", "1,2", "--caches", f"fp16,{VQ}",
               "--decode-tokens", "4", "--warmup", "1", "--prefill-step-size", "128",
               "--out-jsonl", str(out / "e2e.jsonl"), "--out-md", str(out / "e2e.md"), "--plot", str(out / "e2e.png"))
    return proc, out


def test_rows_have_every_field_and_sane_numbers(tiny_run):
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out / "e2e.jsonl")
    assert [(r["context"], r["batch"], r["cache"]) for r in rows] == [
        (c, b, k) for c in (96, 300) for b in (1, 2) for k in ("fp16", VQ)
    ]
    for r in rows:
        assert not set(REQUIRED) - set(r), r
        assert r["error"] is None, r
        assert r["device"] == "cpu" and r["shape"] == "tiny" and r["command"].startswith("veloxquant bench ")
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and r["kv_bytes"] > 0 and r["peak_bytes"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * r["decode_tok_s_per_seq"])
    vq = [r for r in rows if r["cache"] == VQ]
    assert all(r["recipe"]["key_bits"] == 4 and r["recipe"]["value_bits"] == 3 and r["recipe"]["window"] == 32
               for r in vq)
    assert all(r["recipe"] is None for r in rows if r["cache"] == "fp16")


def test_veloxquant_holds_fewer_bytes_at_the_longer_context(tiny_run):
    rows = rows_of(tiny_run[1] / "e2e.jsonl")
    for batch in (1, 2):
        fp16, vq = (next(r for r in rows if (r["context"], r["batch"], r["cache"]) == (300, batch, k))
                    for k in ("fp16", VQ))
        assert vq["compressed_tokens"] > 200
        assert vq["kv_bytes"] < fp16["kv_bytes"]


def test_table_and_plot(tiny_run):
    proc, out = tiny_run
    md = (out / "e2e.md").read_text()
    for text in (md, proc.stdout):
        assert "prefill speed vs fp16" in text and "decode speed vs fp16" in text
        assert text.count("| tiny |") == 8
    assert "| tiny | 300 | 2 | fp16 | " in md and "1.00x" in md
    assert (out / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_jsonl_redraws_an_earlier_run(tiny_run, tmp_path):
    md, png = tmp_path / "again.md", tmp_path / "again.png"
    proc = run("--from-jsonl", str(tiny_run[1] / "e2e.jsonl"), "--out-md", str(md), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert md.read_text() == (tiny_run[1] / "e2e.md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_budget_reports_the_sequences_that_fit(tiny_run, tmp_path):
    md = tmp_path / "capacity.md"
    proc = run("--from-jsonl", str(tiny_run[1] / "e2e.jsonl"), "--memory-budget", "2", "--out-md", str(md))
    assert proc.returncode == 0, proc.stderr
    assert "## Sequences in 2 GiB" in md.read_text()
    rows = rows_of(tiny_run[1] / "e2e.jsonl")
    for cache in ("fp16", VQ):
        r = next(r for r in rows if (r["context"], r["batch"], r["cache"]) == (300, 2, cache))
        assert r["model_bytes"] + r["prefill_kv_bytes"] <= r["prefill_peak_bytes"] <= r["peak_bytes"]
        assert r["model_bytes"] + r["kv_bytes"] <= r["decode_peak_bytes"] <= r["peak_bytes"]
        # Many sequences decoding while one is prefilled: its transient memory once.
        prefill = (r["prefill_peak_bytes"] - r["model_bytes"] - r["prefill_kv_bytes"]) / 2
        fits = int((2 * 2**30 - r["model_bytes"] - prefill) // ((r["decode_peak_bytes"] - r["model_bytes"]) / 2))
        assert f"| tiny | 300 | {cache} | {fits} | " in proc.stdout
        # A row recorded before the decode peak was: the whole peak per sequence.
        old = {k: v for k, v in r.items() if k not in ("prefill_peak_bytes", "prefill_kv_bytes", "decode_peak_bytes")}
        assert bench.capacity_table([old], 2).splitlines()[2].split(" | ")[3] == str(
            int((2 * 2**30 - r["model_bytes"]) // ((r["peak_bytes"] - r["model_bytes"]) / 2)))
    assert "| tiny | 300 | fp16 | " in proc.stdout and "| 1.00x | " in proc.stdout


def test_from_jsonl_names_a_missing_or_empty_file(tmp_path):
    proc = run("--from-jsonl", str(tmp_path / "absent.jsonl"))
    assert proc.returncode == 2 and "--from-jsonl" in proc.stderr
    (tmp_path / "empty.jsonl").write_text("")
    proc = run("--from-jsonl", str(tmp_path / "empty.jsonl"))
    assert proc.returncode == 2 and "no rows" in proc.stderr


def test_mlx_cache_and_default_recipe(tmp_path):
    out = tmp_path / "e2e.jsonl"
    proc = run("--shape", "tiny", "--contexts", "64", "--batch", "1", "--caches", "mlx-q4,veloxquant",
               "--recipe", "kivi:k4:w16", "--decode-tokens", "2", "--warmup", "0", "--out-jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    q4, vq = rows_of(out)
    assert q4["error"] is None and q4["recipe"] == {"bits": 4, "group_size": 64}
    assert vq["error"] is None and vq["cache"] == "veloxquant"
    assert vq["recipe"]["key_method"] == vq["recipe"]["value_method"] == "kivi"
    assert (vq["recipe"]["value_bits"], vq["recipe"]["window"]) == (4, 16)


def test_unknown_shape_in_a_list_exits_2_naming_the_option():
    proc = run("--shape", "tiny,llama-3b", "--caches", "fp16")
    assert proc.returncode == 2
    assert "--shape" in proc.stderr and "llama-3b" in proc.stderr and "llama-8b" in proc.stderr


def test_unknown_cache_exits_2_naming_the_option():
    proc = run("--shape", "tiny", "--caches", "fp16,bogus")
    assert proc.returncode == 2
    assert "--caches" in proc.stderr and "'bogus'" in proc.stderr and "fp16, mlx-q{" in proc.stderr


@pytest.mark.parametrize(
    "args, option",
    [
        (["--caches", "veloxquant:k4v3:zz"], "--caches"),
        (["--caches", "mlx-q7"], "--caches"),
        (["--recipe", "pq:k3"], "--recipe"),  # PQ has 1, 2 or 4 bits
        (["--contexts", "4k"], "--contexts"),
        (["--batch", "0"], "--batch"),
        (["--decode-tokens", "0"], "--decode-tokens"),
        (["--memory-budget", "0"], "--memory-budget"),
        (["--repeat", "0"], "--repeat"),
        (["--prefill-batch", "0"], "--prefill-batch"),
    ],
)
def test_bad_arguments_exit_2(args, option, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shape", "tiny", *args])
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_recipe_syntax():
    assert bench.parse_recipe("kivi:k4v2:w32:s0:off") == dict(
        key_method="kivi", value_method=None, key_bits=4, value_bits=2, window=32, sinks=0, policy="off")
    cfg = bench.recipe_config("k4v3", ":qjl/mse:k3")  # variant parts replace the base's; values follow keys
    assert (cfg.key_method, cfg.value_method, cfg.key_bits, cfg.value_bits) == ("qjl", "turboquant-mse", 3, 3)
    assert bench.recipe_config("k4v3:w64", "kivi").window == 64
    assert bench.recipe_config("k4v3", "kivi/mse:g128").key_group == 128
    assert bench.recipe_config("k4v3", "kivi/mse:query").key_channel_bits == "query"
    # Any method of the crate by its full name or one of the crate's aliases, none listed here.
    cfg = bench.recipe_config("k4v3", "affine:k4v4")
    assert (cfg.key_method, cfg.value_method, cfg.key_bits, cfg.value_bits) == ("affine", "affine", 4, 4)
    assert bench.recipe_config("k4v3", "mlx-affine/rvq").value_method == "turboquant-rvq"
    assert set(bench.METHODS) == set(_native.CACHE_METHODS) | set(_native.CACHE_METHOD_ALIASES)
    with pytest.raises(ValueError, match="unknown recipe part 'nope'"):
        bench.parse_recipe("nope")
    with pytest.raises(ValueError, match="key_group must be a multiple of 8"):
        bench.recipe_config("k4v3", "kivi:g100")


def test_failing_configurations_are_rows(tmp_path):
    # A worker killed at the time limit, and one whose model's weights file is empty (MLX
    # cannot read it): rows with errors, exit 0.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"")
    out = tmp_path / "e.jsonl"
    proc = run("--shape", "tiny", "--contexts", "64", "--batch", "1", "--caches", "fp16", "--timeout", "0.01",
               "--out-jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    (row,) = rows_of(out)
    assert row["error"] == "timeout" and row["prefill_s"] is None and "timeout" in proc.stdout
    proc = run("--model", str(tmp_path / "broken"), "--contexts", "64", "--batch", "1", "--caches", "fp16",
               "--out-jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    (row,) = rows_of(out)
    assert row["shape"] == "broken" and row["device"] == "cpu"
    assert row["error"].startswith("RuntimeError: ") and "\n" not in row["error"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("MemoryError", "out of memory"),
        ("RuntimeError: [cuda::malloc] out of memory", "out of memory"),
        ("RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory", "out of memory"),
        ("RuntimeError: std::bad_alloc", "out of memory"),
        ("RuntimeError: [quantized_matmul] no kernel\nmore detail", "RuntimeError: [quantized_matmul] no kernel"),
    ],
)
def test_failure_messages(text, expected):
    assert bench.describe_failure(text) == expected


def test_repeats_take_the_median_and_keep_every_run():
    runs = [dict(prefill_s=p, prefill_tok_s=100 / p, decode_s=1.0, decode_tok_s=d, decode_tok_s_per_seq=d,
                 peak_bytes=m, prefill_peak_bytes=m, decode_peak_bytes=m, kv_bytes=7, error=None)
            for p, d, m in ((3.0, 10.0, 5), (1.0, 30.0, 9), (2.0, 20.0, 7))]
    row = bench.combine_runs(runs)
    assert (row["prefill_s"], row["decode_tok_s"], row["peak_bytes"], row["kv_bytes"]) == (2.0, 20.0, 9, 7)
    assert row["prefill_s_runs"] == [3.0, 1.0, 2.0] and row["decode_tok_s_runs"] == [10.0, 30.0, 20.0]
    assert row["repeats"] == 3 and bench.combine_runs(runs[:1]) == runs[0]
    failed = bench.combine_runs([runs[0], {"error": "out of memory"}, runs[2]])
    assert failed["error"] == "out of memory" and failed["repeats"] == 3


def test_repeat_runs_each_configuration_round_by_round(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = run("--shape", "tiny", "--contexts", "64", "--batch", "1", "--caches", f"fp16,{VQ}", "--decode-tokens", "2",
               "--warmup", "0", "--repeat", "2", "--out-jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out)
    assert [r["cache"] for r in rows] == ["fp16", VQ]
    for r in rows:
        assert r["error"] is None and r["repeats"] == 2 and len(r["decode_tok_s_runs"]) == 2
        assert min(r["prefill_s_runs"]) <= r["prefill_s"] <= max(r["prefill_s_runs"])
    # Round by round: fp16's first run, the compressed cache's, then the second round.
    labels = [ln for ln in proc.stderr.splitlines() if "(run " in ln and ": prefill" in ln]
    assert [("fp16" in ln.split(":")[0], "run 1/2" in ln) for ln in labels] == [
        (True, True), (False, True), (True, False), (False, False)]


@pytest.mark.parametrize("cache", ["fp16", VQ])
def test_prefill_in_groups_then_joined_decodes_as_the_whole_batch(cache):
    import mlx.core as mx

    model = bench.build_model({"shape": "tiny"})
    spec = bench.parse_cache(cache, "k4v3")
    tokens = mx.random.randint(0, model.args.vocab_size, (3, 70), key=mx.random.key(4))
    whole, y = bench.prefill_groups(model, spec, tokens, 32, None)
    joined, y2 = bench.prefill_groups(model, spec, tokens, 32, 2)
    assert mx.array_equal(y, y2).item() and len(joined) == len(whole)
    from veloxquant.cache import cache_nbytes

    assert all(c.offset == 70 for c in joined) and cache_nbytes(joined) <= cache_nbytes(whole)
    for _ in range(4):  # greedy tokens, row by row, as from the batch prefilled at once
        y = mx.argmax(model(y[:, None], cache=whole)[:, -1], axis=-1)
        y2 = mx.argmax(model(y2[:, None], cache=joined)[:, -1], axis=-1)
        assert mx.array_equal(y, y2).item()


def test_prefill_batch_rows_and_refusals(tmp_path):
    out = tmp_path / "p.jsonl"
    proc = run("--shape", "tiny", "--contexts", "64", "--batch", "3", "--caches", f"fp16,{VQ},mlx-q4", "--decode-tokens", "2",
               "--warmup", "0", "--prefill-batch", "2", "--out-jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    fp16, vq, q4 = rows_of(out)
    assert fp16["error"] is None and vq["error"] is None and fp16["prefill_batch"] == 2 and vq["batch"] == 3
    assert "--prefill-batch joins fp16 and veloxquant caches" in q4["error"]
