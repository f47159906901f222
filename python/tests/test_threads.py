"""LayerCache across threads: made on one, used on another, dropped on a third,
as on one thread; several at once; nothing on stderr; errors, never panics."""

import concurrent.futures as cf
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from veloxquant._native import LayerCache

METHODS = [("turboquant-mse", "turboquant-mse"), ("kivi", "turboquant-mse"), ("turboquant-prod", "kivi"), ("fp16", "fp16")]


def make(key="turboquant-mse", value="turboquant-mse"):
    return LayerCache(64, 2, key_method=key, value_method=value, window=8, sinks=2, device="cpu")


def fill_and_attend(cache, seed):
    """A prefill chunk, then single tokens each followed by a decode query.
    Inputs are made on the calling thread: MLX streams are per thread, and a
    lazy array can be evaluated only on the thread that built it."""

    def normal(shape, i):
        return mx.random.normal(shape, key=mx.random.key(1000 * seed + i)).astype(mx.float16)

    cache.append(normal((1, 2, 40, 64), 0), normal((1, 2, 40, 64), 1))
    outs = []
    for step in range(12):
        cache.append(normal((1, 2, 1, 64), 3 * step + 2), normal((1, 2, 1, 64), 3 * step + 3))
        outs.append(np.array(cache.attention(normal((1, 4, 1, 64), 3 * step + 4), 0.125)))
    return outs


def appended(cache, tokens=20):
    """`cache` with `tokens` appended, nothing evaluated."""
    k = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(tokens)).astype(mx.float16)
    cache.append(k, k)
    return cache


def on_thread(pool, f, *args):
    return pool.submit(f, *args).result()


@pytest.mark.parametrize("key, value", METHODS)
def test_made_used_and_dropped_on_three_threads_as_on_one(key, value):
    want = fill_and_attend(make(key, value), 3)
    with cf.ThreadPoolExecutor(1) as a, cf.ThreadPoolExecutor(1) as b, cf.ThreadPoolExecutor(1) as c:
        held = [on_thread(a, make, key, value)]
        got = on_thread(b, fill_and_attend, held[0], 3)
        on_thread(c, held.clear)  # the last reference goes on the third thread
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_caches_used_at_once_from_several_threads():
    jobs = [(METHODS[i % len(METHODS)], i) for i in range(8)]
    want = [fill_and_attend(make(*m), seed) for m, seed in jobs]
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: fill_and_attend(make(*job[0]), job[1]), jobs))
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            np.testing.assert_array_equal(b, a)


def test_layers_of_different_threads_share_one_rotation():
    with cf.ThreadPoolExecutor(1) as a, cf.ThreadPoolExecutor(1) as b:
        # The first layer makes the shared arrays and evaluates nothing; the
        # second evaluates them on another thread.
        one = on_thread(a, lambda: appended(make()))
        two = make()
        outs = on_thread(b, fill_and_attend, two, 5)
    assert one.shared_id is not None and one.shared_id == two.shared_id
    assert all(np.isfinite(o).all() for o in outs)


def test_work_left_pending_on_another_thread_is_an_exception():
    # MLX evaluates a lazy array only on the thread that built it: the
    # cache's work too, which then raises an ordinary exception elsewhere
    # and stays usable where it was queued.
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    with cf.ThreadPoolExecutor(1) as a:
        cache = on_thread(a, lambda: appended(make()))
        with pytest.raises(RuntimeError):
            mx.eval(cache.attention(q, 0.1))
        assert on_thread(a, lambda: np.array(cache.attention(mx.zeros((1, 4, 1, 64), mx.float16), 0.1)).shape) == (1, 4, 1, 64)


def test_nothing_on_stderr_when_caches_cross_threads():
    # In a process of its own, so that what its threads and its exit print
    # is all there is: caches made and filled on pool threads, dropped on
    # others, some left for the interpreter to drop at exit.
    script = textwrap.dedent(
        """
        import concurrent.futures as cf
        import mlx.core as mx
        from veloxquant._native import LayerCache

        def make():
            return LayerCache(64, 2, key_method="kivi", window=8, sinks=2, device="cpu")

        def fill(cache, i):
            k = mx.random.normal((1, 2, 24, 64), key=mx.random.key(i)).astype(mx.float16)
            cache.append(k, k)
            mx.eval(cache.attention(mx.zeros((1, 4, 1, 64), mx.float16), 0.1))
            return cache

        with cf.ThreadPoolExecutor(2) as a, cf.ThreadPoolExecutor(2) as b, cf.ThreadPoolExecutor(2) as c:
            caches = list(a.map(lambda _: make(), range(16)))
            caches = list(b.map(fill, caches, range(16)))
            kept = caches[:4]
            c.map(lambda i: caches.__setitem__(i, None), range(16))
        print(sum(x.offset for x in kept))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "96"
    assert r.stderr == "", r.stderr


@pytest.mark.parametrize("key, value", METHODS)
def test_bad_calls_raise_exceptions_naming_the_argument(key, value):
    # Every wrong argument is an Exception naming it: nothing reaches Python
    # as a pyo3 PanicException (a BaseException).
    cache = make(key, value)
    filled = appended(make(key, value))
    k = mx.zeros((1, 2, 20, 64), mx.float16)
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    calls = [
        ("queries", lambda: cache.attention(q, 0.1)),  # nothing cached yet
        ("keys", lambda: cache.append(mx.zeros((1, 2, 64)), mx.zeros((1, 2, 64)))),
        ("keys", lambda: cache.append(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)))),
        ("keys", lambda: cache.append(mx.zeros((1, 2, 4, 64), mx.int32), mx.zeros((1, 2, 4, 64), mx.int32))),
        ("values", lambda: cache.append(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 5, 64)))),
        ("n", lambda: cache.trim(-1)),
        ("queries", lambda: filled.attention(mx.zeros((1, 4, 64), mx.float16), 0.1)),
        ("queries", lambda: filled.attention(mx.zeros((2, 4, 1, 64), mx.float16), 0.1)),
        ("queries", lambda: filled.attention(mx.zeros((1, 3, 1, 64), mx.float16), 0.1)),
        ("queries", lambda: filled.attention(mx.zeros((1, 4, 30, 64), mx.float16), 0.1, mask="causal")),
        ("mask", lambda: filled.attention(q, 0.1, mask="sliding")),
        ("mask", lambda: filled.attention(q, 0.1, mask=mx.zeros((3, 3), mx.bool_))),
        ("keys", lambda: filled.attend_framed(q, k, k[:, :, :3], 0.1)),
        ("scale", lambda: filled.attention(q, float("nan"))),
        ("scale", lambda: filled.attention(q, float("inf"), mask="causal")),
        ("scale", lambda: filled.attend_framed(q, *filled.framed_with(k, k), float("nan"))),
    ]
    data = filled.to_bytes()
    calls += [("state", lambda cut=cut: LayerCache.from_bytes(data[:cut])) for cut in (0, 9, len(data) // 2, len(data) - 1)]
    for argument, call in calls:
        try:
            out = call()
            if isinstance(out, mx.array):
                mx.eval(out)
        except Exception as e:
            assert argument in str(e), (argument, e)
        else:
            raise AssertionError(f"no error for a bad {argument}")
