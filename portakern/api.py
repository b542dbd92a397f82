"""The public ops: validate -> select backend -> dispatch. Nothing here knows a backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import selection
from .backends.base import NOT_PLANNED, Backend
from .errors import InvalidArgumentError
from .ops import get_op
from .spec import KernelSpec, Problem, params_key_of


def call(op: str | KernelSpec, *args: Any, backend: str | Backend | None = None,
         config: Mapping[str, int] | None = None, out: Any = None, **kwargs: Any) -> Any:
    """Run any registered op (or a KernelSpec) on the selected backend.

    ``config`` overrides tunables (validated against each tunable's domain). ``out`` is a
    device array of the result's shape and dtype to write into (C-kernel backends).
    """
    spec = op if isinstance(op, KernelSpec) else get_op(op)
    if config is not None and not isinstance(config, Mapping):
        raise InvalidArgumentError(
            f"{spec.name}: config must be a mapping of tunable names to ints, e.g. "
            f"{{'TM': 4}}; got {type(config).__name__} {str(config)[:60]!r}. Pass a dict.")
    if not kwargs and not config and spec.all_positional(args):
        # the hot path: operands only, default parameters. A repeat of a call the backend
        # already planned is one lookup there (Backend.call_site); otherwise validate first.
        be: Backend | None
        if isinstance(backend, Backend):
            be = backend
        else:
            try:
                be = selection.resolve(backend, args)
            except Exception:  # raised again below, after validation
                be = None
        if be is not None:
            res = be.call_site(spec, args, out)
            if res is not NOT_PLANNED:
                return res
        arrays = dict(zip(spec._operand_names, args))
        prob = _problem(spec, arrays, spec.params, spec._default_params_key)
        if be is None:
            be = selection.resolve(backend, arrays.values())
        res = be.run(spec, prob, arrays, None, out=out) if out is not None else \
            be.run(spec, prob, arrays, None)
        be.remember_site(spec, args, prob)
        return res
    arrays, params = spec.bind(args, kwargs)
    prob = _problem(spec, arrays, params)  # validation happens before any backend is touched
    be = selection.resolve(backend, arrays.values())
    if out is not None:
        return be.run(spec, prob, arrays, config, out=out)
    return be.run(spec, prob, arrays, config)


_PROBLEMS: dict[Any, Problem] = {}


def _metadata_key(spec: KernelSpec, arrays: Mapping[str, Any], params: Mapping[str, Any],
                  params_key: tuple | None = None) -> Any:
    """What validation depends on: the spec, each operand's type/shape/dtype, the params.

    None when something is plainly not a key; an unhashable parameter value is caught where
    the key is used (``_problem``), so the hot path hashes the key once."""
    parts: list[Any] = [spec.token]
    append = parts.append
    for x in arrays.values():
        if x is None:
            append(None)
            continue
        try:  # lists and scalars have no .shape; their validation gives the message
            shape, dt = x.shape, x.dtype
            if shape is None or dt is None:
                return None
            append((x.__class__, tuple(shape), dt))
        except (AttributeError, TypeError):
            return None
    # types too: True == 1 and hash(True) == hash(1), yet axis=True must be refused
    append(params_key if params_key is not None else params_key_of(params))
    return tuple(parts)


def _problem(spec: KernelSpec, arrays: Mapping[str, Any], params: Mapping[str, Any],
             params_key: tuple | None = None) -> Problem:
    """Validated Problem, memoised on metadata: a repeated call re-validates nothing.

    ``params`` may be the spec's own defaults (the positional fast path of ``call``);
    ``KernelSpec.problem`` hands validation a copy."""
    key = _metadata_key(spec, arrays, params, params_key)
    if key is not None:
        try:
            got = _PROBLEMS.get(key)
        except TypeError:  # an unhashable parameter value: validate from scratch
            key = got = None
        if got is not None:
            return got
    prob = spec.problem(arrays, params)
    if key is not None:
        prob.cache_key = key  # type: ignore[attr-defined]
        if len(_PROBLEMS) > 4096:
            _PROBLEMS.clear()
        _PROBLEMS[key] = prob
    return prob


# The named wrappers take the same keywords as ``call`` (out= included) and refuse unknown
# ones the same way: with InvalidArgumentError from the spec's binding, not a plain TypeError.
def matmul(a: Any, b: Any, *, backend: str | Backend | None = None,
           config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """(..., M, K) @ (..., K, N) -> (..., M, N); batch dims broadcast; fp32 accumulation."""
    return call("matmul", a, b, backend=backend, config=config, **kwargs)


def softmax(x: Any, axis: int = -1, *, backend: str | Backend | None = None,
            config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Stable softmax along ``axis``; a row of only -inf gives zeros."""
    return call("softmax", x, axis=axis, backend=backend, config=config, **kwargs)


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None,
              scale: float | None = None, backend: str | Backend | None = None,
              config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Fused softmax(scale q k^T [causal, mask]) v; rows with no key to attend give 0."""
    return call("attention", q, k, v, mask=mask, causal=causal, scale=scale, backend=backend,
                config=config, **kwargs)


def rmsnorm(x: Any, weight: Any, eps: float = 1e-6, *, backend: str | Backend | None = None,
            config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """x / sqrt(mean(x**2, axis=-1) + eps) * weight, fused; weight has shape (x.shape[-1],)."""
    return call("rmsnorm", x, weight, eps=eps, backend=backend, config=config, **kwargs)
