#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh: two builds of
# quant_kernels_bench against each other in one session, alternating A, B,
# A, B ... so that the GPU's drift between rows (see
# docs/results/cuda_quant_kernels.md, "x + x ms before") falls on both
# alike, then one table of each row's fused ms per run and the ratio of the
# medians. Output goes to $OUT.
#
#   device-ab.sh BENCH_A BENCH_B [bench arguments, e.g. --only tq_prod]
#   ROUNDS  runs of each build (default 3)
#
# Build B on a branch with scripts/build-cuda.sh and copy its
# .device/build/quant_kernels_bench aside before building A (or the other
# way round); carry both.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BENCH_A BENCH_B [bench arguments]" >&2; exit 2; }
bench_a="$1"
bench_b="$2"
shift 2
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export PYTHONPATH=/root/site
export LD_LIBRARY_PATH=/root/site/mlx/lib
status=0
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in a b; do
    bench="$bench_a"
    [ "$side" = b ] && bench="$bench_b"
    "$bench" --device gpu --dtype f16 "$@" >"$OUT/ab_${side}_${round}.txt" 2>&1 || status=1
  done
done
python3 - "$OUT" "${ROUNDS:-3}" <<'PY'
import pathlib
import statistics
import sys

out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])


def fused(path):
    """Row name -> fused ms, from a benchmark table."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1] not in ("kernel", "") and not cells[1].startswith("-"):
            try:
                rows[cells[1]] = float(cells[2])
            except ValueError:
                pass
    return rows


runs = {side: [fused(out / f"ab_{side}_{r}.txt") for r in range(1, rounds + 1)] for side in "ab"}
names = [n for n in runs["a"][0] if all(n in r for side in "ab" for r in runs[side])]
print("| row | A fused ms | B fused ms | B / A (medians) |")
print("|---|---|---|---|")
for n in names:
    a = [r[n] for r in runs["a"]]
    b = [r[n] for r in runs["b"]]
    ratio = statistics.median(b) / statistics.median(a)
    print(f"| {n} | {', '.join(f'{v:.3f}' for v in a)} | {', '.join(f'{v:.3f}' for v in b)} | {ratio:.3f} |")
PY
exit $status
