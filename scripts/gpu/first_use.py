"""What a fresh process pays before its first tokens, cache by cache.

    python3 scripts/gpu/first_use.py --shape llama-1b --caches fp16,veloxquant --processes 2

Each process builds the model, then for each cache in turn runs a short
prompt and a few decode steps twice (`bench.prefill` and `bench.decode`):
the first run pays every kernel's compilation, the second shows the steady
cost. Processes run one after another, so a later one finds whatever the
earlier ones left on disk: MLX keeps the machine code of its own CUDA kernels
under `MLX_PTX_CACHE_DIR` (default `$TMPDIR/mlx/<version>/ptx`), and
veloxquant writes its custom kernels' there (MLX itself compiles custom
kernels in every process). After each process the script counts the modules
in that directory and how many are veloxquant's.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    import veloxquant  # noqa: F401  (before mlx: the native extension binds MLX's library first)
    import mlx.core as mx
    from veloxquant.tools import bench

    model = bench.build_model({"shape": args.shape})
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, model.args.vocab_size, (1, args.prompt + 1), key=mx.random.key(0))
    for name in args.caches.split(","):
        spec = bench.parse_cache(name, args.recipe)
        for run in ("first", "again"):
            cache = bench.make_cache(model, spec)
            mx.synchronize()
            t0 = time.perf_counter()
            y = bench.prefill(model, cache, tokens, args.step)
            y = bench.decode(model, cache, y, args.decode)
            mx.synchronize()
            print(f"  {name:>12} {run:>5}: {1e3 * (time.perf_counter() - t0):9.1f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-1b")
    p.add_argument("--caches", default="fp16,veloxquant")
    p.add_argument("--recipe", default="k4v3")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens (two chunks of --step)")
    p.add_argument("--step", type=int, default=1024)
    p.add_argument("--decode", type=int, default=4, help="decode steps after the prompt")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    ptx = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx", "*", "ptx")
    print(f"{args.shape}: {args.prompt}-token prompt in chunks of {args.step}, then {args.decode} decode steps; "
          f"prefill and decode wall time per run")
    for i in range(args.processes):
        print(f"process {i + 1}:", flush=True)
        subprocess.run([sys.executable, __file__, "--child"] + sys.argv[1:], check=True)
        modules = glob.glob(os.path.join(ptx, "*.ptx"))
        ours = [m for m in modules if "veloxquant" in os.path.basename(m)]
        print(f"  MLX's compiled-kernel cache ({ptx}): {len(modules)} modules, {len(ours)} of them veloxquant's",
              flush=True)


if __name__ == "__main__":
    main()
