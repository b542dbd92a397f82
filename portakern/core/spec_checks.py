"""What a spec gets from its fields alone: checks at registration, an example problem, and a
case generator derived from its shape family (core layer: pure Python, no backend).

Why here and not in each op: a user writing a KernelSpec should learn about a malformed field
when they register it — with the spec, the field and the fix named — not from a traceback
deep inside a backend on some other machine. ``check_spec`` is what ``register_op`` runs
(milliseconds): names, operands, parameters, required callables, the semantics' signature,
tunables and every schedule against their domains, and — on the example problem of each
dtype — slots, defines, launches (every entry point they name must be defined in ``source``
with ``PK_KERNEL void name(``, or ``PK_KERNEL PK_LAUNCH_BOUNDS(n, m) void name(``), cost, the
semantics' output shape and the statistical model's form; each ``examples`` call validated and
checked the same way. Several outputs
(``Problem.outputs``), int32 operands and int32 workspaces are checked like the rest: each
output named, shaped and typed, the semantics returning one array per output, ``tolerance``
one bound per output (``output_bounds``). Compiling the example everywhere and running the
spec's cases against the oracle (``register_op(check=True)``) is a tool: tools/registration.py.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import codegen, dtypes
from .errors import DTypeError, PortakernError, SpecError
from .sampling import EDGE_SIZES, Case, Chooser
from .spec import ArrayMeta, Buf, Cost, KernelSpec, Launch, Problem, Scalar, Tunable

# PK_KERNEL [PK_LAUNCH_BOUNDS(n, m)] void name(  -- the bounds' arguments may hold one level
# of parentheses, e.g. PK_LAUNCH_BOUNDS((LX * LY), 2)
ENTRY_POINT = re.compile(r"PK_KERNEL\s+(?:PK_MMA_KERNEL_ATTR\s+)?"
                         r"(?:PK_LAUNCH_BOUNDS\s*\((?:[^()]|\([^()]*\))*\)\s*)?"
                         r"void\s+([A-Za-z_]\w*)\s*\(")
RESERVED_PARAMS = ("backend", "config")  # keywords of portakern.call itself
REQUIRED_CALLABLES = ("validate", "semantics", "slots", "defines", "launches", "cost",
                      "tolerance")
OPTIONAL_CALLABLES = ("config_check", "pallas", "example", "examples", "cases", "statistical",
                      "statistical_ordered")
# the derived generator's sizes: last axes (where kernels tile) from the edge list, other axes
# small so that rank-3 and rank-4 families stay cheap on a 2-core CPU
SMALL_SIZES = (1, 2, 3, 5, 8, 17)
# the derived example's sizes: last axes long, other axes a few
EXAMPLE_LAST, EXAMPLE_OTHER = 1024, 8
MAX_EVAL_ELEMENTS = 1 << 22  # evaluate semantics at registration only on examples this small
# ... and the statistical model only on examples of at most this many flops (spec.cost): a
# model may do work like the op's own in float64 numpy (matmul's: every product, K per output)
MAX_EVAL_FLOPS = 1 << 26


def spec_error(spec: str, field: str, what: str, fix: str) -> SpecError:
    """The one message format: which spec, which field, what is wrong, how to fix it."""
    what, fix = what.rstrip().rstrip("."), fix.rstrip().rstrip(".")
    return SpecError(f"spec {spec!r}, field `{field}`: {what}. Fix: {fix}.")


def kernel_names(source: str) -> list[str]:
    """Entry points a source defines (``PK_KERNEL void name(``, the fragment API's kernel
    attribute and launch bounds allowed between PK_KERNEL and void), in order of appearance."""
    return ENTRY_POINT.findall(source)


# --- shape families and examples -----------------------------------------------------------
def shape_family(spec: KernelSpec) -> dict[str, tuple[str | int, ...]] | None:
    """The ``shapes`` hint normalised: operand -> dims (a size name or a fixed int)."""
    if spec.shapes is None:
        return None
    out: dict[str, tuple[str | int, ...]] = {}
    for op, dims in spec.shapes.items():
        items = dims.replace(",", " ").split() if isinstance(dims, str) else list(dims)
        out[op] = tuple(int(d) if isinstance(d, str) and d.isdigit() else d for d in items)
    return out


def _family_from_example(spec: KernelSpec, dtype: str) -> dict[str, tuple[str | int, ...]]:
    """No hint: the example's shapes, dims of equal size tied (size 1 stays a fixed 1)."""
    assert spec.example is not None
    arrays, _ = spec.example(dtype)
    return {name: tuple(1 if int(s) == 1 else f"d{int(s)}" for s in a.shape)
            for name, a in arrays.items() if a is not None}


def _last_dims(family: Mapping[str, tuple[str | int, ...]]) -> set[str]:
    return {dims[-1] for dims in family.values() if dims and isinstance(dims[-1], str)}


def example_inputs(spec: KernelSpec, dtype: str, sizes: Mapping[str, int] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A typical call as (operand stand-ins, params): ``example``, else from ``shapes``
    (``sizes`` overrides size names, e.g. {"n": 4096}); None when the spec gives neither."""
    st = dtypes.info(dtype).name
    if spec.example is not None:
        given, given_params = spec.example(st)
        return dict(given), dict(given_params)
    family = shape_family(spec)
    if family is None:
        return None
    last = _last_dims(family)
    arrays: dict[str, Any] = {}
    for op in spec.operands:
        dims = family.get(op.name)
        if dims is None:
            arrays[op.name] = None
            continue
        shape = tuple(d if isinstance(d, int) else int((sizes or {}).get(
            d, EXAMPLE_LAST if d in last else EXAMPLE_OTHER)) for d in dims)
        arrays[op.name] = ArrayMeta(shape, op.kind if op.kind in ("bool", "int32", "float32") else
                                    dtypes.compute_dtype_name(st) if op.kind == "acc" else st)
    return arrays, dict(spec.params)


def example_problem(spec: KernelSpec, dtype: str) -> Problem | None:
    """The validated Problem of ``example_inputs`` (None when the spec gives no example)."""
    got = example_inputs(spec, dtype)
    if got is None:
        return None
    arrays, params = spec.bind((), {**got[0], **got[1]})
    return spec.problem(arrays, params)


# --- the derived case generator ------------------------------------------------------------
def derived_cases(spec: KernelSpec) -> Callable[[Chooser, str], Case] | None:
    """A case generator from the shape family (``shapes``, else the example's shapes).

    Size names on a last axis are drawn from core.sampling.EDGE_SIZES (1, primes, tile sizes
    +- 1), other size names from a short list; float operands are standard normal at a scale of
    1, 1e-3 or 30 (4 for float16), bool operands ~70% True, optional operands present half the
    time; parameters keep their defaults (write ``cases`` to vary them). None when the spec
    has neither ``shapes`` nor ``example``, and when it has an int32 operand: only the op knows
    which index values are valid, so such a spec brings its own ``cases``.
    """
    hint = shape_family(spec)
    if (hint is None and spec.example is None) or int32_operands(spec):
        return None

    def generate(ch: Chooser, dtype: str) -> Case:
        family = hint if hint is not None else _family_from_example(spec, dtype)
        last = _last_dims(family)
        names = sorted({d for dims in family.values() for d in dims if isinstance(d, str)})
        size = {d: ch.choice(EDGE_SIZES if d in last else SMALL_SIZES) for d in names}
        rng = np.random.default_rng(ch.seed())
        kind = ch.choice(("normal", "normal", "small", "large"))
        scale = {"normal": 1.0, "small": 1e-3,
                 "large": 4.0 if dtype == "float16" else 30.0}[kind]
        arrays: dict[str, np.ndarray | None] = {}
        for op in spec.operands:
            dims = family.get(op.name)
            if dims is None or (op.optional and ch.boolean(0.5)):
                arrays[op.name] = None
                continue
            shape = tuple(d if isinstance(d, int) else size[d] for d in dims)
            if op.kind == "bool":
                arrays[op.name] = rng.random(shape) < 0.7
            else:
                arrays[op.name] = dtypes.cast_to(rng.standard_normal(shape) * scale, dtype)
        note = "derived: " + " ".join(f"{k}={v}" for k, v in size.items()) + f" {kind}"
        return Case(arrays, dict(spec.params), note)

    return generate


def int32_operands(spec: KernelSpec) -> list[str]:
    """The names of a spec's int32 operands (index tables)."""
    return [o.name for o in spec.operands if getattr(o, "kind", None) == "int32"]


def no_generator_reason(spec: KernelSpec) -> str:
    """Why a spec has no case generator, and the fix (for `portakern check` and the tests)."""
    ints = int32_operands(spec)
    if ints:
        return (f"op {spec.name} has int32 operands {ints}, whose valid values only the op "
                "knows, and no `cases`: give its KernelSpec `cases=` (a generator drawing valid "
                "indices) or call portakern.register_cases")
    return (f"op {spec.name} has no case generator; give its KernelSpec `cases`, `shapes` or "
            "`example`")


# --- several outputs: one bound per output ---------------------------------------------------
OUTPUT_DTYPES = (*dtypes.FLOAT_DTYPES, "int32")


def output_bounds(spec: str, outputs: Mapping[str, tuple[tuple[int, ...], str]],
                  bounds: Any) -> tuple[Any, ...]:
    """A several-output spec's ``tolerance`` result as one bound per output, in output order.

    ``tolerance(p, inputs64, refs)`` gets the oracle's tuple and may return a tuple (or list)
    with one entry per output in the order of ``Problem.outputs``, a dict {output name:
    bound}, or one bound for every output. An entry is an array broadcasting to its output, a
    number, or None: exact (no error allowed). An int32 output is always judged exactly,
    whatever its entry (it may be left out of a dict). Raises SpecError naming the spec, what
    was returned and the fix."""
    names = tuple(outputs)
    fix = (f"return a tuple of {len(names)} bounds in the order {names} (None for an exact "
           "output), a dict {output name: bound}, or one bound for all of them")
    if isinstance(bounds, Mapping):
        unknown = sorted(set(bounds) - set(names))
        missing = [n for n in names if n not in bounds and outputs[n][1] != "int32"]
        if unknown or missing:
            raise spec_error(spec, "tolerance", f"returns bounds for {sorted(bounds)}; the "
                             f"outputs are {list(names)} (unknown: {unknown}, missing: "
                             f"{missing})", fix)
        got = tuple(bounds.get(n) for n in names)
    elif isinstance(bounds, (tuple, list)):
        if len(bounds) != len(names):
            raise spec_error(spec, "tolerance", f"returns {len(bounds)} bounds for "
                             f"{len(names)} outputs {list(names)}", fix)
        got = tuple(bounds)
    else:
        got = (bounds,) * len(names)
    return tuple(None if outputs[n][1] == "int32" else b for n, b in zip(names, got))


# --- checks ----------------------------------------------------------------------------------
def check_spec(spec: KernelSpec) -> dict[str, Problem]:
    """Raise SpecError (spec, field, fix) for the first malformed field; see module docstring.
    Returns the example problem of each dtype the op takes (empty without an example)."""
    if not isinstance(spec, KernelSpec):
        raise SpecError(f"register_op expects a portakern.KernelSpec; got {type(spec).__name__}."
                        " Build one with portakern.KernelSpec(name=..., ...).")
    name = spec.name
    if not isinstance(name, str) or not name.isidentifier():
        raise spec_error(str(name), "name", f"{name!r} is not an identifier (it is how "
                         "pk.call, --ops and result files name the op)",
                         "use letters, digits and _, e.g. name='scale_add'")
    _check_signature(spec)
    _check_callables(spec)
    kernels = _check_source(spec)
    _check_schedules(spec)
    _check_hints(spec)
    problems: dict[str, Problem] = {}
    refused: dict[str, DTypeError] = {}
    has_example = spec.example is not None or spec.shapes is not None
    for dt in dtypes.FLOAT_DTYPES if has_example else ():
        try:
            prob = _example_problem_or_error(spec, dt)
        except DTypeError as exc:  # the op does not take this dtype: not a malformed spec
            refused[dt] = exc
            continue
        assert prob is not None
        problems[dt] = prob
        _check_problem(spec, prob, kernels)
    if has_example and not problems:
        raise spec_error(spec.name, "example" if spec.example is not None else "shapes",
                         f"validate refused the example in every dtype ({refused})",
                         "make validate accept at least one float dtype")
    _check_examples(spec, problems, kernels)
    first = next(iter(problems.values()), None)
    _check_semantics_binds(spec, first)
    if first is not None:
        for f in ("statistical", "statistical_ordered"):
            if getattr(spec, f) is not None and first.outputs is not None:
                raise spec_error(spec.name, f, "is set on an op with several outputs "
                                 f"({list(first.outputs)}), whose outputs get the worst-case "
                                 f"check only", f"{f}=None (tolerance bounds every output)")
        _check_semantics_output(spec, first)
    return problems


def _check_examples(spec: KernelSpec, problems: Mapping[str, Problem],
                    kernels: list[str]) -> None:
    """Each ``examples(dtype)`` call (what the compile checks and `portakern resources`
    render) is a labelled call validate accepts and the spec's functions handle, in every dtype
    the example is accepted in (every dtype validate takes, for a spec without an example)."""
    if spec.examples is None:
        return
    n, fix = spec.name, _FIXES["examples"]
    for dt in problems or dtypes.FLOAT_DTYPES:
        got = _call(spec, "examples", spec.examples, dt)
        if isinstance(got, (str, bytes, Mapping)) or not isinstance(got, (list, tuple)):
            raise spec_error(n, "examples", f"returned {type(got).__name__} for {dt}; expected "
                             "a list of (label, operands, params)", fix)
        labels: set[str] = set()
        for entry in got:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], Mapping) and isinstance(entry[2], Mapping)):
                raise spec_error(n, "examples", f"returned the entry {entry!r} for {dt}; "
                                 "expected (label, {operand: array}, {param: value})", fix)
            label, arrays, params = entry
            if label in labels:
                raise spec_error(n, "examples", f"returned the label {label!r} twice for {dt} "
                                 "(it names the call in compile-check results)",
                                 "give every call its own label")
            labels.add(label)
            try:
                prob = spec.problem(*spec.bind((), {**arrays, **params}))
            except DTypeError as exc:
                if dt in problems:
                    raise spec_error(n, "examples", f"the {dt} call {label!r} was refused by "
                                     f"validate, which accepts the example in {dt}: {exc}",
                                     "give operands of the dtype examples() is asked "
                                     "for") from exc
                continue  # the op does not take this dtype
            except PortakernError as exc:
                raise spec_error(n, "examples", f"the {dt} call {label!r} was refused by "
                                 f"validate: {exc}", fix) from exc
            try:
                _check_problem(spec, prob, kernels)
            except SpecError as exc:
                raise spec_error(n, "examples", f"the {dt} call {label!r} fails a check the "
                                 f"spec's functions pass on its example: {exc}",
                                 "fix the field named there, or drop that call") from exc


