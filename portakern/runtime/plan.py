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
from typing import Any

import numpy as np

from ..backend import base, registry
from ..backend.base import Backend, KernelBackend
from ..core import settings
from ..core.errors import InvalidArgumentError
from ..core.lru import LRUCache
from ..core.spec import KernelSpec, storage_dtype
from . import configs, execute, selection
from .execute import Plan, enqueue_steps

PLAN_CACHE_SIZE = 4096  # distinct (op, shapes, params, target) of a long-running process


PLANS: LRUCache = LRUCache(PLAN_CACHE_SIZE)
_LOOKUP = PLANS.lookup
_LOCK = threading.Lock()
# a C-kernel backend's compiled-code cache dropping a program drops the plans holding it
base.KERNEL_EVICTION_LISTENERS.append(PLANS.clear)
if hasattr(os, "register_at_fork"):  # a child never reuses a parent's launchers
    os.register_at_fork(after_in_child=PLANS.clear)

_CURRENT = selection.current_choice
_ENV_BACKEND = settings.watcher(selection.ENV_VAR)
# the lane map of the fragment API's emulation: a plan's kernels were rendered with one
_ENV_MMA_LAYOUT = settings.watcher(settings.Mma.layout.env)


def plan_key(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None = None,
             config: Mapping[str, int] | None = None) -> tuple:
    """The declared key of a plan, taken before the backend is resolved: the spec's token;
    what resolution reads (``backend=``, the ``use`` choice of this thread or task,
    $PORTAKERN_BACKEND, the registry's version; automatic selection also reads the operands'
    types, which are in the key); $PORTAKERN_MMA_LAYOUT (the emulated fragments' lane map);
    each operand's type, shape and dtype (positional, or by
    keyword); each parameter's name, type and value (types: True == 1, yet axis=True must be
    refused); the config overrides; and the tuning generation. So a repeated call never
    resolves its backend again.

    Raises AttributeError for an operand without shape/dtype (a list, a scalar): such a call
    is validated (and refused) without a plan; an unhashable part raises TypeError at lookup.
    A positional None (an optional operand left out, ``pk.call('attention', q, k, v, None)``)
    is a key entry of its own: such calls were once planned, and their kernels' launchers
    built, on every call (4 ms per attention call on a 2-core CPU)."""
    key: list[Any] = [spec.token, backend, _CURRENT(), _ENV_BACKEND(), _ENV_MMA_LAYOUT(),
                      registry.VERSION, configs.GENERATION]
    append = key.append
    for a in args:  # an absent optional operand passed as None is part of the key too
        append(None if a is None else (a.__class__, a.shape, a.dtype))
    if kwargs:
        names = spec._operand_names
        for k, v in kwargs.items():
            if v is None:
                append(k)  # a bare name: every other entry is a tuple
            elif k in names:
                append((k, v.__class__, v.shape, v.dtype))
            else:
                append((k, v.__class__, v))
    if config:
        append(tuple([(k, v.__class__, v) for k, v in config.items()]))
    return tuple(key)


def make_plan(be: Backend, spec: KernelSpec, arrays: Mapping[str, Any],
              params: Mapping[str, Any], config: Mapping[str, int] | None) -> Plan:
    """Validate the metadata, the dtype on ``be`` and the config overrides (no arrays are
    touched, nothing is compiled yet)."""
    gen = configs.GENERATION
    prob = spec.problem(arrays, params)
    be.check_dtype(spec, prob)
    cfg = dict(config) if config else None
    if cfg and isinstance(be, KernelBackend):  # the tunables' domains, the spec's own check
        spec.config(be.schedule_class, cfg, prob,  # (array backends check where they use it)
                    matrix=configs.has_matrix_unit(be))
    return Plan(spec, be, prob, cfg, gen)


def _check_config(spec: KernelSpec, config: Any) -> None:
    if config is not None and not isinstance(config, Mapping):
        raise InvalidArgumentError(
            f"{spec.name}: config must be a mapping of tunable names to ints, e.g. "
            f"{{'TM': 4}}; got {type(config).__name__} {str(config)[:60]!r}. Pass a dict.")


def _key(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
         backend: str | Backend | None, config: Mapping[str, int] | None
         ) -> tuple[tuple | None, Plan | None]:
    """(the plan key or None when uncacheable, the cached plan or None)."""
    try:
        key = plan_key(spec, args, kwargs, backend, config)
        return key, PLANS.lookup(key)
    except (AttributeError, TypeError):  # no shape/dtype, or unhashable: validate, no cache
        return None, None


def _planned(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None, config: Mapping[str, int] | None,
             key: tuple | None) -> tuple[Plan, dict[str, Any]]:
    """A new plan (cached under ``key`` unless None) and the bound operands."""
    try:
        be = selection.resolve(backend, args)
    except Exception:  # validation speaks first: a bad call never reaches a backend
        arrays, params = spec.bind(args, kwargs)
        spec.problem(arrays, params)
        raise
    _check_config(spec, config)
    arrays, params = spec.bind(args, kwargs)
    plan = make_plan(be, spec, arrays, params, config)
    plan.follows_inputs = selection.follows_inputs(backend, args)
    if key is not None:
        with _LOCK:
            PLANS[key] = plan
    return plan, arrays


