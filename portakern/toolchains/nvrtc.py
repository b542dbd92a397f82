"""NVRTC compile only: the cuda dialect compiled to PTX for compute_XX, no GPU or driver needed.

Why a module of its own: the cuda backend (``cuda.py``) compiles through CuPy for the device
it runs on; the compile-only check, ``portakern resources --backend cuda`` and
``register_op(check=True)`` on a machine without a GPU need NVRTC alone, for virtual
architectures, with the same options (``cuda.compile_options``). It is the NVIDIA counterpart
of ``hip.compile_source``; tools reach both through ``compile_only.CompileOnlyTarget``.

NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel) is driven through ``cupy_backends``, which loads
libnvrtc without a driver. PTX does not enforce the 48 KiB static shared-memory limit (ptxas
does; compiling to PTX skips ptxas), so ``compile_raw`` reads the PTX's ``.shared``
declarations and refuses what ptxas would.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..backend.cuda import compile_error_message, compile_options, normalize_arch
from ..core.errors import BackendUnavailable, CompileError
from .ptxas import ptxas_resources, require_ptxas

# Static __shared__ per block: 48 KiB on every CUDA architecture (more only via dynamic shared
# memory and an opt-in attribute).
STATIC_SHARED_LIMIT = 48 * 1024
_SHARED_DECL = re.compile(
    r"^\s*\.shared\s+(?:\.align\s+\d+\s+)?\.[bsuf](8|16|32|64)\s+[\w$.]+(\[(\d*)\])?\s*;",
    re.M)


def load() -> Any:
    """cupy_backends' NVRTC binding, or BackendUnavailable saying how to install it."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:
        raise BackendUnavailable(
            f"NVRTC is not importable ({type(exc).__name__}: {exc}); the compile-only check "
            "needs it. Fix: pip install 'portakern[cuda]'.") from None
    return nvrtc


def version() -> str:
    """NVRTC's version, e.g. '12.9' (BackendUnavailable when NVRTC cannot be loaded)."""
    return ".".join(str(v) for v in load().getVersion())


def supported_archs() -> tuple[str, ...]:
    """Architectures this NVRTC can target (e.g. 50 ... 121)."""
    return tuple(str(a) for a in load().getSupportedArchs())


def refusal(arch: str) -> str:
    """'' when this NVRTC targets compute_<arch>, else why not (with the supported list)."""
    arch = normalize_arch(arch)
    have = supported_archs()
    if arch in have:
        return ""
    return (f"this NVRTC cannot target compute_{arch}; it supports "
            f"{', '.join(sorted(have, key=int))}")


def static_shared_bytes(ptx: str | bytes) -> int:
    """Bytes of static shared memory a module declares (its kernels together: an upper bound
    for each; our sources have one entry point)."""
    text = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
    total = 0
    for bits, brackets, n in _SHARED_DECL.findall(text):
        count = 1 if not brackets else int(n) if n else 0  # x; x[N]; extern x[] (dynamic)
        total += int(bits) // 8 * count
    return total


@dataclass(frozen=True)
class RawCompile:
    """What one NVRTC run produced, in plain data (crosses process boundaries)."""

    ptx: bytes | None
    headline: str
    log: str
    options: tuple[str, ...]
    seconds: float

    def error(self, source: str, arch: str) -> CompileError:
        """The CompileError of a failed run (numbered source, log, options)."""
        return CompileError(self.headline, source=source, log=self.log, options=self.options,
                            device=device(arch))


def device(arch: str) -> str:
    """How a compile-only run is named in errors: 'NVRTC compute_80 (compile only)'."""
    return f"NVRTC compute_{normalize_arch(arch)} (compile only)"


def compile_raw(source: str, arch: str, options: Sequence[str] | None = None,
                name: str = "portakern.cu") -> RawCompile:
    """One NVRTC program -> PTX, then the static shared-memory limit ptxas would enforce.

    Never raises for a compile error (``ptx`` is None, ``headline`` and ``log`` say why):
    the compile check reports every case, failed ones included.
    """
    nvrtc = load()
    arch = normalize_arch(arch)
    opts = tuple(compile_options() if options is None else options) + (
        f"--gpu-architecture=compute_{arch}",)
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as exc:
            try:
                log = nvrtc.getProgramLog(prog) or str(exc)
            except Exception:
                log = str(exc)
            head = compile_error_message(f"NVRTC failed to compile {name} for compute_{arch}",
                                         log)
            return RawCompile(None, head, log, opts, time.perf_counter() - t0)
        ptx = bytes(nvrtc.getPTX(prog))
    finally:
        try:
            nvrtc.destroyProgram(prog)
        except Exception:
            pass
    shared = static_shared_bytes(ptx)
    if shared > STATIC_SHARED_LIMIT:
        log = (f"static shared memory: {shared} bytes declared, more than the "
               f"{STATIC_SHARED_LIMIT} bytes (48 KiB) a block may declare statically on any CUDA "
               "architecture; ptxas would refuse it ('uses too much shared data').")
        return RawCompile(None, f"{name} for compute_{arch} needs too much shared memory; "
                          "lower the tile tunables", log, opts, time.perf_counter() - t0)
    return RawCompile(ptx, "", "", opts, time.perf_counter() - t0)


def compile_source(source: str, arch: str, options: Sequence[str] | None = None,
                   name: str = "portakern.cu") -> bytes:
    """Compile one rendered source to PTX for compute_<arch>; raise CompileError on failure.

    One NVRTC program per call (~0.1-0.4 s): a failure belongs to exactly one case.
    """
    raw = compile_raw(source, arch, options, name)
    if raw.ptx is None:
        raise raw.error(source, arch)
    return raw.ptx


def kernel_resources(source: str, arch: str, name: str = "portakern.cu") -> list[dict[str, Any]]:
    """Per entry point: what ``ptxas -v --gpu-name sm_<arch>`` reports for NVRTC's PTX
    (``ptxas.parse_ptxas_log``'s keys). BackendUnavailable without ptxas (checked before
    compiling, so the fix comes first), CompileError when the source does not compile,
    ToolchainError when ptxas fails."""
    require_ptxas()
    arch = normalize_arch(arch)
    return ptxas_resources(compile_source(source, arch, name=name), arch)
