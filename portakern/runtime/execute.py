"""The checked path of a call (runtime layer): what every backend's calls go through when the
planned runner (portakern.runtime.plan) does not take them: the first call of a plan, host operands,
and every call a runner's fast checks did not pass.

It checks, in order and before anything is uploaded or allocated: ``out=`` (native array of
the result's shape and dtype, writable, sharing no memory with an operand), every allocation
the call would make (the device's limits, the host budget), every host operand against the
shape and dtype validation saw (portakern.core.host); then uploads, runs and downloads. One place
for every backend, so none can forget a check. Backends supply only the primitives these
use (``is_native``, ``prepare_native``, ``memory_span``, ``check_writable``,
``check_device_buffers``, ``empty``/``zeros``, ``kernels_for``, ``launcher``, ...).

Also here: the ``Plan`` itself (what a call needs but its arrays; cached by runtime/plan.py),
its compilation into ``Step``s (a backend Program each, with its buffer slots: the kernel
configuration is chosen here, above the backends, by ``configs.config_for``), and
``enqueue_steps``, the one launch loop both this checked path and the planned runner use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend.base import ArrayBackend, Backend, KernelBackend, Program, Step, check_memory_limits
from ..core import dtypes
from ..core.errors import AliasingError, DTypeError, InvalidArgumentError, ShapeError
from ..core.host import check_host_memory, host_copy_bytes, host_operands
from ..core.spec import Buf, KernelSpec, Problem, Scalar, storage_dtype
from . import configs


@dataclass(eq=False)
class Plan:
    """What a call needs once its metadata were validated for one backend: everything but
    the arrays. ``steps`` are compiled at the plan's first run, after that call's checks
    passed (a refused call compiles nothing: ``compile``); they stay empty on array backends
    (numpy, jax: they evaluate the spec's semantics) and for an empty result. ``runner`` is
    the per-call code runtime/plan.py makes after the first run succeeded."""

    spec: KernelSpec
    backend: Backend
    problem: Problem
    config: dict[str, int] | None  # the caller's overrides (None: tuned or default)
    generation: int  # configs.GENERATION when planned
    compiled: bool = False
    steps: tuple[Step, ...] = ()  # the launches, in order
    workspace: dict[str, tuple[int, str]] = field(default_factory=dict)  # name: (n, dtype)
    # every buffer a launch may name, in the order handles are passed to ``enqueue_steps``:
    # the operands present (spec order), the outputs, the workspace
    buffer_names: tuple[str, ...] = ()
    programs: tuple[Program, ...] = ()  # the steps' programs, bound to buffer_names' slots
    runner: Callable[[Sequence[Any], Mapping[str, Any], Any], Any] | None = None
    follows_inputs: bool = False  # the backend was chosen by where the inputs live

    def compile(self, present: Sequence[str]) -> None:
        """Choose the kernel configuration (the caller's overrides, else the tuner's entry for
        this device and problem bucket, else the spec's schedule) and build the steps, once;
        ``present``: the names of the operands the call passes."""
        if self.compiled:
            return
        be, spec, prob = self.backend, self.spec, self.problem
        if isinstance(be, KernelBackend) and not prob.empty_result:
            cfg = configs.config_for(be, spec, prob, self.config)
            self.steps, self.workspace, self.buffer_names = build_steps(be, spec, prob, cfg,
                                                                        present)
            self.programs = tuple(s.program for s in self.steps)
        self.compiled = True


def enqueue_steps(be: KernelBackend, programs: Sequence[Program], handles: Sequence[Any]
                  ) -> None:
    """The one launch loop: every program of a plan called with the call's buffer handles
    (kernel arguments in ``Plan.buffer_names`` order; each program takes its own slots), all
    under the backend's lock, so one call's launches stay together on an in-order queue."""
    with be.launch_lock:
        for program in programs:
            program(handles)


def run(plan: Plan, arrays: Mapping[str, Any], out: Any = None) -> Any:
    """Execute a call planned by portakern.runtime.plan (``plan``: a Plan, whose problem was
    validated and dtype-checked for this backend). numpy in -> numpy out; native in ->
    native out.

    ``out``: a native, contiguous array of the result's shape and dtype to write into
    (C-kernel backends), which saves the allocation on a hot path.

    Every non-native operand is checked against the shape/dtype validation saw
    (portakern.core.host), all of them before anything is uploaded: one place for every
    backend, so none can forget it."""
    be = plan.backend
    with be.device_scope():
        res = _run(be, plan, arrays, out)
    if res.__class__ is np.ndarray:
        return _as_dtype(res, plan.problem.dtype)
    if res.__class__ is tuple:
        specs = plan.problem.output_specs.values()
        return tuple(_as_dtype(r, dt) if r.__class__ is np.ndarray else r
                     for r, (_, dt) in zip(res, specs))
    return res


def _as_dtype(res: np.ndarray, dtype: str) -> np.ndarray:
    """A host result whose array library lacks the dtype and stored the same bits as unsigned
    integers of its size (an old CuPy's bfloat16 as uint16) is viewed back, never converted."""
    want = storage_dtype(dtype)
    if res.dtype != want and res.dtype.kind == "u" and res.dtype.itemsize == want.itemsize:
        return res.view(want)
    return res


def _run(be: Backend, plan: Plan, arrays: Mapping[str, Any], out: Any) -> Any:
    spec, prob = plan.spec, plan.problem
    is_native = be.is_native
    present: dict[str, Any] = {}
    native_out, all_native = False, True
    for k, v in arrays.items():  # one pass: the all-native call is the hot path
        if v is not None:
            present[k] = v
            if is_native(v):
                native_out = True
            else:
                all_native = False
    if out is not None:
        check_out(be, spec, prob, out)
        check_no_alias(be, spec, out, present.items())
        native_out = True
    check_memory(be, spec, prob, present, out)
    if not all_native:
        present = dict(checked_host_operands(be, present))
    if prob.empty_result:
        if out is not None:
            for o in (out if out.__class__ is tuple else (out,)):
                be.fill_zero(o)
            return out
        if prob.outputs is None:
            res = be.zeros(prob.out_shape, prob.dtype)
        else:
            res = tuple(be.zeros(s, d) for s, d in prob.outputs.values())
    else:
        as_input = be.as_input
        ins = {k: as_input(k, v) for k, v in present.items()}
        res = execute_plan(be, plan, ins, out)
    if native_out:
        return res
    if res.__class__ is tuple:  # several outputs: numpy in -> a tuple of numpy out
        return tuple(be.to_numpy(r) for r in res)
    return be.to_numpy(res)


def check_memory(be: Backend, spec: KernelSpec, prob: Problem, present: Mapping[str, Any],
                 out: Any) -> None:
    """Every allocation a call would make, sized from the shapes and judged before any is
    made: the device's own limits (``check_device_buffers``), then the host budget
    (portakern.core.host) for host copies, plus the device buffers when the device's memory
    is host memory (a CPU device)."""
    try:
        dev = be.device_buffers(spec, prob, present, out)
        host = [(f"host copy of {k!r}", host_copy_bytes(v)) for k, v in present.items()
                if not be.is_native(v)]
    except (TypeError, ValueError, AttributeError):
        return  # an operand without a real shape: host_operand refuses it next
    check_memory_limits(be, spec, dev)
    if be.device.kind == "cpu":
        host += dev
    check_host_memory(f"{spec.name} on {be.label}", host)


def checked_host_operands(be: Backend, arrays: Mapping[str, Any]) -> Mapping[str, Any]:
    """Non-native operands replaced by their checked host arrays (see ``run``)."""
    return host_operands(arrays, be.is_native)


def check_out(be: Backend, spec: KernelSpec, prob: Problem, out: Any) -> None:
    if not be.supports_out:
        raise InvalidArgumentError(f"{spec.name}: out= is not supported on {be.describe()}"
                                   " (its arrays are immutable or it has no C kernels); "
                                   "drop out= and use the returned array.")
    if prob.outputs is not None:
        check_outs(be, spec, prob, out)
        return
    if not be.is_native(out):
        raise InvalidArgumentError(f"{spec.name}: out= must be a {be.name} device array; "
                                   f"got {type(out).__name__}. Create it on this backend.")
    if tuple(out.shape) != tuple(prob.out_shape):
        raise ShapeError(f"{spec.name}: out= has shape {tuple(out.shape)}; expected "
                         f"{tuple(prob.out_shape)}.")
    # the plain dtype comparison is the hot path; the canonical name settles the rest
    if out.dtype != prob.info.storage and dtypes.dtype_name(out.dtype) != prob.dtype:
        raise DTypeError(f"{spec.name}: out= has dtype {dtypes.dtype_name(out.dtype)}; "
                         f"expected {prob.dtype}.")
    be.prepare_native("out", out)
    be.check_writable(spec, out)


def check_outs(be: Backend, spec: KernelSpec, prob: Problem, out: Any) -> None:
    """``out=`` of a several-output op: a tuple with one native array per output, in the
    order of ``prob.outputs``, each of its shape and dtype, writable, no two overlapping."""
    names = tuple(prob.outputs or ())
    if out.__class__ is not tuple or len(out) != len(names):
        raise InvalidArgumentError(
            f"{spec.name}: out= must be a tuple of {len(names)} {be.name} device arrays, "
            f"one per output ({', '.join(names)}); got {type(out).__name__}"
            + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "") + ".")
    for name, o in zip(names, out):
        shape, dt = prob.output_specs[name]
        if not be.is_native(o):
            raise InvalidArgumentError(
                f"{spec.name}: out= entry {name!r} must be a {be.name} device array; got "
                f"{type(o).__name__}. Create it on this backend.")
        if tuple(o.shape) != tuple(shape):
            raise ShapeError(f"{spec.name}: out= entry {name!r} has shape {tuple(o.shape)}; "
                             f"expected {tuple(shape)}.")
        if dtypes.dtype_name(o.dtype) != dt:
            raise DTypeError(f"{spec.name}: out= entry {name!r} has dtype "
                             f"{dtypes.dtype_name(o.dtype)}; expected {dt}.")
        be.prepare_native(name, o)
        be.check_writable(spec, o)
    for i in range(1, len(out)):  # outputs written by one call must not share memory
        check_no_alias(be, spec, out[i],
                            [(f"out= entry {names[j]!r}", out[j]) for j in range(i)])


def check_no_alias(be: Backend, spec: KernelSpec, out: Any, operands: Any) -> None:
    """Refuse ``out=`` that shares memory with any native operand: kernels read their
    inputs while they write, so an overlap gives silently wrong results (none of
    portakern's ops is documented to work in place). A tuple ``out`` (several outputs):
    each entry."""
    if out.__class__ is tuple:
        for o in out:
            check_no_alias(be, spec, o, operands)
        return
    span = be.memory_span(out)
    if span is None:
        return
    for name, x in operands:
        if x is None or not be.is_native(x):
            continue  # a host operand is copied before upload: it cannot alias
        other = be.memory_span(x)
        if other is None:
            continue
        if other[0] == span[0] and other[1] < span[2] and span[1] < other[2]:
            raise AliasingError(
                f"{spec.name}: out= overlaps input {name!r} (bytes {other[1] - span[1]:+d}"
                f" relative to out=, {other[2] - other[1]} bytes long); the kernel would "
                "read what it has already overwritten, a silently wrong result. Expected "
                "an out= array that shares no memory with any input: allocate a separate "
                "one, or drop out= and use the returned array.")


def execute_plan(be: Backend, plan: Plan, ins: dict[str, Any], out: Any) -> Any:
    """Run a plan on checked native operands ``ins``: a C-kernel backend launches the plan's
    steps (compiled at the plan's first run, after that call's checks passed); an array
    backend (numpy, jax; no ``out=``) evaluates the spec's semantics through ``execute``."""
    if isinstance(be, ArrayBackend):
        return be.execute(plan.spec, plan.problem, ins, plan.config)
    assert isinstance(be, KernelBackend)
    plan.compile(tuple(ins))
    prob = plan.problem
    bufs = dict(ins)
    if prob.outputs is None:
        if out is None:
            out = be.empty(prob.out_shape, prob.dtype)
        bufs["out"] = out
    else:  # several outputs, each its own buffer by name; returned as a tuple
        if out is None:
            out = tuple([be.empty(shape, dt) for shape, dt in prob.outputs.values()])
        bufs.update(zip(prob.outputs, out))
    for name, (n, dt) in plan.workspace.items():  # per call: calls may run at once
        bufs[name] = be.empty((n,), dt)
    buffer_arg = be.buffer_arg
    enqueue_steps(be, plan.programs, [buffer_arg(bufs[n]) for n in plan.buffer_names])
    return out


def scalar(s: Scalar, prob: Problem) -> Any:
    if s.ctype == "int":
        return np.int32(s.value)
    if s.ctype == "acc":
        return prob.info.compute.type(s.value)
    raise InvalidArgumentError(f"unknown scalar ctype {s.ctype!r}; expected 'int' or 'acc'.")


def build_steps(be: KernelBackend, spec: KernelSpec, prob: Problem, cfg: Mapping[str, int],
                present: Sequence[str]
                ) -> tuple[tuple[Step, ...], dict[str, tuple[int, str]], tuple[str, ...]]:
    """Compiled kernels + launch geometry + packed scalar arguments for a problem and a
    complete kernel configuration ``cfg``, once per plan: the steps (a backend Program each,
    its scalars and buffer slots bound once), the workspace buffers {name: (elements,
    dtype)} and the buffer names, in the order a call passes their handles: the operands
    ``present`` (spec order), the outputs, the workspace."""
    kernels = be.kernels_for(spec, prob, cfg)
    workspace: dict[str, tuple[int, str]] = {}
    if spec.workspace is not None:
        workspace = {k: (int(n), str(dt)) for k, (n, dt) in spec.workspace(prob, cfg).items()}
    names = [n for n in spec._operand_names if n in present]
    names += list(prob.output_specs) if prob.outputs is not None else ["out"]
    names += list(workspace)
    index = {n: i for i, n in enumerate(names)}
    steps = []
    for launch in spec.launches(prob, cfg):
        wg = launch.local[0] * launch.local[1] * launch.local[2]
        if wg > be.device.max_work_group_size:
            raise InvalidArgumentError(
                f"{spec.name}: work-group of {wg} items ({launch.local}) exceeds "
                f"{be.device.max_work_group_size} on {be.describe()}; lower the tunables.")
        template = tuple(a.name if isinstance(a, Buf) else scalar(a, prob) for a in launch.args)
        kernel = kernels[launch.kernel]
        slots = tuple(a for a in template if a.__class__ is str)
        try:
            indices = [index[n] for n in slots]
        except KeyError as exc:
            raise InvalidArgumentError(
                f"{spec.name}: launch {launch.kernel!r} names buffer {exc.args[0]!r}, which is "
                f"neither an operand passed, an output nor a workspace ({', '.join(names)}); "
                "fix the spec's launches or workspace.") from None
        steps.append(Step(be.program(kernel, launch, template, indices), slots, kernel,
                          launch, template))
    return tuple(steps), workspace, tuple(names)
