#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh: two or more
# builds of quant_kernels_bench against each other in one session, taking
# them in turn (A, B, C, A, B, C ...) so that the GPU's drift between rows
# (see docs/results/cuda_quant_kernels.md, "x + x ms before") falls on all
# alike, then one table of each row's fused ms per run and each build's
# median over the first build's. Output goes to $OUT.
#
#   device-ab.sh BENCH_A BENCH_B [BENCH_C ...] [bench arguments, e.g. --only tq_prod]
#   ROUNDS  runs of each build (default 3); pass --fused-only to skip the references
#
# The benches are the arguments before the first one that starts with "--".
# Build each on its branch with scripts/gpu/build-cuda.sh and copy its
# .device/build/quant_kernels_bench aside before building the next; carry
# them all.
set -uo pipefail
benches=()
while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do
  benches+=("$1")
  shift
done
[ ${#benches[@]} -ge 2 ] || { echo "usage: $0 BENCH_A BENCH_B [BENCH_C ...] [bench arguments]" >&2; exit 2; }
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export PYTHONPATH=/root/site
export LD_LIBRARY_PATH=/root/site/mlx/lib
status=0
for round in $(seq 1 "${ROUNDS:-3}"); do
  for i in "${!benches[@]}"; do
    "${benches[$i]}" --device gpu --dtype f16 "$@" >"$OUT/ab_${i}_${round}.txt" 2>&1 || status=1
  done
done
python3 - "$OUT" "${ROUNDS:-3}" "${benches[@]}" <<'PY'
import pathlib
import statistics
import sys

out, rounds, benches = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]


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


runs = [[fused(out / f"ab_{i}_{r}.txt") for r in range(1, rounds + 1)] for i in range(len(benches))]
names = [n for n in runs[0][0] if all(n in r for build in runs for r in build)]
letters = [chr(ord("A") + i) for i in range(len(benches))]
for letter, bench in zip(letters, benches):
    print(f"{letter}: {bench}")
print()
print("| row | " + " | ".join(f"{l} fused ms" for l in letters) + " | " + " | ".join(f"{l} / A" for l in letters[1:]) + " |")
print("|---|" + "---|" * (2 * len(benches) - 1))
for n in names:
    times = [[r[n] for r in build] for build in runs]
    base = statistics.median(times[0])
    cells = [", ".join(f"{v:.3f}" for v in t) for t in times]
    ratios = [f"{statistics.median(t) / base:.3f}" for t in times[1:]]
    print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
PY
exit $status
