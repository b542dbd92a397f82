"""``portakern resources OP``: what each GPU kernel of an op needs, read from the compilers
without a GPU, and the theoretical occupancy that follows.

For the op's default GPU schedule (and any ``--schedule`` or configuration given), rendered for
the op's first representative problem (``compile_check.representative_problems``: its spec's
``examples``, else its ``example``), each launched kernel is compiled and measured by the
compile-only target's hooks (``portakern.toolchains``: ``kernel_resources``,
``occupancy``); nothing here names a vendor or a toolchain:

* NVIDIA (``--backend cuda``): NVRTC's PTX for compute_XX, then ``ptxas -v --gpu-name sm_XX``:
  registers per thread, stack frame, spill stores/loads, barriers, static shared memory.
* AMD (``--backend hip``): hipcc's code object for gfxXXXX, its metadata: VGPRs (on gfx90a
  the unified VGPR+AGPR count), AGPRs, SGPRs, VGPR/SGPR spills, private (scratch) bytes per
  work-item, LDS bytes, and the ``s_barrier`` instructions.

Theoretical occupancy = resident warps (waves) per SM (CU) / the most the SM (CU) holds, from
the registers, shared memory / LDS and group size, with the per-architecture limits and
calculators in ``portakern.toolchains.ptxas`` (``ARCH_LIMITS`` sm_80, sm_90; ``occupancy``) and
``portakern.toolchains.hipcc`` (gfx906, gfx90a, gfx1030; gfx1030 per WGP, the compiler's default
mode). The limiting resource is named. What these figures cannot say: how fast the kernel
runs (memory traffic, latency hiding, bank conflicts, instruction mix), and whether the
run-time compiler
of a given driver allocates the same registers; they are a floor on waste (a spill or a
stack array is memory traffic a GPU pays on every access), not a prediction of time.

The floor held in CI (tests/tools/test_resources.py): default GPU schedules of every built-in op x
dtype on each target's ``floor_archs`` (sm_80, sm_90 and gfx90a) have no spills, no
stack/private bytes, and at least 25% occupancy, or the floor an op states in its module
docstring as ``Occupancy floor: N% for DTYPES`` with its justification.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core import codegen, dtypes
from ..core.errors import BackendUnavailable, PortakernError, ToolchainError
from ..core.spec import KernelSpec
from ..ops import get_op

DEFAULT_FLOOR = 0.25


@dataclass
class KernelReport:
    """One kernel of one op on one architecture (the --json fields first)."""

    kernel: str
    arch: str
    registers: int  # per thread / work-item (AMD: VGPRs, unified with AGPRs on gfx90a)
    spill_bytes: int  # bytes stored by spills per thread (AMD: 4 x spilled VGPRs)
    stack_bytes: int  # stack frame (NVIDIA) / private segment (AMD) per thread
    shared_bytes: int  # static shared memory / LDS per group
    occupancy: float | None  # theoretical, 0..1; None without a limits table for the arch
    op: str = ""
    dtype: str = ""
    schedule: str = ""
    problem: str = ""
    config: dict[str, int] = field(default_factory=dict)
    group_size: int = 0
    spill_loads: int = 0
    barriers: int = 0
    sgpr: int | None = None
    agpr: int | None = None
    # matrix-unit instructions (HMMA; v_mfma/v_wmma); None where they cannot be read here
    matrix_instructions: int | None = None
    resident: int = 0  # warps / waves per SM / CU (WGP for gfx1030)
    resident_max: int = 0
    limiter: str = ""
    unit: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["occupancy"] = None if self.occupancy is None else round(self.occupancy, 4)
        return d

    @property
    def clean(self) -> bool:
        return self.spill_bytes == 0 and self.spill_loads == 0 and self.stack_bytes == 0


# --- floors ------------------------------------------------------------------------------
_FLOOR = re.compile(r"occupancy floor:\s*([\d.]+)\s*%(?:\s+for\s+([\w, ]+?))?\s*[.;:(\n]",
                    re.I)


def occupancy_floor(spec: KernelSpec, dtype: str) -> float:
    """The op's stated floor for ``dtype`` ('Occupancy floor: 12.5% for float64.' in the op
    module's docstring), else 25%."""
    mod = sys.modules.get(getattr(spec.semantics, "__module__", "") or "")
    text = " ".join(x for x in (getattr(mod, "__doc__", "") or "", spec.doc or "") if x)
    for pct, which in _FLOOR.findall(text + "\n"):
        names = {w.strip() for w in re.split(r"[,\s]+", which or "") if w.strip()} - {"and"}
        if not names or dtype in names:
            return float(pct) / 100.0
    return DEFAULT_FLOOR