def plan_for(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any], *,
             backend: str | Backend | None = None,
             config: Mapping[str, int] | None = None) -> Plan:
    """The plan a call ``spec(*args, **kwargs)`` uses (made, compiled and cached if absent):
    the benchmark launches its kernels raw (bench/dispatch.py); tests inspect it."""
    key, plan = _key(spec, args, kwargs, backend, config)
    if plan is None:
        plan, arrays = _planned(spec, args, kwargs, backend, config, key)
    else:
        arrays = _arrays(spec, args, kwargs)
    plan.compile(tuple(k for k, v in arrays.items() if v is not None))
    return plan


def dispatch(spec: KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any],
             backend: str | Backend | None, config: Mapping[str, int] | None, out: Any) -> Any:
    """Every call's one path: one lookup when repeated, then the plan's runner (or, for what
    it does not take, the backend's fully checked run)."""
    key: tuple | None
    plan: Plan | None
    if spec.check_values is not None:  # values no shape check sees (index tables)
        spec.check_values(_arrays(spec, args, kwargs))
    try:  # _key, inlined: this is every call's path
        key = plan_key(spec, args, kwargs, backend, config)
        plan = _LOOKUP(key)
    except (AttributeError, TypeError):  # no shape/dtype, or unhashable: validate, no cache
        key = plan = None
    if plan is not None:
        runner = plan.runner
        if runner is not None:
            got = runner(args, kwargs, out)
            if got is not _SLOW:
                return got
        if plan.follows_inputs and selection.resolve(None, args) is not plan.backend:
            # chosen by where the inputs lived, and now they live elsewhere: a plan for that
            # device replaces this one under the key, so the calls that follow are fast again
            plan, arrays = _planned(spec, args, kwargs, backend, config, key)
            res = execute.run(plan, arrays, out)
        else:
            res = execute.run(plan, _arrays(spec, args, kwargs), out)
    else:
        plan, arrays = _planned(spec, args, kwargs, backend, config, key)
        res = execute.run(plan, arrays, out)
    if key is not None and plan.runner is None and plan.steps:
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
    the backend offers no fast checks (``argument_checker``).

    Everything the plan fixes (shapes, dtypes, strides a contiguous operand has, the output
    and workspace sizes, which slot takes which buffer) was worked out when the plan was
    compiled; per call the runner runs the backend's checks of what can still differ: each
    operand's context, layout and buffer size, an ``out=``'s layout, writability and overlap
    with the inputs. Any check that does not pass sends the call to ``execute.run``
    (``_SLOW``), which repeats every check and raises the precise error, so the runner can
    only be faster, never more permissive. Calls with a keyword operand given (e.g.
    attention's mask) take that path too. The launches go through ``enqueue_steps``, the
    same loop as the checked path."""
    be, prob = plan.backend, plan.problem
    if not isinstance(be, KernelBackend) or not plan.steps or prob.empty_result:
        return None
    spec_names = plan.spec._operand_names
    given = [i for i, a in enumerate(args) if a is not None]  # positional Nones: left out
    if len(args) > len(spec_names) or tuple(plan.buffer_names[:len(given)]) != tuple(
            spec_names[i] for i in given):
        return None  # operands passed by keyword: the checked path binds them
    checks = []
    for i in given:
        a = args[i]
        c = be.argument_checker(tuple(a.shape), a.dtype)
        if c is None or c(a) is None:  # e.g. host operands: every call takes execute.run
            return None
        checks.append(c)
    kw_operands = tuple(k for k in kwargs if k in spec_names)
    if any(kwargs[k] is not None for k in kw_operands):
        return None
    outputs = [(tuple(shape), dt) for shape, dt in prob.output_specs.values()]
    out_checks: list[tuple[Callable[[Any], Any] | None, Any, tuple[int, ...]]] = []
    for shape, dt in outputs:
        # None: an out= array takes the checked path (calls without out= stay fast)
        out_checks.append((be.argument_checker(shape, storage_dtype(dt), writable=True),
                           storage_dtype(dt), shape))
    ws = [(int(n), dt) for n, dt in plan.workspace.values()]
    big = sum(n * storage_dtype(dt).itemsize for n, dt in ws) + sum(
        int(np.prod(shape, dtype=np.int64)) * storage_dtype(dt).itemsize
        for shape, dt in outputs)
    if big > _FAST_ALLOCATION_BYTES:
        return None  # memory is judged per call (execute.run's check_memory) for big calls
    if len(plan.buffer_names) != len(given) + len(outputs) + len(ws):
        return None
    empty, buffer_arg = be.empty, be.buffer_arg
    # tiny workspaces are made once per plan where the backend runs one call's launches as one
    # uninterrupted sequence on an in-order queue (no other call can run between its pack
    # kernel and the kernel that reads the packed copy); bigger ones are made per call
    fixed_ws: list[Any] = []
    if ws and sum(n * storage_dtype(dt).itemsize for n, dt in ws) <= _PLAN_WORKSPACE_BYTES \
            and be.in_order_queue:
        fixed_ws = [buffer_arg(empty((n,), dt)) for n, dt in ws]
        ws = []
    return _written_out(be, plan.programs, len(args), given, checks, kw_operands,
                        [be.output_maker(shape, dt) for shape, dt in outputs], out_checks,
                        fixed_ws, [be.output_maker((n,), dt) for n, dt in ws],
                        single=prob.outputs is None)


def _written_out(be: KernelBackend, programs: Sequence[Any], nargs: int, given: Sequence[int],
                 checks: Sequence[Callable[[Any], Any]], kw_operands: Sequence[str],
                 make_outs: Sequence[Callable[[], tuple[Any, Any]]],
                 out_checks: Sequence[tuple[Callable[[Any], Any] | None, Any, tuple[int, ...]]],
                 fixed_ws: Sequence[Any], make_ws: Sequence[Callable[[], tuple[Any, Any]]],
                 *, single: bool) -> Callable[[Sequence[Any], Mapping[str, Any], Any], Any]:
    """The runner of one plan, as Python source written out for its number of operands,
    keyword operands, outputs and workspaces (as ``collections.namedtuple`` and pyopencl's
    kernel invokers are): no loops, no list growing, no branch on what the plan fixed. Loops
    over these cost ~0.5 µs more per attention call, a sixth of what portakern adds to a
    launch. Every name in the source is an index; keyword operand names (identifiers of the
    spec) are quoted with repr. The source is the runner's ``__doc__``.

    Per call, in order: each operand's check (None: ``_SLOW``); a positional operand that
    was None when planned and is not now (``_SLOW``); a keyword operand given (``_SLOW``);
    the outputs, made (``make_out<j>``) or, for ``out=``, checked for this plan's dtype and
    shape, the backend's writable check and no overlap with any handle before it (handles
    compare equal exactly when they are one memory); the workspaces; then
    ``enqueue_steps`` with the handles in ``Plan.buffer_names`` order."""
    n, m = len(checks), len(make_outs)
    ins = [f"h{i}" for i in range(n)]
    src = ["def run(args, kwargs, out):"]
    if nargs:
        src.append(f"    {', '.join(f'x{i}' for i in range(nargs))}, = args")
    for j, i in enumerate(given):
        src += [f"    h{j} = check{j}(x{i})", f"    if h{j} is None:", "        return SLOW"]
    for i in sorted(set(range(nargs)) - set(given)):
        src += [f"    if x{i} is not None:", "        return SLOW"]
    for k in kw_operands:
        src += [f"    if kwargs[{k!r}] is not None:", "        return SLOW"]
    src.append("    if out is None:")
    src += [f"        o{j}, g{j} = make_out{j}()" for j in range(m)]
    src.append("    else:")
    if any(c is None for c, _, _ in out_checks):
        src.append("        return SLOW")  # the backend checks such out= on the checked path
    else:
        if single:
            src.append("        o0 = out")
        else:
            src += [f"        if out.__class__ is not tuple or len(out) != {m}:",
                    "            return SLOW",
                    f"        {', '.join(f'o{j}' for j in range(m))}, = out"]
        for j in range(m):
            before = ", ".join(ins + [f"g{i}" for i in range(j)])
            src += [f"        if o{j}.dtype != out_dtype{j} or tuple(o{j}.shape) != "
                    f"out_shape{j}:",
                    "            return SLOW",
                    f"        g{j} = out_check{j}(o{j})",
                    f"        if g{j} is None" + (f" or g{j} in ({before},)" if before else "")
                    + ":",
                    "            return SLOW"]
    handles = ins + [f"g{j}" for j in range(m)] + ["*fixed_ws"]
    handles += [f"make_ws{j}()[1]" for j in range(len(make_ws))]  # alive until enqueued
    src.append(f"    enqueue_steps(be, programs, [{', '.join(handles)}])")
    outs = [f"o{j}" for j in range(m)]
    src.append(f"    return {outs[0] if single else '(' + ', '.join(outs) + ',)'}")
    names: dict[str, Any] = {"SLOW": _SLOW, "be": be, "programs": tuple(programs),
                             "fixed_ws": tuple(fixed_ws), "enqueue_steps": enqueue_steps}
    names.update({f"check{i}": c for i, c in enumerate(checks)})
    names.update({f"make_out{j}": f for j, f in enumerate(make_outs)})
    names.update({f"make_ws{j}": f for j, f in enumerate(make_ws)})
    for j, (c, dt, shape) in enumerate(out_checks):
        names.update({f"out_check{j}": c, f"out_dtype{j}": dt, f"out_shape{j}": shape})
    text = "\n".join(src)
    exec(text, names)  # noqa: S102 - source built above from indices and repr'd names only
    run: Callable[[Sequence[Any], Mapping[str, Any], Any], Any] = names["run"]
    run.__doc__ = text
    return run


_FAST_ALLOCATION_BYTES = 1 << 24  # larger calls take the path that judges memory first
_PLAN_WORKSPACE_BYTES = 1 << 16  # at most this much workspace is kept by a plan
