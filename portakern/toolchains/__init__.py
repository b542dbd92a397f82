"""Compile-only targets: the dialects portakern can compile (and read resources from) without
the device. Tools (compile check, ``portakern resources``, the static tuner, the compile at
``register_op(check=True)``) look targets up here by the name the user gave and call the
record's hooks, never branching on the name or the toolchain.

* ``cuda``: NVRTC to PTX for compute_XX (no driver needed; ``nvrtc.py``); resources from
  ``ptxas -v``.
* ``hip``: hipcc/clang to an AMDGPU code object for gfxXXXX (``hipcc.py``); resources from its
  metadata.

A new target is a constructor here giving the same hooks; the tools need no change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import CompileError, InvalidArgumentError


@dataclass(frozen=True)
class Compiled:
    """One compile-only run, the same plain data for every toolchain (it crosses process
    boundaries: NVRTC holds the GIL, so the check compiles in worker processes)."""

    ok: bool
    headline: str  # what failed ('' when ok)
    log: str
    options: tuple[str, ...]  # options (NVRTC) or command line (hipcc) as run
    device: str  # how errors name the target: 'NVRTC compute_80 (compile only)'
    seconds: float
    object_bytes: int = 0  # PTX / code object size
    shared_bytes: int = 0  # static shared memory / LDS per group (largest kernel)
    kernels: tuple[dict[str, Any], ...] = ()  # per-kernel metadata, where the compile gives it

    def error(self, source: str) -> CompileError | None:
        """The CompileError of a failed run (numbered source and log), None when ok."""
        if self.ok:
            return None
        return CompileError(self.headline, source=source, log=self.log, options=self.options,
                            device=self.device)


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel needs per thread / group, in the same fields for every
    toolchain (``portakern resources`` turns it into a report)."""

    kernel: str
    registers: int  # per thread (AMD: VGPRs, unified with AGPRs on gfx90a)
    spill_stores: int  # bytes stored by spills per thread (AMD: 4 x spilled VGPRs)
    spill_loads: int
    stack_bytes: int  # stack frame (NVIDIA) / private segment (AMD) per thread
    shared_bytes: int  # static shared memory / LDS per group
    barriers: int
    wave_size: int = 32
    sgpr: int | None = None
    agpr: int | None = None
    # matrix-unit instructions in the kernel's machine code (NVIDIA HMMA from cuobjdump -sass,
    # AMD v_mfma/v_wmma from the assembly); None where the tool to read them is absent
    matrix_instructions: int | None = None


# (resident warps/waves, most resident, limiting resource, unit counted per) or None
Occupancy = tuple[int, int, str, str] | None


@dataclass(frozen=True)
class CompileOnlyTarget:
    name: str
    dialect: str  # codegen dialect rendered for it
    compiler: str  # toolchain name, for messages only (tools never compare it)
    default_archs: tuple[str, ...]
    further_archs: tuple[str, ...]  # also tried by the check, reported when refused
    resource_archs: tuple[str, ...]  # default archs of `portakern resources`
    floor_archs: tuple[str, ...]  # where CI holds the resource floor (test_resources.py)
    normalize_arch: Callable[[str], str]
    arch_label: Callable[[str], str]  # in resource reports: '80' -> 'sm_80'; 'gfx90a'
    compile_label: Callable[[str], str]  # in the compile check: '80' -> 'compute_80'
    wave: str  # 'warp' | 'wave'
    unit: str  # 'SM' | 'CU'
    suffix: str  # source file suffix the compiler's messages name: '.cu', '.hip'
    # the hooks
    toolchain: Callable[[], str]  # 'NVRTC 12.9'; BackendUnavailable (with the fix) if absent
    options: Callable[[], tuple[str, ...]]  # the compile options (architecture excluded)
    refusal: Callable[[str], str]  # '' when the toolchain builds for an arch, else why not
    # src, arch, opts, name; a failed compile is Compiled(ok=False), a broken toolchain
    # (ptxas, hipcc, cuobjdump will not start or fail on any source) raises ToolchainError
    compile: Callable[[str, str, Sequence[str] | None, str], Compiled]
    kernel_resources: Callable[[str, str, str], list[KernelResources]]  # src, arch, name
    occupancy: Callable[[str, int, KernelResources], Occupancy]  # arch, group size, kernel
    # NVRTC holds the GIL, so parallel compiles need processes; hipcc is a child process of
    # its own, so threads suffice (and start faster)
    needs_processes: bool = False


# --- cuda: NVRTC (portakern/toolchains/nvrtc.py) --------------------------------------------
def _nvrtc_compile(source: str, arch: str, options: Sequence[str] | None = None,
                   name: str = "portakern.cu") -> Compiled:
    from . import nvrtc

    raw = nvrtc.compile_raw(source, arch, options, name)
    if raw.ptx is None:
        return Compiled(False, raw.headline, raw.log, raw.options, nvrtc.device(arch),
                        raw.seconds)
    return Compiled(True, "", "", raw.options, nvrtc.device(arch), raw.seconds,
                    len(raw.ptx), nvrtc.static_shared_bytes(raw.ptx))


