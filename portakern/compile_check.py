"""Compile-only check: every registered op x dtype x default schedule, rendered in the CUDA
dialect and compiled by NVRTC for several virtual architectures — no GPU and no driver needed.

Why: most machines that build and test portakern (CI included) have no NVIDIA GPU, yet a CUDA
source that does not compile is the first thing a GPU user would hit. NVRTC (the
``nvidia-cuda-nvrtc-cu12`` wheel, driven through ``cupy_backends``) compiles CUDA C to PTX on
any Linux box, so every rendered kernel is proven to compile for compute_70/80/90 (Volta,
Ampere, Hopper) here, with the same options the cuda backend uses at run time
(``portakern.backends.cuda.compile_options``). Running the kernels still needs a GPU
(benchmarks/gpu_check.sh).

``portakern check --backend cuda --compile-only [--arch 80 ...]`` calls ``main``. A failure
prints the CompileError, which carries the numbered rendered source and the NVRTC log.

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
import re
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import codegen, dtypes, settings
from .backends.cuda import COMPUTE_ARCHS, normalize_arch  # noqa: F401 (re-exported)
from .errors import BackendUnavailable, CompileError, InvalidArgumentError, PortakernError
from .ops import OPS, get_op
from .spec import KernelSpec, Problem
from .spec_check import example_inputs

DEFAULT_ARCHS: tuple[str, ...] = COMPUTE_ARCHS  # compute_70, 80, 90
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
DIALECT = "cuda"
# Static __shared__ per block: 48 KiB on every CUDA architecture (more only via dynamic shared
# memory and an opt-in attribute). PTX does not enforce it, ptxas does; compiling to PTX skips
# ptxas, so the check reads the PTX's .shared declarations instead (cheap, and what ptxas adds).
STATIC_SHARED_LIMIT = 48 * 1024
_SHARED_DECL = re.compile(
    r"^\s*\.shared\s+(?:\.align\s+\d+\s+)?\.[bsuf](8|16|32|64)\s+[\w$.]+(\[(\d*)\])?\s*;",
    re.M)

# One representative call: (label, operands as shape/dtype stand-ins, keyword parameters).
Representative = tuple[str, dict[str, object], dict[str, Any]]
ProblemMaker = Callable[[Any], list[Representative]]


def meta(shape: Sequence[int], dtype: Any) -> types.SimpleNamespace:
    """An array stand-in with only .shape and .dtype: all that spec validation reads."""
    return types.SimpleNamespace(shape=tuple(shape), dtype=dtype)


def register_representative(op: str, maker: ProblemMaker) -> KernelSpec:
    """Give a registered op the shapes the compile check renders it with (kept for callers
    of earlier versions; prefer the spec's own ``examples`` field).

    ``maker(storage_dtype)`` returns [(label, {operand: meta(shape, dtype)}, {param: value})].
    The op is re-registered with ``examples`` built from ``maker``; the new spec is returned.
    """
    from .ops import register_op

    def examples(dtype: str) -> list[Representative]:
        return list(maker(dtypes.info(dtype).storage))

    return register_op(get_op(op).replace(examples=examples), replace=True)


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
    error: PortakernError | None = None  # rendering failed (spec, config) before NVRTC ran
    label: str = ""  # how the arch is shown: compute_80 (default), gfx90a

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
    shared_bytes: int = 0  # static shared memory per block, from the PTX
    reused: bool = False  # identical source and arch already compiled in this process
    note: str = ""
    kernels: list[dict[str, Any]] = field(default_factory=list)  # per-kernel resources (hip)

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


def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:
        raise BackendUnavailable(
            f"NVRTC is not importable ({type(exc).__name__}: {exc}); the compile-only check "
            "needs it. Fix: pip install 'portakern[cuda]'.") from None
    return nvrtc


def supported_archs() -> tuple[str, ...]:
    """Architectures this NVRTC can target (e.g. 50 ... 121)."""
    return tuple(str(a) for a in _nvrtc().getSupportedArchs())


def base_options() -> tuple[str, ...]:
    """The cuda backend's run-time options: what is checked here is what runs there."""
    from .backends.cuda import compile_options

    return compile_options()


def static_shared_bytes(ptx: str | bytes) -> int:
    """Bytes of static shared memory a module declares (its kernels together: an upper bound
    for each; our sources have one entry point)."""
    text = ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx
    total = 0
    for bits, brackets, n in _SHARED_DECL.findall(text):
        count = 1 if not brackets else int(n) if n else 0  # x; x[N]; extern x[] (dynamic)
        total += int(bits) // 8 * count
    return total


@dataclass(frozen=True)
class _Raw:
    """What one NVRTC run produced, in plain data (crosses process boundaries)."""

    ptx: bytes | None
    headline: str
    log: str
    options: tuple[str, ...]
    seconds: float


def _compile_raw(source: str, arch: str, options: tuple[str, ...], name: str) -> _Raw:
    """One NVRTC program -> PTX, then the static shared-memory limit ptxas would enforce."""
    nvrtc = _nvrtc()
    from .backends.cuda import compile_error_message

    arch = normalize_arch(arch)
    opts = tuple(options) + (f"--gpu-architecture=compute_{arch}",)
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as exc:
            try:
                log = nvrtc.getProgramLog(prog) or str(exc)
            except Exception:
                log = str(exc)
            head = compile_error_message(f"NVRTC failed to compile {name} for compute_{arch}",
                                         log)
            return _Raw(None, head, log, opts, time.perf_counter() - t0)
        ptx = bytes(nvrtc.getPTX(prog))
    finally:
        try:
            nvrtc.destroyProgram(prog)
        except Exception:
            pass
    shared = static_shared_bytes(ptx)
    if shared > STATIC_SHARED_LIMIT:
        log = (f"static shared memory: {shared} bytes declared, more than the "
               f"{STATIC_SHARED_LIMIT} bytes (48 KiB) a block may declare statically on any CUDA "
               "architecture; ptxas would refuse it ('uses too much shared data').")
        return _Raw(None, f"{name} for compute_{arch} needs too much shared memory; lower the "
                    "tile tunables", log, opts, time.perf_counter() - t0)
    return _Raw(ptx, "", "", opts, time.perf_counter() - t0)


def _error(raw: _Raw, source: str, arch: str) -> CompileError:
    return CompileError(raw.headline, source=source, log=raw.log, options=raw.options,
                        device=f"NVRTC compute_{normalize_arch(arch)} (compile only)")


def compile_source(source: str, arch: str, options: Sequence[str] | None = None,
                   name: str = "portakern.cu") -> bytes:
    """Compile one rendered source to PTX for compute_<arch>; raise CompileError on failure.

    One NVRTC program per call (~0.1-0.4 s): a failure belongs to exactly one case.
    """
    opts = tuple(base_options() if options is None else options)
    raw = _compile_raw(source, arch, opts, name)
    if raw.ptx is None:
        raise _error(raw, source, arch)
    return raw.ptx


def _result(case: CompileCase, raw: _Raw) -> CompileResult:
    if raw.ptx is None:
        return CompileResult(case, "FAIL", raw.seconds, error=_error(raw, case.source, case.arch))
    return CompileResult(case, "ok", raw.seconds, ptx_bytes=len(raw.ptx),
                         shared_bytes=static_shared_bytes(raw.ptx))


def _worker(job: tuple[str, str, tuple[str, ...], str]) -> _Raw:
    return _compile_raw(*job)


def default_jobs() -> int:
    """Worker processes for compile_all: $PORTAKERN_COMPILE_JOBS, else the CPUs (at most 8).

    NVRTC holds the GIL, so parallel compiles need processes, not threads.
    """
    jobs = settings.get("PORTAKERN_COMPILE_JOBS")
    if jobs:
        return int(jobs)
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return max(1, min(8, ncpu))


def cases(archs: Iterable[str] = DEFAULT_ARCHS, ops: Iterable[str] | None = None,
          dtypes_: Iterable[str] | None = None, dialect: str = DIALECT,
          normalize: Callable[[str], str] = normalize_arch) -> list[CompileCase]:
    """Every (op, dtype, schedule, problem, arch) with its rendered source (no NVRTC yet)."""
    arch_list = [normalize(a) for a in archs]
    op_names = list(OPS) if ops is None else list(ops)
    out: list[CompileCase] = []
    for op in op_names:
        spec = get_op(op)
        for dt in (DEFAULT_DTYPES if dtypes_ is None else tuple(dtypes_)):
            dt = dtypes.info(dt).name
            try:
                probs = representative_problems(spec, dt)
            except PortakernError as exc:
                out += [CompileCase(op, dt, "-", "-", a, error=exc) for a in arch_list]
                continue
            if not probs:
                out += [CompileCase(op, dt, "-", "(none)", a) for a in arch_list]
                continue
            for label, prob in probs:
                for sched in sorted(spec.schedules) or ["gpu"]:
                    src, err = "", None
                    try:
                        cfg = spec.config(sched, None, prob)
                        src = spec.render(dialect, prob, cfg)
                    except PortakernError as exc:
                        err = exc
                    out += [CompileCase(op, dt, sched, label, a, src, err) for a in arch_list]
    return out


_MEMO: dict[tuple[str, str, tuple[str, ...]], CompileResult] = {}


def compile_case(case: CompileCase, options: Sequence[str] | None = None) -> CompileResult:
    """Compile one case (identical source+arch+options compiled once per process)."""
    if case.error is not None:
        return CompileResult(case, "FAIL", error=case.error, note="rendering failed")
    if not case.source:
        return CompileResult(case, "skip", note=f"no representative problem for {case.op!r}; "
                             "give its KernelSpec `examples` (or `example`)")
    opts = tuple(base_options() if options is None else options)
    key = _memo_key(case, opts)
    prev = _MEMO.get(key)
    if prev is not None:
        return CompileResult(case, prev.status, 0.0, prev.error, prev.ptx_bytes,
                             prev.shared_bytes, reused=True,
                             note=f"same source as {prev.case.name}")
    res = _result(case, _compile_raw(case.source, case.arch, opts, f"{case.op}.cu"))
    _MEMO[key] = res
    return res


def _memo_key(case: CompileCase, opts: tuple[str, ...]) -> tuple[str, str, tuple[str, ...]]:
    return (hashlib.sha256(case.source.encode()).hexdigest(), case.arch, opts)


def compile_all(archs: Iterable[str] = DEFAULT_ARCHS, ops: Iterable[str] | None = None,
                dtypes: Iterable[str] | None = None,
                progress: Callable[[CompileResult], None] | None = None,
                options: Sequence[str] | None = None,
                jobs: int | None = None) -> list[CompileResult]:
    """Render and compile every case; ``progress`` gets each result, in case order.

    ``jobs`` > 1 compiles distinct sources in that many worker processes (default
    ``default_jobs()``); results are the same as serial, only sooner.
    """
    arch_list = [normalize_arch(a) for a in archs]
    have = set(supported_archs())
    missing = [a for a in arch_list if a not in have]
    if missing:
        raise InvalidArgumentError(
            f"this NVRTC cannot target compute_{', compute_'.join(missing)}; it supports "
            f"{', '.join(sorted(have, key=int))}. Pass --arch with one of those.")
    return compile_cases(cases(arch_list, ops, dtypes), progress, options, jobs)


def compile_cases(todo: Sequence[CompileCase],
                  progress: Callable[[CompileResult], None] | None = None,
                  options: Sequence[str] | None = None, jobs: int | None = None
                  ) -> list[CompileResult]:
    """Compile the given cases (see compile_all); distinct sources in parallel processes."""
    opts = tuple(base_options() if options is None else options)
    jobs = default_jobs() if jobs is None else max(1, int(jobs))
    fresh: dict[tuple[str, str, tuple[str, ...]], CompileCase] = {}
    for c in todo:
        if c.source and c.error is None and _memo_key(c, opts) not in _MEMO:
            fresh.setdefault(_memo_key(c, opts), c)
    pending: dict[tuple[str, str, tuple[str, ...]], Any] = {}
    pool = None
    if jobs > 1 and len(fresh) > 1:
        import concurrent.futures
        import multiprocessing

        try:  # spawn, not fork: the parent may hold threads (jax, pytest) that fork breaks
            pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=min(jobs, len(fresh)), mp_context=multiprocessing.get_context("spawn"))
            for key, c in fresh.items():
                pending[key] = pool.submit(_worker, (c.source, c.arch, opts, f"{c.op}.cu"))
        except (OSError, RuntimeError, ImportError):  # no processes here: compile serially
            pending.clear()
    results = []
    try:
        for case in todo:
            key = _memo_key(case, opts) if case.source else None
            fut = pending.pop(key, None) if key is not None else None
            raw = None
            if fut is not None:  # the first case with this source: compiled by a worker
                try:
                    raw = fut.result()
                except Exception:  # a worker died (e.g. killed): redo this one here
                    raw = None
            if raw is not None:
                res = _MEMO[key] = _result(case, raw)  # type: ignore[index]
            else:
                res = compile_case(case, opts)
            results.append(res)
            if progress is not None:
                progress(res)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


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
    """``portakern check --backend cuda --compile-only``: print the table; non-zero on failure."""
    from .backends import compile_only

    try:
        targets = [compile_only.get(b) for b in
                   (_split(getattr(args, "backend", None)) or ["cuda"])]
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    rc = 0
    for target in {t.name: t for t in targets}.values():
        run = hip_main if target.compiler == "hipcc" else _nvrtc_main
        rc = max(rc, run(args))
    return rc


