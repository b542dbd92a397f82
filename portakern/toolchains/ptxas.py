"""ptxas (compile only): NVIDIA's PTX assembler for real architectures (sm_XX), no GPU needed.

``portakern resources --backend cuda`` (and the static tuner) assemble NVRTC's PTX with
``ptxas -v --gpu-name sm_<arch>`` and read per kernel the registers, stack frame, spills,
barriers and static shared memory it reports; the sm_80 / sm_90 limits below turn those into
the theoretical occupancy (``occupancy``), as ``hipcc.py`` does for AMD.

Nothing here runs kernels: the cuda backend (``backends/cuda.py``) compiles with NVRTC at run
time and never needs ptxas, so this lives with the compile-only toolchains.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

from ..core import settings
from ..core.errors import BackendUnavailable

# --- where ptxas is ---------------------------------------------------------------------
PTXAS_FIX = ("install the CUDA toolkit's ptxas (it sits beside nvcc: apt-get install "
             "nvidia-cuda-toolkit, or the NVIDIA CUDA toolkit under /usr/local/cuda/bin), or "
             "pip install nvidia-cuda-nvcc-cu12; or set PORTAKERN_PTXAS")

def find_ptxas() -> str | None:
    """$PORTAKERN_PTXAS, ptxas on PATH, beside nvcc, $CUDA_PATH/bin, /usr/local/cuda/bin."""
    env = settings.tools.ptxas
    if env:
        return env if os.path.isfile(env) else None
    found = shutil.which("ptxas")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    roots = [os.path.dirname(nvcc)] if nvcc else []
    roots += [os.path.join(os.environ[v], "bin") for v in ("CUDA_PATH", "CUDA_HOME")
              if os.environ.get(v)]
    roots.append("/usr/local/cuda/bin")
    return next((os.path.join(r, "ptxas") for r in roots
                 if os.path.isfile(os.path.join(r, "ptxas"))), None)


def ptxas_resources(ptx: bytes | str, arch: str) -> list[dict[str, Any]]:
    """``ptxas -v --gpu-name sm_<arch>`` on a PTX module: per entry point the registers,
    stack frame, spill stores/loads, barriers and static shared memory it reports.

    Raises BackendUnavailable (with the install hint) without ptxas, RuntimeError with ptxas's
    log when it rejects the PTX.
    """

    exe = find_ptxas()
    if exe is None:
        raise BackendUnavailable(f"ptxas is not installed (CUDA resource reports need it). "
                                 f"Fix: {PTXAS_FIX}.")
    data = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    with tempfile.TemporaryDirectory(prefix="portakern-ptxas-") as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "wb") as f:
            f.write(data)
        run = subprocess.run([exe, "-v", "--gpu-name", f"sm_{arch}", src, "-o",
                              os.path.join(d, "kernel.cubin")],
                             capture_output=True, text=True, timeout=300)
    log = run.stderr + run.stdout
    if run.returncode != 0:
        raise RuntimeError(f"ptxas rejected the PTX for sm_{arch}:\n{log}")
    return parse_ptxas_log(log)


def parse_ptxas_log(log: str) -> list[dict[str, Any]]:
    """The per-function lines of ``ptxas -v`` as dicts (kernel, registers, stack_bytes,
    spill_stores, spill_loads, barriers, shared_bytes)."""

    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = {"kernel": m.group(1), "registers": 0, "stack_bytes": 0, "spill_stores": 0,
                   "spill_loads": 0, "barriers": 0, "shared_bytes": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m:
            cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            s = re.search(r"(\d+) bytes smem", line)
            cur["barriers"] = int(b.group(1)) if b else 0
            cur["shared_bytes"] = int(s.group(1)) if s else 0
    return out


# --- sm_XX limits and the occupancy they give ------------------------------------------
# Per-architecture limits for the occupancy estimate (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability", and the CUDA occupancy calculator): registers are
# allocated per warp in units of 256, shared memory per block in units of 128 bytes plus
# 1 KiB the runtime reserves per block; "smem" is the largest carve-out per SM.
ARCH_LIMITS: dict[str, dict[str, int]] = {
    "80": {"warps": 64, "blocks": 32, "regs": 65536, "reg_unit": 256, "max_regs": 255,
           "smem": 164 * 1024, "smem_unit": 128, "smem_reserved": 1024},
    "90": {"warps": 64, "blocks": 32, "regs": 65536, "reg_unit": 256, "max_regs": 255,
           "smem": 228 * 1024, "smem_unit": 128, "smem_reserved": 1024},
}


def occupancy(lim: dict[str, int], threads: int, regs: int, smem: int) -> tuple[int, int, str]:
    """(resident warps per SM, max warps, limiter) as the CUDA occupancy calculator has it,
    for a block of ``threads`` using ``regs`` registers per thread and ``smem`` bytes of static
    shared memory, under one ``ARCH_LIMITS`` entry."""
    def up(x: int, unit: int) -> int:
        return -(-x // unit) * unit if unit else x

    wpb = max(1, -(-threads // 32))
    caps = {"warps": lim["warps"] // wpb, "blocks": lim["blocks"]}
    if regs:
        per_warp = up(regs * 32, lim["reg_unit"])
        caps["registers"] = (lim["regs"] // per_warp) // wpb
    per_block = up(smem + lim["smem_reserved"], lim["smem_unit"])
    caps["shared memory"] = lim["smem"] // per_block
    limiter = min(caps, key=lambda k: (caps[k], k not in ("warps", "blocks")))
    return caps[limiter] * wpb, lim["warps"], limiter