def _nvrtc_resources(source: str, arch: str, name: str) -> list[KernelResources]:
    from . import nvrtc

    return [KernelResources(k["kernel"], k["registers"], k["spill_stores"], k["spill_loads"],
                            k["stack_bytes"], k["shared_bytes"], k["barriers"],
                            matrix_instructions=k.get("matrix_instructions"))
            for k in nvrtc.kernel_resources(source, arch, name)]


def _cuda_occupancy(arch: str, threads: int, k: KernelResources) -> Occupancy:
    from . import ptxas

    lim = ptxas.ARCH_LIMITS.get(arch)
    if lim is None:
        return None
    return (*ptxas.occupancy(lim, threads, k.registers, k.shared_bytes), "SM")


def _cuda() -> CompileOnlyTarget:
    from ..backend import cuda
    from . import nvrtc

    return CompileOnlyTarget(
        "cuda", cuda.CudaBackend.dialect, "nvrtc", cuda.COMPUTE_ARCHS, (), ("80", "90"),
        ("80", "90"), cuda.normalize_arch, lambda a: f"sm_{a}", lambda a: f"compute_{a}",
        "warp", "SM", ".cu", toolchain=lambda: f"NVRTC {nvrtc.version()}",
        options=cuda.compile_options, refusal=nvrtc.refusal, compile=_nvrtc_compile,
        kernel_resources=_nvrtc_resources, occupancy=_cuda_occupancy, needs_processes=True)


# --- hip: hipcc (portakern/toolchains/hipcc.py) --------------------------------------------
def _hip_compile(source: str, arch: str, options: Sequence[str] | None = None,
                 name: str = "portakern.hip") -> Compiled:
    from . import hipcc

    device = f"hipcc {hipcc.normalize_arch(arch)} (compile only, {hipcc.version()})"
    res = hipcc.compile_source(source, arch, name, options)
    broken = hipcc.toolchain_failure(res, name)
    if broken is not None:  # hipcc's fault, not the source's: no CompileError
        raise broken
    if not res.ok:
        return Compiled(False, f"hipcc failed to compile {name} for {res.arch}", res.log,
                        res.command, device, res.seconds)
    return Compiled(True, "", res.log, res.command, device, res.seconds, res.object_bytes,
                    max((k["lds_bytes"] for k in res.kernels), default=0), tuple(res.kernels))


def _hip_resources(source: str, arch: str, name: str) -> list[KernelResources]:
    from . import hipcc

    got = _hip_compile(source, arch, hipcc.resource_options(arch), name)
    err = got.error(source)
    if err is not None:
        raise err
    return [KernelResources(k["kernel"], k["vgpr"], 4 * k["vgpr_spills"], 4 * k["vgpr_spills"],
                            k["private_bytes"], k["lds_bytes"], k["barriers"], k["wave_size"],
                            sgpr=k["sgpr"], agpr=k["agpr"],
                            matrix_instructions=k.get("matrix_instructions"))
            for k in got.kernels]


def _hip_occupancy(arch: str, threads: int, k: KernelResources) -> Occupancy:
    from . import hipcc

    lim = hipcc.ARCH_LIMITS.get(arch)
    if lim is None:
        return None
    return (*hipcc.occupancy(lim, threads, k.wave_size, k.registers, k.sgpr or 0,
                           k.shared_bytes), hipcc.unit(arch))


def _hip_toolchain() -> str:
    from . import hipcc

    hipcc.require_hipcc()
    return f"hipcc ({hipcc.version()}), HIP_PLATFORM=amd"


def _hip() -> CompileOnlyTarget:
    from . import hipcc

    return CompileOnlyTarget(
        "hip", hipcc.DIALECT, "hipcc", hipcc.DEFAULT_ARCHS, hipcc.FURTHER_ARCHS,
        ("gfx90a", "gfx1030"), ("gfx90a",), hipcc.normalize_arch, lambda a: a, lambda a: a,
        "wave", "CU", ".hip", toolchain=_hip_toolchain, options=hipcc.compile_options,
        refusal=hipcc.probe_arch, compile=_hip_compile, kernel_resources=_hip_resources,
        occupancy=_hip_occupancy)


_TARGETS: dict[str, Callable[[], CompileOnlyTarget]] = {"cuda": _cuda, "hip": _hip}
DEFAULT = "cuda"  # what `portakern check --compile-only` checks without --backend


def names() -> list[str]:
    return list(_TARGETS)


def get(selector: str) -> CompileOnlyTarget:
    """The target for 'cuda', 'cuda:0', 'hip', ...; InvalidArgumentError naming the others."""
    name = str(selector).split(":")[0].strip().lower()
    try:
        return _TARGETS[name]()
    except KeyError:
        raise InvalidArgumentError(
            f"no compile-only target {selector!r}; compile-only covers {', '.join(_TARGETS)}. "
            f"Run `portakern check --backend {name}` to build and run its kernels on a device."
        ) from None
