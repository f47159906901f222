"""Host time of one MLX custom-kernel launch on the GPU by the size of its
source: a builtin op, a small `mx.fast.cuda_kernel`, the same kernel padded
with 93 KB of comment lines (tq_decode's size with its headers before the
crate dropped their comments) and that kernel with ten inputs. Each op is
chained 64 times; `build` is graph building and `eval` the evaluation
(launches and the tiny kernels' run), per op, median of ten rounds.

    python3 scripts/gpu/custom_kernel_host_cost.py
"""

import statistics
import time

import mlx.core as mx

N = 64
SMALL = "unsigned n = blockIdx.x * blockDim.x + threadIdx.x; if (n < 4096) out[n] = x[n] + 1.0f;"
PADDED = ("// " + "x" * 1000 + "\n") * 93 + SMALL
TEMPLATE = [("T", mx.float16), ("D", 128), ("R", True)]


def kernel(name, source, inputs=1):
    names = ["x"] + [f"unused{i}" for i in range(1, inputs)]
    k = mx.fast.cuda_kernel(name=name, input_names=names, output_names=["out"], source=source)
    return lambda y: k(inputs=[y] * inputs, output_shapes=[(4096,)], output_dtypes=[mx.float32],
                       grid=(4096, 1, 1), threadgroup=(256, 1, 1), template=TEMPLATE)[0]


def main() -> None:
    ops = {
        "builtin": lambda y: y + 1.0,
        "small": kernel("probe_small", SMALL),
        "93 KB": kernel("probe_padded", PADDED),
        "93 KB, 10 inputs": kernel("probe_padded_10", PADDED, 10),
    }
    x = mx.ones((4096,), dtype=mx.float32)
    mx.eval(x)
    times = {name: ([], []) for name in ops}
    for r in range(12):
        for name, op in ops.items():
            y = x
            t0 = time.perf_counter()
            for _ in range(N):
                y = op(y)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            if r >= 2:
                times[name][0].append(1e6 * (t1 - t0) / N)
                times[name][1].append(1e6 * (t2 - t1) / N)
    print(f"{'op':<18}{'build us':>10}{'eval us':>10}")
    for name, (b, e) in times.items():
        print(f"{name:<18}{statistics.median(b):>10.2f}{statistics.median(e):>10.2f}")


if __name__ == "__main__":
    main()
