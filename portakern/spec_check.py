"""What a spec gets from its fields alone: checks at registration, an example problem, and a
case generator derived from its shape family (core layer: pure Python, no backend).

Why here and not in each op: a user writing a KernelSpec should learn about a malformed field
when they register it — with the spec, the field and the fix named — not from a traceback
deep inside a backend on some other machine. ``check_spec`` is what ``register_op`` runs
(milliseconds): names, operands, parameters, required callables, the semantics' signature,
tunables and every schedule against their domains, and — on the example problem of each
dtype — slots, defines, launches (every entry point they name must be defined in ``source``
with ``PK_KERNEL void name(``), cost, and the semantics' output shape. Compiling the example
everywhere (``register_op(check=True)``) is a tool: portakern.spec_tools.
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

ENTRY_POINT = re.compile(r"PK_KERNEL\s+void\s+([A-Za-z_]\w*)\s*\(")
RESERVED_PARAMS = ("backend", "config")  # keywords of portakern.call itself
REQUIRED_CALLABLES = ("validate", "semantics", "slots", "defines", "launches", "cost",
                      "tolerance")
OPTIONAL_CALLABLES = ("config_check", "pallas", "example", "cases")
# the derived generator's sizes: last axes (where kernels tile) from the edge list, other axes
# small so that rank-3 and rank-4 families stay cheap on a 2-core CPU
SMALL_SIZES = (1, 2, 3, 5, 8, 17)
# the derived example's sizes: last axes long, other axes a few
EXAMPLE_LAST, EXAMPLE_OTHER = 1024, 8
MAX_EVAL_ELEMENTS = 1 << 22  # evaluate semantics at registration only on examples this small


def spec_error(spec: str, field: str, what: str, fix: str) -> SpecError:
    """The one message format: which spec, which field, what is wrong, how to fix it."""
    what, fix = what.rstrip().rstrip("."), fix.rstrip().rstrip(".")
    return SpecError(f"spec {spec!r}, field `{field}`: {what}. Fix: {fix}.")


def kernel_names(source: str) -> list[str]:
    """Entry points a source defines (``PK_KERNEL void name(``), in order of appearance."""
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
        arrays, params = spec.example(st)
        return dict(arrays), dict(params)
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
        arrays[op.name] = ArrayMeta(shape, "bool" if op.kind == "bool" else st)
    return arrays, dict(spec.params)


def example_problem(spec: KernelSpec, dtype: str) -> Problem | None:
    """The validated Problem of ``example_inputs`` (None when the spec gives no example)."""
    got = example_inputs(spec, dtype)
    if got is None:
        return None
    arrays, params = spec.bind((), {**got[0], **got[1]})
    return spec.problem(arrays, params)


def representative_maker(spec: KernelSpec) -> Callable[[Any], list[tuple[str, dict, dict]]]:
    """The example in compile_check's form: storage dtype -> [(label, arrays, params)]."""
    def maker(storage: Any) -> list[tuple[str, dict, dict]]:
        got = example_inputs(spec, dtypes.dtype_name(storage))
        return [] if got is None else [("example", got[0], got[1])]
    return maker


# --- the derived case generator ------------------------------------------------------------
def derived_cases(spec: KernelSpec) -> Callable[[Chooser, str], Case] | None:
    """A case generator from the shape family (``shapes``, else the example's shapes).

    Size names on a last axis are drawn from portakern.cases.EDGE_SIZES (1, primes, tile sizes
    +- 1), other size names from a short list; float operands are standard normal at a scale of
    1, 1e-3 or 30 (4 for float16), bool operands ~70% True, optional operands present half the
    time; parameters keep their defaults (write ``cases`` to vary them). None when the spec
    has neither ``shapes`` nor ``example``.
    """
    hint = shape_family(spec)
    if hint is None and spec.example is None:
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
    first = next(iter(problems.values()), None)
    _check_semantics_binds(spec, first)
    if first is not None:
        _check_semantics_output(spec, first)
    return problems


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
        if o.kind not in ("float", "bool"):
            raise spec_error(n, "operands", f"operand {o.name!r} has kind {o.kind!r}; "
                             "expected 'float' or 'bool'", "use Operand(name) or "
                             "Operand(name, 'bool')")
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
                 "error analysis (see portakern/ops/rmsnorm.py)",
    "config_check": "config_check(p_or_None, cfg) -> None or a reason string",
    "pallas": "pallas=None unless you ship a Pallas kernel builder",
    "example": "example(dtype) -> ({operand: ArrayMeta(shape, dtype)}, {param: value})",
    "cases": "cases(chooser, dtype) -> portakern.cases.Case",
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
    operand_names = {o.name for o in spec.operands} | {"out"}
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


def _check_workspace(spec: KernelSpec, prob: Problem, cfg: Mapping[str, int],
                     operand_names: set[str]) -> set[str]:
    """Names of the spec's workspace buffers for this problem, after checking them."""
    if spec.workspace is None:
        return set()
    n = spec.name
    ws = _call(spec, "workspace", spec.workspace, prob, cfg)
    fix = ("return {name: (elements, dtype name)}, e.g. {'packed': (K * N, p.dtype)}, with "
           "names that are neither operands nor 'out'")
    if not isinstance(ws, Mapping):
        raise spec_error(n, "workspace", f"returned {type(ws).__name__}; expected a dict", fix)
    for name, val in ws.items():
        ok = (isinstance(name, str) and name.isidentifier() and name not in operand_names
              and isinstance(val, tuple) and len(val) == 2
              and isinstance(val[0], (int, np.integer)) and val[0] >= 0
              and val[1] in dtypes.FLOAT_DTYPES)
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
                                 f"which is not an operand, 'out' or a workspace buffer "
                                 f"({sorted(names)})",
                                 "pass Buf(operand), Buf('out') or a name from workspace()")
        elif isinstance(a, Scalar):
            if a.ctype not in ("int", "acc"):
                raise spec_error(n, "launches", f"Scalar({a.value!r}, {a.ctype!r}) has an unknown"
                                 " ctype", "use ctype 'int' (32-bit) or 'acc' (compute float)")
        else:
            raise spec_error(n, "launches", f"argument {a!r} is neither Buf nor Scalar",
                             "wrap buffers as Buf(name) and numbers as Scalar(value, ctype)")


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
        out.append(None if shp is None else np.zeros(shp, bool if o.kind == "bool"
                                                     else np.float64))
    return out


