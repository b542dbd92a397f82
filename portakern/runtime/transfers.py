"""Moving arrays between backends: ``pk.to_backend`` (``pk.backends()`` lists them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend.base import Backend
from ..core import dtypes
from ..core.errors import (
    BackendUnavailable,
    DeviceMemoryError,
    DTypeError,
    NotAnArrayError,
    PortakernError,
)
from . import selection


def to_backend(x: Any, backend: str | Backend) -> Any:
    """Move an array to a backend's native array type (counted on that backend).

    Native arrays of another library go through the host unless both sides speak DLPack,
    which backends may use in their ``from_foreign`` hook.
    """
    be = selection.resolve(backend)
    if be.is_native(x):
        _check_kind(x)
        return x
    arr = _checked(x, be)
    hook = getattr(be, "from_foreign", None)
    try:
        if hook is not None:  # numpy goes in validated (arr); others as they are
            got = hook(arr if isinstance(x, np.ndarray) else x)
            if got is not None:
                return got
        return be.to_native(arr)
    except PortakernError:
        raise
    except MemoryError as exc:
        raise DeviceMemoryError(f"to_backend: cannot allocate {arr.nbytes} bytes on "
                                f"{be.describe()} ({exc}). Fix: move a smaller array, or free "
                                "device arrays you no longer need.") from None
    except Exception as exc:
        raise BackendUnavailable(f"to_backend: {be.describe()} could not take the array "
                                 f"(shape {arr.shape}, dtype {arr.dtype}): "
                                 f"{type(exc).__name__}: {exc}") from None


_KINDS = "fbiu"  # numpy floats, bool, signed and unsigned ints (bfloat16 by name)


def _checked(x: Any, be: Backend) -> np.ndarray:
    """The host array ``to_backend`` moves, validated as an op validates an operand: an array
    (not a list, string or None) of a real dtype (float, bool or integer; never complex,
    strings or objects), converted only after its size is judged (portakern.core.host), and its
    shape kept (a 0-d array stays 0-d)."""
    _check_kind(x)
    from ..core.host import check_host_memory, host_copy_bytes, host_operand, nbytes_of

    check_host_memory(f"to_backend({be.label})",
                      [("host copy", host_copy_bytes(x)),
                       ("device copy", nbytes_of(x) if be.device.kind == "cpu" else 0)])
    return host_operand("x", x)


def _check_kind(x: Any) -> None:
    if x is None or isinstance(x, (str, bytes, list, tuple, dict, set)) or \
            getattr(x, "shape", None) is None or getattr(x, "dtype", None) is None:
        raise NotAnArrayError(
            f"to_backend: expected an array (numpy, or another library's array with .shape and "
            f".dtype); got {type(x).__name__} {str(x)[:40]!r}. Wrap it with np.asarray(...).")
    try:
        dt = np.dtype(x.dtype)
    except TypeError:
        dt = None
    if dt is None or not (dt.kind in _KINDS or dtypes.dtype_name(dt) in dtypes.FLOAT_DTYPES):
        raise DTypeError(
            f"to_backend: dtype {x.dtype} cannot be moved to a device; expected a floating "
            f"({', '.join(dtypes.FLOAT_DTYPES)}), bool or integer array. Convert it first, "
            "e.g. x.real.astype(np.float32).")
