#!/usr/bin/env bash
# Set up (idempotent), then run portakern's main job: the portability benchmark (quick suite)
# on every backend present, with PoCL as the default OpenCL device here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if .venv/bin/portakern bench --help >/dev/null 2>&1; then
  exec .venv/bin/portakern bench --suite quick --out benchmarks/results/"$(hostname)".json "$@"
fi
exec .venv/bin/portakern check "$@"
