"""ptxas and cuobjdump (compile only): NVIDIA's tools for real architectures (sm_XX), no GPU.

``portakern resources --backend cuda`` (and the static tuner) assemble NVRTC's PTX with
``ptxas -v --gpu-name sm_<arch>`` and read per kernel the registers, stack frame, spills,
barriers and static shared memory it reports; the sm_80 / sm_90 limits below turn those into
the theoretical occupancy (``occupancy``), as ``hipcc.py`` does for AMD. ``cubin_resources``
reads the same figures back from the assembled cubin with ``cuobjdump --dump-resource-usage``
(the resource test cross-checks the two).

Nothing here runs kernels: the cuda backend (``backend/cuda.py``) compiles with NVRTC at run
time and never needs ptxas, so this lives with the compile-only toolchains.

Where the tools are found (``locate``), first hit wins:

1. ``$PORTAKERN_PTXAS`` (ptxas only): an explicit choice beats every search;
2. the NVIDIA wheels in this interpreter's site-packages, which ``pip install
   'portakern[cuda]'`` installs: ``nvidia-cuda-nvcc-cu12`` (``nvidia/cuda_nvcc/bin/ptxas``, the
   release of the NVRTC wheel, so it reads every PTX that NVRTC writes) and
   ``nvidia-cuda-cuobjdump`` (``nvidia/cu13/bin/cuobjdump``; no cu12 build of it is
   published, and CUDA 13's reads sm_75+ cubins of CUDA 12);
3. ``PATH``, beside ``nvcc`` on PATH, ``$CUDA_PATH/bin``, ``$CUDA_HOME/bin``, then
   ``SYSTEM_DIRS`` (/usr/local/cuda/bin).

A tool that is found but fails (will not start, times out, exits non-zero) raises
ToolchainError naming the command, its stderr and the fix; a missing one BackendUnavailable.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from typing import Any

from ..core import settings
from ..core.errors import BackendUnavailable, ToolchainError
from ._process import executable, run

# --- where the tools are -------------------------------------------------------------------
PTXAS_INSTALL = ("pip install 'portakern[cuda]' (its nvidia-cuda-nvcc-cu12 wheel ships "
                 "ptxas), or install the CUDA toolkit (ptxas sits beside nvcc, e.g. "
                 "/usr/local/cuda/bin)")
PTXAS_FIX = PTXAS_INSTALL + ", or set PORTAKERN_PTXAS to a ptxas"
CUOBJDUMP_FIX = ("pip install 'portakern[cuda]' (its nvidia-cuda-cuobjdump wheel ships "
                 "cuobjdump), or install the CUDA toolkit (cuobjdump sits beside nvcc)")
# The packages whose bin/ holds each tool, as the NVIDIA wheels lay them out in
# site-packages (nvidia/cu13 is the shared folder of every CUDA 13 wheel).
WHEEL_PACKAGES: dict[str, tuple[str, ...]] = {
    "ptxas": ("nvidia.cuda_nvcc", "nvidia.cu13"),
    "cuobjdump": ("nvidia.cu13", "nvidia.cuda_cuobjdump"),
    "nvdisasm": ("nvidia.cu13", "nvidia.cuda_nvdisasm"),  # what cuobjdump -sass runs
}
SYSTEM_DIRS: tuple[str, ...] = ("/usr/local/cuda/bin",)
TIMEOUT_S = 300


def wheel_tool(tool: str) -> str | None:
    """``tool`` from an NVIDIA wheel installed in this interpreter, or None."""
    for package in WHEEL_PACKAGES.get(tool, ()):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or ()) if spec is not None else ():
            path = os.path.join(loc, "bin", tool)
            if executable(path):
                return os.path.abspath(path)
    return None


def locate(tool: str) -> tuple[str, str] | None:
    """(path, where it was found) of ``ptxas`` or ``cuobjdump``, searched in the documented
    order (the module docstring); None when it is nowhere. ``$PORTAKERN_PTXAS`` naming no
    file is None too (``require_ptxas`` says so)."""
    if tool == "ptxas":
        env = settings.tools.ptxas
        if env:
            return (env, "PORTAKERN_PTXAS") if os.path.isfile(env) else None
    found = wheel_tool(tool)
    if found:
        return found, "wheel"
    found = shutil.which(tool)
    if found:
        return found, "PATH"
    nvcc = shutil.which("nvcc")
    dirs = [(os.path.dirname(nvcc), "beside nvcc")] if nvcc else []
    dirs += [(os.path.join(os.environ[v], "bin"), f"${v}") for v in ("CUDA_PATH", "CUDA_HOME")
             if os.environ.get(v)]
    dirs += [(d, d) for d in SYSTEM_DIRS]
    return next(((os.path.join(d, tool), where) for d, where in dirs
                 if executable(os.path.join(d, tool))), None)


def find_ptxas() -> str | None:
    """The ptxas ``locate`` finds, or None."""
    got = locate("ptxas")
    return got[0] if got else None


def find_cuobjdump() -> str | None:
    """The cuobjdump ``locate`` finds, or None."""
    got = locate("cuobjdump")
    return got[0] if got else None


def require_ptxas() -> str:
    """The ptxas path, or BackendUnavailable naming the fix."""
    path = find_ptxas()
    if path is not None:
        return path
    env = settings.tools.ptxas
    if env:
        raise BackendUnavailable(f"PORTAKERN_PTXAS={env} names no file (CUDA resource reports "
                                 "need ptxas). Fix: point it at a ptxas, or unset it to use "
                                 f"the one found otherwise ({PTXAS_INSTALL}).")
    raise BackendUnavailable(f"ptxas is not installed (CUDA resource reports need it). "
                             f"Fix: {PTXAS_FIX}.")


def require_cuobjdump() -> str:
    """The cuobjdump path, or BackendUnavailable naming the fix."""
    path = find_cuobjdump()
    if path is None:
        raise BackendUnavailable(f"cuobjdump is not installed (reading a cubin's resources "
                                 f"needs it). Fix: {CUOBJDUMP_FIX}.")
    return path


# --- ptxas: PTX -> cubin, and its -v report -------------------------------------------------
_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+\.\d+)", re.M)


def _ptxas_fix(exe: str, ptx: bytes, log: str) -> str:
    """What to do about a ptxas that refused NVRTC's PTX: the usual cause is a ptxas older than
    the NVRTC that wrote it (the PTX ISA version it cannot read), else a broken ptxas."""
    env = " (PORTAKERN_PTXAS)" if settings.tools.ptxas else ""
    if re.search(r"Unsupported \.version|not supported (by|on) this|\.target|"
                 r"not defined for option 'gpu-name'", log, re.I):
        m = _PTX_VERSION.search(ptx)
        isa = f"PTX ISA {m.group(1).decode()}" if m else "this PTX"
        return (f"the ptxas at {exe}{env} is older than the NVRTC that wrote {isa}: use the "
                "ptxas of NVRTC's CUDA release (pip install 'portakern[cuda]' installs "
                "nvidia-cuda-nvcc-cu12 to match nvidia-cuda-nvrtc-cu12), or point "
                "PORTAKERN_PTXAS at a newer ptxas")
    if env:
        return (f"check that `{exe} --version` runs and names a CUDA 12 or newer ptxas; unset "
                f"PORTAKERN_PTXAS or point it at a working ptxas ({PTXAS_INSTALL})")
    return f"check that `{exe} --version` runs and names a CUDA 12 or newer ptxas; {PTXAS_FIX}"


def assemble(ptx: bytes | str, arch: str) -> tuple[bytes, str]:
    """``ptxas -v --gpu-name sm_<arch>`` on a PTX module: (the cubin, ptxas's log).

    BackendUnavailable (with the fix) without ptxas; ToolchainError (the command, stderr and
    fix) when ptxas will not start, times out or refuses the PTX."""
    exe = require_ptxas()
    data = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    with tempfile.TemporaryDirectory(prefix="portakern-ptxas-") as d:
        src, out = os.path.join(d, "kernel.ptx"), os.path.join(d, "kernel.cubin")
        with open(src, "wb") as f:
            f.write(data)
        cmd = (exe, "-v", "--gpu-name", f"sm_{arch}", src, "-o", out)
        shown = (exe, "-v", "--gpu-name", f"sm_{arch}", "kernel.ptx", "-o", "kernel.cubin")
        what = f"assembling NVRTC's PTX for sm_{arch}"
        done = run("ptxas", cmd, what=what, fix=_ptxas_fix(exe, data, ""), timeout=TIMEOUT_S,
                   check=False, shown=shown)
        err, so = ((x or "").replace(d + os.sep, "") for x in (done.stderr, done.stdout))
        log = err + so  # ptxas -v writes its report to stderr
        if done.returncode != 0 or not os.path.isfile(out):
            raise ToolchainError(
                f"{what}: ptxas failed" if done.returncode else
                f"{what}: ptxas exited 0 but wrote no cubin", tool="ptxas", command=shown,
                returncode=done.returncode, stderr=err, stdout=so,
                fix=_ptxas_fix(exe, data, log))
        with open(out, "rb") as f:
            return f.read(), log


def ptxas_resources(ptx: bytes | str, arch: str) -> list[dict[str, Any]]:
    """Per entry point of a PTX module: the registers, stack frame, spill stores/loads,
    barriers and static shared memory ``ptxas -v --gpu-name sm_<arch>`` reports
    (``parse_ptxas_log``'s keys), and ``matrix_instructions``: the HMMA instructions in its
    SASS (``cuobjdump -sass``; None without cuobjdump). Raises as ``assemble`` does."""
    cubin, log = assemble(ptx, arch)
    got = parse_ptxas_log(log)
    counts = sass_matrix_counts(cubin)
    for k in got:
        k["matrix_instructions"] = None if counts is None else counts.get(k["kernel"], 0)
    return got


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


# --- cuobjdump: a cubin's own resource table ------------------------------------------------
def cubin_resources(cubin: bytes) -> list[dict[str, Any]]:
    """Per function of a cubin, what ``cuobjdump --dump-resource-usage`` reads from it
    (``parse_cuobjdump_resources``' keys). BackendUnavailable without cuobjdump,
    ToolchainError (command, stderr, fix) when it will not start, times out or fails."""
    exe = require_cuobjdump()
    with tempfile.TemporaryDirectory(prefix="portakern-cuobjdump-") as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(bytes(cubin))
        done = run("cuobjdump", (exe, "--dump-resource-usage", path),
                   what="reading the cubin's resource usage",
                   fix=f"check that `{exe} --version` runs; {CUOBJDUMP_FIX}",
                   timeout=TIMEOUT_S, shown=(exe, "--dump-resource-usage", "kernel.cubin"))
    return parse_cuobjdump_resources(done.stdout)


# --- cuobjdump -sass: the matrix instructions of each function ------------------------------
_SASS_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")
MATRIX_SASS = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?HMMA\b", re.M)


def find_nvdisasm() -> str | None:
    """nvdisasm (which ``cuobjdump -sass`` runs): the nvidia-cuda-nvdisasm wheel's, else
    PATH's, else None."""
    return wheel_tool("nvdisasm") or shutil.which("nvdisasm")


def sass_matrix_counts(cubin: bytes) -> dict[str, int] | None:
    """Per function of a cubin, how many tensor-core instructions (``HMMA``) its SASS
    (``cuobjdump -sass``) holds; None without cuobjdump or nvdisasm (pip install
    'portakern[cuda]'). Raises ToolchainError as ``cubin_resources`` does."""
    exe, disasm = find_cuobjdump(), find_nvdisasm()
    if exe is None or disasm is None:
        return None
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(disasm) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="portakern-cuobjdump-") as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(bytes(cubin))
        done = run("cuobjdump", (exe, "-sass", path), what="disassembling the cubin",
                   fix=f"check that `{exe} --version` runs; {CUOBJDUMP_FIX}",
                   timeout=TIMEOUT_S, env=env, shown=(exe, "-sass", "kernel.cubin"))
    return parse_sass_matrix_counts(done.stdout)


def parse_sass_matrix_counts(text: str) -> dict[str, int]:
    """``cuobjdump -sass`` text -> {function: HMMA instructions}."""
    out: dict[str, int] = {}
    name = None
    for line in text.splitlines():
        m = _SASS_FUNCTION.match(line)
        if m:
            name = m.group(1)
            out.setdefault(name, 0)
        elif name is not None and MATRIX_SASS.match(line):
            out[name] += 1
    return out


_FUNCTION = re.compile(r"^\s*Function ([^:\s]+):\s*$")
_FIELD = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def parse_cuobjdump_resources(text: str) -> list[dict[str, Any]]:
    """The ``Function NAME:`` blocks of ``cuobjdump --dump-resource-usage`` as dicts (kernel,
    registers, stack_bytes, shared_bytes, local_bytes). SHARED counts what the cubin reserves
    too: on sm_90 it is the declared static shared memory plus 1 KiB once any is declared."""
    keys = {"REG": "registers", "STACK": "stack_bytes", "SHARED": "shared_bytes",
            "LOCAL": "local_bytes"}
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            out.append({"kernel": m.group(1), **{v: 0 for v in keys.values()}})
            continue
        if out:
            for k, v in _FIELD.findall(line):
                out[-1][keys[k]] = int(v)
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
