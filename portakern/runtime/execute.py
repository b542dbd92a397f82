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

Also here: ``build_launches``, which turns a plan's problem and kernel configuration into
compiled kernels, geometry and packed scalar arguments (``LaunchPlan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..backends.base import Backend, KernelBackend, LaunchPlan
from ..core import dtypes
from ..core.errors import AliasingError, DTypeError, InvalidArgumentError, ShapeError
from ..core.host import check_host_memory, host_copy_bytes, host_operands
from ..core.spec import Buf, KernelSpec, Problem, Scalar, storage_dtype


def run(plan: Any, arrays: Mapping[str, Any], out: Any = None) -> Any:
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


def _run(be: Backend, plan: Any, arrays: Mapping[str, Any], out: Any) -> Any:
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
    be.check_device_buffers(spec, dev)
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
        shape, dt = prob.outputs[name]  # type: ignore[index]
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


def execute_plan(be: Backend, plan: Any, ins: dict[str, Any], out: Any) -> Any:
    """Run a plan on checked native operands ``ins``: a C-kernel backend launches the plan's
    kernels (compiled at the plan's first run, after that call's checks passed:
    ``plan.compile()``, where the Plan layer chooses the configuration); an array backend
    (numpy, jax; no ``out=``) evaluates the spec's semantics through its ``execute``."""
    if not isinstance(be, KernelBackend):
        return be.execute(plan.spec, plan.problem, ins, plan.config)
    launches = plan.launches
    if launches is None:
        launches = plan.compile()
    return launch(be, launches, dict(ins), out, plan.problem)


def scalar(s: Scalar, prob: Problem) -> Any:
    if s.ctype == "int":
        return np.int32(s.value)
    if s.ctype == "acc":
        return prob.info.compute.type(s.value)
    raise InvalidArgumentError(f"unknown scalar ctype {s.ctype!r}; expected 'int' or 'acc'.")


def launch(be: KernelBackend, plan: LaunchPlan, bufs: dict[str, Any], out: Any,
           prob: Problem) -> Any:
    """Enqueue a plan's kernels on ``bufs`` (operands by name, filled in with ``out`` and
    the workspace); return the output array."""
    outputs = prob.outputs
    if outputs is None:
        if out is None:
            out = be.empty(prob.out_shape, prob.dtype)
        bufs["out"] = out
    else:  # several outputs, each its own buffer by name; returned as a tuple
        if out is None:
            out = tuple([be.empty(shape, dt) for shape, dt in outputs.values()])
        bufs.update(zip(outputs, out))
    if plan.workspace:
        for name, (n, dt) in plan.workspace.items():  # per call: calls may run at once
            bufs[name] = be.empty((n,), dt)
    buffer_arg = be.buffer_arg
    for launcher, template, slots in plan.steps:
        args = template.copy()
        for i, name in slots:
            args[i] = buffer_arg(bufs[name])
        launcher(args)
    return out


def build_launches(be: KernelBackend, spec: KernelSpec, prob: Problem,
                   cfg: Mapping[str, int]) -> LaunchPlan:
    """Compiled kernels + launch geometry + packed scalar arguments for a problem and a
    complete kernel configuration ``cfg`` (the Plan layer's choice: tuned.config_for),
    once per plan: a repeated call skips rendering, config lookups and argument packing."""
    kernels = be.kernels_for(spec, prob, cfg)
    plan = LaunchPlan()
    if spec.workspace is not None:
        plan.workspace = {k: (int(n), str(dt)) for k, (n, dt)
                          in spec.workspace(prob, cfg).items()}
    for launch in spec.launches(prob, cfg):
        wg = launch.local[0] * launch.local[1] * launch.local[2]
        if wg > be.device.max_work_group_size:
            raise InvalidArgumentError(
                f"{spec.name}: work-group of {wg} items ({launch.local}) exceeds "
                f"{be.device.max_work_group_size} on {be.describe()}; lower the tunables.")
        template = [a.name if isinstance(a, Buf) else scalar(a, prob) for a in launch.args]
        kernel = kernels[launch.kernel]
        be.declare_arguments(kernel, template)
        plan.add(kernel, launch, template, be.launcher(kernel, launch))
    return plan
