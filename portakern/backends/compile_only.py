"""Compile-only targets: the dialects portakern can compile (and read resources from) without
the device. Tools (compile check, ``portakern resources``, the static tuner) look targets up
here by the name the user gave and read what to do from the record, never from the name.

* ``cuda``: NVRTC to PTX for compute_XX (no driver needed); resources from ``ptxas -v``.
* ``hip``: hipcc/clang to an AMDGPU code object for gfxXXXX; resources from its metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class CompileOnlyTarget:
    name: str
    dialect: str  # codegen dialect rendered for it
    compiler: str  # 'nvrtc' | 'hipcc': which driver the tools use
    default_archs: tuple[str, ...]
    further_archs: tuple[str, ...]  # also tried by the check, reported when refused
    resource_archs: tuple[str, ...]  # default archs of `portakern resources`
    normalize_arch: Callable[[str], str]
    arch_label: Callable[[str], str]  # '80' -> 'sm_80'; 'gfx90a' -> 'gfx90a'
    wave: str  # 'warp' | 'wave'
    unit: str  # 'SM' | 'CU'


def _cuda() -> CompileOnlyTarget:
    from . import cuda

    return CompileOnlyTarget("cuda", "cuda", "nvrtc", cuda.COMPUTE_ARCHS, (), ("80", "90"),
                             cuda.normalize_arch, lambda a: f"sm_{a}", "warp", "SM")


def _hip() -> CompileOnlyTarget:
    from . import hip

    return CompileOnlyTarget("hip", hip.DIALECT, "hipcc", hip.DEFAULT_ARCHS, hip.FURTHER_ARCHS,
                             ("gfx90a", "gfx1030"), hip.normalize_arch, lambda a: a, "wave",
                             "CU")


_TARGETS: dict[str, Callable[[], CompileOnlyTarget]] = {"cuda": _cuda, "hip": _hip}


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
