"""`veloxquant serve` under a burst of 64 concurrent streaming requests: every
stream completes, none is reset, and they are decoded together (batched);
a repeated prompt reuses the cache of the first; Ctrl-C then stops it
cleanly. The tiny model keeps it quick: the default one takes most of a
second a token on a small CPU."""

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from serve_load import free_port, most_at_once, wait_until_healthy  # noqa: E402

CLIENTS = 64


def stream(port, i, start, results):
    """One streaming completion; records its status, its events and when
    its first and last events came, or the error."""
    try:
        start.wait()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({"prompt": f"Count from {i} to {i + 20}:", "max_tokens": 6, "temperature": 0, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        events, times = [], []
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                times.append(time.monotonic())
        conn.close()
        results[i] = (reply.status, events, times[0], times[-1])
    except Exception as e:  # a reset, a refused or timed-out connection
        results[i] = e


def complete(port, prompt):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    return reply


@pytest.mark.parametrize("extra", [["--kv-cache", "veloxquant", "--kv-window", "4"], []], ids=["veloxquant", "fp16"])
def test_burst_of_streams_all_complete_and_ctrl_c_stops_cleanly(tiny_model, extra, tmp_path):
    port = free_port()
    with open(tmp_path / "stderr", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "veloxquant", "serve", "--model", tiny_model, "--host", "127.0.0.1",
             "--port", str(port), *extra],
            stdout=subprocess.DEVNULL, stderr=log,
            # Ctrl-C's default action even where this test runs with SIGINT
            # ignored (a background job), which the server would inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_until_healthy(proc, port, seconds=60)
            start = threading.Barrier(CLIENTS)
            results = [None] * CLIENTS
            clients = [threading.Thread(target=stream, args=(port, i, start, results)) for i in range(CLIENTS)]
            for c in clients:
                c.start()
            for c in clients:
                c.join(timeout=150)
            failed = {i: r for i, r in enumerate(results) if not isinstance(r, tuple)}
            assert not failed, f"{len(failed)} of {CLIENTS} streams failed: {list(failed.items())[:3]}"
            for status, events, _, _ in results:
                assert status == 200 and events[-1] == "[DONE]"
                chunks = [json.loads(e) for e in events[:-1]]
                assert chunks and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
            # Served one at a time, no two streams would be under way at once.
            assert most_at_once([r[2:] for r in results]) >= 8
            # mlx_lm's prompt cache: the second request finds the first's cache.
            prompt = "The quick brown fox jumps over the lazy dog, and then"
            first, again = complete(port, prompt), complete(port, prompt)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
            proc.send_signal(signal.SIGINT)
            status = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        err = log.read()
    assert status in (0, 130), err[-2000:]
    assert "Traceback" not in err and "panicked" not in err and "terminate called" not in err, err[-2000:]
