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
third operand has not already copied the first two to the device. This belongs at the top of
``Backend.run`` (backends/base.py); until it is called there, the opencl and jax backends call
it from their own ``run`` and the numpy backend from its ``as_input``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .dtypes import dtype_name
from .errors import NotAnArrayError


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
        claimed_shape = tuple(int(s) for s in x.shape)  # type: ignore[attr-defined]
        claimed_dtype = dtype_name(x.dtype)  # type: ignore[attr-defined]
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
