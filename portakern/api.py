"""The public ops: validate -> select backend -> dispatch. Nothing here knows a backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import selection
from .backends.base import Backend
from .ops import get_op
from .spec import KernelSpec


def call(op: str | KernelSpec, *args: Any, backend: str | Backend | None = None,
         config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Run any registered op (or a KernelSpec) on the selected backend.

    ``config`` overrides tunables (validated against each tunable's domain).
    """
    spec = op if isinstance(op, KernelSpec) else get_op(op)
    arrays, params = spec.bind(args, kwargs)
    prob = spec.problem(arrays, params)  # validation happens before any backend is touched
    be = selection.resolve(backend, arrays.values())
    return be.run(spec, prob, arrays, config)


def matmul(a: Any, b: Any, *, backend: str | Backend | None = None,
           config: Mapping[str, int] | None = None) -> Any:
    """(..., M, K) @ (..., K, N) -> (..., M, N); batch dims broadcast; fp32 accumulation."""
    return call("matmul", a, b, backend=backend, config=config)


def softmax(x: Any, axis: int = -1, *, backend: str | Backend | None = None,
            config: Mapping[str, int] | None = None) -> Any:
    """Stable softmax along ``axis``; a row of only -inf gives zeros."""
    return call("softmax", x, axis=axis, backend=backend, config=config)


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None,
              scale: float | None = None, backend: str | Backend | None = None,
              config: Mapping[str, int] | None = None) -> Any:
    """Fused softmax(scale q k^T [causal, mask]) v; rows with no key to attend give 0."""
    return call("attention", q, k, v, mask=mask, causal=causal, scale=scale, backend=backend,
                config=config)
