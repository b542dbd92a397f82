"""The peer of an op that has no hand-written one: its own ``spec.semantics`` on the device's
best native array library, in the compute dtype.

Why this is the peer: a user op (or a plugin op) has no vendor library to compare with, but
its spec states the computation once against the array API. Run by numpy on a CPU, by XLA
(``jax.jit`` of ``lower_semantics``) on a jax device, or by cupy on a CUDA device, that is what
the user would otherwise write with the library at hand, so "how far is the portable kernel
from the plain expression on the vendor's own stack" is a fair question for any op.

Dtypes: like portakern's kernels, the semantics compute in the compute dtype (float32 for
float16/bfloat16 inputs): inputs are cast up and the result cast back to the storage dtype
*inside* the timed call, because a user of that library has to do the same; bool operands and
int32 index tables are passed unchanged and absent optional operands as None. The record's
``what`` says all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...core import dtypes
from ...core.spec import KernelSpec

# ops whose peers are written by hand (numpy_worker.build, peers._xla_fn, peers.run_cupy):
# every other op gets the semantics peer
HANDWRITTEN_OPS = ("matmul", "softmax", "attention", "attention_backward")


def has_handwritten_peers(op: str) -> bool:
    """True for the built-in ops whose peers are vendor calls rather than their semantics."""
    return op in HANDWRITTEN_OPS


def identity(spec: KernelSpec) -> str:
    """Where the spec's semantics is defined (module:qualname:line).

    The numpy peer process imports portakern afresh, so it knows the built-in ops and the
    entry-point plugins but not an op registered in code; the parent compares this string
    with the one the child reports to decide whether the child can run the op's semantics
    (the same function) or the peer must run in the benchmark's own process.
    """
    fn = spec.semantics
    code = getattr(fn, "__code__", None)
    return (f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}:"
            f"{getattr(code, 'co_firstlineno', '?')}")


def semantics_call(spec: KernelSpec, xp: Any, arrays: Sequence[Any], params: dict[str, Any],
                   dtype: str) -> Callable[[], Any]:
    """``f()``: ``spec.semantics(xp, *arrays, **params)`` in the compute dtype, result in the
    storage dtype. ``arrays`` are in operand order (None for absent optional ones)."""
    info = dtypes.info(dtype)
    compute, storage = np.dtype(info.compute), np.dtype(info.storage)
    kinds = [o.kind for o in spec.operands]
    args = list(arrays)
    semantics = spec.semantics
    if compute == storage:
        def f() -> Any:
            return semantics(xp, *args, **params)
        return f

    def f_cast() -> Any:
        up = [x if x is None or k in ("bool", "int32") else x.astype(compute)
              for x, k in zip(args, kinds, strict=True)]
        return semantics(xp, *up, **params).astype(storage)
    return f_cast


def what(spec: KernelSpec, library: str, dtype: str) -> str:
    """The words for what a semantics peer times."""
    info = dtypes.info(dtype)
    cast = ("" if info.compute == info.storage else
            f"; inputs cast to {info.compute.name} and the result back to {dtype} inside the "
            "timed call")
    return (f"spec.semantics({library}, ...) of {spec.name!r} (the op's own array-API "
            f"definition) in {info.compute.name}{cast}")
