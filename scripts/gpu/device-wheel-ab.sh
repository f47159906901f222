#!/usr/bin/env bash
# Runs on the NVIDIA GPU machine, after .device/b/install.sh: two or more
# veloxquant wheels (builds of different branches) against each other in one
# session, taking them in turn (A, B, A, B ...) so that the machine's drift
# falls on all alike. Each wheel goes to its own directory ahead of
# /root/site on PYTHONPATH; this checkout's Python files go over each (the
# builds are to differ in their Rust and kernel sources). Output in $OUT:
# each run's table, wab_<build>_<round>.md.
#
#   device-wheel-ab.sh WHEEL_A WHEEL_B [...] [-- python module or script.py, and arguments]
#   ROUNDS  runs of each build (default 2)
#   OWN_PY=1  each wheel keeps its own Python files (builds of commits whose
#             Python differs too: a bisection across a range of commits)
#
# Default command: python3 -m veloxquant.tools.bench_attention --device gpu
# --iters 20 --contexts 32768 131072. Build each wheel with
# `ONLY=wheel bash scripts/gpu/build-cuda.sh` on its branch, copy it aside
# (say .device/ab/a.whl, .device/ab/b.whl) and carry .device/ab (the wheels
# are stripped, ~2 MB each: several fit one carry beside .device/b).
set -uo pipefail
wheels=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  wheels+=("$1")
  shift
done
[ $# -gt 0 ] && shift
[ ${#wheels[@]} -ge 2 ] || { echo "usage: $0 WHEEL_A WHEEL_B [...] [-- module or script.py, args]" >&2; exit 2; }
cmd=("$@")
[ ${#cmd[@]} -gt 0 ] || cmd=(veloxquant.tools.bench_attention --device gpu --iters 20 --contexts 32768 131072)
OUT="${OUT:-/tmp/vq-out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/root/site/mlx/lib PYTHONUNBUFFERED=1
for i in "${!wheels[@]}"; do
  rm -rf "/root/vq$i"
  python3 -m pip install -q --no-index --no-deps --target "/root/vq$i" "${wheels[$i]}" || exit 1
  if [ "${OWN_PY:-0}" != 1 ]; then
    cp python/veloxquant/*.py "/root/vq$i/veloxquant/"
    cp python/veloxquant/tools/*.py "/root/vq$i/veloxquant/tools/"
  fi
done
# A script (scripts/gpu/prefill_chunks.py ...) runs as a file, anything else as a module.
run=(-m); [[ "${cmd[0]}" == *.py ]] && run=()
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!wheels[@]}"; do
    echo "== ${wheels[$i]}, round $round"
    PYTHONPATH="/root/vq$i:/root/site:$PWD/.device/pylib" python3 "${run[@]}" "${cmd[@]}" >"$OUT/wab_${i}_${round}.md" 2>&1 || status=1
    grep "^|" "$OUT/wab_${i}_${round}.md" | tail -n +3
  done
done
exit $status
