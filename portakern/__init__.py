"""portakern: one kernel spec, every vendor's accelerator, proven equal and measured."""

from __future__ import annotations

from typing import Any

from ._version import __version__ as __version__
from .api import (
    attention,
    attention_backward,
    call,
    matmul,
    paged_attention,
    rmsnorm,
    softmax,
)
from .backend import registry as _registry
from .backend.registry import refresh as refresh_backends
from .core.errors import (
    BackendUnavailable,
    CompileError,
    DeviceMemoryError,
    DTypeError,
    InvalidArgumentError,
    KernelFaultError,
    NotAnArrayError,
    PortakernError,
    ShapeError,
    SpecError,
    UnknownBackendError,
    UnsupportedDTypeError,
)
from .core.spec import (
    ArrayMeta,
    Buf,
    Cost,
    KernelSpec,
    Launch,
    Operand,
    PallasKernel,
    Problem,
    Scalar,
    Tunable,
)
from .core.statmodel import StatModel
from .ops import register_op as _register_op
from .ops import unregister_op
from .runtime.selection import explain, use
from .runtime.transfers import to_backend
from .runtime.verify import Verdict, verify

__all__ = [
    "ArrayMeta", "BackendUnavailable", "Buf", "CompileError", "Cost", "DTypeError",
    "DeviceMemoryError", "InvalidArgumentError", "KernelFaultError", "KernelSpec", "Launch",
    "NotAnArrayError",
    "Operand", "PallasKernel", "PortakernError", "Problem", "Scalar", "ShapeError", "SpecError",
    "StatModel", "Tunable",
    "UnknownBackendError", "UnsupportedDTypeError", "attention", "backends", "call",
    "attention_backward", "explain", "matmul", "paged_attention", "refresh_backends",
    "register_cases",
    "register_op", "rmsnorm",
    "softmax", "to_backend",
    "unregister_op", "use", "Verdict", "verify",
]


def backends() -> dict[str, dict[str, Any]]:
    """Every registered backend: available?, its devices and versions, or why not and the fix.

    (This function is ``portakern.backends``; the package of that name holds the backends
    themselves and is imported as ``portakern.backend.<module>``.)"""
    return _registry.report()


def register_op(spec: KernelSpec, *, replace: bool = False, check: bool = False) -> KernelSpec:
    """Make a spec visible to `portakern.call`, `portakern check`, the tests and the benchmark.

    The spec is checked first (portakern.core.spec_checks.check_spec): a malformed field raises
    SpecError naming the spec, the field and the fix. ``check=True`` also compiles the spec's
    example on every available C-kernel backend and through NVRTC, and traces its semantics
    with jax (seconds, not milliseconds: use it in tests and when developing an op).
    """
    if check and isinstance(spec, KernelSpec):  # the tool loads only when asked for
        from .tools.registration import check_registered

        check_registered(spec, compile=True)
    return _register_op(spec, replace=replace)


def __getattr__(name: str) -> object:
    """Public names that live in tools modules, imported on first use so that importing the
    package or calling an op loads no tool (tests/test_layers.py)."""
    if name == "register_cases":
        from .tools.cases import register_cases

        globals()[name] = register_cases
        return register_cases
    raise AttributeError(f"module 'portakern' has no attribute {name!r}")
