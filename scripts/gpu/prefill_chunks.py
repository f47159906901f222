"""Where a prefill's time goes, chunk by chunk, for several caches in one
process (rounds interleaved, so that the host's drift between processes does
not enter the ratios).

    python3 scripts/gpu/prefill_chunks.py --shape llama-8b --context 32768 --caches fp16,veloxquant --rounds 2

Each round prefills `--context` tokens with each cache in turn, as
`veloxquant bench` does (mlx_lm's chunks, every cache's state evaluated
after each chunk), after one warm-up prefill per cache of the
same length (its total is printed too: what a fresh process pays once). Per
chunk it records the host time to build the graph, the time to evaluate it and
MLX's peak memory (weights included); it prints the medians over rounds (the
peaks' largest), chunk by chunk, and the totals. A cost paid once per prefill shows as a first chunk slower than
the second; a cost that grows with the history, as a gap that widens.

`--eval-layers` evaluates each decoder layer's output and cache as the layer
returns, so that the host never runs more than a layer ahead of the GPU: a
probe of how much of a chunk's peak is temporaries that the GPU has not yet
released because the host queued later layers first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant  # noqa: F401  (before mlx: the native extension binds MLX's library first)
import mlx.core as mx

from veloxquant.tools import bench


def prefill_timed(model, cache, tokens, step: int):
    """bench.prefill's chunks and its last token, each timed: [(history, build
    s, eval s, peak bytes)], the peak being MLX's memory in use at its highest
    during the chunk."""
    n, done, out = tokens.shape[1], 0, []
    while n - done > 1:
        k = min(step, n - 1 - done)
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        model(tokens[:, done:done + k], cache=cache)
        t1 = time.perf_counter()
        mx.eval([c.state for c in cache])
        t2 = time.perf_counter()
        out.append((done, t1 - t0, t2 - t1, mx.get_peak_memory()))
        done += k
        mx.clear_cache()
    # The prompt's last token, as bench.prefill ends: one query through the
    # decode path, then the first generated token.
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    y = mx.argmax(model(tokens[:, done:], cache=cache)[:, -1], axis=-1)
    t1 = time.perf_counter()
    mx.eval(y)
    t2 = time.perf_counter()
    out.append((done, t1 - t0, t2 - t1, mx.get_peak_memory()))
    return out


def eval_each_layer(model) -> None:
    """Makes every decoder layer of `model` evaluate its output and its cache's
    state before it returns (the probe behind `--eval-layers`)."""
    block = type(model.model.layers[0])
    call = block.__call__

    def evaluated(self, x, *args, **kwargs):
        out = call(self, x, *args, **kwargs)
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        mx.eval(out, cache.state if cache is not None else [])
        return out

    block.__call__ = evaluated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--model", help="a model path, or 'default' (instead of --shape)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--caches", default="fp16,veloxquant")
    p.add_argument("--recipe", default="k4v3", help="the veloxquant recipe (veloxquant bench's syntax)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--step", type=int, default=2048, help="prefill chunk (mlx_lm's prefill_step_size)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eval-layers", action="store_true", help="evaluate each layer as it returns (see above)")
    args = p.parse_args()
    model = bench.build_model({"shape": args.shape, "model": args.model})
    from veloxquant import blas

    blas.maybe_float32_compute(model)  # as bench does on a CPU with a fast BLAS
    if args.eval_layers:
        eval_each_layer(model)
    tokens = mx.random.randint(0, model.args.vocab_size, (args.batch, args.context), key=mx.random.key(0))
    mx.eval(tokens)
    names = args.caches.split(",")
    specs = {name: bench.parse_cache(name, args.recipe) for name in names}
    runs = {name: [] for name in names}
    first = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in names:
            cache = bench.make_cache(model, specs[name])
            mx.synchronize()
            timed = prefill_timed(model, cache, tokens, args.step)
            mx.synchronize()
            if r:
                runs[name].append(timed)
            else:
                first[name] = timed
            del cache
            mx.clear_cache()
    print(f"{args.model or args.shape} context {args.context} batch {args.batch}, chunks of {args.step}; medians over {args.rounds} rounds, ms")
    head = "chunk  history " + " ".join(f"{n + ' build':>16} {n + ' eval':>16} {n + ' peak GiB':>16}" for n in names)
    print(head)
    n_chunks = len(runs[names[0]][0])
    totals = {n: [0.0, 0.0] for n in names}
    for i in range(n_chunks):
        cells = []
        for n in names:
            build = statistics.median(run[i][1] for run in runs[n]) * 1e3
            ev = statistics.median(run[i][2] for run in runs[n]) * 1e3
            peak = max(run[i][3] for run in runs[n]) / 2**30
            totals[n][0] += build
            totals[n][1] += ev
            cells.append(f"{build:16.2f} {ev:16.2f} {peak:16.3f}")
        print(f"{i:5d} {runs[names[0]][0][i][0]:8d} " + " ".join(cells))
    base = sum(totals[names[0]])
    for n in names:
        b, e = totals[n]
        print(f"{n}: build {b:.1f} ms + eval {e:.1f} ms = {b + e:.1f} ms ({(b + e) / base:.3f}x of {names[0]})")
    # The process's first prefill of this length (the warm-up round): what a
    # fresh process pays once more (kernels compiled, graphs built per shape).
    for n in names:
        once = sum(b + e for _, b, e, _ in first[n]) * 1e3
        print(f"{n}: first prefill {once:.1f} ms, {once - sum(totals[n]):+.1f} ms over the later ones")


if __name__ == "__main__":
    main()
