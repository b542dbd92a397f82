#!/usr/bin/env bash
# Idempotent set-up: system packages when missing, a .venv/ at the repo root, portakern[all].
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if command -v dpkg-query >/dev/null 2>&1; then
  # pocl: the embedded OpenCL device; oclgrind: the GPU simulator (opencl:oclgrind);
# hipcc + AMD device libs: the AMD compile check and static resource reports;
# libclblast-dev: the CLBlast benchmark peer.
for p in pocl-opencl-icd ocl-icd-opencl-dev libclblast-dev oclgrind hipcc libamdhip64-dev rocm-device-libs; do
    have_pkg "$p" || need_apt+=("$p")
  done
  command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
  command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-dev)
  python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    log "missing system packages: ${need_apt[*]} (run as root or install them; continuing)"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
# Intel's OpenCL runtime (portakern[intel]) lives in .venv/lib, where no ICD loader looks:
# portakern loads it from there by itself; as root, an ICD file is also written so that other
# OpenCL programs (clinfo) list it. A file of its own (no other ICD is touched), named after
# pocl.icd so PoCL stays opencl:0; undo: rm /etc/OpenCL/vendors/portakern-intel.icd.
register_intel_icd() {
  local lib icd=/etc/OpenCL/vendors/portakern-intel.icd
  lib="$(cd .venv/lib && pwd)/libintelocl.so"
  [ -f "$lib" ] || return 0
  if [ "$(id -u)" = 0 ] && [ -d /etc/OpenCL/vendors ]; then
    if [ "$(cat "$icd" 2>/dev/null)" != "$lib" ]; then
      echo "$lib" > "$icd" && log "registered Intel's OpenCL runtime: $icd (undo: rm $icd)"
    fi
  else
    log "Intel's OpenCL runtime: portakern loads $lib itself; for other OpenCL programs" \
        "set OCL_ICD_VENDORS to a directory holding your .icd files and one naming it"
  fi
}

stamp=.venv/.portakern-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "pip install -e .[all] (first run downloads CuPy, JAX, PyOpenCL: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # ml_dtypes < 0.7: 0.7.0 takes 1.1 s to import beside numpy 2.4 (0.6.0: 7 ms), paid by
  # every process that imports portakern (CLI, benchmark workers, test subprocesses); the
  # package itself accepts any ml_dtypes >= 0.4 (README, Install)
  .venv/bin/python -m pip install -q -e '.[all]' 'ml_dtypes<0.7'
  # CLBlast peer for the benchmark: pyclblast 1.4 builds with scikit-build-core against
  # Debian's libclblast-dev, so it needs build isolation (its own build environment).
  if ! .venv/bin/python -c "import pyclblast" >/dev/null 2>&1; then
    log "building pyclblast against libclblast-dev (about a minute)"
    .venv/bin/python -m pip install -q pyclblast >/dev/null 2>&1 \
      || log "pyclblast did not build: the CLBlast peer will be reported missing"
  fi
  # ptxas and cuobjdump come from the cuda extra's wheels (portakern/toolchains/ptxas.py
  # looks there before PATH and /usr/local/cuda): say which ones portakern will run
  .venv/bin/python -c "from portakern.toolchains import ptxas
for t in ('ptxas', 'cuobjdump'): print('[setup]', t, ptxas.locate(t) or 'NOT FOUND')" >&2 || true
  register_intel_icd
  echo "$want" > "$stamp"
else
  log ".venv up to date"
fi