def _check_signature(spec: KernelSpec) -> None:
    n = spec.name
    ops = spec.operands
    if not isinstance(ops, tuple) or not ops:
        raise spec_error(n, "operands", f"expected a non-empty tuple of portakern.Operand; got "
                         f"{ops!r}", "operands=(Operand('x'),) (a list is not accepted: specs "
                         "are immutable)")
    seen: set[str] = set()
    for o in ops:
        if not hasattr(o, "name") or not hasattr(o, "kind"):
            raise spec_error(n, "operands", f"{o!r} is not a portakern.Operand",
                             "wrap each operand as Operand('name') or Operand('m', 'bool')")
        if not isinstance(o.name, str) or not o.name.isidentifier() or o.name == "out":
            raise spec_error(n, "operands", f"operand name {o.name!r} is not usable (it must be "
                             "an identifier and not 'out', the output buffer's name)",
                             "rename the operand")
        if o.name in seen:
            raise spec_error(n, "operands", f"operand {o.name!r} appears twice",
                             "give every operand its own name")
        if o.kind not in ("float", "bool", "int32", "acc", "float32"):
            raise spec_error(n, "operands", f"operand {o.name!r} has kind {o.kind!r}; "
                             "expected 'float', 'bool', 'int32', 'acc' or 'float32'", "use "
                             "Operand(name), Operand(name, 'bool') (a mask), Operand(name, "
                             "'int32') (an index table), Operand(name, 'acc') (an array in "
                             "the compute type) or Operand(name, 'float32')")
        seen.add(o.name)
    if not any(o.kind == "float" for o in ops):
        raise spec_error(n, "operands", "no float operand (the op's dtype is its float "
                         "operands' dtype)", "declare at least one Operand(name) of kind 'float'")
    if not isinstance(spec.params, Mapping):
        raise spec_error(n, "params", f"expected a mapping of parameter -> default; got "
                         f"{type(spec.params).__name__}", "params={'eps': 1e-6} (or {})")
    for p in spec.params:
        if not isinstance(p, str) or not p.isidentifier():
            raise spec_error(n, "params", f"parameter name {p!r} is not an identifier",
                             "rename it")
        if p in seen:
            raise spec_error(n, "params", f"parameter {p!r} has an operand's name",
                             "rename one of them")
        if p in RESERVED_PARAMS:
            raise spec_error(n, "params", f"parameter {p!r} would be taken by portakern.call's "
                             f"own keyword {p}=", "rename the parameter")


