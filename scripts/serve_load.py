"""Aggregate decode speed of `veloxquant serve` under concurrent streaming
clients, one server per KV cache, side by side:

    python scripts/serve_load.py [--model PATH] [--clients 64] [--max-tokens 32]
        [--caches fp16,veloxquant] [--out-jsonl F] [--out-md F]

For each cache a server starts (`veloxquant serve --kv-cache CACHE`), answers
one warm-up request, then `--clients` streams at once (a barrier releases
them together; prompts "Count from i to i + 20:", greedy). Reported per
cache: streams complete, tokens streamed, wall time from the release to the
last event, aggregate tokens/s, the most streams under way at once, and
the median time to the first token. The server is stopped with Ctrl-C.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, prompt: str, max_tokens: int, stream: bool):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def one_stream(port: int, i: int, max_tokens: int, start: threading.Barrier, results: list) -> None:
    try:
        start.wait()
        t0 = time.monotonic()
        conn, reply = request(port, f"Count from {i} to {i + 20}:", max_tokens, True)
        tokens, times = 0, []
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                # A chunk per token; the last may carry only the finish reason.
                tokens += bool(json.loads(line[len("data: "):])["choices"][0].get("text"))
                times.append(time.monotonic())
        conn.close()
        results[i] = {"status": reply.status, "tokens": tokens, "start": t0, "first": times[0], "last": times[-1]}
    except Exception as e:  # a reset, a refused or timed-out connection
        results[i] = {"error": f"{type(e).__name__}: {e}"}


def wait_until_healthy(proc, port: int, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


def most_at_once(spans) -> int:
    ends = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    now = best = 0
    for _, step in ends:
        now += step
        best = max(best, now)
    return best


def run(cache: str, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "veloxquant", "serve", "--host", "127.0.0.1", "--port", str(port), "--kv-cache", cache]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until_healthy(proc, port)
        conn, reply = request(port, "Count from 1 to 5:", 4, False)  # warm-up
        reply.read()
        conn.close()
        start = threading.Barrier(args.clients)
        results = [None] * args.clients
        threads = [threading.Thread(target=one_stream, args=(port, i, args.max_tokens, start, results))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ok = [r for r in results if r and "error" not in r and r["status"] == 200]
    row = {"cache": cache, "clients": args.clients, "max_tokens": args.max_tokens, "complete": len(ok),
           "errors": sorted({r["error"] for r in results if r and "error" in r})[:3]}
    if ok:
        wall = max(r["last"] for r in ok) - min(r["start"] for r in ok)
        tokens = sum(r["tokens"] for r in ok)
        row.update(tokens=tokens, wall_s=wall, aggregate_tok_s=tokens / wall,
                   most_at_once=most_at_once([(r["first"], r["last"]) for r in ok]),
                   median_first_token_s=statistics.median(r["first"] - r["start"] for r in ok))
    return row


def table(rows) -> str:
    fp16 = next((r for r in rows if r["cache"] == "fp16" and r.get("aggregate_tok_s")), None)
    out = ["| cache | streams complete | tokens | wall s | aggregate tok/s | vs fp16 | most at once | median first token s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("aggregate_tok_s"):
            out.append(f"| {r['cache']} | {r['complete']}/{r['clients']} | — | — | — | — | — | — |")
            continue
        ratio = f"{r['aggregate_tok_s'] / fp16['aggregate_tok_s']:.2f}x" if fp16 else "—"
        out.append(f"| {r['cache']} | {r['complete']}/{r['clients']} | {r['tokens']} | {r['wall_s']:.1f} | "
                   f"{r['aggregate_tok_s']:.1f} | {ratio} | {r['most_at_once']} | {r['median_first_token_s']:.1f} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: serve's default model)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--caches", default="fp16,veloxquant")
    p.add_argument("--out-jsonl", default=None)
    p.add_argument("--out-md", default=None)
    args = p.parse_args()
    if args.clients < 1 or args.max_tokens < 1:
        p.error("--clients and --max-tokens must be >= 1")
    rows = []
    for cache in [c.strip() for c in args.caches.split(",") if c.strip()]:
        rows.append(run(cache, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    command = "python scripts/serve_load.py " + " ".join(sys.argv[1:])
    if args.out_jsonl:
        with open(args.out_jsonl, "w") as f:
            f.writelines(json.dumps({**r, "command": command}) + "\n" for r in rows)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(f"# `veloxquant serve` under {args.clients} concurrent streams\n\n`{command}`\n\n"
                    f"Each stream asks for {args.max_tokens} greedy tokens; aggregate tok/s is every stream's "
                    "tokens over the wall time from their release to the last event.\n\n" + text + "\n")
    return 0 if all(r["complete"] == r["clients"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
