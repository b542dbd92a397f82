"""The Plan layer: one dispatcher and one bounded plan cache (docs/architecture.md, "The Plan
and a call's path").

Every entry point (``pk.softmax``, ``pk.matmul``, ``pk.attention``, ``pk.rmsnorm``,
``pk.call`` positional or keyword, with or without ``out=`` and ``config=``) goes through
``dispatch``. It turns (spec, operand metadata, parameters, target backend, config overrides,
tuning generation) into a ``Plan`` once: the validated problem, the backend it runs on and,
on a C-kernel backend, the kernel configuration (``configs.config_for``: the tuner's entry or
the spec's schedule), the compiled kernels, their launches in order with packed scalar
arguments, the workspace, and the per-call ``runner``. Plans live in ``PLANS``, one bounded
cache whose key is ``plan_key``: everything backend resolution reads is in it, so a repeated
call is one key, one lookup, then the runner: the backend's fast checks of what can still
differ per call (context, layout, buffer size, ``out=`` and aliasing) and its enqueues. A
check that does not pass hands the call to ``execute.run``, which checks everything again and
raises the precise error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import backends as registry
from ..backends import base
from ..backends.base import Backend, KernelBackend, LaunchPlan, LRUCache
from ..core import settings
from ..core.errors import InvalidArgumentError
from ..core.spec import KernelSpec, Problem, storage_dtype
from . import configs, execute, selection

PLAN_CACHE_SIZE = 4096  # distinct (op, shapes, params, target) of a long-running process


@dataclass(eq=False)
class Plan:
    """What a call needs once its metadata were validated for one backend: everything but
    the arrays. ``launches`` is filled in at the plan's first run, after that call's checks
    passed (a refused call compiles nothing; ``execute.run`` asks for it through
    ``compile``); it stays None on array backends (numpy, jax: they evaluate the spec's
    semantics) and for an empty result. ``runner`` is made after the first run succeeded."""

    spec: KernelSpec
    backend: Backend
    problem: Problem
    config: dict[str, int] | None  # the caller's overrides (None: tuned or default)
    launches: LaunchPlan | None
    generation: int  # configs.GENERATION when planned
    # the per-call code of a C-kernel plan (``_runner``), made after its first run succeeded
    runner: Callable[[Sequence[Any], Mapping[str, Any], Any], Any] | None = None

    @property
    def workspace(self) -> dict[str, tuple[int, str]]:
        return self.launches.workspace if self.launches is not None else {}

    def compile(self) -> LaunchPlan | None:
        """The launches, compiled at the first call: the kernel configuration is chosen here,
        above the backends (the tuner's entry for this device and problem bucket, else the
        spec's schedule; a caller's overrides win), and handed to ``build_launches``."""
        launches = self.launches
        if launches is None and not self.problem.empty_result:
            be, spec, prob = self.backend, self.spec, self.problem
            if not isinstance(be, KernelBackend):  # an array backend: nothing to compile
                return None
            cfg = configs.config_for(be, spec, prob, self.config)
            launches = self.launches = execute.build_launches(be, spec, prob, cfg)
        return launches


PLANS: LRUCache = LRUCache(PLAN_CACHE_SIZE)
_LOCK = threading.Lock()
# a C-kernel backend's compiled-code cache dropping a program drops the plans holding it
base.KERNEL_EVICTION_LISTENERS.append(PLANS.clear)
if hasattr(os, "register_at_fork"):  # a child never reuses a parent's launchers
    os.register_at_fork(after_in_child=PLANS.clear)

_CURRENT = selection.current_choice
_ENV_BACKEND = settings.watcher(selection.ENV_VAR)


def plan_key(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None = None,
             config: Mapping[str, int] | None = None) -> tuple:
    """The declared key of a plan, taken before the backend is resolved: the spec's token;
    what resolution reads (``backend=``, the ``use`` choice of this thread or task,
    $PORTAKERN_BACKEND, the registry's version; automatic selection also reads the operands'
    types, which are in the key); each operand's type, shape and dtype (positional, or by
    keyword); each parameter's name, type and value (types: True == 1, yet axis=True must be
    refused); the config overrides; and the tuning generation. So a repeated call never
    resolves its backend again.

    Raises AttributeError for an operand without shape/dtype (a list, a scalar): such a call
    is validated (and refused) without a plan; an unhashable part raises TypeError at lookup."""
    key = [spec.token, backend, _CURRENT(), _ENV_BACKEND(), registry.VERSION,
           configs.GENERATION]
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
        key.append(tuple([(k, v.__class__, v) for k, v in config.items()]))
    return tuple(key)


def make_plan(be: Backend, spec: KernelSpec, arrays: Mapping[str, Any],
              params: Mapping[str, Any], config: Mapping[str, int] | None) -> Plan:
    """Validate the metadata, the dtype on ``be`` and the config overrides (no arrays are
    touched, nothing is compiled yet)."""
    gen = configs.GENERATION
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


def _planned(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None, config: Mapping[str, int] | None
             ) -> tuple[Plan, tuple | None, dict[str, Any] | None]:
    """(plan, its key or None when uncacheable, the bound operands when they were bound)."""
    try:
        key: tuple | None = plan_key(spec, args, kwargs, backend, config)
        plan = PLANS.lookup(key)
    except (AttributeError, TypeError):  # no shape/dtype, or unhashable: validate, no cache
        key = plan = None
    if plan is not None:
        return plan, key, None
    try:
        be = selection.resolve(backend, args)
    except Exception:  # validation speaks first: a bad call never reaches a backend
        arrays, params = spec.bind(args, kwargs)
        spec.problem(arrays, params)
        raise
    _check_config(spec, config)
    arrays, params = spec.bind(args, kwargs)
    plan = make_plan(be, spec, arrays, params, config)
    if key is not None:
        with _LOCK:
            PLANS[key] = plan
    return plan, key, arrays


def plan_for(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any], *,
             backend: str | Backend | None = None,
             config: Mapping[str, int] | None = None) -> Plan:
    """The plan a call ``spec(*args, **kwargs)`` uses (made, compiled and cached if absent):
    the benchmark launches its kernels raw (bench/dispatch.py); tests inspect it."""
    plan = _planned(spec, args, kwargs, backend, config)[0]
    plan.compile()
    return plan


def dispatch(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None, config: Mapping[str, int] | None, out: Any) -> Any:
    """Every call's one path: one lookup when repeated, then the plan's runner (or, for what
    it does not take, the backend's fully checked run)."""
    try:
        plan = PLANS.lookup(plan_key(spec, args, kwargs, backend, config))
    except (AttributeError, TypeError):
        plan = None
    if plan is not None:
        runner = plan.runner
        if runner is not None:
            got = runner(args, kwargs, out)
            if got is not _SLOW:
                return got
        return execute.run(plan, _arrays(spec, args, kwargs), out)
    plan, key, arrays = _planned(spec, args, kwargs, backend, config)
    res = execute.run(plan, arrays if arrays is not None else _arrays(spec, args, kwargs), out)
    if key is not None and plan.runner is None and plan.launches is not None:
        plan.runner = _runner(plan, args, kwargs)
    return res


def _arrays(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The operands of a call whose plan exists (its parameters were bound when planned)."""
    arrays = dict(zip(spec._operand_names, args))
    if kwargs:
        params = spec.params
        for k, v in kwargs.items():
            if k not in arrays and k not in params:
                arrays[k] = v
    return arrays


_SLOW = object()  # a runner's answer: take the backend's fully checked run instead


def _runner(plan: Plan, args: Sequence[Any], kwargs: Mapping[str, Any]
            ) -> Callable[[Sequence[Any], Mapping[str, Any], Any], Any] | None:
    """The per-call code of a planned C-kernel call whose first run succeeded, or None when
    the backend offers no fast checks (``native_checker``).

    Everything the plan fixes (shapes, dtypes, strides a contiguous operand has, the output
    and workspace sizes, which template slot takes which buffer) is worked out here, once;
    per call it runs the backend's checks of what can still differ: each operand's
    context, layout and buffer size, an ``out=``'s layout, writability and overlap with the
    inputs. Any check that does not pass sends the call to ``execute.run`` (``_SLOW``), which
    repeats every check and raises the precise error, so the runner can only be faster, never
    more permissive. Calls with a keyword operand given (e.g. attention's mask) take that
    path too."""
    be, prob = plan.backend, plan.problem
    launches = plan.launches
    if launches is None or prob.empty_result:
        return None
    names = spec_names = plan.spec._operand_names
    checks = []
    for a in args:
        c = be.native_checker(tuple(a.shape), a.dtype)
        if c is None or c(a) is None:  # e.g. host operands: every call takes execute.run
            return None
        checks.append(c)
    kw_operands = tuple(k for k in kwargs if k in spec_names)
    if any(kwargs[k] is not None for k in kw_operands):
        return None
    outputs = (list(prob.outputs.items()) if prob.outputs is not None
               else [("out", (tuple(prob.out_shape), prob.dtype))])
    out_checks = []
    for _, (shape, dt) in outputs:
        c = be.output_checker(tuple(shape), dt)
        if c is None:
            return None
        out_checks.append(c)
    scratch = be.scratch
    ws = [(name, int(n) * storage_dtype(dt).itemsize) for name, (n, dt)
          in launches.workspace.items()]
    big = sum(nb for _, nb in ws) + sum(
        int(np.prod(shape, dtype=np.int64)) * storage_dtype(dt).itemsize
        for _, (shape, dt) in outputs)
    if big > _FAST_ALLOCATION_BYTES:
        return None  # memory is judged per call (execute.run's check_memory) for big calls
    index = {n: i for i, n in enumerate(names[:len(args)])}
    n_in = len(args)
    for j, (name, _) in enumerate(outputs):
        index[name] = n_in + j
    for j, (name, _) in enumerate(ws):
        index[name] = n_in + len(outputs) + j
    try:
        launch_all = be.sequence_launcher(launches, index)
    except KeyError:
        return None  # a template names a buffer this call shape does not have
    single = prob.outputs is None
    makers = [be.output_maker(tuple(shape), dt) for _, (shape, dt) in outputs]
    ws_bytes = tuple(nb for _, nb in ws)
    # tiny workspaces are made once per plan where the backend runs one call's launches as one
    # uninterrupted sequence on an in-order queue (no other call can run between its pack
    # kernel and the kernel that reads the packed copy); bigger ones are made per call
    fixed_ws: list[Any] = []
    if ws_bytes and sum(ws_bytes) <= _PLAN_WORKSPACE_BYTES and be.reusable_workspace():
        fixed_ws = [scratch(nb) for nb in ws_bytes]
        ws_bytes = ()
    out_check = out_checks[0]
    make0 = makers[0]

    def run(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> Any:
        hs = []
        for c, x in zip(checks, args):
            h = c(x)
            if h is None:
                return _SLOW
            hs.append(h)
        for k in kw_operands:
            if kwargs[k] is not None:
                return _SLOW
        if out is None:
            if single:
                out, h = make0()
                hs.append(h)
            else:
                made = [m() for m in makers]
                out = tuple([o for o, _ in made])
                hs.extend([h for _, h in made])
        elif single:
            h = out_check(out)
            if h is None or h in hs:  # handles compare by device memory: aliasing
                return _SLOW
            hs.append(h)
        else:
            if out.__class__ is not tuple or len(out) != len(out_checks):
                return _SLOW
            for c, o in zip(out_checks, out):
                h = c(o)
                if h is None or h in hs:
                    return _SLOW
                hs.append(h)
        if fixed_ws:
            hs += fixed_ws
        for nb in ws_bytes:
            hs.append(scratch(nb))
        launch_all(hs)
        return out

    return run


_FAST_ALLOCATION_BYTES = 1 << 24  # larger calls take the path that judges memory first
_PLAN_WORKSPACE_BYTES = 1 << 16  # at most this much workspace is kept by a plan
