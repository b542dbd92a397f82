"""The op registry: name -> KernelSpec. Built-in ops register here; users call register_op."""

from __future__ import annotations

import threading

from ..errors import InvalidArgumentError, SpecError
from ..spec import KernelSpec
from . import attention, matmul, softmax

_LOCK = threading.Lock()
OPS: dict[str, KernelSpec] = {s.name: s for s in (matmul.SPEC, softmax.SPEC, attention.SPEC)}


def register_op(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Make a spec visible to `portakern.call`, `portakern check`, the tests and the benchmark."""
    if not isinstance(spec, KernelSpec):
        raise SpecError(f"register_op expects a KernelSpec; got {type(spec).__name__}.")
    with _LOCK:
        if spec.name in OPS and not replace and OPS[spec.name] is not spec:
            raise SpecError(f"an op named {spec.name!r} is already registered; pass "
                            "replace=True to override it or choose another name.")
        OPS[spec.name] = spec
    return spec


def get_op(name: str) -> KernelSpec:
    try:
        return OPS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown op {name!r}; registered ops: {sorted(OPS)}.") from None
