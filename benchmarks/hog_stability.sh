#!/usr/bin/env bash
# Does load bend the benchmark's ratios? (issue 26.) A few quick-suite cases on the OpenCL
# target, each measured quiet and then again with a CPU hog (`python -c 'while True: pass'`)
# pinned to one core (`portakern bench --hog`: the last usable core, or CORE=n). The result
# file, its table ("Load stability": each ratio quiet, hogged and the difference) and
# ratio_stability.png land in benchmarks/results/stability/ unless OUT=... says otherwise.
# About 5 minutes on a 2-core CPU with PoCL; extra arguments go to `portakern bench`.
#
# Usage: bash benchmarks/hog_stability.sh [--min-reps N] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/stability/$(hostname)-hog.json}"
exec .venv/bin/portakern bench --suite quick --backends opencl:0 --no-probes --no-dispatch \
  --case softmax/float32/4096x4096 --case matmul/float32/N=1024 \
  --case "attention/float32/B1 H8 S1024 D64 kv2" --case "attention/float32/B1 H8 S4096 D64" \
  --min-reps 7 --remeasure 2 --hog ${CORE:-} --out "$OUT" "$@"
