"""The host array a backend uploads for an operand that is not already one of its own arrays.

Why this step needs checks of its own: validation (``KernelSpec.problem``) reads only
``.shape`` and ``.dtype`` — that is what lets portakern refuse a call from metadata alone and
validate shape/dtype stand-ins (``portakern check --compile-only``, the benchmark) without
allocating. The launch geometry is then derived from those claimed sizes. If the data a
backend actually uploads does not match them — an object that has ``.shape``/``.dtype`` but no
data (``np.asarray`` makes a 0-d object array of it), or one whose ``__array__`` returns a
different shape — the kernels would index past the end of the uploaded buffer: wrong results
at best, an out-of-bounds read of device memory at worst. So the conversion is checked against
the metadata that was validated, and refused with ``NotAnArrayError`` otherwise.

Masked arrays are refused: ``np.asarray`` drops the mask, so the result would silently
ignore it (and the numpy oracle would compute something else again with ``np.ma`` arithmetic).

Byte order: a big-endian ``>f4`` array has dtype name ``float32``, so it validates, but C
kernels and XLA read native-order floats. ``native_byte_order`` converts it (one copy) so that
every backend computes on the values the caller meant; the numpy oracle does this implicitly.

Every operand is checked before ANY is uploaded (``host_operands``), so a call refused for its
third operand has not already copied the first two to the device. ``portakern.runtime.execute.run``
does this for every backend before its first upload.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import settings
from .dtypes import dtype_name
from .errors import HostMemoryError, InvalidArgumentError, NotAnArrayError

# --- memory judged before it is spent ------------------------------------------------------
# Every host copy a call would make (contiguous and byte-order copies of operands, the
# oracle's float64 copies, and on CPU devices the device buffers too, which are host memory
# there) is sized from the shapes first and refused with HostMemoryError when the call's total
# exceeds the budget: $PORTAKERN_HOST_MEMORY_BUDGET (bytes, or with a K/M/G/T suffix) when set,
# else half of physical memory, and never more than MemAvailable or the headroom left under
# the address-space limit (ulimit -v). A zero-stride (broadcast) view of 4 bytes that claims
# 8 GB is 8 GB to copy, and is judged as such before anything is allocated.
ENV_BUDGET = "PORTAKERN_HOST_MEMORY_BUDGET"
SMALL_BYTES = 64 << 20  # a call below this total is never refused (the budget is not read)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        n = -1.0
    if not n >= 0 or n != n or n == float("inf"):
        raise InvalidArgumentError(f"${ENV_BUDGET}={text!r} is not a size; expected bytes, "
                                   "optionally with a K/M/G/T suffix, e.g. 8G.")
    return int(n * _UNITS[unit])


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_headroom() -> int | None:
    """Bytes left under RLIMIT_AS (None = unlimited or unknown)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", "rb") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(0, soft - used)


