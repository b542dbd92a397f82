"""Compile-only check: every registered op x dtype x default schedule, rendered in a
compile-only target's dialect and compiled for several architectures — no GPU, no driver.

Why: most machines that build and test portakern (CI included) have no NVIDIA or AMD GPU, yet
a source that does not compile is the first thing a GPU user would hit. NVRTC (the
``nvidia-cuda-nvrtc-cu12`` wheel) compiles CUDA C to PTX on any Linux box, and hipcc compiles
the hip dialect to AMDGPU code objects, so every rendered kernel is proven to compile for
compute_70/80/90 (Volta, Ampere, Hopper) and gfx906/gfx90a/gfx1030 here, with the options the
backends use at run time. Running the kernels still needs a GPU (benchmarks/gpu_check.sh).

What to compile with is the target's business: ``portakern.toolchains`` gives
each target (cuda: NVRTC, ``toolchains/nvrtc.py``; hip: hipcc, ``toolchains/hipcc.py``) as a record
whose hooks this module calls (``toolchain``, ``options``, ``refusal``, ``compile``); nothing
here names a toolchain.

``portakern check --backend cuda|hip --compile-only [--arch 80 ...]`` calls ``main``. A
failure prints the CompileError, which carries the numbered rendered source and the log.

Rendering needs a Problem, and a Problem needs operand shapes: ``representative_problems``
builds them from shape/dtype stand-ins (no data) that each op's spec declares in its
``examples`` field, chosen to cover what changes the rendered source (dtype, schedule, head
dims 64/40/80/111/128 for attention, plus a masked causal variant: the same source, mask and
causal are run-time flags). A spec without ``examples`` renders its ``example`` (or one from
its ``shapes``). Built-in and user ops are read the same way; nothing here names an op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import toolchains
from ..backend.cuda import COMPUTE_ARCHS
from ..core import codegen, dtypes, settings
from ..core.errors import CompileError, InvalidArgumentError, PortakernError
from ..core.spec import KernelSpec, Problem
from ..core.spec_checks import example_inputs
from ..ops import OPS, get_op
from ..toolchains import Compiled, CompileOnlyTarget

DEFAULT_ARCHS: tuple[str, ...] = COMPUTE_ARCHS  # the default target's: compute_70, 80, 90
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")

# One representative call: (label, operands as shape/dtype stand-ins, keyword parameters).
Representative = tuple[str, dict[str, object], dict[str, Any]]


def meta(shape: Sequence[int], dtype: Any) -> types.SimpleNamespace:
    """An array stand-in with only .shape and .dtype: all that spec validation reads."""
    return types.SimpleNamespace(shape=tuple(shape), dtype=dtype)


def spec_examples(spec: KernelSpec, dtype: str) -> list[Representative]:
    """The representative calls of ``spec`` in ``dtype``: its ``examples``, else its example
    (or one from its ``shapes``) labelled 'example', else none."""
    name = dtypes.info(dtype).name
    if spec.examples is not None:
        return [(str(label), dict(arrays), dict(params))
                for label, arrays, params in spec.examples(name)]
    got = example_inputs(spec, name)
    return [] if got is None else [("example", got[0], got[1])]


def representative_problems(spec: KernelSpec, dtype: str = "float32"
                            ) -> list[tuple[str, Problem]]:
    """Validated Problems that exercise what changes ``spec``'s rendered source.

    Empty when the spec gives no ``examples``, ``example`` or ``shapes`` (the check then
    reports it as skipped, not passed).
    """
    out = []
    for label, arrays, params in spec_examples(spec, dtype):
        arrs, prms = spec.bind((), {**arrays, **params})
        out.append((label, spec.problem(arrs, prms)))
    return out


# --- cases and results -------------------------------------------------------------------
@dataclass
class CompileCase:
    """One rendered source to compile for one architecture."""

    op: str
    dtype: str
    schedule: str
    problem: str
    arch: str
    source: str = ""
    error: PortakernError | None = None  # rendering failed (spec, config) before compiling
    label: str = ""  # how the arch is shown: compute_80 (default), gfx90a
    target: str = toolchains.DEFAULT  # the compile-only target (toolchains.get) it is for

    @property
    def arch_label(self) -> str:
        return self.label or f"compute_{self.arch}"

    @property
    def name(self) -> str:
        return f"{self.op}-{self.dtype}-{self.schedule}-{self.problem.replace(' ', '_')}-" \
               f"{self.arch_label}"


@dataclass
class CompileResult:
    case: CompileCase
    status: str  # 'ok' | 'FAIL' | 'skip'
    seconds: float = 0.0
    error: PortakernError | None = None
    ptx_bytes: int = 0
    shared_bytes: int = 0  # static shared memory / LDS per block (PTX / code object)
    reused: bool = False  # identical source and arch already compiled in this process
    note: str = ""
    kernels: list[dict[str, Any]] = field(default_factory=list)  # per-kernel metadata (hipcc)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        c = self.case
        d: dict[str, Any] = {"op": c.op, "dtype": c.dtype, "schedule": c.schedule,
                             "problem": c.problem, "arch": c.arch_label,
                             "status": self.status, "seconds": round(self.seconds, 4),
                             "ptx_bytes": self.ptx_bytes, "shared_bytes": self.shared_bytes,
                             "reused": self.reused}
        if c.source:
            d["source_hash"] = codegen.source_hash(c.source)
        if self.note:
            d["note"] = self.note
        if isinstance(self.error, CompileError):
            d["log"] = self.error.log
        elif self.error is not None:
            d["error"] = str(self.error)
        return d


def _target(case: CompileCase) -> CompileOnlyTarget:
    return toolchains.get(case.target)


def _result(case: CompileCase, got: Compiled) -> CompileResult:
    if not got.ok:
        return CompileResult(case, "FAIL", got.seconds, error=got.error(case.source))
    return CompileResult(case, "ok", got.seconds, ptx_bytes=got.object_bytes,
                         shared_bytes=got.shared_bytes, kernels=[dict(k) for k in got.kernels])


def _worker(job: tuple[str, str, str, tuple[str, ...], str]) -> Compiled:
    """One compile in a worker process (the target travels by name: its hooks are closures)."""
    target, source, arch, opts, name = job
    return toolchains.get(target).compile(source, arch, opts, name)


def default_jobs() -> int:
    """Worker processes for compile_all: $PORTAKERN_COMPILE_JOBS, else the CPUs (at most 8).

    NVRTC holds the GIL, so parallel compiles need processes, not threads.
    """
    jobs = settings.tools.compile_jobs
    if jobs is not None:
        return jobs
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return max(1, min(8, ncpu))


def cases(archs: Iterable[str] | None = None, ops: Iterable[str] | None = None,
          dtypes_: Iterable[str] | None = None,
          target: str | CompileOnlyTarget = toolchains.DEFAULT) -> list[CompileCase]:
    """Every (op, dtype, schedule, problem, arch) with its source rendered in ``target``'s
    dialect (nothing compiled yet); ``archs`` default to the target's."""
    tgt = toolchains.get(target) if isinstance(target, str) else target
    arch_list = [tgt.normalize_arch(a) for a in (tgt.default_archs if archs is None else archs)]
    op_names = list(OPS) if ops is None else list(ops)
    out: list[CompileCase] = []

    def each(op: str, dt: str, sched: str, label: str, src: str = "",
             err: PortakernError | None = None) -> list[CompileCase]:
        return [CompileCase(op, dt, sched, label, a, src, err, tgt.compile_label(a), tgt.name)
                for a in arch_list]

    for op in op_names:
        spec = get_op(op)
        for dt in (DEFAULT_DTYPES if dtypes_ is None else tuple(dtypes_)):
            dt = dtypes.info(dt).name
            try:
                probs = representative_problems(spec, dt)
            except PortakernError as exc:
                out += each(op, dt, "-", "-", err=exc)
                continue
            if not probs:
                out += each(op, dt, "-", "(none)")
                continue
            for label, prob in probs:
                for sched in sorted(spec.schedules) or ["gpu"]:
                    src, err = "", None
                    try:
                        cfg = spec.config(sched, None, prob)
                        src = spec.render(tgt.dialect, prob, cfg)
                    except PortakernError as exc:
                        err = exc
                    out += each(op, dt, sched, label, src, err)
    return out