# --- measuring ---------------------------------------------------------------------------
def render(spec: KernelSpec, dialect: str, dtype: str, schedule: str = "gpu",
           config: Mapping[str, int] | None = None, problem: int = 0, arch: str | None = None
           ) -> tuple[str, str, dict[str, int], dict[str, int]]:
    """(problem label, rendered source, config, {kernel: group size}) for the op's
    representative problem number ``problem``. ``arch`` ('sm_80', 'gfx90a'): the device's
    matrix units, where it has them, give the fragment lowering and (schedule gpu) the
    spec's "mma" schedule, as on the device itself."""
    from .compile_check import representative_problems

    probs = representative_problems(spec, dtype)
    if not probs:
        raise PortakernError(f"{spec.name}: no representative problem to render resources "
                             "for; give its KernelSpec `examples` (or `example`, or `shapes`) "
                             "and register it again.")
    label, prob = probs[problem]
    low = codegen.lowering(dialect, arch)
    cfg = spec.config(schedule, dict(config) if config else None, prob,
                      matrix=low.native and schedule == "gpu")
    src = spec.render(dialect, prob, cfg, low)
    sizes: dict[str, int] = {}
    for launch in spec.launches(prob, cfg):
        n = launch.local[0] * launch.local[1] * launch.local[2]
        sizes[launch.kernel] = max(sizes.get(launch.kernel, 0), n)
    return label, src, cfg, sizes


def measure(op: str, backend: str = "cuda", arch: str | None = None, dtype: str = "float32",
            schedule: str = "gpu", config: Mapping[str, int] | None = None, problem: int = 0
            ) -> list[KernelReport]:
    """Resources and occupancy of each kernel the op launches (BackendUnavailable without the
    tool; CompileError when the kernel does not compile)."""
    from .. import toolchains

    target = toolchains.get(backend)
    spec = get_op(op)
    dtype = dtypes.info(dtype).name
    arch = target.normalize_arch(arch or target.resource_archs[0])
    label, src, cfg, sizes = render(spec, target.dialect, dtype, schedule, config, problem,
                                    target.arch_label(arch))
    base = {"op": spec.name, "dtype": dtype, "schedule": schedule, "problem": label,
            "config": dict(cfg)}
    out = []
    for k in target.kernel_resources(src, arch, f"{spec.name}{target.suffix}"):
        if k.kernel not in sizes:
            continue  # compiled but not launched by this schedule (e.g. attention_pack_kv)
        n = sizes[k.kernel]
        rep = KernelReport(k.kernel, target.arch_label(arch), k.registers, k.spill_stores,
                           k.stack_bytes, k.shared_bytes, None, group_size=n,
                           spill_loads=k.spill_loads, barriers=k.barriers, sgpr=k.sgpr,
                           agpr=k.agpr, matrix_instructions=k.matrix_instructions,
                           unit=target.unit, **base)
        occ = target.occupancy(arch, n, k)
        if occ is not None:
            rep.resident, rep.resident_max, rep.limiter, rep.unit = occ
            rep.occupancy = rep.resident / rep.resident_max
        out.append(rep)
    return out


# --- the command -------------------------------------------------------------------------
def _split(values: Iterable[str] | None) -> list[str]:
    return [p.strip() for v in values or () for p in str(v).split(",") if p.strip()]


