"""Benchmark cases and suites: which ops, sizes and dtypes, and how long each may take.

``quick`` is sized for a 2-core CPU running PoCL (it must finish in under 5 minutes there):
each op at three or four sizes, fp32, with the large attention case (~34 GFLOP) measured
only a few times under the time box. ``full`` sweeps sizes and dtypes for GPUs; on a CPU it
takes long and its biggest cases are cut by the same time box rather than skipped.

Inputs are generated from the case alone (op, dtype, size, seed), so the numpy peer, which
runs in its own process, rebuilds exactly the arrays every other implementation gets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import dtypes
from ..errors import InvalidArgumentError
from .timing import TimingConfig

OPS = ("matmul", "softmax", "attention")


@dataclass(frozen=True)
class Case:
    """One benchmark problem: op, dtype, a size record and the op's parameters."""

    op: str
    dtype: str
    size: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def label(self) -> str:
        return size_label(self.op, self.size, self.params)

    @property
    def id(self) -> str:
        return f"{self.op}/{self.dtype}/{self.label}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        return cls(op=d["op"], dtype=d["dtype"], size=dict(d["size"]),
                   params=dict(d.get("params") or {}), seed=int(d.get("seed", 0)))


def size_label(op: str, size: dict[str, Any], params: dict[str, Any]) -> str:
    """A short, unique, human-readable name of a size (used as the case key in reports)."""
    if op == "matmul":
        M, N, K = size["M"], size["N"], size["K"]
        lab = f"N={N}" if M == N == K else f"M={M} N={N} K={K}"
        batch = size.get("batch") or []
        return (f"B={'x'.join(map(str, batch))} " + lab) if batch else lab
    if op == "softmax":
        return f"{size['rows']}x{size['cols']}"
    if op == "attention":
        lab = f"B{size['B']} H{size['Hq']} S{size['Sq']}"
        if size["Sk"] != size["Sq"]:
            lab += f" Sk{size['Sk']}"
        lab += f" D{size['D']}"
        if size["Dv"] != size["D"]:
            lab += f" Dv{size['Dv']}"
        if size["Hkv"] != size["Hq"]:
            lab += f" kv{size['Hkv']}"
        if params.get("causal"):
            lab += " causal"
        return lab
    return ",".join(f"{k}={v}" for k, v in sorted(size.items()))


def shapes(case: Case) -> dict[str, tuple[int, ...]]:
    """Operand shapes of a case, in the op's operand order."""
    s = case.size
    if case.op == "matmul":
        batch = tuple(s.get("batch") or ())
        return {"a": batch + (s["M"], s["K"]), "b": batch + (s["K"], s["N"])}
    if case.op == "softmax":
        return {"x": (s["rows"], s["cols"])}
    if case.op == "attention":
        return {"q": (s["B"], s["Hq"], s["Sq"], s["D"]), "k": (s["B"], s["Hkv"], s["Sk"], s["D"]),
                "v": (s["B"], s["Hkv"], s["Sk"], s["Dv"])}
    raise InvalidArgumentError(f"bench: no input recipe for op {case.op!r}; expected one of "
                               f"{OPS}. Add it to portakern/bench/suites.py.")


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Deterministic host inputs of a case (standard normal, rounded to the storage dtype)."""
    rng = np.random.default_rng(case.seed)
    st = dtypes.info(case.dtype).storage
    out = {}
    for name, shp in shapes(case).items():
        x = rng.standard_normal(shp, dtype=np.float32)
        out[name] = x if st == np.float32 else x.astype(st)
    return out


def _mm(n: int, m: int | None = None, k: int | None = None, batch: tuple[int, ...] = ()
        ) -> dict[str, Any]:
    return {"M": m or n, "N": n, "K": k or n, "batch": list(batch)}


def _att(s: int, d: int = 64, b: int = 1, h: int = 8, hkv: int | None = None,
         sk: int | None = None) -> dict[str, Any]:
    return {"B": b, "Hq": h, "Hkv": hkv or h, "Sq": s, "Sk": sk or s, "D": d, "Dv": d}


# (size, params) per op and suite, smallest first (``--limit N`` keeps the first N).
SIZES: dict[str, dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]] = {
    "quick": {
        "matmul": [(_mm(256), {}), (_mm(512), {}), (_mm(1024), {})],
        "softmax": [({"rows": 1024, "cols": 1024}, {}), ({"rows": 4096, "cols": 4096}, {}),
                    ({"rows": 8192, "cols": 4096}, {})],
        "attention": [(_att(512), {"causal": False}), (_att(1024), {"causal": False}),
                      (_att(1024, hkv=2), {"causal": False}), (_att(4096), {"causal": False})],
    },
    "full": {
        "matmul": [(_mm(n), {}) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
        + [(_mm(4096, m=4096, k=256), {}), (_mm(64, m=8192, k=1024), {}),
           (_mm(512, batch=(16,)), {})],
        "softmax": [({"rows": r, "cols": c}, {}) for r, c in
                    ((1024, 1024), (4096, 4096), (8192, 4096), (65536, 128), (4096, 32768),
                     (16384, 16384))],
        "attention": [(_att(s), {"causal": False}) for s in (512, 1024, 2048, 4096, 8192, 16384)]
        + [(_att(4096, d=128), {"causal": False}), (_att(2048, d=128, h=32, hkv=8),
                                                    {"causal": False}),
           (_att(2048, b=4, h=16), {"causal": False}), (_att(4096), {"causal": True})],
    },
}

DEFAULT_DTYPES = {"quick": ("float32",), "full": ("float32", "float16", "bfloat16")}

TIMING = {
    "quick": TimingConfig(min_time=0.2, min_reps=3, max_reps=200, budget_s=30.0),
    "full": TimingConfig(min_time=0.5, min_reps=5, max_reps=1000, budget_s=60.0),
}


def suite_cases(suite: str, ops: tuple[str, ...] | None = None,
                dtype_list: tuple[str, ...] | None = None, limit: int | None = None
                ) -> list[Case]:
    """The cases of a suite, op by op, dtype by dtype, smallest size first."""
    if suite not in SIZES:
        raise InvalidArgumentError(f"unknown suite {suite!r}; expected one of {sorted(SIZES)}.")
    ops = ops or OPS
    for op in ops:
        if op not in SIZES[suite]:
            raise InvalidArgumentError(f"bench: op {op!r} has no sizes in suite {suite!r}; "
                                       f"expected some of {sorted(SIZES[suite])}.")
    dts = dtype_list or DEFAULT_DTYPES[suite]
    for dt in dts:
        dtypes.info(dt)  # raises DTypeError naming the supported set
    if limit is not None and limit < 1:
        raise InvalidArgumentError(f"--limit must be >= 1; got {limit}.")
    cases = []
    for op in ops:
        for dt in dts:
            entries = SIZES[suite][op][:limit] if limit else SIZES[suite][op]
            for size, params in entries:
                cases.append(Case(op, dtypes.info(dt).name, dict(size), dict(params)))
    return cases