def _check_callables(spec: KernelSpec) -> None:
    for f in REQUIRED_CALLABLES:
        v = getattr(spec, f)
        if v is None:
            raise spec_error(spec.name, f, "is missing", _FIXES[f])
        if not callable(v):
            raise spec_error(spec.name, f, f"must be callable; got {type(v).__name__} {v!r}",
                             _FIXES[f])
    for f in OPTIONAL_CALLABLES:
        v = getattr(spec, f)
        if v is not None and not callable(v):
            raise spec_error(spec.name, f, f"must be callable or None; got {type(v).__name__}",
                             _FIXES[f])


_FIXES: dict[str, str] = {
    "validate": "validate(metas, params) -> Problem: check shapes/params, return "
                "Problem(name, dtype, shapes, params, out_shape, derived)",
    "semantics": "semantics(xp, *operands, **params): the op once, against the array API "
                 "(xp is numpy, jax.numpy or cupy)",
    "slots": "slots=lambda p: {'T': p.dtype} (dtype slot -> dtype, gives PK_T_T, PK_LOAD_T, ...)",
    "defines": "defines=lambda p, cfg: dict(cfg) (tunables and compile-time constants)",
    "launches": "launches(p, cfg) -> [Launch(kernel, groups, local, args)]",
    "cost": "cost(p) -> Cost(flops, bytes) (compulsory traffic: inputs once, output once)",
    "tolerance": "tolerance(p, inputs64, ref) -> bound per element, derived from the op's "
                 "error analysis (see portakern/ops/rmsnorm.py); with several outputs ref is "
                 "the oracle's tuple and the result one bound per output (a tuple in output "
                 "order, a dict by output name, None for an exact output)",
    "config_check": "config_check(p_or_None, cfg) -> None or a reason string",
    "pallas": "pallas=None unless you ship a Pallas kernel builder",
    "example": "example(dtype) -> ({operand: ArrayMeta(shape, dtype)}, {param: value})",
    "examples": "examples(dtype) -> [(label, {operand: ArrayMeta(shape, dtype)}, {param: "
                "value}), ...]: calls validate accepts, one label each (or examples=None)",
    "cases": "cases(chooser, dtype) -> portakern.core.sampling.Case",
    "statistical": "statistical(p, inputs64, ref) -> portakern.StatModel(sigma, slack, "
                   "group_axes), sigma and slack broadcasting to the output (or "
                   "statistical=None: the worst-case check alone)",
    "statistical_ordered": "statistical_ordered(p, inputs64, ref) -> portakern.StatModel(sigma, "
                           "slack, group_axes) for results of the spec's own source, sigma and "
                           "slack broadcasting to the output (or statistical_ordered=None: "
                           "`statistical` judges those too)",
}


