#!/usr/bin/env bash
# Set up (idempotent), then run portakern's main job: the portability benchmark (quick suite)
# on every backend present, with PoCL as the default OpenCL device here. It writes into a new
# benchmarks/runs/<hostname>-<UTC time>/ (git-ignored) and prints where: the committed
# benchmarks/results/<hostname>.* change only when a maintainer passes --out (docs/bench.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if .venv/bin/portakern bench --help >/dev/null 2>&1; then
  exec .venv/bin/portakern bench --suite quick "$@"
fi
exec .venv/bin/portakern check "$@"
