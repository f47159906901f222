#!/usr/bin/env bash
# The main job: set-up, then the demo (see README).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd /
exec "$root/.venv/bin/python" -m veloxquant.demo "$@"