def _check_source(spec: KernelSpec) -> list[str]:
    n = spec.name
    if not isinstance(spec.source, str) or not spec.source.strip():
        raise spec_error(n, "source", "is empty or not a string", "give the C kernel in "
                         "portakern's dialect, e.g. 'PK_KERNEL void my_op(PK_GLOBAL const "
                         "PK_T_T* X, ...) { ... }'")
    names = kernel_names(spec.source)
    if not names:
        raise spec_error(n, "source", "defines no entry point", "declare each kernel as "
                         "`PK_KERNEL void name(...)` (codegen turns PK_KERNEL into __kernel or "
                         "extern \"C\" __global__)")
    return names


def _check_schedules(spec: KernelSpec) -> None:
    n = spec.name
    known: dict[str, Tunable] = {}
    for t in spec.tunables:
        if not isinstance(t, Tunable):
            raise spec_error(n, "tunables", f"{t!r} is not a portakern.Tunable",
                             "tunables=(Tunable('WG', (64, 128, 256)),)")
        if not t.name.isidentifier() or t.name in known:
            raise spec_error(n, "tunables", f"tunable name {t.name!r} is not a unique C "
                             "identifier (it becomes #define NAME value)", "rename it")
        if not t.domain or not all(isinstance(v, int) and not isinstance(v, bool)
                                   for v in t.domain):
            raise spec_error(n, "tunables", f"tunable {t.name!r} has domain {t.domain!r}; "
                             "expected a non-empty tuple of ints", f"Tunable({t.name!r}, "
                             "(16, 32, 64))")
        known[t.name] = t
    if not isinstance(spec.schedules, Mapping):
        raise spec_error(n, "schedules", "expected a mapping {'cpu': {...}, 'gpu': {...}}",
                         "schedules={'gpu': {...}, 'cpu': {...}}")
    if known and "gpu" not in spec.schedules:
        raise spec_error(n, "schedules", f"has no 'gpu' schedule (got {sorted(spec.schedules)}); "
                         "'gpu' is the default every device class falls back to",
                         "add schedules['gpu'] = {" + ", ".join(f"{k!r}: ..." for k in known)
                         + "} (and a 'cpu' one for CPU runtimes such as PoCL)")
    for sched, cfg in spec.schedules.items():
        if not isinstance(cfg, Mapping):
            raise spec_error(n, "schedules", f"schedule {sched!r} is {cfg!r}, not a mapping",
                             "give tunable -> value, e.g. {'WG': 256}")
        unknown = sorted(set(cfg) - set(known))
        if unknown:
            raise spec_error(n, "schedules", f"schedule {sched!r} sets {unknown}, which are not "
                             f"tunables (declared: {sorted(known)})",
                             "declare them in `tunables` or remove them from the schedule")
        missing = sorted(set(known) - set(cfg))
        if missing:
            raise spec_error(n, "schedules", f"schedule {sched!r} lacks tunables {missing}",
                             "give every tunable a value in every schedule")
        for k, v in cfg.items():
            dom = known[k].domain
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) not in dom:
                raise spec_error(n, "schedules", f"schedule {sched!r} sets {k}={v!r}, outside "
                                 f"the tunable's domain {dom}",
                                 f"pick one of {dom} or widen Tunable({k!r}, ...)'s domain")