def format_table(reports: Sequence[KernelReport]) -> str:
    head = (f"{'kernel':18s} {'dtype':9s} {'arch':8s} {'regs':>5s} {'sgpr':>5s} {'agpr':>5s} "
            f"{'spill B':>8s} {'stack B':>8s} {'shared B':>9s} {'bar':>4s} {'mma':>5s} "
            f"{'group':>6s} "
            f"{'occupancy':>22s}  limited by")
    lines = [head]
    for r in reports:
        occ = "n/a (no limits table)" if r.occupancy is None else \
            f"{r.occupancy:5.1%} ({r.resident}/{r.resident_max} {'warps' if r.unit == 'SM' else 'waves'}/{r.unit})"  # noqa: E501
        lines.append(
            f"{r.kernel:18s} {r.dtype:9s} {r.arch:8s} {r.registers:5d} "
            f"{'-' if r.sgpr is None else r.sgpr:>5} {'-' if r.agpr is None else r.agpr:>5} "
            f"{r.spill_bytes:8d} {r.stack_bytes:8d} {r.shared_bytes:9d} {r.barriers:4d} "
            f"{'-' if r.matrix_instructions is None else r.matrix_instructions:>5} "
            f"{r.group_size:6d} {occ:>22s}  {r.limiter}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from .. import toolchains

    try:
        backends = _split(args.backend) or toolchains.names()
        targets = [toolchains.get(b) for b in backends]
        dts = _split(args.dtype) or ["float32"]
        if dts == ["all"]:
            dts = ["float32", "float16", "bfloat16", "float64"]
        dts = [dtypes.info(d).name for d in dts]
        schedules = _split(args.schedule) or ["gpu"]
        config = {}
        for item in _split(args.config):
            k, _, v = item.partition("=")
            config[k.strip()] = int(v)
        get_op(args.op)
    except (PortakernError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    reports: list[KernelReport] = []
    problems: list[tuple[str, str]] = []  # (printed as: error | unavailable | FAIL, what)
    rc = 0
    for t in targets:
        archs = [t.normalize_arch(a) for a in _split(args.arch)
                 if _arch_belongs(t, a)] or list(t.resource_archs)
        for arch in archs:
            for dt in dts:
                for sched in schedules:
                    try:
                        reports += measure(args.op, t.name, arch, dt, sched, config or None)
                    except BackendUnavailable as exc:  # no tool, or a broken one: next target
                        broken = isinstance(exc, ToolchainError)
                        where = f"{t.name} {t.arch_label(arch)}" if broken else t.name
                        problems.append(("error" if broken else "unavailable", f"{where}: {exc}"))
                        rc = 2
                        break
                    except PortakernError as exc:
                        problems.append(("FAIL", f"{t.name} {arch} {dt} {sched}: {exc}"))
                        rc = max(rc, 1)
                else:
                    continue
                break
    if args.json:
        print(json.dumps({"op": args.op, "kernels": [r.as_dict() for r in reports],
                          "problems": [p for _, p in problems]}, indent=1))
    else:
        if reports:
            r0 = reports[0]
            print(f"{args.op}: problem {r0.problem}, schedule(s) {', '.join(schedules)}")
            print(format_table(reports))
        for how, p in dict.fromkeys(problems):
            print(f"{how}: {p}")
        print("theoretical occupancy from registers, shared memory/LDS and group size "
              "(portakern/tools/resources.py); a static figure, not a measured speed")
    return rc


def _arch_belongs(target: Any, arch: str) -> bool:
    try:
        target.normalize_arch(arch)
        return True
    except PortakernError:
        return False


def floor_violations(reports: Iterable[KernelReport]) -> list[str]:
    """Why each report misses the floor (spills, stack/private bytes, occupancy)."""
    out = []
    for r in reports:
        why = []
        if r.spill_bytes or r.spill_loads:
            why.append(f"spills {r.spill_bytes} B stored / {r.spill_loads} B loaded")
        if r.stack_bytes:
            why.append(f"{r.stack_bytes} B of stack/private memory")
        floor = occupancy_floor(get_op(r.op), r.dtype)
        if r.occupancy is not None and r.occupancy + 1e-9 < floor:
            why.append(f"occupancy {r.occupancy:.1%} < floor {floor:.1%} "
                       f"(limited by {r.limiter}, {r.registers} registers)")
        if why:
            out.append(f"{r.op} {r.dtype} {r.kernel} on {r.arch}: " + "; ".join(why))
    return out


def add_resources_parser(sub: Any) -> None:
    s = sub.add_parser("resources", help="registers, spills, stack, shared memory and "
                       "theoretical occupancy of an op's GPU kernels (no GPU needed)")
    s.add_argument("op")
    s.add_argument("--backend", action="append", default=None,
                   help="cuda (NVRTC + ptxas) and/or hip (hipcc); default both")
    s.add_argument("--arch", action="append", default=None,
                   help="sm_80, sm_90, gfx90a, gfx1030, ... (default sm_80, sm_90, gfx90a, "
                        "gfx1030)")
    s.add_argument("--dtype", action="append", default=None,
                   help="float32 (default), float16, bfloat16, float64 or all")
    s.add_argument("--schedule", action="append", default=None,
                   help="schedule(s) to report (default gpu)")
    s.add_argument("--config", action="append", default=None,
                   help="tunable overrides, e.g. BK=16,BQ=128")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=main)


# --- static tuning: rank candidate schedules without the GPU ---------------------------------
STATIC_NAMESPACE = "tuning-static"


def static_candidates(spec: KernelSpec, base: Mapping[str, int], limit: int
                      ) -> list[dict[str, int]]:
    """The GPU schedule, then every one-tunable change of it (its domain, nearest first)."""
    out = [dict(base)]
    for t in spec.tunables:
        dom = sorted(t.domain, key=lambda v: (abs(math.log2(max(v, 1) + 1)
                                                  - math.log2(max(base[t.name], 1) + 1)), v))
        for v in dom:
            if v != base[t.name]:
                out.append({**base, t.name: v})
    return out[:limit]


def static_tune(op: str, backend: str, dtype: str = "float32", max_candidates: int = 24,
                save: bool = True, say: Any = print) -> dict[str, Any]:
    """``portakern tune OP --backend cuda|hip --static``: compile candidate schedules for the
    target's resource architectures, reject any that spills or uses stack/private memory,
    rank the rest by their worst occupancy (then fewer registers), and record the winner as a
    *static* choice (not used by ops: it waits for a GPU to confirm it by measurement)."""
    from .. import toolchains
    from ..core.cache import Store
    from ..core.errors import CompileError

    target = toolchains.get(backend)
    spec = get_op(op)
    dtype = dtypes.info(dtype).name
    gpu = spec.config("gpu")
    rows = []
    for cand in static_candidates(spec, gpu, max_candidates):
        try:
            reps = [r for a in target.resource_archs
                    for r in measure(op, target.name, a, dtype, "gpu", cand)]
        except CompileError as exc:
            say(f"  {_cfg(cand)}: does not compile ({str(exc).splitlines()[0][:80]})")
            continue
        except BackendUnavailable:  # no tool or a broken one: not the candidate's fault
            raise
        except PortakernError as exc:  # outside the domain, invalid for the problem
            say(f"  {_cfg(cand)}: rejected ({str(exc).splitlines()[0][:80]})")
            continue
        spill = any(not r.clean for r in reps)
        occ = min((r.occupancy or 0.0) for r in reps)
        regs = max(r.registers for r in reps)
        rows.append((cand, spill, occ, regs, reps))
        say(f"  {_cfg(cand)}: {'SPILLS, rejected' if spill else 'no spills'}, worst "
            f"occupancy {occ:.1%}, {regs} registers")
    ok = sorted((r for r in rows if not r[1]), key=lambda r: (-r[2], r[3], r[0] != gpu))
    if not ok:
        say(f"static tuning of {op} on {target.name}: every candidate spills or fails")
        return {"op": op, "best": None}
    best, _, occ, regs, reps = ok[0]
    entry = {"op": op, "backend": target.name, "dtype": dtype,
             "archs": [target.arch_label(a) for a in target.resource_archs],
             "config": best, "static": True, "confirmed": False,
             "basis": "static figures only (no spills, worst occupancy, registers); confirm "
                      "with `portakern tune` on the GPU",
             "occupancy": round(occ, 4), "registers": regs,
             "candidates": len(rows), "rejected_spilling": sum(1 for r in rows if r[1]),
             "kernels": [r.as_dict() for r in reps]}
    say(f"static choice for {op} {dtype} on {target.name} "
        f"({', '.join(entry['archs'])}): {_cfg(best)} — worst occupancy {occ:.1%}, {regs} "
        f"registers; {entry['rejected_spilling']} of {len(rows)} candidates rejected for "
        "spilling. STATIC: not used until a GPU run confirms it.")
    if save:
        st = Store(STATIC_NAMESPACE)
        key = f"{op}-{target.name}-{dtype}"
        if st.put(key, entry):
            say(f"recorded as a static choice in {st.path} ({key})")
    return {"op": op, "best": best, "entry": entry}


def _cfg(cfg: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())
