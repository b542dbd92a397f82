"""`portakern check`: the shared properties as a conformance run on this machine's devices.

What a user runs on a new device or driver: every registered op x dtype on every available
target, random edge-case shapes and values (portakern.tools.cases), each compared with the float64
oracle through portakern.verify (the code path of pk.verify and the test suite): the op's
worst-case bound and, for ops with a probabilistic error model, its statistical check (on a
C-kernel backend with the op's model of its own kernel's summation order where it has one,
``statistical_ordered``; elsewhere the order-free ``statistical``). An op
with several outputs is judged on each (its verdict names the output), int32 outputs exactly.
Prints op x backend x dtype with pass/fail and both ratios (worst |err|/bound over every
element of every case; the largest statistic T/tau of any case; <= 1 passes), writes a
result file naming device, driver and versions, and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import zlib
from typing import Any

import numpy as np

from .._version import __version__
from ..backend import registry
from ..core import dtypes
from ..core.errors import PortakernError
from ..core.sampling import Chooser, NumpyChooser
from ..core.spec_checks import no_generator_reason
from ..ops import OPS, plugin_errors
from ..runtime import selection
from .cases import case_generator

DEFAULT_EXAMPLES = 25  # random cases per op x dtype (--examples)
SIMULATOR_EXAMPLES = 4  # ... on a simulator (an interpreter), unless --examples says


class SimulatorChooser(Chooser):
    """A chooser for simulators: integer options above ``cap`` are dropped (the smallest is
    kept when all are above), so every case generator — built-in, a spec's own ``cases`` or
    one derived from its ``shapes`` — draws shapes an interpreter runs in seconds, still with
    1, primes and the tile sizes +- 1 up to ``cap``. Other options pass through."""

    def __init__(self, inner: Chooser, cap: int = 65) -> None:
        self.inner, self.cap = inner, cap

    def choice(self, options: Any) -> Any:
        opts = list(options)
        if opts and all(isinstance(o, int) and not isinstance(o, bool) for o in opts):
            opts = [o for o in opts if o <= self.cap] or [min(opts)]
        return self.inner.choice(opts)

    def boolean(self, p: float = 0.5) -> bool:
        return self.inner.boolean(p)

    def seed(self) -> int:
        return self.inner.seed()


def targets(requested: list[str] | None) -> tuple[list[str], dict[str, str]]:
    if requested:
        return list(requested), {}
    return registry.available_targets()


def run_check(target: str, op: str, dtype: str, examples: int | None, seed: int
              ) -> dict[str, Any]:
    be = selection.get(target)
    spec = OPS[op]
    if dtype not in be.supported_dtypes():
        return {"status": "n/a", "why": f"{be.describe()} does not support {dtype}"}
    gen = case_generator(spec)  # built-in table, else the spec's own or derived generator
    if gen is None:
        return {"status": "n/a", "why": no_generator_reason(spec)}
    # a seed that is the same in every process (hash(op) is salted per process: --seed did
    # not reproduce a run) and differs per op and dtype (len(dtype) did not: float16, float32
    # and float64 drew one case stream)
    ch = NumpyChooser(np.random.default_rng([seed, zlib.crc32(f"{op}/{dtype}".encode())]))
    simulator = getattr(be, "simulator", False)
    if simulator:  # opencl:oclgrind interprets: simulator-sized cases
        ch = SimulatorChooser(ch)
    if examples is None:
        examples = SIMULATOR_EXAMPLES if simulator else DEFAULT_EXAMPLES
    from ..runtime.verify import compare_arrays, native_matrix_unit, own_kernel

    worst, worst_case, t0 = 0.0, "", time.perf_counter()
    stat: float | None = None
    stat_case = ""
    for _ in range(examples):
        case = gen(ch, dtype)
        try:
            got = _to_host(be, spec_call(op, target, case))
        except PortakernError as exc:
            return {"status": "FAIL", "why": f"{type(exc).__name__}: {exc}"[:2000],
                    "case": case.describe()}
        arrays, params = spec.bind((), dict(case.arrays) | case.params)
        v = compare_arrays(spec, arrays, params, got, ordered=own_kernel(be),
                           matrix_unit=native_matrix_unit(be))
        if v.worst_ratio >= worst:
            worst, worst_case = v.worst_ratio, f"{case.describe()} {v.where}"
        if v.stat_ratio is not None and (stat is None or v.stat_ratio >= stat):
            stat, stat_case = v.stat_ratio, f"{case.describe()} {v.checks[-1].detail}"
        if not v.ok:
            return {"status": "FAIL", "worst_ratio": worst, "stat_ratio": stat,
                    "case": f"{case.describe()}\n{v}"}
    return {"status": "pass", "worst_ratio": worst, "stat_ratio": stat, "examples": examples,
            "seconds": round(time.perf_counter() - t0, 3), "case": worst_case,
            "stat_case": stat_case}


def _to_host(be: Any, got: Any) -> Any:
    """A call's result on host: one array, or a tuple of them (an op with several outputs)."""
    if isinstance(got, tuple):
        return tuple(_to_host(be, g) for g in got)
    return be.to_numpy(got) if be.is_native(got) else got


