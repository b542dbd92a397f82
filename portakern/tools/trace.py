"""`portakern trace`: what each kernel launch of an op moves and computes, counted exactly.

Runs one call of an op on the Oclgrind simulator (``opencl:oclgrind``) with instruction
counting on, and reports per launch: global bytes loaded and stored, local bytes loaded and
stored, barriers (summed over work-items) and FMAs (contracted multiply-adds and fma calls,
one per lane). Beside them: the op's cost model (compulsory bytes: inputs read once, output
written once; and flops) and the ratios — traffic over compulsory bytes says how many times
the schedule moves each byte (1.0: once; a tiled matmul re-reads A and B once per tile), and
2 * FMA over the model's flops says how much of the arithmetic is multiply-add.

The counts are the simulator's, at the schedule the call would use on a GPU-class device (the
simulator reports a GPU), or ``--schedule``/``--config``. They are exact for that shape and
schedule: tests assert data-movement claims against them (tests/tools/test_trace.py). They say
nothing about timing. Works for every registered op, user ops included.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.errors import BackendUnavailable, InvalidArgumentError
from ..ops import get_op
from ..runtime import configs

FIELDS = ("kernel", "global_load_bytes", "global_store_bytes", "local_load_bytes",
          "local_store_bytes", "barriers", "fma")


@dataclass
class LaunchTrace:
    kernel: str
    global_load_bytes: int
    global_store_bytes: int
    local_load_bytes: int
    local_store_bytes: int
    barriers: int
    fma: int
    global_size: tuple[int, ...] = ()
    local_size: tuple[int, ...] | None = None


@dataclass
class Trace:
    op: str
    dtype: str
    shapes: dict[str, tuple[int, ...] | None]
    params: dict[str, Any]
    config: dict[str, int]
    launches: list[LaunchTrace]
    compulsory_bytes: float
    compulsory_flops: float
    device: str = ""
    totals: dict[str, int] = field(default_factory=dict)

    @property
    def global_bytes(self) -> int:
        return self.totals["global_load_bytes"] + self.totals["global_store_bytes"]

    @property
    def traffic_ratio(self) -> float:
        """Global bytes moved over the cost model's compulsory bytes (1.0: each byte once)."""
        return self.global_bytes / self.compulsory_bytes if self.compulsory_bytes else math.nan

    @property
    def fma_ratio(self) -> float:
        """2 * FMAs over the cost model's flops (1.0: all the modelled arithmetic is FMA)."""
        return 2 * self.totals["fma"] / self.compulsory_flops if self.compulsory_flops else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "dtype": self.dtype, "device": self.device,
                "shapes": {k: list(v) if v is not None else None for k, v in self.shapes.items()},
                "params": self.params, "config": self.config,
                "launches": [asdict(la) for la in self.launches],
                "total": dict(self.totals, global_bytes=self.global_bytes),
                "cost": {"compulsory_bytes": self.compulsory_bytes,
                         "compulsory_flops": self.compulsory_flops,
                         "traffic_ratio": _finite(self.traffic_ratio),
                         "fma_ratio": _finite(self.fma_ratio)}}


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def simulator() -> Any:
    """A fresh simulator instance with instruction counting on (its own OpenCL context)."""
    try:
        from ..backend.oclgrind import OclgrindBackend, require_simulator
    except Exception as exc:  # pyopencl missing
        raise BackendUnavailable(
            f"portakern trace needs the OpenCL backend: {exc}. Fix: pip install "
            "'portakern[opencl]' and apt-get install oclgrind.") from None
    require_simulator("portakern trace")
    return OclgrindBackend.counting()


def make_inputs(spec: Any, shapes: Mapping[str, Sequence[int]], dtype: str, seed: int = 0
                ) -> dict[str, np.ndarray | None]:
    """Random operands of the given shapes (standard normal; bool operands ~70% True)."""
    names = [o.name for o in spec.operands]
    unknown = set(shapes) - set(names)
    if unknown:
        raise InvalidArgumentError(f"trace {spec.name}: no operand named {sorted(unknown)}; "
                                   f"its operands are {names}.")
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray | None] = {}
    for o in spec.operands:
        shape = shapes.get(o.name)
        if shape is None:
            if not o.optional:
                raise InvalidArgumentError(
                    f"trace {spec.name}: give the shape of {o.name!r}, e.g. --shape "
                    f"{o.name}=64,64 (operands: {', '.join(names)}).")
            arrays[o.name] = None
            continue
        shape = tuple(int(d) for d in shape)
        if o.kind == "bool":
            arrays[o.name] = rng.random(shape) < 0.7
        elif o.kind == "acc":  # e.g. a log-sum-exp: in the compute type
            arrays[o.name] = dtypes.cast_to(rng.standard_normal(shape),
                                            dtypes.compute_dtype_name(dtype))
        else:
            arrays[o.name] = dtypes.cast_to(rng.standard_normal(shape), dtype)
    return arrays


