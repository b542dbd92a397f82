"""`portakern show OP --backend B`: the exact source a backend compiles for an op.

The representative problem is the op spec's ``example``; its sizes only matter where they are
compile-time constants (attention's head dims). ``--shape 'D=80,Dv=64'`` sets the size
keywords the example takes (or the size names of a ``shapes`` family).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ..backend import registry
from ..core import codegen, dtypes
from ..core.errors import InvalidArgumentError
from ..core.spec import KernelSpec, Problem
from ..core.spec_checks import example_inputs, shape_family
from ..ops import get_op


def parse_sizes(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, val = part.partition("=")
        try:
            out[key.strip()] = int(val)
        except ValueError:
            raise InvalidArgumentError(f"--shape entry {part!r} must be NAME=INT, e.g. D=64.") \
                from None
    return out


def size_names(example: Any) -> frozenset[str] | None:
    """The size keywords an ``example(dtype, **sizes)`` takes (None: any, it has **kwargs)."""
    try:
        sig = inspect.signature(example)
    except (TypeError, ValueError):
        return frozenset()
    names = []
    for i, p in enumerate(sig.parameters.values()):
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and i > 0:
            names.append(p.name)
    return frozenset(names)


def example_call(spec: KernelSpec, dtype: str, sizes: Mapping[str, int] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The spec's typical call (operand stand-ins, params) with ``sizes`` applied: its
    ``example`` given the size keywords it takes (others are ignored), else its ``shapes``
    family with ``sizes`` setting size names. None when the spec gives neither."""
    if spec.example is not None:
        takes = size_names(spec.example)
        _refuse_unknown(spec, sizes, takes)
        kw = {k: int(v) for k, v in (sizes or {}).items() if takes is None or k in takes}
        arrays, params = spec.example(dtypes.info(dtype).name, **kw)
        return dict(arrays), dict(params)
    family = shape_family(spec)
    if family is not None:
        _refuse_unknown(spec, sizes, frozenset(d for dims in family.values() for d in dims
                                               if isinstance(d, str)))
    return example_inputs(spec, dtype, sizes)


def _refuse_unknown(spec: KernelSpec, sizes: Mapping[str, int] | None,
                    takes: frozenset[str] | None) -> None:
    """A --shape name the op does not take is an error (`tune matmul --shape m=16` tuned and
    stored 256^3 with the lower-case names dropped), as in `trace`."""
    if takes is None:
        return
    unknown = sorted(set(sizes or {}) - takes)
    if unknown:
        raise InvalidArgumentError(
            f"--shape {', '.join(unknown)}: {spec.name} takes no such size; its sizes are "
            f"{', '.join(sorted(takes)) or '(none)'} (names are case-sensitive).")


def representative_problem(spec: KernelSpec, dtype: str, sizes: dict[str, int] | None = None
                           ) -> Problem:
    """A Problem of typical size for an op: its spec's ``example`` (or ``shapes``), sized by
    ``sizes`` (``--shape``). Built-in and user ops alike; nothing here names an op."""
    got = example_call(spec, dtype, sizes)
    if got is None:
        raise InvalidArgumentError(f"op {spec.name!r} has no representative problem; give "
                                   "its KernelSpec an `example` or `shapes` (see "
                                   "docs/add-a-kernel.md).")
    arrays, params = got
    bound, par = spec.bind((), {**arrays, **params})
    return spec.problem(bound, par)


def dialect_of(backend: str) -> tuple[str, str]:
    """(dialect, device class) for a dialect name or a backend name/selector."""
    name = backend.split(":")[0]
    if name in codegen.DIALECTS:
        return name, codegen.DIALECTS[name].device_class
    cls = registry.load(name) if name in registry.names() else None
    dialect = getattr(cls, "dialect", None) if isinstance(cls, type) else None
    if dialect is None:
        raise InvalidArgumentError(
            f"{backend!r} has no C dialect to show; expected one of {sorted(codegen.DIALECTS)} "
            "(numpy and jax evaluate the op's semantics instead of a C kernel).")
    return dialect, "gpu"


def show(op: str, backend: str = "opencl", dtype: str = "float32", shape: str | None = None,
         schedule: str | None = None) -> str:
    spec = get_op(op)
    dialect, device_class = dialect_of(backend)
    prob = representative_problem(spec, dtype, parse_sizes(shape))
    cfg = spec.config(schedule or device_class, None, prob)
    src = spec.render(dialect, prob, cfg)
    head = (f"// {op} for {dialect}, dtype {dtype}, schedule {schedule or device_class} {cfg}\n"
            f"// launches: {spec.launches(prob, cfg)[:1]}\n")
    return head + src
