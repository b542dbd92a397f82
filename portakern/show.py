"""`portakern show OP --backend B`: the exact source a backend compiles for an op.

The representative problem (sizes) only matters where sizes are compile-time constants
(attention's head dims); ``--shape 'D=80,Dv=64'`` changes them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import backends as registry
from . import codegen, dtypes
from .errors import InvalidArgumentError
from .ops import get_op
from .spec import KernelSpec, Problem

DEFAULT_SIZES: dict[str, dict[str, int]] = {
    "matmul": {"M": 256, "N": 256, "K": 256},
    "softmax": {"R": 64, "N": 1024},
    "attention": {"B": 1, "H": 8, "Hkv": 8, "Sq": 128, "Sk": 128, "D": 64, "Dv": 0},
}


def _meta(shape: tuple[int, ...], dtype: Any) -> SimpleNamespace:
    return SimpleNamespace(shape=shape, dtype=dtype)


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


def representative_problem(spec: KernelSpec, dtype: str, sizes: dict[str, int] | None = None
                           ) -> Problem:
    """A Problem of typical size for an op (built-in ops; user specs give `example`)."""
    dt = dtypes.info(dtype).storage
    s = {**DEFAULT_SIZES.get(spec.name, {}), **(sizes or {})}
    if spec.name == "matmul":
        arrays = {"a": _meta((s["M"], s["K"]), dt), "b": _meta((s["K"], s["N"]), dt)}
        params: dict[str, Any] = {}
    elif spec.name == "softmax":
        arrays, params = {"x": _meta((s["R"], s["N"]), dt)}, {"axis": -1}
    elif spec.name == "attention":
        dv = s["Dv"] or s["D"]
        arrays = {"q": _meta((s["B"], s["H"], s["Sq"], s["D"]), dt),
                  "k": _meta((s["B"], s["Hkv"], s["Sk"], s["D"]), dt),
                  "v": _meta((s["B"], s["Hkv"], s["Sk"], dv), dt), "mask": None}
        params = {"causal": False, "scale": None}
    else:  # user ops: their `example`, or their `shapes` family with --shape overriding names
        from .spec_tools import example_inputs

        got = example_inputs(spec, dtype, sizes)
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
