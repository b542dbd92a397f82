"""What a spec gets from its fields alone: checks at registration, an example problem, and a
case generator derived from its shape family.

Why here and not in each op: a user writing a KernelSpec should learn about a malformed field
when they register it — with the spec, the field and the fix named — not from a traceback
deep inside a backend on some other machine. ``check_registered`` is what
``register_op(check=True)`` runs:

* always (pure Python, milliseconds): names, operands, parameters, required callables, the
  semantics' signature, tunables and every schedule against their domains, and — on the
  example problem of each dtype — slots, defines, launches (every entry point they name must be
  defined in ``source`` with ``PK_KERNEL void name(``), cost, and the semantics' output shape;
* with ``check=True`` also: the example problem compiled on every available C-kernel backend
  (every device, every dtype it supports, both schedules), through NVRTC for CUDA when the cuda
  backend cannot run here but NVRTC is importable, the semantics traced by jax.numpy, and a
  few cases of the spec's own generator (``cases``, else the derived one) per dtype run
  against the float64 oracle: each must be accepted by validate and the oracle's result,
  rounded to the op's dtype (the numpy backend), must pass the spec's own tolerance.

Several outputs (``Problem.outputs``), int32 operands and int parameters go through all of
these like any other spec: each output is traced, shaped and judged on its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..core import dtypes
from ..core import spec_checks as _core
from ..core.errors import CompileError, SpecError
from ..core.spec import KernelSpec, Problem
from ..core.spec_checks import (
    derived_cases,
    spec_error,
)
from ..toolchains import CompileOnlyTarget


def check_registered(spec: KernelSpec, *, compile: bool = False) -> None:
    """``core.spec_checks.check_spec`` (the static checks), and with ``compile=True`` also
    the example compiled on every available C-kernel backend and NVRTC and the semantics
    traced by jax."""
    problems = _core.check_spec(spec)
    first = next(iter(problems.values()), None)
    if compile and first is not None:
        compile_everywhere(spec, problems)
        _trace_with_jax(spec, first)
    if compile:
        check_cases(spec, problems)


# --- compiling at registration ---------------------------------------------------------------
def compile_everywhere(spec: KernelSpec, problems: Mapping[str, Problem]) -> list[str]:
    """Compile the example on every available C-kernel backend (and NVRTC); returns what ran.

    Each device compiles every dtype it supports under every schedule, with the options it
    runs with; the programs stay in the backend's kernel cache, so the first real call is warm.
    """
    from ..backend import registry
    from ..backend.base import KernelBackend
    from ..runtime import selection

    done: list[str] = []
    dialects_ran: set[str] = set()
    for bname in registry.names():
        cls = registry.load(bname)
        if not (isinstance(cls, type) and issubclass(cls, KernelBackend)):
            continue
        if not cls.probe().available:
            continue
        for target in cls.test_targets():
            be = selection.get(target)
            for dt, prob in problems.items():
                if dt not in be.supported_dtypes() or prob.empty_result:
                    continue
                for sched in sorted(spec.schedules) or ["gpu"]:
                    cfg = spec.config(sched, None, prob)
                    try:
                        be.kernels_for(spec, prob, cfg)
                    except CompileError as exc:
                        raise _compile_failure(spec, be.describe(), dt, sched, cfg, exc) from exc
            done.append(be.describe())
            dialects_ran.add(str(cls.dialect))
    from .. import toolchains  # compile-only covers its dialect if no device ran it

    target = toolchains.get(toolchains.DEFAULT)
    if target.dialect not in dialects_ran:
        done += _compile_only(target, spec, problems)
    return done


def _compile_failure(spec: KernelSpec, where: str, dtype: str, sched: str,
                     cfg: Mapping[str, int], exc: CompileError) -> SpecError:
    return spec_error(spec.name, "source", f"does not compile on {where} (dtype {dtype}, "
                      f"schedule {sched} {dict(cfg)}); compiler log:\n{exc.log.strip()}\n"
                      "(end of log)",
                      "correct the kernel; the numbered rendered source is in this error's "
                      "__cause__ (a CompileError), and `portakern show` prints it once the op is "
                      "registered with check=False")


def _compile_only(target: CompileOnlyTarget, spec: KernelSpec,
                  problems: Mapping[str, Problem]) -> list[str]:
    """A dialect without its device (CUDA through NVRTC): the compile-only target compiles the
    source for its oldest default architecture (what compiles there compiles on newer ones);
    skipped when its toolchain is not installed."""
    try:
        target.toolchain()
        archs = [a for a in target.default_archs if not target.refusal(a)]
    except Exception:  # toolchain missing or unloadable: nothing to compile with here
        return []
    if not archs:
        return []
    arch = archs[0]
    where = f"{target.compiler.upper()} {target.compile_label(arch)}"
    for dt, prob in problems.items():
        if prob.empty_result:
            continue
        for sched in sorted(spec.schedules) or ["gpu"]:
            cfg = spec.config(sched, None, prob)
            src = spec.render(target.dialect, prob, cfg)
            got = target.compile(src, arch, None, f"{spec.name}{target.suffix}")
            err = got.error(src)
            if err is not None:
                raise _compile_failure(spec, where, dt, sched, cfg, err) from err
    return [where]


def _trace_with_jax(spec: KernelSpec, prob: Problem) -> None:
    """The semantics must trace under jax.numpy (no in-place writes, no numpy-only calls) and
    give every output its declared shape."""
    from ..backend import registry

    try:
        if not registry.availability("jax").available:
            return
        import jax

        from ..backend.jax import lower_semantics
    except Exception:
        return
    if prob.empty_result:
        return
    st = dtypes.info(prob.dtype).storage
    kind_dtype = {"bool": bool, "int32": np.int32, "acc": dtypes.info(prob.dtype).compute,
                  "float32": np.float32}
    structs = [None if prob.shapes.get(o.name) is None else jax.ShapeDtypeStruct(
        prob.shapes[o.name], kind_dtype.get(o.kind, st)) for o in spec.operands]
    out_dtypes = None if prob.outputs is None else tuple(d for _, d in prob.outputs.values())
    try:
        out = jax.eval_shape(lower_semantics(spec, prob.params, prob.dtype, out_dtypes),
                             *structs)
    except Exception as exc:
        raise spec_error(spec.name, "semantics", f"does not trace with jax.numpy as xp "
                         f"({type(exc).__name__}: {exc})", "use only xp.* array-API calls: no "
                         "in-place assignment, no np.* calls, no Python branches on values; "
                         "with several outputs return a tuple, one array per output"
                         ) from exc
    outs = (out,) if prob.outputs is None else tuple(out)
    for (name, (shape, _)), o in zip(prob.output_specs.items(), outs):
        if tuple(o.shape) != tuple(shape):
            what = "out_shape" if prob.outputs is None else f"output {name!r} of shape"
            raise spec_error(spec.name, "semantics", f"gives shape {tuple(o.shape)} under jax; "
                             f"validate promises {what} {tuple(shape)}",
                             "make the semantics and validate's out_shape/outputs agree")


# --- the spec's cases against the oracle -----------------------------------------------------
CASES_PER_DTYPE = 3  # cases drawn per dtype at registration (check=True): small, seeded


def check_cases(spec: KernelSpec, problems: Mapping[str, Problem],
                per_dtype: int = CASES_PER_DTYPE) -> int:
    """Draw ``per_dtype`` cases per dtype the op takes from the spec's own generator
    (``cases``, else the one derived from ``shapes``/``example``) and hold the float64
    oracle's result, rounded to the dtype (the numpy backend), to the spec's own tolerance.

    What it catches at registration, not in a conformance run on another machine: a generator
    that raises or draws calls validate refuses (e.g. an index table that is not int32), a
    semantics whose outputs disagree with validate's, and a tolerance too tight to hold even
    the correctly rounded answer (a missing output-rounding term). Returns the cases run."""
    from ..api import call
    from ..core.sampling import NumpyChooser
    from .cases import compare

    gen = spec.cases if spec.cases is not None else derived_cases(spec)
    if gen is None:
        return 0
    ran = 0
    for dt in problems:
        for i in range(per_dtype):
            ch = NumpyChooser(np.random.default_rng([i, len(dt), 0x5EC]))
            try:
                case = gen(ch, dt)
                arrays, params = spec.bind((), {**case.arrays, **case.params})
                spec.problem(arrays, params)
            except Exception as exc:
                raise spec_error(spec.name, "cases", f"{dt} case {i} drawn by the generator was "
                                 f"refused: {type(exc).__name__}: {exc}",
                                 "make cases(chooser, dtype) return Case({operand: array}, "
                                 "{param: value}) that validate accepts: arrays in the op's "
                                 "dtype, int32 index tables as int32 with valid indices") from exc
            got = call(spec, backend="numpy", **case.arrays, **case.params)
            v = compare(spec, case, got)
            if not v.ok:
                raise spec_error(spec.name, "tolerance", f"the float64 oracle rounded to {dt} "
                                 f"fails the spec's own bound on {case.describe()}: "
                                 f"{v.where}\n{v}", "include the output's rounding "
                                 "(p.info.unit_roundoff * |ref|) and an underflow floor in "
                                 "each bound; see portakern/ops/rmsnorm.py")
            ran += 1
    return ran