def _nvrtc_main(args: argparse.Namespace) -> int:
    """The CUDA dialect through NVRTC for compute_XX."""
    try:
        archs = [normalize_arch(a) for a in (_split(getattr(args, "arch", None))
                                             or DEFAULT_ARCHS)]
        ops = _split(getattr(args, "ops", None))
        dts = _split(getattr(args, "dtypes", None))
        for op in ops or ():
            get_op(op)
        for dt in dts or ():
            dtypes.info(dt)
        nv = ".".join(str(v) for v in _nvrtc().getVersion())
        opts = base_options()
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2

    print(f"portakern compile-only check: NVRTC {nv}, dialect {DIALECT}, options "
          f"{' '.join(opts)}")
    table = _Table(archs)
    print(table.header())
    progress = _printer(table)
    t0 = time.perf_counter()
    try:
        results = compile_all(archs, ops, dts, progress, opts)
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.status == "FAIL"]
    skipped = [r for r in results if r.status == "skip"]
    _print_failures(failed)
    for r in {r.case.op: r for r in skipped}.values():
        print(f"SKIPPED {r.case.op}: {r.note}")
    compiled = sum(1 for r in results if r.status != "skip" and not r.reused)
    print(f"\n{len(results)} cases ({compiled} compiled, "
          f"{sum(r.reused for r in results)} identical sources reused), {len(failed)} failed, "
          f"{len(skipped)} skipped, {wall:.1f} s")
    out = getattr(args, "out", None)
    if out:
        with open(out, "w") as f:
            json.dump({"kind": "compile-only", "nvrtc": nv, "options": list(opts),
                       "archs": [f"compute_{a}" for a in archs], "seconds": round(wall, 2),
                       "results": [r.as_dict() for r in results]}, f, indent=1)
        print(f"results written to {out}")
    return 1 if failed else 0


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


