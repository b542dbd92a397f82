"""The Plan layer: one dispatcher and one bounded plan cache (docs/architecture.md, "The Plan
and a call's path").

Every entry point (``pk.softmax``, ``pk.matmul``, ``pk.attention``, ``pk.rmsnorm``,
``pk.call`` positional or keyword, with or without ``out=`` and ``config=``) goes through
``dispatch``. It turns (spec, operand metadata, parameters, target backend, config overrides,
tuning generation) into a ``Plan`` once: the validated problem and, on a C-kernel backend, the
compiled kernels, their launches in order with packed scalar arguments, and the workspace
buffers each call allocates. Plans live in ``PLANS``, one LRU cache whose key is ``plan_key``.
A repeated call is: resolve the backend, build the key, one lookup, then the backend's
per-call checks (context, layout, buffer size, ``out=`` and aliasing) and its enqueues.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import selection, tuned
from .backends import base
from .backends.base import Backend, LaunchPlan, LRUCache
from .errors import InvalidArgumentError
from .spec import KernelSpec, Problem

PLAN_CACHE_SIZE = 4096  # distinct (op, shapes, params, target) of a long-running process


@dataclass(eq=False)
class Plan:
    """What a call needs once its metadata were validated for one backend: everything but
    the arrays. ``launches`` is filled by the backend at the plan's first run, after that
    call's checks passed (a refused call compiles nothing); it stays None on array backends
    (numpy, jax: they evaluate the spec's semantics) and for an empty result."""

    spec: KernelSpec
    backend: Backend
    problem: Problem
    config: dict[str, int] | None  # the caller's overrides (None: tuned or default)
    launches: LaunchPlan | None
    generation: int  # tuned.GENERATION when planned

    @property
    def workspace(self) -> dict[str, tuple[int, str]]:
        return self.launches.workspace if self.launches is not None else {}


PLANS: LRUCache = LRUCache(PLAN_CACHE_SIZE)
_LOCK = threading.Lock()
# a C-kernel backend's compiled-code cache dropping a program drops the plans holding it
base.KERNEL_EVICTION_LISTENERS.append(PLANS.clear)


def plan_key(be: Backend, spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             config: Mapping[str, int] | None) -> tuple:
    """The declared key of a plan: backend instance, spec token, each operand's type, shape
    and dtype (positional or by keyword), each parameter's name, type and value (types: True
    == 1, yet axis=True must be refused), config overrides and the tuning generation.

    Raises AttributeError for an operand without shape/dtype (a list, a scalar): such a call
    is validated (and refused) without a plan; an unhashable part raises TypeError at lookup."""
    key: tuple = (be, spec.token)
    for a in args:
        key += (a.__class__, a.shape, a.dtype)
    if kwargs:
        names = spec._operand_names
        for k, v in kwargs.items():
            if v is None:
                key += (k, None)
            elif k in names:
                key += (k, v.__class__, v.shape, v.dtype)
            else:
                key += (k, v.__class__, v)
    if config:
        key += (tuple([(k, v.__class__, v) for k, v in config.items()]),)
    return key + (tuned.GENERATION,)


def make_plan(be: Backend, spec: KernelSpec, arrays: Mapping[str, Any],
              params: Mapping[str, Any], config: Mapping[str, int] | None) -> Plan:
    """Validate the metadata, the dtype on ``be`` and the config overrides (no arrays are
    touched, nothing is compiled yet)."""
    gen = tuned.GENERATION
    prob = spec.problem(arrays, params)
    be.check_dtype(spec, prob)
    cfg = dict(config) if config else None
    if cfg:
        be.check_config(spec, prob, cfg)
    return Plan(spec, be, prob, cfg, None, gen)


def _check_config(spec: KernelSpec, config: Any) -> None:
    if config is not None and not isinstance(config, Mapping):
        raise InvalidArgumentError(
            f"{spec.name}: config must be a mapping of tunable names to ints, e.g. "
            f"{{'TM': 4}}; got {type(config).__name__} {str(config)[:60]!r}. Pass a dict.")


def plan_for(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any], *,
             backend: str | Backend | None = None,
             config: Mapping[str, int] | None = None) -> Plan:
    """The plan a call ``spec(*args, **kwargs)`` uses (made and cached if absent): the
    benchmark launches its kernels raw (bench/dispatch.py); tests inspect it."""
    _check_config(spec, config)
    be = selection.resolve(backend, args)
    try:
        key: tuple | None = plan_key(be, spec, args, kwargs, config)
        got = PLANS.get(key)
    except (AttributeError, TypeError):
        key = got = None
    if got is not None:
        return got
    arrays, params = spec.bind(args, kwargs)
    plan = make_plan(be, spec, arrays, params, config)
    if key is not None:
        with _LOCK:
            PLANS[key] = plan
    be.compile_plan(plan)
    return plan


def dispatch(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None, config: Mapping[str, int] | None, out: Any) -> Any:
    """Every call's one path: backend, plan (one lookup when repeated), run."""
    try:
        be = selection.resolve(backend, args)
    except Exception:  # validation speaks first: a bad call never reaches a backend
        arrays, params = spec.bind(args, kwargs)
        spec.problem(arrays, params)
        raise
    try:
        key: tuple | None = plan_key(be, spec, args, kwargs, config)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # no shape/dtype, or unhashable: validate, no cache
        key = plan = None
    if plan is None:
        _check_config(spec, config)
        arrays, params = spec.bind(args, kwargs)
        plan = make_plan(be, spec, arrays, params, config)
        if key is not None:
            with _LOCK:
                PLANS[key] = plan
    elif kwargs:
        arrays = dict(zip(spec._operand_names, args))
        for k, v in kwargs.items():
            if k in arrays or k in spec.params:
                continue
            arrays[k] = v
    else:
        arrays = dict(zip(spec._operand_names, args))
    return be.run(plan, arrays, out)
