"""GPU check of the decode over several sequences' own caches in one launch
(``LayerCache.attention_each`` on CUDA; run on a machine whose MLX has a GPU
back-end, not collected by pytest in CI):

    python python/tests/check_decode_each_gpu.py

For each head size, dtype, query heads per KV head and set of sequences,
every sequence gets its own cache of its own length (a prefill, then a few
decode-sized appends, so that windows and compressed counts differ), and
the batch's queries attend once through ``attention_each`` and once cache by
cache through ``attention``. The relative error between the two must stay
below 5e-3 (2e-2 in bfloat16: the split plans differ, and with them the
order of the float16 products' sums), every output must be finite, and a
second pair of calls built into the same graph must agree with the first
(each call hands the next its zeroed counters). Sets longer than one launch
serves, and one whose sinks are still filling, take several launches.

Then ``LayerCache.append_each`` on CUDA (one ``window_append`` per run of
sequences): 20 decode steps appended to one set of caches through it and
to a copy cache by cache must leave caches that attend exactly alike
(flushes every 16 tokens go cache by cache in both).
Prints one line per case and the largest error.
"""

import itertools
import sys

import mlx.core as mx

from veloxquant import LayerCache


def caches_for(d, dtype, hkv, lengths, seed):
    mx.random.seed(seed)
    out = []
    for n in lengths:
        c = LayerCache(d, hkv, key_bits=4, value_bits=3, window=32, sinks=4, device="gpu", policy="require")
        k = (mx.random.normal((1, hkv, n, d)) * mx.linspace(0.2, 3.0, d) + 0.7).astype(dtype)
        v = mx.random.normal((1, hkv, n, d)).astype(dtype)
        tail = min(3, n - 1)
        c.append(k[:, :, : n - tail], v[:, :, : n - tail])
        for i in range(n - tail, n):
            c.append(k[:, :, i : i + 1], v[:, :, i : i + 1])
        out.append(c)
    return out


def case(d, dtype, group, lengths, seed):
    hkv = 2
    caches = caches_for(d, dtype, hkv, lengths, seed)
    q = (mx.random.normal((len(lengths), hkv * group, 1, d)) * 2.0).astype(dtype)
    scale = d**-0.5
    together = [LayerCache.attention_each(caches, q, scale) for _ in range(2)]
    alone = mx.concatenate([c.attention(q[b : b + 1], scale) for b, c in enumerate(caches)], axis=0)
    mx.eval(together, alone)
    want = alone.astype(mx.float32)
    err = max((mx.linalg.norm(t.astype(mx.float32) - want) / mx.linalg.norm(want)).item() for t in together)
    same = mx.array_equal(together[0], together[1]).item()
    finite = all(mx.all(mx.isfinite(t)).item() for t in together)
    return err, finite and same


def append_case(d, dtype, lengths, seed):
    hkv = 2
    together, alone = caches_for(d, dtype, hkv, lengths, seed), caches_for(d, dtype, hkv, lengths, seed)
    q = (mx.random.normal((len(lengths), hkv * 4, 1, d)) * 2.0).astype(dtype)
    for step in range(20):
        k = mx.random.normal((len(lengths), hkv, 1, d)).astype(dtype)
        v = mx.random.normal((len(lengths), hkv, 1, d)).astype(dtype)
        LayerCache.append_each(together, k, v)
        for b, c in enumerate(alone):
            c.append(k[b : b + 1], v[b : b + 1])
        if step % 5 == 4:
            for b in range(len(lengths)):
                x, y = together[b].attention(q[b : b + 1], d**-0.5), alone[b].attention(q[b : b + 1], d**-0.5)
                if not mx.array_equal(x, y).item():
                    return False
    return True


def main() -> int:
    worst, failed = 0.0, 0
    sets = (
        (3000, 700),
        (140, 3000, 41, 2200),
        tuple(300 + 517 * i for i in range(8)),
        tuple(64 + 97 * i for i in range(17)),  # two launches: 16 and one
        (900, 2, 1500),  # the second still fills its sinks: runs of one
    )
    for d, dtype, group, lengths in itertools.product((64, 128), (mx.float16, mx.bfloat16), (4, 1), sets):
        err, ok = case(d, dtype, group, lengths, seed=len(lengths) + d)
        limit = 2e-2 if dtype == mx.bfloat16 else 5e-3
        good = ok and err < limit
        failed += not good
        worst = max(worst, err)
        print(f"{'ok  ' if good else 'FAIL'} d={d} {dtype} group={group} sequences={len(lengths)} err={err:.2e}", flush=True)
    for d, dtype, lengths in itertools.product((64, 128), (mx.float16, mx.bfloat16), sets):
        good = append_case(d, dtype, lengths, seed=len(lengths) + d + 1)
        failed += not good
        print(f"{'ok  ' if good else 'FAIL'} append_each d={d} {dtype} sequences={len(lengths)}", flush=True)
    print(f"largest error {worst:.2e}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
