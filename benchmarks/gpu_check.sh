#!/usr/bin/env bash
# portakern on a fresh NVIDIA GPU machine: set up, then compile-only check, the static resource
# report for this GPU's architecture (`portakern resources`: the predicted side), the whole
# test suite on cuda, the conformance check and the quick benchmark (the measured side), all
# with CUPY_TF32=0, and the matrix-unit figures (bf16 matmul vs cuBLAS, fp16 attention vs
# SDPA). Everything
# (logs, results.json with GPU model, driver, CUDA and CuPy versions) lands in one folder:
# $OUT if set, else ./gpu_out. 8 minutes in all: each step has its own `timeout` and is cut to
# what is left of the budget, so a hung step cannot eat the rest.
#
# Setup order: .venv/bin/python if it imports cupy (a carried virtualenv), then python3 if
# it does; portakern is (re)installed into that interpreter offline if it is not importable
# (`pip install --no-deps --no-build-isolation -e .`); only then, if the network allows,
# `pip install -e '.[cuda,jax,dev]'` into a fresh venv.
#
# Usage: bash benchmarks/gpu_check.sh          (from anywhere; it cds to the repo root)

set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

BUDGET_S="${PORTAKERN_GPU_BUDGET_S:-470}"   # a little under 8 minutes
START_S=$(date +%s)
STEPS="$OUT/steps.tsv"
: > "$STEPS"
export OUT_DIR="$OUT" START_S

export CUPY_TF32=0                     # cuBLAS peers: no TF32 (our kernels never use it)
export PORTAKERN_TEST_BACKENDS=cuda    # the shared suite's conftest honours this
export PORTAKERN_HYPOTHESIS_PROFILE="${PORTAKERN_HYPOTHESIS_PROFILE:-dev}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export PORTAKERN_CUDA_CACHE="${PORTAKERN_CUDA_CACHE:-${TMPDIR:-/tmp}/portakern-cuda-cache}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cupy-cache}"

log() { echo "[gpu_check $(($(date +%s) - START_S))s] $*" | tee -a "$OUT/gpu_check.log"; }

# run_step NAME MAX_SECONDS CMD...  -> $OUT/NAME.log, a line in steps.tsv; never aborts the script
run_step() {
    local name="$1" max="$2"
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START_S) - 10))
    local limit=$((max < left ? max : left))
    if [ "$limit" -lt 15 ]; then
        log "skip $name: out of time (${left}s left)"
        printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 "out of time" >> "$STEPS"
        return 0
    fi
    log "run  $name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local dt=$(($(date +%s) - t0))
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note="timed out after ${limit}s"; fi
    log "done $name: rc=$rc in ${dt}s ${note}"
    tail -n 5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu_check.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$note" >> "$STEPS"
    return 0
}

# --- machine facts first (they are worth having even if setup fails) -----------------------
{
    nvidia-smi || echo "nvidia-smi failed (rc=$?)"
    echo
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,pci.bus_id \
        --format=csv || true
} > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv,noheader > "$OUT/gpu.csv" 2>/dev/null || true
{ uname -a; nproc; free -g; df -h "$ROOT"; } > "$OUT/host.txt" 2>&1
log "GPU: $(head -n 1 "$OUT/gpu.csv" 2>/dev/null || echo unknown)"

# --- setup -----------------------------------------------------------------------------------
PY=""
has() { "$1" -c "$2" > /dev/null 2>&1; }
for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ] && has "$cand" "import cupy"; then PY="$cand"; break; fi
done
if [ -n "$PY" ] && ! has "$PY" "import portakern.backend.cuda"; then
    log "portakern not importable by $PY; installing it offline (editable, no deps)"
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -e "$ROOT" \
        > "$OUT/setup_offline.log" 2>&1 || log "offline install failed (see setup_offline.log)"
fi
if [ -z "$PY" ] || ! has "$PY" "import portakern.backend.cuda, pytest, hypothesis"; then
    VENV="${TMPDIR:-/tmp}/portakern-gpu-venv"
    log "no interpreter with cupy + portakern + pytest; trying pip (network) into $VENV"
    BASEPY="$(command -v python3 || true)"
    if [ -n "$BASEPY" ] && timeout 60 "$BASEPY" -m venv "$VENV" > "$OUT/setup_pip.log" 2>&1 \
        && timeout 180 "$VENV/bin/python" -m pip install -q -e "$ROOT[cuda,jax,dev]" \
            >> "$OUT/setup_pip.log" 2>&1; then
        PY="$VENV/bin/python"
    else
        log "pip install failed (no network?) - see setup_pip.log"
    fi
fi
if [ -z "$PY" ] || ! has "$PY" "import portakern.backend.cuda, cupy"; then
    log "SETUP FAILED: no Python with cupy and portakern. Carry a .venv or allow PyPI access."
    printf '%s\t%s\t%s\t%s\n' "setup" 1 0 "no python with cupy and portakern" >> "$STEPS"
    SETUP_OK=0
else
    log "python: $PY ($("$PY" --version 2>&1))"
    printf '%s\t%s\t%s\t%s\n' "setup" 0 "$(($(date +%s) - START_S))" "$PY" >> "$STEPS"
    SETUP_OK=1
fi
PK=("$PY" -m portakern.tools.cli)

# --- the checks --------------------------------------------------------------------------------
if [ "$SETUP_OK" -eq 1 ]; then
    run_step versions 30 "$PY" - <<'EOF'