def spec_call(op: str, target: str, case: Any) -> Any:
    from ..api import call

    return call(op, backend=target, **case.arrays, **case.params)


def main(args: argparse.Namespace) -> int:
    tlist, skipped = targets(args.backend)
    # names as the CLI validated them: stripped ("float32, float64" once checked float64 as
    # " float64", n/a on every backend, and passed)
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(OPS)
    dts = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else list(
        dtypes.FLOAT_DTYPES)
    results: list[dict[str, Any]] = []
    failed = False
    print(f"{'op':10s} {'backend':12s} {'dtype':9s} {'result':6s} {'worst err/bound':>15s} "
          f"{'stat T/tau':>10s}")
    for target in tlist:
        try:
            be = selection.get(target)
        except PortakernError as exc:
            print(f"{'*':10s} {target:12s} {'*':9s} FAIL   {exc}")
            failed = True
            continue
        for op in ops:
            for dt in dts:
                r = run_check(target, op, dt, args.examples, args.seed)
                r.update(op=op, backend=target, dtype=dt, device=be.device.as_dict())
                results.append(r)
                failed |= r["status"] == "FAIL"
                ratio = f"{r['worst_ratio']:.3g}" if "worst_ratio" in r else "-"
                sr = f"{r['stat_ratio']:.3g}" if r.get("stat_ratio") is not None else "-"
                print(f"{op:10s} {target:12s} {dt:9s} {r['status']:6s} {ratio:>15s} {sr:>10s}"
                      f"{'  ' + r.get('why', '') if r['status'] != 'pass' else ''}", flush=True)
                if r["status"] == "FAIL" and r.get("case"):
                    print(f"    failing case: {r['case']}")
    for name, why in skipped.items():
        print(f"NOT CHECKED: {name}: {why}")
    for name, why in plugin_errors().items():
        print(f"OP PLUGIN NOT LOADED: {name}: {why}")
    doc = {"portakern": __version__, "python": sys.version.split()[0],
           "machine": platform.machine(), "node": platform.node(),
           "versions": {n: registry.availability(n).versions for n in registry.names()},
           "skipped": skipped, "op_plugin_errors": plugin_errors(), "results": results,
           "passed": not failed and any(r["status"] == "pass" for r in results)}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        print(f"wrote {args.out}")
    passes = sum(r["status"] == "pass" for r in results)
    counts = (f" ({passes} pass, {sum(r['status'] == 'FAIL' for r in results)} fail, "
              f"{sum(r['status'] == 'n/a' for r in results)} n/a)")
    if not failed and not passes:  # a check that checked nothing must not read as passed
        print("conformance: NOTHING CHECKED" + counts + ": every result is n/a (see the why "
              "column); give the op a case generator (cases=) or choose another dtype or "
              "backend")
        return 1
    print("conformance: " + ("FAILED" if failed else "passed") + counts)
    return 1 if failed else 0
