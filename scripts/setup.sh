#!/usr/bin/env bash
# Prepares this checkout on a fresh machine, and again at no cost: system
# packages (libclang for bindgen; OpenBLAS, which veloxquant loads in place of
# the reference BLAS of the mlx[cpu] wheel: see veloxquant/blas.py), a virtual
# environment .venv with the pinned Python packages, and veloxquant built from
# source and installed into it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

MLX_VERSION=0.32.4
PINNED=(nanobind==3.1.0 maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 mlx-lm==0.32.2 gguf==0.19.0
        matplotlib==3.11.2 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0)

if [ "$(uname)" = "Linux" ]; then
  need=()
  dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || need+=(libopenblas0-pthread)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  if [ ${#need[@]} -gt 0 ]; then
    echo "== installing ${need[*]}"
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  MLX_SPEC="mlx[cpu]==$MLX_VERSION"
else
  MLX_SPEC="mlx==$MLX_VERSION"
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
PY="$root/.venv/bin/python"
if ! "$PY" -m pip show -q mlx nanobind maturin numpy pytest mlx-lm gguf matplotlib nbclient nbformat ipykernel >/dev/null 2>&1 ||
   [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("mlx"))')" != "$MLX_VERSION" ]; then
  echo "== installing Python packages"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$MLX_SPEC" "${PINNED[@]}"
fi

export VELOXQUANT_PYTHON="$PY"
echo "== building veloxquant"
rm -f target/wheels/veloxquant-*.whl
"$root/.venv/bin/maturin" build --release -i "$PY" -o target/wheels
shopt -s nullglob
wheels=(target/wheels/veloxquant-*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "expected one veloxquant wheel in target/wheels, found ${#wheels[@]}" >&2; exit 1; }
wheel="${wheels[0]}"
"$PY" -m pip install -q --force-reinstall --no-deps "$wheel"
echo "== ready: $(basename "$wheel")"