def _check_hints(spec: KernelSpec) -> None:
    if spec.shapes is None:
        return
    bad = spec_error(spec.name, "shapes", f"{spec.shapes!r} is not a mapping operand -> dims",
                     "shapes={'x': ('rows', 'n'), 'w': ('n',)}")
    if not isinstance(spec.shapes, Mapping):
        raise bad
    try:
        family = shape_family(spec)
    except (TypeError, AttributeError, ValueError):
        raise bad from None
    assert family is not None
    names = {o.name for o in spec.operands}
    for op, dims in family.items():
        if op not in names:
            raise spec_error(spec.name, "shapes", f"names {op!r}, which is not an operand "
                             f"(operands: {sorted(names)})", "use the operands' names as keys")
        for d in dims:
            ok = d.isidentifier() if isinstance(d, str) else d >= 0
            if not ok:
                raise spec_error(spec.name, "shapes", f"operand {op!r} has dim {d!r}; expected "
                                 "a size name (identifier) or a fixed size >= 0",
                                 "e.g. ('rows', 'n') or ('n', 3)")
    absent = [o.name for o in spec.operands if not o.optional and o.name not in family]
    if absent:
        raise spec_error(spec.name, "shapes", f"has no dims for required operands {absent}",
                         "give every required operand its dims")


