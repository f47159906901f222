"""The kernel-throughput figure's cases run for every input dtype it uses
(float32 on the CPU, float16 on the GPU)."""

import mlx.core as mx
import pytest

from veloxquant.tools import plot_kernels


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_every_case_runs_for_the_dtype(dtype):
    cases, d = plot_kernels._cases(dtype)
    x = mx.random.normal((64, d), key=mx.random.key(0)).astype(dtype)
    for name, run in cases.items():
        for policy in ("require", "off"):
            out = run(x, policy)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o is not None]
            mx.eval(*outs)
            assert all(o.size > 0 for o in outs), name