import json, os
out = {}
try:
    import cupy
    rt = cupy.cuda.runtime
    out["cupy"] = cupy.__version__
    out["cuda_runtime"] = rt.runtimeGetVersion()
    out["cuda_driver"] = rt.driverGetVersion()
    from cupy_backends.cuda.libs import nvrtc
    out["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    out["devices"] = []
    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        out["devices"].append({"index": i, "name": p["name"].decode(), "cc": f"{p['major']}.{p['minor']}",
                               "memory_bytes": p["totalGlobalMem"], "sms": p["multiProcessorCount"]})
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
try:
    import portakern as pk
    out["portakern"] = pk.__version__
    out["backends"] = pk.backends()
except Exception as exc:
    out["portakern_error"] = f"{type(exc).__name__}: {exc}"
with open(os.path.join(os.environ["OUT_DIR"], "versions.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
print(json.dumps({k: v for k, v in out.items() if k != "backends"}, default=str))
EOF
    run_step info 30 "${PK[@]}" info
    run_step compile_only 90 "${PK[@]}" check --backend cuda --compile-only \
        --out "$OUT/compile_only.json"
    # static figures (ptxas on NVRTC's PTX) for this GPU's architecture, beside the measured
    # numbers below: registers, spills, stack, shared memory, theoretical occupancy per kernel
    CC="$(head -n 1 "$OUT/gpu.csv" 2>/dev/null | awk -F', *' '{print $4}' | tr -d '.')"
    export RES_ARCH="sm_${CC:-90}"
    run_step resources 60 bash -c 'for op in matmul softmax rmsnorm attention; do
            a=(resources "$op" --backend cuda --arch "$RES_ARCH" --dtype all)
            "$@" "${a[@]}" --json > "$OUT_DIR/resources_$op.json"
            rc=$?; [ $rc -eq 0 ] || echo "resources $op: rc=$rc"
            "$@" "${a[@]}"
        done' _ "${PK[@]}"
    # matrix units (docs/fragments.md): bf16 matmul N=4096 through the fragment API (the
    # default MMA=1 on sm_80+) against cuBLAS on the same device, goal >= 0.5x; the figures
    # land in mma_matmul.json and results.json. Never part of CI.
    run_step mma_matmul 60 "$PY" benchmarks/gpu_mma_matmul.py
    # fp16 attention (the fragment schedule) against torch SDPA where torch has CUDA, else
    # the unfused cuBLAS chain (named as such); goal >= 0.4x SDPA; mma_attention.json
    run_step mma_attention 60 "$PY" benchmarks/gpu_mma_attention.py
    run_step pytest 200 "$PY" -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml" tests
    run_step check 90 "${PK[@]}" check --backend cuda --out "$OUT/check.json"
    if "${PK[@]}" bench --help > "$OUT/bench_help.txt" 2>&1; then
        BENCH_OUT=()   # only the flags this tree's bench understands
        if grep -q -- "--out" "$OUT/bench_help.txt"; then BENCH_OUT+=(--out "$OUT/bench.json"); fi
        if grep -q -- "--budget" "$OUT/bench_help.txt"; then BENCH_OUT+=(--budget 20); fi
        run_step bench 110 "${PK[@]}" bench --suite quick --backends cuda \
            ${BENCH_OUT[@]+"${BENCH_OUT[@]}"}
    else
        log "skip bench: \`portakern bench\` does not exist in this tree"
        printf '%s\t%s\t%s\t%s\n' "bench" "skipped" 0 "no bench command" >> "$STEPS"
    fi
fi

# --- results.json ------------------------------------------------------------------------------
WRITER="${PY:-$(command -v python3 || true)}"
if [ -n "$WRITER" ]; then
    "$WRITER" - <<'EOF' || log "could not write results.json"
import json, os, time
out = os.environ["OUT_DIR"]
def read(name):
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return None
steps = []
for line in (read("steps.tsv") or "").splitlines():
    name, rc, secs, note = (line.split("\t") + ["", "", "", ""])[:4]
    steps.append({"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else rc,
                  "seconds": int(secs or 0), "note": note,
                  "log": f"{name}.log" if os.path.exists(os.path.join(out, f"{name}.log")) else None})
gpu = [dict(zip(["name", "driver", "memory", "compute_cap"], [x.strip() for x in ln.split(",")]))
       for ln in (read("gpu.csv") or "").splitlines() if ln.strip()]
versions = json.loads(read("versions.json") or "{}")
static = {}  # predicted (static) per-kernel figures, beside the measured bench/check results
for op in ("matmul", "softmax", "rmsnorm", "attention"):
    try:
        static[op] = json.loads(read(f"resources_{op}.json") or "null")
    except ValueError:
        static[op] = None
ok = all(s["rc"] in (0, "skipped") for s in steps) and any(s["step"] == "pytest" for s in steps)
def figures(name):
    try:
        return json.loads(read(name) or "null")
    except ValueError:
        return None
res = {"ok": ok, "gpu": gpu, "versions": versions, "steps": steps, "static_resources": static,
       "mma_matmul": figures("mma_matmul.json"),  # bf16 N=4096 vs cuBLAS
       "mma_attention": figures("mma_attention.json"),  # fp16 vs SDPA (or the unfused chain)
       "env": {k: os.environ.get(k) for k in ("CUPY_TF32", "PORTAKERN_TEST_BACKENDS",
                                               "PORTAKERN_HYPOTHESIS_PROFILE")},
       "seconds": int(time.time()) - int(os.environ["START_S"]),
       "files": sorted(os.listdir(out))}
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
print("results.json:", "ok" if ok else "FAILURES", [(s["step"], s["rc"]) for s in steps])
EOF
fi
log "finished in $(($(date +%s) - START_S))s; output in $OUT"
# exit status: 0 only when every step that ran passed
FAILED=$(awk -F'\t' '$2 != "0" && $2 != "skipped" {n++} END {print n + 0}' "$STEPS")
[ "$FAILED" -eq 0 ]