def _example_problem_or_error(spec: KernelSpec, dtype: str) -> Problem | None:
    field = "example" if spec.example is not None else "shapes"
    try:
        return example_problem(spec, dtype)
    except DTypeError:
        raise  # the caller skips dtypes the op refuses
    except PortakernError as exc:
        raise spec_error(spec.name, field, f"the {dtype} example was refused by validate: "
                         f"{exc}", "make example()/shapes describe a call validate accepts, "
                         "or fix validate") from exc
    except Exception as exc:
        raise spec_error(spec.name, field, f"building the {dtype} example raised "
                         f"{type(exc).__name__}: {exc}", "example(dtype) must return "
                         "({operand: ArrayMeta(shape, dtype)}, {param: value}) and validate "
                         "must return a Problem") from exc


def _call(spec: KernelSpec, field: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise spec_error(spec.name, field, f"raised {type(exc).__name__}: {exc} on the example "
                         "problem", _FIXES.get(field, "fix the function")) from exc


def _check_problem(spec: KernelSpec, prob: Problem, kernels: list[str]) -> None:
    n = spec.name
    if not isinstance(prob, Problem):
        raise spec_error(n, "validate", f"returned {type(prob).__name__}, not a Problem",
                         _FIXES["validate"])
    slots = _call(spec, "slots", spec.slots, prob)
    if not isinstance(slots, Mapping) or not slots:
        raise spec_error(n, "slots", f"returned {slots!r}; expected a non-empty dict "
                         "slot -> dtype", _FIXES["slots"])
    operand_names = {o.name for o in spec.operands} | _check_outputs(spec, prob)
    scheds = sorted(spec.schedules) or ["gpu"]
    for sched in scheds:
        try:
            cfg = spec.config(sched, None, prob)
        except PortakernError as exc:
            field = "config_check" if "is invalid" in str(exc) else "schedules"
            raise spec_error(n, field, f"schedule {sched!r} is refused for the {prob.dtype} "
                             f"example: {exc}", "make the schedule valid for typical "
                             "problems") from exc
        defines = _call(spec, "defines", spec.defines, prob, cfg)
        if not isinstance(defines, Mapping):
            raise spec_error(n, "defines", f"returned {type(defines).__name__}; expected a dict",
                             _FIXES["defines"])
        try:
            codegen.render(spec.source, "opencl", slots=slots, defines=defines)
        except (SpecError, KeyError, TypeError) as exc:
            raise spec_error(n, "slots/defines", f"cannot be rendered: {exc}",
                             "slots map identifiers to float dtypes; defines map identifiers "
                             "to int/float/bool") from exc
        launches = _call(spec, "launches", spec.launches, prob, cfg)
        if not isinstance(launches, (list, tuple)) or (not launches and not prob.empty_result):
            raise spec_error(n, "launches", f"returned {launches!r}; expected a non-empty list "
                             "of Launch", _FIXES["launches"])
        buffers = operand_names | _check_workspace(spec, prob, cfg, operand_names)
        for la in launches:
            _check_launch(spec, la, kernels, buffers)
    c = _call(spec, "cost", spec.cost, prob)
    if not isinstance(c, Cost) or not all(math.isfinite(v) and v >= 0
                                          for v in (c.flops, c.bytes)):
        raise spec_error(n, "cost", f"returned {c!r}; expected Cost(flops >= 0, bytes >= 0)",
                         _FIXES["cost"])


def _check_outputs(spec: KernelSpec, prob: Problem) -> set[str]:
    """The output buffers' names (``{"out"}`` for a one-output op), after checking that each
    several-output entry is a fresh identifier with a shape and a float or int32 dtype."""
    if prob.outputs is None:
        return {"out"}
    n = spec.name
    fix = ("validate returns Problem(..., outputs={'y': ((M, D), dtype), 's': ((M,), dtype)}): "
           "name -> (shape, dtype name), in the order the op returns them, each dtype a float "
           f"dtype or 'int32' ({', '.join(OUTPUT_DTYPES)})")
    if not isinstance(prob.outputs, Mapping) or not prob.outputs:
        raise spec_error(n, "validate", f"Problem.outputs is {prob.outputs!r}; expected a "
                         "non-empty dict", fix)
    operands = {o.name for o in spec.operands}
    for name, val in prob.outputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name in operands:
            raise spec_error(n, "validate", f"output name {name!r} is not an identifier or is "
                             f"an operand's name (operands: {sorted(operands)})",
                             "give every output its own identifier; " + fix)
        ok = (isinstance(val, tuple) and len(val) == 2 and isinstance(val[0], tuple)
              and all(isinstance(d, (int, np.integer)) and d >= 0 for d in val[0])
              and val[1] in OUTPUT_DTYPES)
        if not ok:
            raise spec_error(n, "validate", f"output {name!r} is declared as {val!r}, not "
                             "(shape tuple, dtype name)", fix)
    return set(prob.outputs)


def _check_workspace(spec: KernelSpec, prob: Problem, cfg: Mapping[str, int],
                     operand_names: set[str]) -> set[str]:
    """Names of the spec's workspace buffers for this problem, after checking them."""
    if spec.workspace is None:
        return set()
    n = spec.name
    ws = _call(spec, "workspace", spec.workspace, prob, cfg)
    fix = ("return {name: (elements, dtype name)}, e.g. {'packed': (K * N, p.dtype)}, with "
           "names that are neither operands nor outputs and a float dtype or 'int32' "
           f"({', '.join(OUTPUT_DTYPES)})")
    if not isinstance(ws, Mapping):
        raise spec_error(n, "workspace", f"returned {type(ws).__name__}; expected a dict", fix)
    for name, val in ws.items():
        ok = (isinstance(name, str) and name.isidentifier() and name not in operand_names
              and isinstance(val, tuple) and len(val) == 2
              and isinstance(val[0], (int, np.integer)) and val[0] >= 0
              and val[1] in OUTPUT_DTYPES)
        if not ok:
            raise spec_error(n, "workspace", f"entry {name!r}: {val!r} is not a valid buffer",
                             fix)
    return set(ws)


def _check_launch(spec: KernelSpec, la: Any, kernels: list[str], names: set[str]) -> None:
    n = spec.name
    if not isinstance(la, Launch):
        raise spec_error(n, "launches", f"returned {la!r}, not a portakern.Launch",
                         _FIXES["launches"])
    if la.kernel not in kernels:
        raise spec_error(n, "source", f"launches name entry point {la.kernel!r} but the source "
                         f"defines only {kernels}", f"define `PK_KERNEL void {la.kernel}(...)` "
                         "in the source, or name one of those in the Launch")
    for what, dims in (("groups", la.groups), ("local", la.local)):
        if len(dims) != 3 or not all(isinstance(d, (int, np.integer)) and d >= 1 for d in dims):
            raise spec_error(n, "launches", f"Launch({la.kernel!r}) has {what}={dims!r}; "
                             "expected three ints >= 1", "pad with 1s, e.g. (rows, 1, 1)")
    for a in la.args:
        if isinstance(a, Buf):
            if a.name not in names:
                raise spec_error(n, "launches", f"Launch({la.kernel!r}) passes Buf({a.name!r}), "
                                 f"which is not an operand, an output or a workspace buffer "
                                 f"({sorted(names)})",
                                 "pass Buf(operand), Buf(output) (Buf('out') for a one-output "
                                 "op, the names of Problem.outputs otherwise) or a name from "
                                 "workspace()")
        elif isinstance(a, Scalar):
            _check_scalar(spec, la, a)
        else:
            raise spec_error(n, "launches", f"argument {a!r} is neither Buf nor Scalar",
                             "wrap buffers as Buf(name) and numbers as Scalar(value, ctype)")


def _check_scalar(spec: KernelSpec, la: Launch, a: Scalar) -> None:
    """An 'int' Scalar holds an integer in 32-bit range (a float would be truncated by the C
    argument, a larger int wrapped); an 'acc' Scalar a real number."""
    n = spec.name
    if a.ctype == "int":
        v = a.value
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise spec_error(n, "launches", f"Launch({la.kernel!r}) passes Scalar({v!r}, 'int'), "
                             f"a {type(v).__name__}, where the kernel takes a 32-bit int",
                             "pass an int (validate can normalise the parameter with int(...)) "
                             "or use Scalar(value, 'acc') for a float")
        if not -2**31 <= int(v) < 2**31:
            raise spec_error(n, "launches", f"Launch({la.kernel!r}) passes Scalar({v!r}, 'int'), "
                             "outside the 32-bit int range", "refuse such values in validate")
    elif a.ctype == "acc":
        if isinstance(a.value, bool) or not isinstance(a.value, (int, float, np.integer,
                                                                 np.floating)):
            raise spec_error(n, "launches", f"Launch({la.kernel!r}) passes Scalar({a.value!r}, "
                             "'acc'), which is not a number", "pass a float")
    else:
        raise spec_error(n, "launches", f"Scalar({a.value!r}, {a.ctype!r}) has an unknown"
                         " ctype", "use ctype 'int' (32-bit) or 'acc' (compute float)")


def _check_semantics_binds(spec: KernelSpec, prob: Problem | None) -> None:
    params = prob.params if prob is not None else dict(spec.params)
    try:
        sig = inspect.signature(spec.semantics)
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return
    try:
        sig.bind(np, *[None] * len(spec.operands), **params)
    except TypeError as exc:
        want = ", ".join(["xp"] + [o.name for o in spec.operands]
                         + [f"{k}=..." for k in params])
        raise spec_error(spec.name, "semantics", f"cannot be called as semantics({want}): {exc}",
                         "take xp first, then one positional argument per operand in order, "
                         "then every parameter as a keyword") from None


def _zeros(spec: KernelSpec, prob: Problem) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    for o in spec.operands:
        shp = prob.shapes.get(o.name)
        dt = {"bool": bool, "int32": np.int32}.get(o.kind, np.float64)
        out.append(None if shp is None else np.zeros(shp, dt))  # int32: index 0, valid
    return out


def _check_statistical(spec: KernelSpec, prob: Problem, ins: dict[str, np.ndarray],
                       ref: np.ndarray, field: str = "statistical") -> None:
    """The model ``field`` (statistical or statistical_ordered) on the example: a StatModel
    whose sigma and slack broadcast to the output and whose group_axes are output axes
    (portakern.verify reads nothing else)."""
    model = getattr(spec, field)
    if model is None:  # no model: nothing to check
        return
    st = _call(spec, field, model, prob, ins, ref)
    fix = _FIXES[field]
    if not all(hasattr(st, a) for a in ("sigma", "slack", "group_axes")):
        raise spec_error(spec.name, field, f"returned {type(st).__name__}, not a "
                         "portakern.StatModel", fix)
    for what in ("sigma", "slack"):
        try:
            np.broadcast_to(np.asarray(getattr(st, what), dtype=np.float64), ref.shape)
        except (ValueError, TypeError):
            raise spec_error(spec.name, field, f"returns a {what} of shape "
                             f"{np.shape(getattr(st, what))}, which does not broadcast to the "
                             f"output's shape {ref.shape}", fix) from None
    axes = st.group_axes
    if not isinstance(axes, tuple) or not all(
            isinstance(a, (int, np.integer)) and not isinstance(a, bool)
            and -ref.ndim <= a < ref.ndim for a in axes):
        raise spec_error(spec.name, field, f"returns group_axes={axes!r}; expected a "
                         f"tuple of axes of the {ref.ndim}-d output", "e.g. (-1,) when a row's "
                         "errors share its sum, () when every element's are independent")


def _check_semantics_output(spec: KernelSpec, prob: Problem) -> None:
    """Run semantics and tolerance once on zeros of the example's shapes (numpy, float64):
    one array per output of the declared shape, one non-negative bound per output."""
    outs = prob.output_specs
    if prob.empty_result or max(int(np.prod(s)) for s, _ in outs.values()) > MAX_EVAL_ELEMENTS:
        return
    args = _zeros(spec, prob)
    ins = {o.name: a for o, a in zip(spec.operands, args, strict=True) if a is not None}
    with np.errstate(all="ignore"):
        res = _call(spec, "semantics", lambda: spec.semantics(np, *args, **prob.params))
        refs: tuple[np.ndarray, ...]
        if prob.outputs is None:
            refs = (np.asarray(res),)
        elif not isinstance(res, (tuple, list)) or len(res) != len(outs):
            got = (f"{len(res)} arrays" if isinstance(res, (tuple, list))
                   else f"one {type(res).__name__}")
            raise spec_error(spec.name, "semantics", f"returns {got} for the example while "
                             f"validate declares {len(outs)} outputs {list(outs)}",
                             "return a tuple with one array per output, in the order of "
                             "Problem.outputs")
        else:
            refs = tuple(np.asarray(r) for r in res)
        for (name, (shape, dt)), ref in zip(outs.items(), refs):
            what = "out_shape" if prob.outputs is None else f"output {name!r} of shape"
            if ref.shape != tuple(shape):
                raise spec_error(spec.name, "semantics", f"returns shape {ref.shape} for the "
                                 f"example while validate promises {what} {tuple(shape)}",
                                 "make validate's out_shape/outputs and the semantics agree")
            if dt == "int32" and ref.dtype.kind not in "iub":
                raise spec_error(spec.name, "semantics", f"returns {ref.dtype} for output "
                                 f"{name!r}, which validate declares int32",
                                 "compute integer outputs with integer operations (e.g. "
                                 "xp.argmax) or declare the output a float dtype")
        refs64 = tuple(r.astype(np.float64) for r in refs)
        raw = _call(spec, "tolerance", spec.tolerance, prob, ins,
                    refs64[0] if prob.outputs is None else refs64)
        bounds = (raw,) if prob.outputs is None else output_bounds(spec.name, outs, raw)
        if spec.cost(prob).flops <= MAX_EVAL_FLOPS:
            for f in ("statistical", "statistical_ordered"):
                _check_statistical(spec, prob, ins, refs64[0], f)
    for (name, _), ref, b in zip(outs.items(), refs64, bounds):
        if b is None:
            continue  # exact
        of = "the output" if prob.outputs is None else f"output {name!r}"
        try:
            bound = np.broadcast_to(np.asarray(b, dtype=np.float64), ref.shape)
        except (ValueError, TypeError):
            raise spec_error(spec.name, "tolerance", f"returns a bound of shape "
                             f"{np.shape(b)} for {of}, which does not broadcast to its shape "
                             f"{ref.shape}", "return one bound per output element (or a "
                             "scalar)") from None
        if np.any(bound < 0):
            raise spec_error(spec.name, "tolerance", f"returns negative bounds for {of}",
                             "return |ref| * rel + floor with rel, floor >= 0")
