"""hip (compile only): AMD GPUs' dialect compiled by the installed hipcc/clang, never run.

No AMD GPU and no ROCm CuPy are available to this project, so ``hip`` is not a run-time
backend. What can be proven without the hardware is proven here: every kernel rendered in the
``hip`` dialect (codegen.DIALECTS["hip"]) compiles to an AMDGPU code object, and the code
object's metadata says how many registers, how much scratch (spills, private arrays) and LDS
each kernel needs (``portakern resources OP --backend hip``).

The compiler is ``hipcc`` (Debian/Ubuntu: ``apt-get install hipcc libamdhip64-dev
rocm-device-libs``; ROCm: /opt/rocm/bin/hipcc) with ``HIP_PLATFORM=amd`` (without it hipcc
picks nvcc when one is installed). The options are the ones hipRTC applies to a run-time
compile, so what is checked is what a ROCm CuPy would build:

* ``-include hip/hip_runtime.h``: hipRTC includes the runtime header implicitly;
* ``-O3 -std=c++14`` (hipRTC's defaults), ``--cuda-device-only`` (device code only);
* numerics as on every backend: ``-ffp-contract=fast`` (FMA contraction, as NVRTC's
  ``--fmad=true`` and OpenCL C's default), ``-fno-fast-math``, denormals kept
  (``-fno-gpu-flush-denormals-to-zero``).

Targets: gfx906 (MI50/60, GCN5), gfx90a (MI200, CDNA2) and gfx1030 (RDNA2) by default;
``FURTHER_ARCHS`` are tried too and listed as accepted or not with the compiler's reason (on
Debian's ROCm 5.2: gfx1100 lacks device libraries, gfx942 is unknown to LLVM 15).

Reading resources: ``-save-temps`` keeps the AMDGPU assembly, whose ``.amdgpu_metadata``
block is the code object's metadata note (the same YAML the loader reads): ``.vgpr_count``
(on gfx90a the unified VGPR+AGPR total), ``.agpr_count``, ``.sgpr_count``,
``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.private_segment_fixed_size`` (scratch per
work-item: spills and private arrays), ``.group_segment_fixed_size`` (static LDS),
``.wavefront_size`` and ``.max_flat_workgroup_size``; barriers are the ``s_barrier``
instructions in each kernel's body.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import settings
from ..core.errors import BackendUnavailable, InvalidArgumentError, ToolchainError
from ._process import run

DIALECT = "hip"
DEFAULT_ARCHS: tuple[str, ...] = ("gfx906", "gfx90a", "gfx1030")
# Tried after the defaults; reported as accepted or not (with the compiler's reason).
FURTHER_ARCHS: tuple[str, ...] = ("gfx908", "gfx940", "gfx1100", "gfx942")
INSTALL_FIX = ("apt-get install hipcc libamdhip64-dev rocm-device-libs (Debian/Ubuntu), or "
               "install ROCm and put /opt/rocm/bin on PATH (or set PORTAKERN_HIPCC)")
OPTIONS: tuple[str, ...] = ("-x", "hip", "--cuda-device-only", "-O3", "-std=c++14",
                            "-include", "hip/hip_runtime.h", "-ffp-contract=fast",
                            "-fno-fast-math", "-fno-gpu-flush-denormals-to-zero",
                            "-Wno-unused-function", "-Wno-unused-command-line-argument")
FORBIDDEN_OPTIONS: tuple[str, ...] = ("-ffast-math", "-fgpu-flush-denormals-to-zero",
                                      "-funsafe-math-optimizations")
TIMEOUT_S = 300
# Architectures for which this toolchain has no device libraries (Debian's ROCm 5.2: gfx11):
# the resource report builds them with -nogpulib, which serves kernels that call no library
# function (the hip dialect's ids, sizes and barrier are compiler builtins; matmul needs no
# math library). The compile check still reports them as not accepted (probe_arch).
NO_DEVICE_LIBS: tuple[str, ...] = ("gfx1100",)
_ARCH = re.compile(r"^gfx[0-9]{2,4}[a-z]?$")


def normalize_arch(text: str) -> str:
    """'gfx90a', 'GFX90A', 'amdgcn-amd-amdhsa--gfx90a' -> 'gfx90a'; refuse anything else."""
    s = str(text).strip().lower().rsplit("-", 1)[-1].split(":")[0]
    if not _ARCH.match(s):
        raise InvalidArgumentError(
            f"AMD GPU architecture {text!r} is not understood; expected a gfx name like "
            "'gfx90a' (MI200), 'gfx906' (MI50) or 'gfx1030' (RDNA2).")
    return s


def find_hipcc() -> str | None:
    """$PORTAKERN_HIPCC, else hipcc on PATH, else /opt/rocm/bin/hipcc."""
    env = settings.tools.hipcc
    if env:
        return env if os.path.isfile(env) else None
    return shutil.which("hipcc") or next(
        (p for p in ("/opt/rocm/bin/hipcc",) if os.path.isfile(p)), None)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["HIP_PLATFORM"] = "amd"  # else hipcc drives nvcc where CUDA is installed
    return env


def require_hipcc() -> str:
    """The hipcc path, or BackendUnavailable saying how to install it."""
    path = find_hipcc()
    if path is None:
        raise BackendUnavailable(f"hipcc is not installed (the AMD compile check and AMD "
                                 f"resource reports need it). Fix: {INSTALL_FIX}.")
    return path


_VERSION: dict[str, str] = {}


def version() -> str:
    """'HIP 5.2.21153 / clang 15.0.6' (cached per hipcc path)."""
    path = require_hipcc()
    if path not in _VERSION:
        fix = _fix(path)
        done = run("hipcc", (path, "--version"), what="asking hipcc its version", fix=fix,
                   timeout=60, env=_env())
        out = done.stdout or ""
        hip = re.search(r"HIP version:\s*(\S+)", out)
        clang = re.search(r"clang version\s*(\S+)", out)
        lines = out.strip().splitlines()
        if not (hip or clang or lines):
            raise ToolchainError("asking hipcc its version: it printed nothing on stdout",
                                 tool="hipcc", command=(path, "--version"),
                                 returncode=done.returncode, stderr=done.stderr or "",
                                 fix=fix)
        _VERSION[path] = " / ".join(x for x in (f"HIP {hip.group(1)}" if hip else "",
                                                f"clang {clang.group(1)}" if clang else "")
                                    if x) or lines[0]
    return _VERSION[path]


def _fix(path: str) -> str:
    env = settings.tools.hipcc
    return (f"check that `{path} --version` runs and names HIP and clang; "
            f"{'unset PORTAKERN_HIPCC or point it at a working hipcc; ' if env else ''}"
            f"{INSTALL_FIX}")


def compile_options() -> tuple[str, ...]:
    """hipcc options of the check (the architecture and output are added per compile)."""
    return OPTIONS


def resource_options(arch: str) -> tuple[str, ...] | None:
    """The options the resource report compiles ``arch`` with (None: ``OPTIONS``)."""
    return OPTIONS + ("-nogpulib",) if normalize_arch(arch) in NO_DEVICE_LIBS else None


@dataclass
class HipCompile:
    """One hipcc run: the code object (None on failure), its assembly and the log."""

    arch: str
    ok: bool
    log: str
    command: tuple[str, ...]
    seconds: float
    object_bytes: int = 0
    asm: str = ""
    kernels: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = 0  # None: it did not finish


def compile_source(source: str, arch: str, name: str = "portakern.hip",
                   options: Sequence[str] | None = None, keep_asm: bool = True) -> HipCompile:
    """Compile one rendered source for one gfx target to a device code object.

    ``keep_asm`` also keeps the assembly (``-save-temps``) and parses each kernel's
    metadata into ``kernels``. Never raises for a compile error: ``ok`` is False and ``log``
    holds the compiler's messages (the caller turns it into a CompileError).
    """
    hipcc = require_hipcc()
    arch = normalize_arch(arch)
    opts = tuple(OPTIONS if options is None else options)
    base = os.path.splitext(os.path.basename(name))[0] or "portakern"
    with tempfile.TemporaryDirectory(prefix="portakern-hip-") as d:
        src = os.path.join(d, base + ".hip")
        obj = os.path.join(d, base + ".o")
        with open(src, "w") as f:
            f.write(source)
        cmd = (hipcc, *opts, f"--offload-arch={arch}", "-c", src, "-o", obj)
        if keep_asm:
            cmd = cmd + ("-save-temps",)
        shown = tuple(name if c == src else c for c in cmd if c not in (obj,))
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=d, env=_env(),
                                  timeout=TIMEOUT_S)
            rc, log = done.returncode, (done.stderr + done.stdout).strip()
        except subprocess.TimeoutExpired:  # may be the source's doing: a failed compile
            rc, log = -1, f"hipcc did not finish within {TIMEOUT_S} s"
        except OSError as exc:  # not the source's doing: hipcc would not start
            raise ToolchainError(f"compiling {name} for {arch}: hipcc could not be started "
                                 f"({exc.strerror or type(exc).__name__}: {hipcc})",
                                 tool="hipcc", command=shown, stderr=str(exc),
                                 fix=_fix(hipcc)) from None
        secs = time.perf_counter() - t0
        # paths in the log name the temporary file: show the name the caller chose
        log = log.replace(src, name).replace(d + os.sep, "")
        if rc != 0 or not os.path.isfile(obj):
            return HipCompile(arch, False, log or f"hipcc exited with {rc}", shown, secs,
                              returncode=None if rc == -1 else rc)
        res = HipCompile(arch, True, log, shown, secs, object_bytes=os.path.getsize(obj))
        if keep_asm:
            asm_files = [f for f in os.listdir(d) if f.endswith(f"-{arch}.s")]
            if asm_files:
                with open(os.path.join(d, asm_files[0]), errors="replace") as f:
                    res.asm = f.read()
                res.kernels = kernel_metadata(res.asm)
        return res


_KEY = re.compile(r"^    \.(\w+):\s*(.*?)\s*$")


def kernel_metadata(asm: str) -> list[dict[str, Any]]:
    """Per-kernel resources from an AMDGPU assembly file's ``.amdgpu_metadata`` block.

    Keys: kernel, vgpr, agpr, sgpr, vgpr_spills, sgpr_spills, private_bytes, lds_bytes,
    wave_size, max_group_size, barriers (``s_barrier`` in the kernel's body).
    """
    start = asm.find("amdhsa.kernels:")
    if start < 0:
        return []
    end = asm.find(".end_amdgpu_metadata", start)
    block = asm[start:end if end > 0 else None].splitlines()[1:]
    entries: list[dict[str, str]] = []
    for line in block:
        if line.startswith("  - "):
            entries.append({})
            line = "    " + line[4:]
        m = _KEY.match(line)
        if m and entries:
            entries[-1][m.group(1)] = m.group(2)
    out = []
    for e in entries:
        name = e.get("name", "?")

        def num(key: str, e: dict[str, str] = e) -> int:
            try:
                return int(e.get(key, "0"))
            except ValueError:
                return 0

        out.append({"kernel": name, "vgpr": num("vgpr_count"), "agpr": num("agpr_count"),
                    "sgpr": num("sgpr_count"), "vgpr_spills": num("vgpr_spill_count"),
                    "sgpr_spills": num("sgpr_spill_count"),
                    "private_bytes": num("private_segment_fixed_size"),
                    "lds_bytes": num("group_segment_fixed_size"),
                    "wave_size": num("wavefront_size") or 64,
                    "max_group_size": num("max_flat_workgroup_size"),
                    "barriers": _barriers(asm, name),
                    "matrix_instructions": _count_in_body(asm, name, _MATRIX_ASM)})
    return out


_MATRIX_ASM = r"^\s*v_(?:mfma|wmma|smfmac)\w*"  # matrix-core instructions (CDNA, RDNA3)


def _count_in_body(asm: str, kernel: str, pattern: str) -> int:
    m = re.search(rf"^{re.escape(kernel)}:.*?$(.*?)^\.Lfunc_end", asm, re.M | re.S)
    return len(re.findall(pattern, m.group(1), re.M)) if m else 0


def _barriers(asm: str, kernel: str) -> int:
    m = re.search(rf"^{re.escape(kernel)}:.*?$(.*?)^\.Lfunc_end", asm, re.M | re.S)
    return len(re.findall(r"^\s*s_barrier\b", m.group(1), re.M)) if m else 0


_PROBED: dict[tuple[str, str], str] = {}


def toolchain_failure(res: HipCompile, name: str) -> ToolchainError | None:
    """The ToolchainError of a failed compile that is hipcc's fault, not the source's: none
    of its messages points into ``name`` and hipcc cannot build a one-line kernel for that
    architecture either (``probe_arch``; e.g. no device libraries). None otherwise: the
    caller reports a CompileError with the numbered source."""
    # an error (not a warning) at a line of the source: the source's fault
    if res.ok or re.search(rf"^{re.escape(name)}:\d+:\d+: (fatal )?error", res.log, re.M):
        return None
    why = probe_arch(res.arch)
    if not why:
        return None
    return ToolchainError(f"compiling {name} for {res.arch}: hipcc failed, and fails on a "
                          "one-line kernel too, so the toolchain is at fault, not the source",
                          tool="hipcc", command=res.command,
                          returncode=res.returncode,
                          stderr=res.log, fix=_fix(res.command[0]))


def probe_arch(arch: str) -> str:
    """'' when this hipcc builds for ``arch``, else the compiler's first error line."""
    arch = normalize_arch(arch)
    key = (require_hipcc(), arch)  # per hipcc: PORTAKERN_HIPCC may change in one process
    if key not in _PROBED:
        res = compile_source('extern "C" __global__ void k(float* p) { p[0] = 1.0f; }\n',
                             arch, "probe.hip", keep_asm=False)
        err = next((ln.strip() for ln in res.log.splitlines() if "error" in ln), res.log)
        _PROBED[key] = "" if res.ok else (err[:300] or "rejected")
    return _PROBED[key]


# --- per-architecture limits for the occupancy estimate -----------------------------------
# Sources: AMD's CDNA2 (MI200) and RDNA2 ISA guides; LLVM AMDGPUBaseInfo.cpp (LLVM 15):
# getMaxWavesPerEU (gfx90a 8, other gfx9 10, gfx10.3 16), getTotalNumVGPRs (gfx90a 512
# unified VGPR+AGPR, gfx9 256, gfx10 wave32 1024), getVGPRAllocGranule (gfx90a 8, gfx9 4,
# gfx10.3 wave32 16), SGPRs (gfx9: 800 per SIMD in granules of 16; not a limit on gfx10).
# LDS: 64 KiB per CU on gfx9; 128 KiB per WGP on gfx10 (clang's default WGP mode, where a
# work-group may span the WGP's 4 SIMD32s). Work-group slots per CU are not modelled.
ARCH_LIMITS: dict[str, dict[str, int]] = {
    "gfx906": {"simds": 4, "waves_per_simd": 10, "vgprs": 256, "vgpr_granule": 4,
               "sgprs": 800, "sgpr_granule": 16, "lds": 64 * 1024, "lds_granule": 512},
    "gfx90a": {"simds": 4, "waves_per_simd": 8, "vgprs": 512, "vgpr_granule": 8,
               "sgprs": 800, "sgpr_granule": 16, "lds": 64 * 1024, "lds_granule": 512},
    "gfx1030": {"simds": 4, "waves_per_simd": 16, "vgprs": 1024, "vgpr_granule": 16,
                "sgprs": 0, "sgpr_granule": 0, "lds": 128 * 1024, "lds_granule": 512},
    # gfx1100 (RDNA3, wave32, per WGP): 1536 VGPRs per SIMD in granules of 24 (LLVM
    # AMDGPUBaseInfo: getTotalNumVGPRs / getVGPRAllocGranule for gfx1100/1101)
    "gfx1100": {"simds": 4, "waves_per_simd": 16, "vgprs": 1536, "vgpr_granule": 24,
                "sgprs": 0, "sgpr_granule": 0, "lds": 128 * 1024, "lds_granule": 512},
}
UNIT = "CU"  # gfx1030 rows are per WGP (2 CUs); the report says so


def occupancy(lim: dict[str, int], threads: int, wave: int, vgpr: int, sgpr: int,
              lds: int) -> tuple[int, int, str]:
    """(resident waves per CU/WGP, max waves, limiter) under one ``ARCH_LIMITS`` entry: per
    SIMD from VGPRs/SGPRs, whole work-groups from LDS and the wave slots."""
    def up(x: int, unit: int) -> int:
        return -(-x // unit) * unit if unit else x

    wpg = max(1, -(-threads // wave))
    simds, maxw = lim["simds"], lim["waves_per_simd"]
    per_simd = {"waves": maxw}
    if vgpr:
        per_simd["VGPRs"] = lim["vgprs"] // up(vgpr, lim["vgpr_granule"])
    if sgpr and lim["sgprs"]:
        per_simd["SGPRs"] = lim["sgprs"] // up(sgpr, lim["sgpr_granule"])
    caps = {k: (v * simds) // wpg for k, v in per_simd.items()}
    if lds:
        caps["LDS"] = lim["lds"] // up(lds, lim["lds_granule"])
    limiter = min(caps, key=lambda k: (caps[k], k != "waves"))
    return caps[limiter] * wpg, maxw * simds, limiter


def unit(arch: str) -> str:
    """What a resident-wave count of ``arch`` is per: a WGP (two CUs) on gfx10+'s default
    WGP mode, whose limits table pools more than 512 VGPRs, else a CU."""
    lim = ARCH_LIMITS.get(arch)
    return "WGP" if lim and lim["vgprs"] > 512 else UNIT