# --- AMD: the hip dialect through hipcc (portakern.backends.hip) -----------------------------
_HIP_MEMO: dict[tuple[str, str], CompileResult] = {}


def _hip() -> Any:
    from .backends import hip

    return hip


def hip_cases(archs: Iterable[str] | None = None, ops: Iterable[str] | None = None,
              dtypes_: Iterable[str] | None = None) -> list[CompileCase]:
    """Every op x dtype x schedule x problem rendered in the hip dialect, per gfx target."""
    hip = _hip()
    out = cases(archs or hip.DEFAULT_ARCHS, ops, dtypes_, dialect=hip.DIALECT,
                normalize=hip.normalize_arch)
    for c in out:
        c.label = c.arch
    return out


def compile_case_hip(case: CompileCase) -> CompileResult:
    """Compile one hip case with hipcc (identical source+arch compiled once per process)."""
    if case.error is not None:
        return CompileResult(case, "FAIL", error=case.error, note="rendering failed")
    if not case.source:
        return CompileResult(case, "skip", note=f"no representative problem for {case.op!r}; "
                             "give its KernelSpec `examples` (or `example`)")
    key = (hashlib.sha256(case.source.encode()).hexdigest(), case.arch)
    prev = _HIP_MEMO.get(key)
    if prev is not None:
        return CompileResult(case, prev.status, 0.0, prev.error, prev.ptx_bytes,
                             prev.shared_bytes, reused=True,
                             note=f"same source as {prev.case.name}", kernels=prev.kernels)
    res = _hip().compile_source(case.source, case.arch, f"{case.op}.hip")
    if not res.ok:
        err = CompileError(f"hipcc failed to compile {case.op}.hip for {case.arch}",
                           source=case.source, log=res.log, options=res.command,
                           device=f"hipcc {case.arch} (compile only, {_hip().version()})")
        out = CompileResult(case, "FAIL", res.seconds, error=err)
    else:
        out = CompileResult(case, "ok", res.seconds, ptx_bytes=res.object_bytes,
                            shared_bytes=max((k["lds_bytes"] for k in res.kernels), default=0),
                            kernels=res.kernels)
    _HIP_MEMO[key] = out
    return out