def trace(op: Any, shapes: Mapping[str, Sequence[int]], dtype: str = "float32",
          params: Mapping[str, Any] | None = None, config: Mapping[str, int] | None = None,
          schedule: str | None = None, backend: Any = None, seed: int = 0,
          arrays: Mapping[str, Any] | None = None) -> Trace:
    """Run one call of ``op`` on the counting simulator and return its per-launch counts.

    ``config`` overrides tunables over ``schedule`` (default: the simulator's, i.e. "gpu").
    ``arrays`` replaces the random operands (then ``shapes`` may be empty)."""
    from ..api import call

    spec = get_op(op) if isinstance(op, str) else op
    be = backend if backend is not None else simulator()
    if not getattr(be, "count_instructions", False):
        raise BackendUnavailable(f"trace counts on the simulator only; {be.describe()} does not "
                                 "count instructions. Use backend=None (a counting "
                                 "opencl:oclgrind instance).")
    ins = dict(arrays) if arrays is not None else make_inputs(spec, shapes, dtype, seed)
    dtype = next((dtypes.dtype_name(v.dtype) for o in spec.operands if o.kind != "bool"
                  and (v := ins.get(o.name)) is not None), dtype)
    bound, bound_params = spec.bind((), {**ins, **(params or {})})
    prob = spec.problem(bound, bound_params)
    overrides = dict(spec.config(schedule)) if schedule else {}
    overrides.update(config or {})
    cfg = configs.config_for(be, spec, prob, overrides or None)
    be.launch_counts.clear()
    call(spec, backend=be, config=overrides or None, **ins, **(params or {}))
    launches = []
    for lc in be.launch_counts:
        b = lc.bytes
        launches.append(LaunchTrace(
            lc.kernel, b.get("load global", 0), b.get("store global", 0),
            b.get("load local", 0), b.get("store local", 0), lc.barriers, lc.fma,
            tuple(lc.global_size), lc.local_size))
    be.launch_counts.clear()
    totals = {k: sum(getattr(la, k) for la in launches) for k in FIELDS[1:]}
    cost = spec.cost(prob)
    return Trace(spec.name, dtype, {k: tuple(np.shape(v)) if v is not None else None
                                    for k, v in ins.items()},
                 dict(prob.params), dict(cfg), launches, float(cost.bytes), float(cost.flops),
                 be.describe(), totals)


def format_trace(t: Trace) -> str:
    head = (f"{'kernel':24s} {'glob load B':>12s} {'glob store B':>12s} {'local load B':>12s} "
            f"{'local store B':>13s} {'barriers':>9s} {'FMA':>12s}")
    lines = [f"{t.op} {t.dtype} {t.shapes} on {t.device}", f"config {t.config}", head]
    rows = [(la.kernel, asdict(la)) for la in t.launches] + [("total", t.totals)]
    for name, r in rows:
        g = r.__getitem__
        lines.append(f"{name:24s} {g('global_load_bytes'):>12,d} {g('global_store_bytes'):>12,d} "
                     f"{g('local_load_bytes'):>12,d} {g('local_store_bytes'):>13,d} "
                     f"{g('barriers'):>9,d} {g('fma'):>12,d}")
    lines.append(f"cost model: compulsory {t.compulsory_bytes:,.0f} bytes, "
                 f"{t.compulsory_flops:,.0f} flops; global traffic / compulsory = "
                 f"{t.traffic_ratio:.3f}, 2*FMA / flops = {t.fma_ratio:.3f}")
    return "\n".join(lines)


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _ints(text: str, what: str, nonnegative: bool = False) -> tuple[int, ...]:
    """Comma-separated integers, or the one-line error the CLI prints (a ValueError ended
    `--shape x=4,x8` and `--config WG=abc` in a traceback)."""
    try:
        got = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise InvalidArgumentError(f"{what}{text}: expected integers, e.g. {what}64,64.") from None
    if nonnegative and any(d < 0 for d in got):
        raise InvalidArgumentError(f"{what}{text}: sizes must be >= 0.")
    return got


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{what}{text}: expected an integer, e.g. {what}64.") from None


def _pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidArgumentError(f"{what} {item!r}: expected NAME=VALUE.")
        out[name.strip()] = value.strip()
    return out


def add_trace_parser(sub: Any) -> None:
    s = sub.add_parser("trace", help="per-launch memory traffic, barriers and FMAs of one call, "
                                     "counted on the Oclgrind simulator")
    s.add_argument("op")
    s.add_argument("--backend", default="opencl:oclgrind",
                   help="the simulator (opencl:oclgrind); the only device that counts")
    s.add_argument("--shape", action="append", default=None, metavar="NAME=d0,d1,...",
                   help="an operand's shape (repeat per operand), e.g. --shape a=64,64")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--param", action="append", default=None, metavar="NAME=VALUE",
                   help="an op parameter, e.g. --param causal=true")
    s.add_argument("--config", action="append", default=None, metavar="TUNABLE=INT",
                   help="a tunable override, e.g. --config BQ=16")
    s.add_argument("--schedule", default=None, choices=("gpu", "cpu"),
                   help="start from this device class's schedule (default: gpu, the "
                        "simulator's)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=main)


def main(args: argparse.Namespace) -> int:
    from ..runtime.selection import parse

    name, dev = parse(args.backend, "--backend")
    if not _is_simulator(name, dev):
        raise BackendUnavailable(f"portakern trace counts on the Oclgrind simulator only; got "
                                 f"--backend {args.backend}. Use --backend opencl:oclgrind.")
    shapes = {k: _ints(v, f"--shape {k}=", nonnegative=True)
              for k, v in _pairs(args.shape, "--shape").items()}
    params = {k: _value(v) for k, v in _pairs(args.param, "--param").items()}
    config = {k: _int(v, f"--config {k}=") for k, v in _pairs(args.config, "--config").items()}
    t = trace(args.op, shapes, dtype=args.dtype, params=params, config=config,
              schedule=args.schedule)
    print(json.dumps(t.as_dict(), indent=2, default=str) if args.json else format_trace(t))
    return 0


def _is_simulator(name: str, dev: str | None) -> bool:
    from ..backend.oclgrind import names_simulator

    return names_simulator(name, dev)
