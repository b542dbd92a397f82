#!/usr/bin/env bash
# Does load bend the benchmark's ratios? (issue 26.) A few quick-suite cases on the OpenCL
# target, each measured quiet and then again with a CPU hog (`python -c 'while True: pass'`)
# pinned to one core (`portakern bench --hog`: the last usable core, or CORE=n). The result
# file, its table ("Load stability": each ratio quiet, hogged and the difference) and
# ratio_stability.png land in benchmarks/results/stability/ unless OUT=... says otherwise.
# About 5 minutes on a 2-core CPU with PoCL; extra arguments go to `portakern bench`.
#
# ONE_CORE=1 runs the same cases with no hog, confined instead to core 0 (taskset) with one
# thread in every runtime (PoCL, OpenBLAS, torch's OpenMP, XLA's Eigen pool): the best any
# method could do against a load that holds the other core is to measure on the core it
# leaves free, and this run shows the ratios that such isolation would print (docs/bench.md).
#
# Usage: bash benchmarks/hog_stability.sh [--min-reps N] [...]
#        ONE_CORE=1 bash benchmarks/hog_stability.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=(--case softmax/float32/4096x4096 --case matmul/float32/N=1024
       --case "attention/float32/B1 H8 S1024 D64 kv2" --case "attention/float32/B1 H8 S4096 D64")
BENCH=(.venv/bin/portakern bench --suite quick --backends opencl:0 --no-probes --no-dispatch
       "${CASES[@]}" --min-reps 7 --remeasure 2)
if [[ "${ONE_CORE:-0}" == 1 ]]; then
  OUT="${OUT:-benchmarks/results/stability/$(hostname)-one-core.json}"
  exec taskset -c 0 env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
    POCL_MAX_PTHREAD_COUNT=1 \
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
    "${BENCH[@]}" --out "$OUT" "$@"
fi
OUT="${OUT:-benchmarks/results/stability/$(hostname)-hog.json}"
exec "${BENCH[@]}" --hog ${CORE:-} --out "$OUT" "$@"