def memory_budget() -> tuple[int, str]:
    """(bytes, what set it): the most host memory one call may ask for."""
    env = settings.host.memory_budget
    if env:
        budget, why = _parse_bytes(env), f"${ENV_BUDGET}={env}"
    else:
        try:
            phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            phys = 0
        budget, why = (phys // 2, "half of physical memory") if phys > 0 else (1 << 62, "")
        avail = _meminfo("MemAvailable")
        if avail is not None and avail < budget:
            budget, why = avail, "MemAvailable in /proc/meminfo"
    room = _address_space_headroom()
    if room is not None and room < budget:
        budget, why = room, "the address-space headroom left under ulimit -v (RLIMIT_AS)"
    return budget, why


def check_host_memory(what: str, parts: Iterable[tuple[str, int]]) -> None:
    """Refuse (HostMemoryError, naming every part and the budget) a call whose host
    allocations ``parts`` ((description, bytes), ...) exceed ``memory_budget()``."""
    parts = [(d, int(n)) for d, n in parts if n]
    total = sum(n for _, n in parts)
    if total < SMALL_BYTES:
        return
    budget, why = memory_budget()
    if total <= budget:
        return
    listed = "; ".join(f"{d}: {n} bytes" for d, n in parts)
    raise HostMemoryError(
        f"{what} would allocate {total} bytes of host memory ({listed}), more than the budget "
        f"of {budget} bytes ({why}). Nothing was allocated. Fix: split the call into smaller "
        "pieces; pass a contiguous array instead of a broadcast (zero-stride) view; or raise "
        f"${ENV_BUDGET} if the machine really has the memory.")


def nbytes_of(x: Any) -> int:
    """Bytes of ``x``'s data as its shape and dtype claim (a zero-stride view counts in full)."""
    n = 1
    for s in x.shape:
        n *= int(s)
    return n * np.dtype(x.dtype).itemsize if n else 0


def host_copy_bytes(x: Any, contiguous: bool = True) -> int:
    """Bytes ``host_operand`` would allocate for ``x`` (0 when it passes it through)."""
    if isinstance(x, np.ndarray) and x.dtype.isnative and (not contiguous
                                                           or x.flags.c_contiguous):
        return 0
    try:
        return nbytes_of(x)
    except (TypeError, ValueError, AttributeError):
        return 0


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides numpy (and CuPy, pyopencl) give a C-contiguous array of this shape: the
    runners' fast argument checks compare an operand's strides with these."""
    out, step = [], itemsize
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def native_byte_order(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when its dtype is in the machine's byte order, else a converted copy."""
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def host_operand(name: str, x: object, *, contiguous: bool = True) -> np.ndarray:
    """A numpy array holding ``x``'s data, in native byte order (and C order if asked).

    Raises NotAnArrayError when ``x`` cannot be converted or converts to something other than
    the shape and dtype it reported at validation time.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise NotAnArrayError(
            f"argument {name!r} is a numpy masked array; portakern computes on plain arrays and "
            "would silently ignore its mask. Pass x.filled(value) (for softmax, -inf excludes "
            "an entry), or for attention pass the keep-mask as mask=.")
    if isinstance(x, np.ndarray):  # shape and dtype of an ndarray are its data's, by definition
        arr = np.asarray(x)  # subclasses (np.matrix) compute as the plain array they hold
    else:
        meta: Any = x  # an array-like: validation read its shape and dtype already
        claimed_shape = tuple(int(s) for s in meta.shape)
        claimed_dtype = dtype_name(meta.dtype)
        what = f"argument {name!r} ({type(x).__name__}, shape {claimed_shape}, " \
               f"dtype {claimed_dtype})"
        try:
            arr = np.asarray(x)
        except Exception as exc:
            raise NotAnArrayError(
                f"{what} cannot be converted to an array for upload ({type(exc).__name__}: "
                f"{exc}); expected a numpy array, this backend's device array, or an object "
                "with __array__ or the buffer protocol. Convert it yourself first, e.g. "
                "np.asarray(x) or x.get().") from None
        if arr.dtype == object or arr.shape != claimed_shape \
                or dtype_name(arr.dtype) != claimed_dtype:
            raise NotAnArrayError(
                f"{what} does not hold the data it describes: converting it gives shape "
                f"{arr.shape} and dtype {dtype_name(arr.dtype)}; expected an array whose data "
                "matches its .shape and .dtype (a shape/dtype stand-in can be validated, not "
                "computed on). Pass the real array, e.g. np.asarray(data).")
    arr = native_byte_order(arr)
    if contiguous and not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def host_operands(arrays: Mapping[str, Any], is_native: Callable[[object], bool]
                  ) -> dict[str, Any]:
    """``arrays`` with every operand that is neither None nor native replaced by its checked
    host array; all are checked before the caller uploads any."""
    return {k: v if v is None or is_native(v) else host_operand(k, v)
            for k, v in arrays.items()}


__all__ = ["host_operand", "host_operands", "native_byte_order"]