def compile_hip_source(source: str, arch: str, name: str = "portakern.hip") -> CompileResult:
    """Compile one rendered hip source; raise CompileError (log + numbered source) on failure."""
    stem = name[:-4] if name.endswith(".hip") else name  # compiled as <stem>.hip
    res = compile_case_hip(CompileCase(stem, "-", "-", "-", _hip().normalize_arch(arch), source,
                                label=arch))
    if res.error is not None:
        raise res.error
    return res


def compile_cases_hip(todo: Sequence[CompileCase], progress: Callable[[CompileResult], None] | None
                      = None, jobs: int | None = None) -> list[CompileResult]:
    """Compile hip cases, distinct sources on ``jobs`` threads (each a hipcc process)."""
    import concurrent.futures

    jobs = default_jobs() if jobs is None else max(1, int(jobs))
    first: dict[tuple[str, str], CompileCase] = {}
    for c in todo:
        if c.source and c.error is None:
            first.setdefault((hashlib.sha256(c.source.encode()).hexdigest(), c.arch), c)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {id(c): pool.submit(compile_case_hip, c) for c in first.values()}
        results = []
        for c in todo:
            fut = futs.pop(id(c), None)
            res = fut.result() if fut is not None else compile_case_hip(c)
            results.append(res)
            if progress is not None:
                progress(res)
    return results


