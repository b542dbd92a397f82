"""Storage vs compute dtypes, and how each dialect names, loads and stores them.

An operand is *stored* in its dtype and *computed* in a wider one: float16 and bfloat16
accumulate in float32; float32 in float32; float64 in float64. Kernels never see the storage
type directly; they use ``PK_LOAD_<slot>(ptr, i)`` (returns the compute type) and
``PK_STORE_<slot>(ptr, i, v)``, so one kernel source serves every dtype and every dialect.
The per-dialect spellings live in the tables below: data, not branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import ml_dtypes
import numpy as np

from .errors import DTypeError

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

bfloat16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class DTypeInfo:
    """What portakern knows about one floating dtype."""

    name: str
    storage: np.dtype
    compute: np.dtype  # accumulation/compute dtype inside kernels
    unit_roundoff: float  # u = 2**-p for storage rounding (round to nearest)
    tiny: float  # smallest positive normal of the storage dtype
    subnormal: float  # smallest positive subnormal of the storage dtype
    needs_fp64: bool = False


def _info(name: str, storage: np.dtype, compute: np.dtype, needs_fp64: bool = False) -> DTypeInfo:
    fi = ml_dtypes.finfo(storage) if storage == bfloat16 else np.finfo(storage)
    return DTypeInfo(name, np.dtype(storage), np.dtype(compute), float(fi.eps) / 2.0,
                     float(fi.tiny), float(fi.smallest_subnormal), needs_fp64)


FLOAT_DTYPES: dict[str, DTypeInfo] = {
    "float32": _info("float32", np.dtype(np.float32), np.dtype(np.float32)),
    "float16": _info("float16", np.dtype(np.float16), np.dtype(np.float32)),
    "bfloat16": _info("bfloat16", bfloat16, np.dtype(np.float32)),
    "float64": _info("float64", np.dtype(np.float64), np.dtype(np.float64), needs_fp64=True),
}


def compute_dtype_name(dtype: object) -> str:
    """The name of a float dtype's compute type: float64 for float64, else float32."""
    return dtype_name(info(dtype).compute)


def dtype_name(dtype: object) -> str:
    """Canonical name of a dtype-like (numpy dtype, ml_dtypes, jax/cupy dtypes, strings)."""
    try:
        dt = np.dtype(cast("DTypeLike", dtype))  # anything else raises TypeError, caught
    except TypeError:
        return str(dtype)
    if dt == bfloat16:
        return "bfloat16"
    return dt.name


def info(dtype: object) -> DTypeInfo:
    """Look up a supported floating dtype; raise DTypeError naming the supported set."""
    got = FLOAT_DTYPES.get(dtype) if dtype.__class__ is str else None  # the hot path: by name
    if got is not None:
        return got
    name = dtype_name(dtype)
    try:
        return FLOAT_DTYPES[name]
    except KeyError:
        raise DTypeError(
            f"dtype {name} is not supported; expected one of {', '.join(FLOAT_DTYPES)}. "
            "Cast the input, e.g. x.astype(np.float32).") from None


# --- per-dialect spellings ---------------------------------------------------------------
# storage: the C type of a pointer's element; load/store: expressions in terms of (p, i, v).
# `acc`: the C compute type. bf16 is stored as 16-bit integers and converted with
# round-to-nearest-even by helpers in the shared preamble (codegen.COMMON_PREAMBLE).

@dataclass(frozen=True)
class DTypeSpelling:
    storage: str
    acc: str
    load: str
    store: str


_F32 = DTypeSpelling("float", "float", "((float)(p)[i])", "((p)[i] = (float)(v))")
_F64 = DTypeSpelling("double", "double", "((double)(p)[i])", "((p)[i] = (double)(v))")
_BF16 = DTypeSpelling("unsigned short", "float", "pk_bf16_to_float((p)[i])",
                      "((p)[i] = pk_float_to_bf16((float)(v)))")

DIALECT_DTYPES: dict[str, dict[str, DTypeSpelling]] = {
    # OpenCL: fp16 storage through core vload_half/vstore_half_rte (no cl_khr_fp16 needed).
    "opencl": {
        "float32": _F32,
        "float64": _F64,
        "bfloat16": _BF16,
        "float16": DTypeSpelling("half", "float", "vload_half((i), (p))",
                                 "vstore_half_rte((float)(v), (i), (p))"),
    },
    # CUDA (NVRTC) and HIP (hipRTC): cuda_fp16.h / hip_fp16.h conversions, round to nearest.
    "cuda": {
        "float32": _F32,
        "float64": _F64,
        "bfloat16": _BF16,
        "float16": DTypeSpelling("__half", "float", "__half2float((p)[i])",
                                 "((p)[i] = __float2half_rn((float)(v)))"),
    },
}
DIALECT_DTYPES["hip"] = DIALECT_DTYPES["cuda"]


def spelling(dialect: str, dtype: object) -> DTypeSpelling:
    return DIALECT_DTYPES[dialect][info(dtype).name]


def cast_to(x: np.ndarray, dtype: object) -> np.ndarray:
    """Round a float64/float32 numpy array to a storage dtype (round to nearest even)."""
    return np.asarray(x).astype(info(dtype).storage)