MemoKey = tuple[str, str, str, tuple[str, ...]]
_MEMO: dict[MemoKey, CompileResult] = {}


def _options(case: CompileCase, options: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(_target(case).options() if options is None else options)


def _memo_key(case: CompileCase, opts: tuple[str, ...]) -> MemoKey:
    return (case.target, hashlib.sha256(case.source.encode()).hexdigest(), case.arch, opts)


def _file_name(case: CompileCase) -> str:
    return f"{case.op}{_target(case).suffix}"


def compile_case(case: CompileCase, options: Sequence[str] | None = None) -> CompileResult:
    """Compile one case with its target's compiler (identical target+source+arch+options
    compiled once per process); ``options`` default to the target's."""
    if case.error is not None:
        return CompileResult(case, "FAIL", error=case.error, note="rendering failed")
    if not case.source:
        return CompileResult(case, "skip", note=f"no representative problem for {case.op!r}; "
                             "give its KernelSpec `examples` (or `example`)")
    opts = _options(case, options)
    key = _memo_key(case, opts)
    prev = _MEMO.get(key)
    if prev is not None:
        return CompileResult(case, prev.status, 0.0, prev.error, prev.ptx_bytes,
                             prev.shared_bytes, reused=True,
                             note=f"same source as {prev.case.name}", kernels=prev.kernels)
    res = _result(case, _target(case).compile(case.source, case.arch, opts, _file_name(case)))
    _MEMO[key] = res
    return res




def compile_target_source(source: str, arch: str, name: str,
                          target: str | CompileOnlyTarget = toolchains.DEFAULT
                          ) -> CompileResult:
    """Compile one rendered source for ``target``; raise CompileError (log + numbered source)
    on failure. ``name`` is the file the compiler's messages name ('softmax.hip')."""
    tgt = toolchains.get(target) if isinstance(target, str) else target
    stem = name[:-len(tgt.suffix)] if name.endswith(tgt.suffix) else name
    arch = tgt.normalize_arch(arch)
    res = compile_case(CompileCase(stem, "-", "-", "-", arch, source,
                                   label=tgt.compile_label(arch), target=tgt.name))
    if res.error is not None:
        raise res.error
    return res




def compile_all(archs: Iterable[str] = DEFAULT_ARCHS, ops: Iterable[str] | None = None,
                dtypes: Iterable[str] | None = None,
                progress: Callable[[CompileResult], None] | None = None,
                options: Sequence[str] | None = None,
                jobs: int | None = None,
                target: str | CompileOnlyTarget = toolchains.DEFAULT) -> list[CompileResult]:
    """Render and compile every case; ``progress`` gets each result, in case order.

    An architecture the target's compiler refuses is an InvalidArgumentError (with its
    reason) before anything compiles. ``jobs`` > 1 compiles distinct sources in that many
    workers (default ``default_jobs()``); results are the same as serial, only sooner.
    """
    tgt = toolchains.get(target) if isinstance(target, str) else target
    arch_list = [tgt.normalize_arch(a) for a in archs]
    refused = {a: why for a in arch_list if (why := tgt.refusal(a))}
    if refused:
        raise InvalidArgumentError(
            "; ".join(f"{tgt.compile_label(a)}: {why}" for a, why in refused.items())
            + ". Pass --arch with one this compiler accepts.")
    return compile_cases(cases(arch_list, ops, dtypes, tgt), progress, options, jobs)


def compile_cases(todo: Sequence[CompileCase],
                  progress: Callable[[CompileResult], None] | None = None,
                  options: Sequence[str] | None = None, jobs: int | None = None
                  ) -> list[CompileResult]:
    """Compile the given cases (see compile_all); distinct sources in parallel workers:
    processes where the compiler holds the GIL (NVRTC), else threads (hipcc)."""
    import concurrent.futures

    jobs = default_jobs() if jobs is None else max(1, int(jobs))
    fresh: dict[MemoKey, CompileCase] = {}
    for c in todo:
        if c.source and c.error is None:
            key = _memo_key(c, _options(c, options))
            if key not in _MEMO:
                fresh.setdefault(key, c)
    pending: dict[MemoKey, Any] = {}
    pools: list[concurrent.futures.Executor] = []
    if jobs > 1 and len(fresh) > 1:
        pending = _submit(fresh, options, min(jobs, len(fresh)), pools)
    results = []
    try:
        for case in todo:
            key = _memo_key(case, _options(case, options)) if case.source else None
            fut = pending.pop(key, None) if key is not None else None
            got = None
            if fut is not None:  # the first case with this source: compiled by a worker
                try:
                    got = fut.result()
                except Exception:  # a worker died (e.g. killed): redo this one here
                    got = None
            if got is not None:
                res = _MEMO[key] = _result(case, got)
            else:
                res = compile_case(case, options)
            results.append(res)
            if progress is not None:
                progress(res)
    finally:
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def _submit(fresh: dict[MemoKey, CompileCase], options: Sequence[str] | None, workers: int,
            pools: list[Any]) -> dict[MemoKey, Any]:
    """Start one compile per distinct source: a process pool for targets whose compiler holds
    the GIL, a thread pool for the others. No processes here: {} (compiled serially)."""
    import concurrent.futures
    import multiprocessing

    pending: dict[MemoKey, Any] = {}
    by_kind: dict[bool, Any] = {}
    try:
        for key, c in fresh.items():
            tgt = _target(c)
            pool = by_kind.get(tgt.needs_processes)
            if pool is None:
                if tgt.needs_processes:  # spawn, not fork: the parent may hold threads
                    pool = concurrent.futures.ProcessPoolExecutor(
                        max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
                else:
                    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
                by_kind[tgt.needs_processes] = pool
                pools.append(pool)
            job = (c.target, c.source, c.arch, _options(c, options), _file_name(c))
            pending[key] = pool.submit(_worker, job)
    except (OSError, RuntimeError, ImportError):  # no workers here: compile serially
        pending.clear()
    return pending




# --- the command ------------------------------------------------------------------------
def _split(value: object) -> list[str] | None:
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    out = [p.strip() for it in items for p in str(it).split(",") if p.strip()]
    return out or None


@dataclass
class _Table:
    archs: list[str]
    rows: dict[tuple[str, str, str, str], dict[str, CompileResult]] = field(default_factory=dict)
    printed: int = 0
    label: Callable[[str], str] = lambda a: "compute_" + a

    def header(self) -> str:
        cols = "".join(f"{self.label(a):>12s}" for a in self.archs)
        return f"{'op':10s} {'dtype':9s} {'schedule':8s} {'problem':18s}{cols}"

    def add(self, r: CompileResult) -> str | None:
        c = r.case
        row = self.rows.setdefault((c.op, c.dtype, c.schedule, c.problem), {})
        row[c.arch] = r
        if len(row) < len(self.archs):
            return None
        cells = "".join(f"{row[a].status:>12s}" for a in self.archs)
        return f"{c.op:10s} {c.dtype:9s} {c.schedule:8s} {c.problem:18s}{cells}"



def _printer(table: _Table) -> Callable[[CompileResult], None]:
    """The per-result progress callback both compile-only checks print their table with."""

    def progress(r: CompileResult) -> None:
        line = table.add(r)
        if line is not None:
            print(line, flush=True)

    return progress

def main(args: argparse.Namespace) -> int:
    """``portakern check --backend cuda|hip --compile-only``: per target, the table of every
    op x dtype x schedule x architecture; non-zero when a case fails or a required
    architecture is refused."""
    try:
        targets = [toolchains.get(b) for b in
                   (_split(getattr(args, "backend", None)) or [toolchains.DEFAULT])]
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    rc = 0
    for target in {t.name: t for t in targets}.values():
        rc = max(rc, _check(target, args))
    return rc


def _check(target: CompileOnlyTarget, args: argparse.Namespace) -> int:
    """One target: its default (and further) architectures, or the ones given; each refused
    one listed with the compiler's reason (an error when it was required: given, or a
    default)."""
    try:
        tool = target.toolchain()
        given = [target.normalize_arch(a) for a in _split(getattr(args, "arch", None)) or ()]
        archs = list(dict.fromkeys(given or target.default_archs + target.further_archs))
        ops = _split(getattr(args, "ops", None))
        dts = _split(getattr(args, "dtypes", None))
        for op in ops or ():
            get_op(op)
        for dt in dts or ():
            dtypes.info(dt)
        opts = target.options()
        refused = {a: why for a in archs if (why := target.refusal(a))}
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    label = target.compile_label
    required = set(given or target.default_archs)
    accepted = [a for a in archs if a not in refused]
    print(f"portakern compile-only check: {tool}, dialect {target.dialect}, options "
          f"{' '.join(opts)}")
    print(f"targets accepted by this toolchain: {', '.join(map(label, accepted)) or '(none)'}")
    for a, why in refused.items():
        print(f"target {label(a)} not accepted{' (REQUIRED)' if a in required else ''}: {why}")
    table = _Table(accepted, label=label)
    print(table.header())
    progress = _printer(table)
    t0 = time.perf_counter()
    try:
        results = compile_cases(cases(accepted, ops, dts, target), progress, opts)
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.status == "FAIL"]
    skipped = [r for r in results if r.status == "skip"]
    _print_failures(failed)
    for r in {r.case.op: r for r in skipped}.values():
        print(f"SKIPPED {r.case.op}: {r.note}")
    missing = sorted(label(a) for a in required & set(refused))
    compiled = sum(1 for r in results if r.status != "skip" and not r.reused)
    print(f"\n{len(results)} cases ({compiled} compiled, "
          f"{sum(r.reused for r in results)} identical sources reused), {len(failed)} failed, "
          f"{len(skipped)} skipped, {len(refused)} targets not accepted"
          f"{' (' + ', '.join(missing) + ' required)' if missing else ''}, {wall:.1f} s")
    out = getattr(args, "out", None)
    if out:
        with open(out, "w") as f:
            json.dump({"kind": "compile-only", "target": target.name, "compiler": tool,
                       "options": list(opts), "archs": [label(a) for a in accepted],
                       "refused": {label(a): why for a, why in refused.items()},
                       "seconds": round(wall, 2),
                       "results": [r.as_dict() | {"kernels": r.kernels} for r in results]},
                      f, indent=1)
        print(f"results written to {out}")
    return 1 if failed or missing else 0


MAX_DUMPS = 8


def _print_failures(failed: list[CompileResult]) -> None:
    """One full dump (numbered source + log) per distinct error; the cases sharing it listed."""
    groups: dict[str, list[CompileResult]] = {}
    for r in failed:
        text = r.error.log if isinstance(r.error, CompileError) else str(r.error)
        groups.setdefault(text, []).append(r)
    for i, (_, rs) in enumerate(groups.items()):
        names = ", ".join(r.case.name for r in rs[:6]) + (f" (+{len(rs) - 6} more)"
                                                          if len(rs) > 6 else "")
        if i >= MAX_DUMPS:
            print(f"\nFAIL {names}: a further distinct error; narrow with --ops/--dtypes/--arch "
                  "to see it")
            continue
        print(f"\n===== FAIL {names}\n{rs[0].error}")