def hip_main(args: argparse.Namespace) -> int:
    """``portakern check --backend hip --compile-only``: every op x dtype x schedule for each
    gfx target this hipcc accepts; the refused further targets listed with the reason."""
    hip = _hip()
    try:
        hip.require_hipcc()
        ver = hip.version()
        given = _split(getattr(args, "arch", None))
        archs = [hip.normalize_arch(a) for a in
                 (given or list(hip.DEFAULT_ARCHS) + list(hip.FURTHER_ARCHS))]
        ops = _split(getattr(args, "ops", None))
        dts = _split(getattr(args, "dtypes", None))
        for op in ops or ():
            get_op(op)
        for dt in dts or ():
            dtypes.info(dt)
    except PortakernError as exc:
        print(f"error: {exc}")
        return 2
    required = set(given or hip.DEFAULT_ARCHS)
    refused = {a: why for a in archs if (why := hip.probe_arch(a))}
    accepted = [a for a in archs if a not in refused]
    print(f"portakern compile-only check: hipcc ({ver}), dialect {hip.DIALECT}, HIP_PLATFORM=amd,"
          f" options {' '.join(hip.compile_options())}")
    print(f"targets accepted by this toolchain: {', '.join(accepted) or '(none)'}")
    for a, why in refused.items():
        print(f"target {a} not accepted{' (REQUIRED)' if a in required else ''}: {why}")
    table = _Table(accepted, label=lambda a: a)
    print(table.header())
    progress = _printer(table)
    t0 = time.perf_counter()
    results = compile_cases_hip(hip_cases(accepted, ops, dts), progress)
    wall = time.perf_counter() - t0
    failed = [r for r in results if r.status == "FAIL"]
    skipped = [r for r in results if r.status == "skip"]
    _print_failures(failed)
    for r in {r.case.op: r for r in skipped}.values():
        print(f"SKIPPED {r.case.op}: {r.note}")
    missing = sorted(required & set(refused))
    compiled = sum(1 for r in results if r.status != "skip" and not r.reused)
    print(f"\n{len(results)} cases ({compiled} compiled, "
          f"{sum(r.reused for r in results)} identical sources reused), {len(failed)} failed, "
          f"{len(skipped)} skipped, {len(refused)} targets not accepted"
          f"{' (' + ', '.join(missing) + ' required)' if missing else ''}, {wall:.1f} s")
    out = getattr(args, "out", None)
    if out:
        with open(out, "w") as f:
            json.dump({"kind": "compile-only", "compiler": f"hipcc {ver}",
                       "options": list(hip.compile_options()), "archs": accepted,
                       "refused": refused, "seconds": round(wall, 2),
                       "results": [r.as_dict() | {"kernels": r.kernels} for r in results]},
                      f, indent=1)
        print(f"results written to {out}")
    return 1 if failed or missing else 0
