"""Graph building of one prefill chunk's cache work, and the MLX operations it makes.

    python scripts/chunk_graph_cost.py [--caches 200] [--heads 32,8] [--head-dim 128] [--chunk 2048] [--first]

For each of ``--caches`` layer caches holding one chunk already (evaluated),
times ``framed_append`` and ``attend_framed`` of the next chunk as a prefill
calls them, without evaluating (host time only: on a GPU each operation also
costs its launch at evaluation), and counts the operations they leave to
evaluate for the output and the cache's state
(``veloxquant.kernels.pending_primitives``).
With ``--first``, the prompt's first chunk instead: ``append`` into empty
caches (that chunk attends over its own keys and values, as float16 does).
Run it with two builds to compare them; the count is exact, the time moves
with the host's load.
"""

import argparse
import collections
import statistics
import time

import mlx.core as mx

from veloxquant import LayerCache
from veloxquant.kernels import pending_primitives


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--caches", type=int, default=200)
    p.add_argument("--heads", default="32,8", help="query heads, KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--first", action="store_true", help="the prompt's first chunk (append into empty caches)")
    a = p.parse_args()
    hq, hkv = (int(x) for x in a.heads.split(","))
    d, t = a.head_dim, a.chunk
    mx.random.seed(0)

    def rnd(*shape):
        return mx.random.normal(shape).astype(mx.float16)

    k, v, k2, v2, q = rnd(1, hkv, t, d), rnd(1, hkv, t, d), rnd(1, hkv, t, d), rnd(1, hkv, t, d), rnd(1, hq, t, d)
    mx.eval(k, v, k2, v2, q)
    caches = []
    for _ in range(a.caches):
        c = LayerCache(d, hkv)
        if not a.first:
            c.append(k, v)
        caches.append(c)
    if not a.first:
        mx.eval([list(c.state_parts()[0].values()) for c in caches])
    times, outs = [], []
    for c in caches:
        t0 = time.perf_counter()
        if a.first:
            c.append(k2, v2)
        else:
            fk, fv = c.framed_append(k2, v2)
            outs = [c.attend_framed(q, fk, fv, d ** -0.5, "causal")]
        times.append(time.perf_counter() - t0)
    ops = pending_primitives([*outs, *caches[-1].state_parts()[0].values()])
    over = "first" if a.first else f"over {t}"
    print(f"heads {hq},{hkv} head_dim {d} chunk {t} {over}: graph built in {statistics.median(times) * 1e6:.1f} us "
          f"(median of {a.caches}), {len(ops)} operations to evaluate")
    print("  " + ", ".join(f"{n} {c}" for n, c in collections.Counter(ops).most_common()))


if __name__ == "__main__":
    main()
