"""Tensor-parallel generation with veloxquant's cache on MLX's ring backend:
two local processes started by ``mlx.launch``, compared with one process."""

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


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """A 2-layer Llama with 4 query and 4 KV heads (2 per rank on 2 ranks) and
    float32 weights: the sharded and the whole model then differ only in the
    order of float32 sums. Its matrices are scaled up from mlx's small random
    init so that greedy tokens depend on the context (at mlx's init every
    token is the same one)."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed beside {sys.executable}")
    import mlx.core as mx

    from conftest import write_tiny_llama

    if not mx.distributed.is_available():
        pytest.skip("this mlx build has no distributed backend")
    return write_tiny_llama(
        tmp_path_factory.mktemp("tp-llama"), matrix_scale=2.0,
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
    )


def _worker(tp_model, tmp_path: Path, ranks: int) -> dict:
    out = tmp_path / f"ranks{ranks}.json"
    args = [str(WORKER), tp_model, str(out), str(PROMPT_TOKENS), str(MAX_TOKENS)]
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
