"""Tensor- and pipeline-parallel generation with veloxquant's cache on MLX's
ring backend: two and four local processes started by ``mlx.launch``,
compared with one process."""

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("distributed_generate.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
PROMPT_TOKENS, MAX_TOKENS = 48, 16


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free on localhost (mlx.launch's ring listens on one per rank)."""
    for _ in range(100):
        base = random.randint(20000, 60000)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free localhost ports for the ring backend")


def _launch(n: int, args, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
    """``args`` (after the interpreter) in ``n`` ring processes, with this environment."""
    cmd = [str(LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(_free_ports(n))]
    cmd += ["--python", sys.executable, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    # mlx.launch exits 0 even when a rank fails; it says so on stderr.
    if check:
        assert r.returncode == 0 and "exited with code" not in r.stderr, f"{cmd}:\n{r.stdout}\n{r.stderr}"
    return r


def _ring_model(tmp_path_factory, name: str, **shape) -> str:
    """A tiny model (conftest.write_tiny_llama with ``shape``) for runs on the
    ring backend; skips where mlx.launch or a distributed backend is missing."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed beside {sys.executable}")
    import mlx.core as mx

    from conftest import write_tiny_llama

    if not mx.distributed.is_available():
        pytest.skip("this mlx build has no distributed backend")
    return write_tiny_llama(tmp_path_factory.mktemp(name), **shape)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """A 2-layer Llama with 4 query and 4 KV heads (2 per rank on 2 ranks) and
    float32 weights: the sharded and the whole model then differ only in the
    order of float32 sums. Its matrices are scaled up from mlx's small random
    init so that greedy tokens depend on the context (at mlx's init every
    token is the same one)."""
    return _ring_model(
        tmp_path_factory, "tp-llama", matrix_scale=2.0,
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
    )


@pytest.fixture(scope="module")
def pp_model(tmp_path_factory):
    """A 4-layer Qwen2 (k_proj with a bias; mlx_lm runs it as a pipeline) with
    4 query and 4 KV heads, float32, matrices scaled as tp_model's."""
    return _ring_model(
        tmp_path_factory, "pp-qwen2", matrix_scale=2.0, model_type="qwen2",
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    )


def _worker(tp_model, tmp_path: Path, ranks: int, parallel: str = "tensor") -> dict:
    out = tmp_path / f"ranks{ranks}-{parallel}.json"
    args = [str(WORKER), tp_model, str(out), str(PROMPT_TOKENS), str(MAX_TOKENS), parallel]
    if ranks == 1:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    else:
        _launch(ranks, args)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tp_model, tmp_path_factory):
    return _worker(tp_model, tmp_path_factory.mktemp("one"), 1)


def test_two_ranks_generate_the_single_process_tokens_with_half_the_cache(tp_model, one_process, tmp_path):
    one = one_process
    two = _worker(tp_model, tmp_path, 2)
    assert one["ranks"] == 1 and two["ranks"] == 2
    assert one["kv_heads"] == [4, 4] and two["kv_heads"] == [2, 2]
    assert len(set(one["tokens"])) > MAX_TOKENS // 2  # the model's output depends on its context
    assert two["tokens"] == one["tokens"]
    # Each rank stores half the heads; the rotation and codebooks depend on
    # the head size only, so each process holds a full copy of them.
    assert two["shared_bytes"] == one["shared_bytes"] > 0
    assert two["kv_bytes"] <= 0.5 * one["kv_bytes"] + two["shared_bytes"]
    assert two["kv_bytes_total"] == 2 * two["kv_bytes"]  # equal heads per rank


def test_four_ranks_tensor_parallel_generate_the_single_process_tokens(tp_model, one_process, tmp_path):
    four = _worker(tp_model, tmp_path, 4)
    assert four["kv_heads"] == [1, 1]
    assert four["tokens"] == one_process["tokens"]
    assert four["kv_bytes_total"] == 4 * four["kv_bytes"]


@pytest.fixture(scope="module")
def pp_one_process(pp_model, tmp_path_factory):
    return _worker(pp_model, tmp_path_factory.mktemp("pp-one"), 1)


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_ranks_generate_the_single_process_tokens_with_their_layers_caches(pp_model, pp_one_process, tmp_path, ranks):
    one = pp_one_process
    many = _worker(pp_model, tmp_path, ranks, "pipeline")
    assert one["layers"] == 4 and many["layers"] == 4 // ranks
    assert many["kv_heads"] == [4] * (4 // ranks)  # whole layers, every head
    assert len(set(one["tokens"])) > MAX_TOKENS // 2
    assert many["tokens"] == one["tokens"]
    assert many["shared_bytes"] == one["shared_bytes"] > 0
    assert many["kv_bytes"] - many["shared_bytes"] == (one["kv_bytes"] - one["shared_bytes"]) // ranks
    assert many["kv_bytes_total"] == ranks * many["kv_bytes"]  # equal layers per rank


def test_generate_command_as_a_pipeline_on_two_ranks(pp_model):
    args = ["-m", "veloxquant", "generate", "--model", pp_model, "--prompt", "tell me a story about a cat"]
    args += ["--max-tokens", "12", "--kv-window", "8", "--kv-sinks", "4", "--ignore-chat-template"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two = _launch(2, [*args, "--parallel", "pipeline"])
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(two.stdout) == text(one.stdout)
    kv = re.findall(r"^KV cache: ([\d,]+) bytes held on rank 0, ([\d,]+) over 2 ranks \(pipeline parallel;", two.stdout, re.M)
    assert len(kv) == 1, two.stdout


def test_generate_command_refuses_an_automatic_recipe_in_a_pipeline(pp_model):
    args = ["-m", "veloxquant", "generate", "--model", pp_model, "--prompt", "hi", "--parallel", "pipeline"]
    r = _launch(2, [*args, "--kv-recipe", "auto"], check=False)
    assert re.search(r"Node with rank \d exited with code 2 ", r.stderr), r.stderr
    assert "--kv-recipe auto: not supported on 2 ranks (pipeline parallel)" in r.stderr
    assert "Traceback" not in r.stderr


def test_pipeline_refuses_a_model_without_stages(tiny_model):
    from mlx_lm.utils import load

    from veloxquant import distributed

    class Two:
        def size(self):
            return 2

    model, _ = load(tiny_model, lazy=True)
    with pytest.raises(ValueError, match=r"^model: mlx_lm\.models\.llama has no pipeline\(\), so it cannot run as a pipeline on 2 ranks$"):
        distributed.shard_model(model, Two(), "pipeline")
    with pytest.raises(ValueError, match=r"^parallel must be one of \('tensor', 'pipeline'\), got 'data'$"):
        distributed.shard_model(model, Two(), "data")


def test_the_float16_cache_gives_other_tokens(tp_model, one_process):
    """The compressed cache decides the tokens above, so their equality
    tests the sharded compressed cache, not only the sharded model."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(tp_model)
    vocab = model.args.vocab_size
    prompt = mx.array([(i * 7919 + 13) % vocab for i in range(PROMPT_TOKENS)])
    fp16 = [int(t) for t, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS)]
    assert fp16 != one_process["tokens"]


def test_generate_command_on_two_ranks(tp_model):
    args = ["-m", "veloxquant", "generate", "--model", tp_model, "--prompt", "tell me a story about a cat"]
    args += ["--max-tokens", "12", "--kv-window", "8", "--kv-sinks", "4", "--ignore-chat-template"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two = _launch(2, args)
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(two.stdout) == text(one.stdout)
    assert two.stdout.count("==========") == 2  # rank 0 alone writes
    kv = re.findall(r"^KV cache: ([\d,]+) bytes held on rank 0, ([\d,]+) over 2 ranks \(tensor parallel;", two.stdout, re.M)
    assert len(kv) == 1, two.stdout
    rank0, total = (int(n.replace(",", "")) for n in kv[0])
    assert total == 2 * rank0
    single = re.findall(r"^KV cache: ([\d,]+) bytes held \(", one.stdout, re.M)
    assert len(single) == 1 and rank0 < int(single[0].replace(",", ""))


def test_shard_refuses_heads_that_do_not_divide(tiny_model):
    from mlx_lm.utils import load

    from veloxquant import distributed

    class Three:
        def size(self):
            return 3

    model, _ = load(tiny_model, lazy=True)
    with pytest.raises(ValueError, match=r"^model: layer 0 has 2 query heads, which do not divide among 3 ranks$"):
        distributed.shard_model(model, Three())


def test_generate_command_names_heads_that_do_not_divide(tiny_model):
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed beside {sys.executable}")
    r = _launch(2, ["-m", "veloxquant", "generate", "--model", tiny_model, "--prompt", "hi"], check=False)
    assert re.search(r"Node with rank \d exited with code 2 ", r.stderr), r.stderr  # a usage error's status
    assert f"--model {tiny_model}: layer 0 has 1 KV heads, which do not divide among 2 ranks" in r.stderr
    assert "Traceback" not in r.stderr


def test_keys_of_a_compressed_cache_carry_a_pipeline_dependency_into_its_state():
    """mlx_lm's pipeline stages tie their send to ``cache[-1].keys``; the
    compressed cache passes it on through ``state`` and refuses anything
    but an array."""
    import mlx.core as mx

    from veloxquant.cache import KVConfig, VeloxQuantCache

    c = VeloxQuantCache(KVConfig(window=4, sinks=0))
    k = mx.random.normal((1, 1, 8, 64))
    c.update_and_fetch(k, k)
    c.attention(mx.random.normal((1, 1, 8, 64)), 0.125, "causal")
    before = {n: mx.array(a) for n, a in c.state["arrays"].items()}
    sent = mx.array([3.0]) * 2
    c.keys = mx.depends(c.keys, sent)
    assert c.keys.size == 1
    after = c.state["arrays"]
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[n], before[n]).item() for n in before)
    with pytest.raises(TypeError, match=r"^VeloxQuantCache\.keys: expected an mlx\.core\.array dependency, got list$"):
        c.keys = [1]


def test_a_pipeline_stage_configures_its_layers_by_their_model_wide_index(pp_model):
    """Rank 0 of a 2-stage pipeline runs layers 2 and 3 (mlx_lm gives rank 0
    the last layers): --kv-protect 2 keeps its first layer in float16, as
    layer 2 of the whole model."""
    from mlx_lm.utils import load

    from veloxquant.cache import KVConfig, make_prompt_cache

    class Stage:
        def rank(self):
            return 0

        def size(self):
            return 2

    config = KVConfig(window=8, sinks=4, protect=(2,))
    whole, _ = load(pp_model, lazy=True)
    full = make_prompt_cache(whole, config)
    staged, _ = load(pp_model, lazy=True)
    staged.model.pipeline(Stage())
    part = make_prompt_cache(staged, config)
    kinds = lambda caches: [type(c).__name__ for c in caches]  # noqa: E731
    assert kinds(full) == ["VeloxQuantCache"] * 2 + ["KVCache", "VeloxQuantCache"]  # float16 for the protected layer
    assert kinds(part) == ["KVCache", "VeloxQuantCache"]


def test_bench_on_two_ranks_reports_rank_zero_and_the_total(tmp_path):
    """``veloxquant bench`` under mlx.launch: each configuration's workers form
    the group (tensor parallel), rank 0 alone writes the rows."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed beside {sys.executable}")
    out = tmp_path / "bench.jsonl"
    args = ["-m", "veloxquant", "bench", "--shape", "tiny", "--contexts", "256", "--batch", "1",
            "--caches", "fp16,veloxquant", "--decode-tokens", "4", "--warmup", "1", "--timeout", "120",
            "--out-jsonl", str(out)]
    r = _launch(2, args, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["cache"] for row in rows] == ["fp16", "veloxquant"]
    for row in rows:
        assert row["error"] is None and row["ranks"] == 2
        assert row["kv_bytes_total"] == 2 * row["kv_bytes"]  # one of the tiny shape's two KV heads per rank
    assert rows[1]["kv_bytes"] < rows[0]["kv_bytes"]
    assert r.stdout.count("| KV MiB rank 0 | KV MiB, 2 ranks |") == 1  # rank 0 alone prints