def _check_semantics_output(spec: KernelSpec, prob: Problem) -> None:
    """Run semantics and tolerance once on zeros of the example's shapes (numpy, float64)."""
    if prob.empty_result or int(np.prod(prob.out_shape)) > MAX_EVAL_ELEMENTS:
        return
    args = _zeros(spec, prob)
    with np.errstate(all="ignore"):
        ref = _call(spec, "semantics", lambda: np.asarray(spec.semantics(np, *args,
                                                                         **prob.params)))
        if ref.shape != tuple(prob.out_shape):
            raise spec_error(spec.name, "semantics", f"returns shape {ref.shape} for the example "
                             f"while validate promises out_shape {tuple(prob.out_shape)}",
                             "make validate's out_shape and the semantics agree")
        ins = {o.name: a for o, a in zip(spec.operands, args, strict=True) if a is not None}
        bound = np.asarray(_call(spec, "tolerance", spec.tolerance, prob, ins,
                                 ref.astype(np.float64)))
    try:
        np.broadcast_to(bound, ref.shape)
    except ValueError:
        raise spec_error(spec.name, "tolerance", f"returns shape {bound.shape}, which does not "
                         f"broadcast to the output {ref.shape}", "return one bound per output "
                         "element (or a scalar)") from None
    if np.any(bound < 0):
        raise spec_error(spec.name, "tolerance", "returns negative bounds",
                         "return |ref| * rel + floor with rel, floor >= 0")
