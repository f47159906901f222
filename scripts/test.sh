#!/usr/bin/env bash
# Every test: set-up, then the Rust tests (unit, CPU kernels, the Metal
# emulator, golden sources), then the Python tests against the installed package.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export VELOXQUANT_PYTHON="$root/.venv/bin/python"
echo "== Rust tests"
cargo test --release --lib --tests --no-fail-fast
echo "== Rust example"
cargo run --release --example cache_demo -- --tokens 512
echo "== Python tests"
# Run from outside the source tree so that the installed package is tested.
cd "$root/python/tests"
"$VELOXQUANT_PYTHON" -m pytest -q -p no:cacheprovider --rootdir . .
