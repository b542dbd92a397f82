"""portakern: one kernel spec, every vendor's accelerator, proven equal and measured."""

from __future__ import annotations

from . import backends  # the registry; calling it lists every backend
from ._version import __version__ as __version__
from .api import attention, call, matmul, rmsnorm, softmax
from .backends import refresh as refresh_backends
from .cases import register_cases
from .errors import (
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
from .info import to_backend
from .ops import register_op, unregister_op
from .selection import explain, use
from .spec import ArrayMeta, Buf, Cost, KernelSpec, Launch, Operand, Problem, Scalar, Tunable
from .verify import Verdict, verify

__all__ = [
    "ArrayMeta", "BackendUnavailable", "Buf", "CompileError", "Cost", "DTypeError",
    "DeviceMemoryError", "InvalidArgumentError", "KernelFaultError", "KernelSpec", "Launch",
    "NotAnArrayError",
    "Operand", "PortakernError", "Problem", "Scalar", "ShapeError", "SpecError", "Tunable",
    "UnknownBackendError", "UnsupportedDTypeError", "attention", "backends", "call",
    "explain", "matmul", "refresh_backends", "register_cases", "register_op", "rmsnorm",
    "softmax", "to_backend",
    "unregister_op", "use", "Verdict", "verify",
]
