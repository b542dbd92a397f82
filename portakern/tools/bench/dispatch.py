"""Dispatch overhead: what the calls users write cost beyond enqueueing the same kernel.

The target (DESIGN.md, "The Plan"): every entry point costs at most 5 µs over a raw enqueue
of the same compiled kernel. On a tiny shape the kernel itself is negligible, so the
difference is portakern's Python path: binding, (memoised) validation, backend resolution,
the launch plan, argument packing and, without ``out=``, the output allocation.

Measured for the named entry points as users write them, on device-resident inputs, each with
the backend picked from the inputs (no ``backend=``) when that picks the target measured:

- ``pk.softmax``: ``pk.softmax(x)`` on a 4x8 float32 array;
- ``pk.matmul``: ``pk.matmul(a, b)`` on 8x8 @ 8x8;
- ``pk.attention``: ``pk.attention(q, k, v, causal=True)`` on B1 H1 S8 D16;
- ``pk.rmsnorm``: ``pk.rmsnorm(x, weight)`` on 4x8 and 8;

and for each five implementations:

- ``call``: the named call, the backend picked automatically (as the quick start calls it);
- ``call_out``: the same writing into a preallocated ``out=`` (through the named function if
  it takes ``out=``, else ``pk.call(op, ..., out=o)`` with the same keywords; ``what`` says
  which);
- ``call_backend``: the named call with ``backend="<target>"``;
- ``call_use``: the named call inside ``with pk.use(target):``, entered once per block of
  calls as user code enters it (each selection mode has its own plan key, so each is warmed
  up in its own mode);
- ``raw``: the very kernel objects of the plan the call uses (``portakern.runtime.plan.plan_for``:
  the cached Plan of that call), launched through the device API by the backend's
  ``raw_launcher`` hook (OpenCL: a kernel object of its own whose scalar arguments are set
  once, then per call ``set_arg`` for each buffer and ``enqueue_nd_range_kernel``; CUDA the
  cupy ``Function`` call), arguments and workspace built once outside the timed region, as a
  user of the raw API would. Scalars are bound once there exactly as the plan's programs
  bind them (backend/opencl.py ``OpenCLBackend.program``), so the overhead measured is
  portakern's host code alone, not a difference in how arguments are set.

Each implementation is timed two ways, in interleaved rounds (the order rotated each round),
the median over rounds per implementation:

- **host** (the target's measure, where the backend offers ``held_queue``): a block enqueues
  ``iterations`` back-to-back calls while the device queue is held (an OpenCL user event
  gates the in-order queue), timing only the host's side; the device then runs them,
  untimed. overhead = median(call) - median(raw): exactly the time portakern's code adds to a
  call on the host. On a CPU OpenCL device this matters: the device's worker threads share
  the host's cores, and while they run they slow the host's Python down by 1.5-2.5x, so a
  wall-clock difference mixes portakern's cost with the device's contention for the cores.
- **wall**: a block times ``iterations`` back-to-back calls followed by one
  ``backend.synchronize()``, so the per-call time includes the device work (the same kernels
  for all three). Reported beside the host figure, never instead of it. When the device is
  slower than the host at a tiny kernel, back-to-back enqueues overlap the kernel's
  execution and the queue, not the host, sets the pace; when it shares the host's cores, it
  amplifies host overhead instead.

The median of the per-round paired differences is recorded beside each overhead (less
sensitive to slow drifts of the machine). The target is judged on the host overhead when it
was measured, else on the wall overhead (``judged_on`` says which).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...backend.base import Backend, KernelBackend
from .timing import Clock, summarize

VARIANTS = ("call", "call_out", "call_backend", "call_use", "raw")
REQUIRED = ("call", "call_out", "raw")  # what every record has; the two others since issue 15
TARGET_US = 5.0  # DESIGN.md: every entry point within 5 µs of a raw enqueue


@dataclass(frozen=True)
class DispatchEntry:
    """One entry point as users write it: the named function, its operands and keywords."""

    name: str  # "pk.softmax": the key in the result file
    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def text(self) -> str:
        args = ", ".join(n for n, _ in self.shapes)
        kw = "".join(f", {k}={v!r}" for k, v in self.kwargs)
        return f"{self.name}({args}{kw})"

    @property
    def shape_text(self) -> str:
        return " ".join(f"{n} {'x'.join(map(str, s))}" for n, s in self.shapes)


ENTRIES = (
    DispatchEntry("pk.softmax", "softmax", (("x", (4, 8)),)),
    DispatchEntry("pk.matmul", "matmul", (("a", (8, 8)), ("b", (8, 8)))),
    DispatchEntry("pk.attention", "attention",
                  (("q", (1, 1, 8, 16)), ("k", (1, 1, 8, 16)), ("v", (1, 1, 8, 16))),
                  (("causal", True),)),
    DispatchEntry("pk.rmsnorm", "rmsnorm", (("x", (4, 8)), ("weight", (8,)))),
)


@dataclass(frozen=True)
class DispatchConfig:
    """What the dispatch measurement runs: the entry points, and how many calls per block."""

    entries: tuple[DispatchEntry, ...] = field(default=ENTRIES)
    dtype: str = "float32"
    iterations: int = 200  # calls per timed block (then one synchronize)
    rounds: int = 15  # blocks per implementation, interleaved
    warmup: int = 50  # untimed calls per implementation before the first round

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.rounds < 1 or self.warmup < 0 or not self.entries:
            raise ValueError(f"invalid DispatchConfig: iterations={self.iterations}, rounds="
                             f"{self.rounds}, warmup={self.warmup}, {len(self.entries)} "
                             "entries; expected iterations >= 1, rounds >= 1, warmup >= 0 "
                             "and at least one entry.")

    @property
    def shape_text(self) -> str:
        return ", ".join(e.name for e in self.entries) + f" {self.dtype}"

    def as_dict(self) -> dict[str, Any]:
        return {"entries": [{"name": e.name, "op": e.op, "call": e.text,
                             "shapes": {n: list(s) for n, s in e.shapes},
                             "kwargs": dict(e.kwargs)} for e in self.entries],
                "dtype": self.dtype, "iterations": self.iterations, "rounds": self.rounds,
                "warmup": self.warmup}


def summarize_dispatch(per_call_s: Mapping[str, Sequence[float]],
                       target_us: float = TARGET_US) -> dict[str, Any]:
    """Medians (µs per call), the overheads over ``raw`` and whether they meet the target.

    ``per_call_s[v][r]`` is implementation v's per-call time in round r (seconds); the three
    lists are aligned by round, which the paired differences rely on.
    """
    missing = [v for v in REQUIRED if not per_call_s.get(v)]
    if missing:
        raise ValueError(f"summarize_dispatch needs samples of {list(REQUIRED)}; missing "
                         f"{missing}.")
    present = [v for v in VARIANTS if per_call_s.get(v)]
    n = len(per_call_s["raw"])
    if any(len(per_call_s[v]) != n for v in present):
        raise ValueError("summarize_dispatch: the implementations have different numbers of "
                         f"rounds ({ {v: len(per_call_s[v]) for v in present} }); expected "
                         "one sample per implementation per round.")
    us = {v: [1e6 * float(t) for t in per_call_s[v]] for v in present}
    stats = {v: summarize(us[v]) for v in present}
    per_call = {v: {"median": st.median, "q1": st.q1, "q3": st.q3, "min": st.min,
                    "max": st.max, "samples": us[v]} for v, st in stats.items()}
    raw = stats["raw"].median
    calls = [v for v in present if v != "raw"]
    overhead = {v: stats[v].median - raw for v in calls}
    paired = {v: summarize([a - b for a, b in zip(us[v], us["raw"], strict=True)]).median
              for v in calls}
    return {"per_call_us": per_call, "overhead_us": overhead, "overhead_paired_us": paired,
            "target_us": target_us,
            "meets_target": {v: bool(overhead[v] <= target_us) for v in overhead}}


def _raw_launcher(be: KernelBackend, plan: Any, bufs: Mapping[str, Any]
                  ) -> Callable[[], None] | None:
    """One callable enqueueing the plan's compiled kernels through the backend's
    ``raw_launcher`` hook (the device API, no portakern code per call: scalars set once, as
    the plan's programs do, buffers set per call); None when the backend offers none."""
    bufs = dict(bufs)
    for name, (n, dt) in plan.workspace.items():  # made once, like the args
        bufs[name] = be.empty((n,), dt)
    launches = []
    for step in plan.steps:
        fn = be.raw_launcher(step.kernel, step.launch, step.template, bufs)
        if fn is None:
            return None
        launches.append(fn)
    if len(launches) == 1:
        return launches[0]
    seq = tuple(launches)

    def run_all() -> None:
        for f in seq:
            f()

    return run_all


def not_applicable(be: Backend, why: str) -> dict[str, Any]:
    return {"status": "not_applicable", "reason": why, "target": be.label}


def _named(entry: DispatchEntry) -> Callable[..., Any]:
    from ... import api  # pk.softmax is api.softmax: the package itself is never imported here

    return getattr(api, entry.name.split(".", 1)[1])


def _ok_error(got: np.ndarray, ref: np.ndarray) -> tuple[float, bool]:
    err = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return err, math.isfinite(err) and err <= 1e-5 * max(1.0, scale)


def measure_entry(be: KernelBackend, entry: DispatchEntry, cfg: DispatchConfig, *,
                  clock: Clock = time.perf_counter) -> dict[str, Any]:
    """Time ``call``, ``call_out`` and ``raw`` of one entry point on ``be``."""
    from ...api import call
    from ...core import dtypes
    from ...ops import get_op
    from ...runtime import selection
    from ...runtime.plan import plan_for

    spec = get_op(entry.op)
    rng = np.random.default_rng(0)
    st = dtypes.info(cfg.dtype).storage
    host = {n: rng.standard_normal(s).astype(st) for n, s in entry.shapes}
    dev = {n: be.to_native(x) for n, x in host.items()}
    kwargs = dict(entry.kwargs)
    operands = [dev[n] for n, _ in entry.shapes]
    plan = plan_for(spec, operands, kwargs, backend=be)  # the very plan the call launches
    prob = plan.problem
    # NaN until the raw launch writes it: its check below runs first, so a raw path that
    # launched nothing (or only part) cannot pass on what the other calls wrote there
    out = be.to_native(np.full(tuple(prob.out_shape), np.nan, st))
    raw = _raw_launcher(be, plan, {**dev, "out": out}) if plan.steps else None
    if raw is None:
        return not_applicable(be, f"{be.name} offers no raw_launcher (the device API's own "
                              "enqueue) to compare with")
    named = _named(entry)
    # the calls name no backend, as users write them: the inputs pick it where that gives this
    # very instance, else ``with pk.use(target):`` around the whole measurement does
    try:
        auto = selection.resolve(None, operands) is be
    except Exception:
        auto = False
    how = ("the backend picked from the inputs" if auto else
           f"inside `with pk.use({be.label!r})` (the inputs alone pick another instance)")
    if "out" in inspect.signature(named).parameters:
        def f_call_out() -> None:
            named(*operands, **kwargs, out=out)
        out_what = f"{entry.name}(..., out=o)"
    else:
        def f_call_out() -> None:
            call(entry.op, *operands, **kwargs, out=out)
        out_what = (f"pk.call({entry.op!r}, {', '.join(n for n, _ in entry.shapes)}"
                    + "".join(f", {k}={v!r}" for k, v in kwargs.items())
                    + f", out=o) ({entry.name} takes no out=)")

    def f_call() -> None:
        named(*operands, **kwargs)

    label = be.label

    def f_call_backend() -> None:
        named(*operands, **kwargs, backend=label)

    fns: dict[str, Callable[[], None]] = {"call": f_call, "call_out": f_call_out,
                                          "call_backend": f_call_backend, "call_use": f_call,
                                          "raw": raw}
    # call_use is the plain call inside `with pk.use(target):`, entered once per block as a
    # user's code enters it around its calls, not per call
    scopes: dict[str, Callable[[], Any]] = {"call_use": lambda: selection.use(be)}
    sync = be.synchronize
    iters = cfg.iterations

    def block(v: str) -> float:
        fn, scope = fns[v], scopes.get(v, contextlib.nullcontext)
        with scope():
            t0 = clock()
            for _ in range(iters):
                fn()
            sync()
            return (clock() - t0) / iters

    held = be.held_queue() is not None

    def held_block(v: str) -> float:
        fn, scope = fns[v], scopes.get(v, contextlib.nullcontext)
        with scope(), be.held_queue():
            t0 = clock()
            for _ in range(iters):
                fn()
            dt = clock() - t0
        return dt / iters

    ref = np.asarray(spec.semantics(np, *[host[n].astype(np.float64) for n, _ in entry.shapes],
                                    **prob.params))
    # a backend with a current-device notion (CUDA's cupy Device: device_scope) is made
    # current once per measurement, not per raw launch, as a raw user would
    ctx = be.device_scope()
    ctx.__enter__()
    chosen = None if auto else selection.use(be)
    if chosen is not None:
        chosen.__enter__()
    try:
        raw()  # first: `out` holds NaN until it writes the op's result there
        sync()
        err, ok = _ok_error(be.to_numpy(out), ref)
        for v in VARIANTS:
            with scopes.get(v, contextlib.nullcontext)():
                for _ in range(cfg.warmup):
                    fns[v]()
            sync()
        per_call: dict[str, list[float]] = {v: [] for v in VARIANTS}
        held_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(cfg.rounds):
            k = r % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                per_call[v].append(block(v))
                if held:
                    held_times[v].append(held_block(v))
    finally:
        if chosen is not None:
            chosen.__exit__(None, None, None)
        ctx.__exit__(None, None, None)
    rec: dict[str, Any] = {"status": "ok", "target": be.label, "entry": entry.name,
                           "op": entry.op, "call": entry.text, "shapes": {
                               n: list(s) for n, s in entry.shapes}, "dtype": cfg.dtype,
                           "iterations": iters, "rounds": cfg.rounds}
    rec.update(summarize_dispatch(per_call))  # wall
    rec["judged_on"] = "wall"
    if held:
        h = summarize_dispatch(held_times)
        rec["host"] = {k: h[k] for k in ("per_call_us", "overhead_us", "overhead_paired_us")}
        rec["meets_target"] = h["meets_target"]
        rec["judged_on"] = "host"
    rec["what"] = {
        "call": f"{entry.text} on device-resident {entry.shape_text} {cfg.dtype} arrays, "
                f"{how}: binding, memoised validation, backend resolution, launch plan, "
                "output allocation and enqueue",
        "call_out": out_what + ": the same without the output allocation",
        "call_backend": f"{entry.text[:-1]}, backend={be.label!r}): the target named",
        "call_use": f"{entry.text} inside `with pk.use({be.label!r})`, entered once per "
                    "block of calls",
        "raw": "the backend's raw_launcher: the device API's own enqueue of the compiled "
               "kernels of the call's launch plan, the scalar arguments bound once and the "
               "buffers set on each launch, as the plan's own programs do (arguments and "
               "workspace built once, outside the timed region)",
        "timing": f"wall: per call = (time of {iters} back-to-back calls + one "
                  f"backend.synchronize()) / {iters}; host: the same {iters} calls enqueued "
                  "while the device queue is held, only the host's side timed; medians over "
                  f"{cfg.rounds} interleaved rounds, the order rotated each round",
        "judged_on": "the target is judged on the host overhead (portakern's own cost per "
                     "call) where the backend can hold its queue, else on the wall overhead",
        "caveat": "wall: back-to-back enqueues overlap the kernels' execution: if the device "
                  "is slower than the host at this tiny kernel, the queue sets the pace and "
                  "part of the host overhead is hidden; if the device shares the host's cores "
                  "(a CPU OpenCL device), its worker threads slow the host down and amplify "
                  "it"}
    kernels = [{"kernel": la.kernel, "groups": list(la.groups), "local": list(la.local)}
               for la in (s.launch for s in plan.steps)]
    rec["info"] = {"kernels": kernels, "raw_max_abs_error": err, "backend_from_inputs": auto}
    if not ok:  # then "raw" did not time the op's kernel
        rec["status"] = "error"
        rec["reason"] = (f"the raw enqueue's output differs from the op's semantics (max abs "
                         f"error {err:.3g}); its time would not be the kernel's")
    return rec


def measure_dispatch(be: Backend, cfg: DispatchConfig | None = None, *,
                     clock: Clock = time.perf_counter) -> dict[str, Any]:
    """``{entry name: record}`` for every entry point of ``cfg`` on ``be``, or one
    ``not_applicable`` record when ``be`` launches no compiled kernels."""
    cfg = cfg or DispatchConfig()
    if not isinstance(be, KernelBackend):
        return not_applicable(be, f"{be.name} does not launch compiled C kernels, so there is "
                              "no raw enqueue to compare with (measured on OpenCL and CUDA)")
    if cfg.dtype not in be.supported_dtypes():
        return not_applicable(be, f"{be.describe()} does not support {cfg.dtype}")
    out: dict[str, Any] = {}
    for entry in cfg.entries:
        try:
            out[entry.name] = measure_entry(be, entry, cfg, clock=clock)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            out[entry.name] = {"status": "error", "target": be.label, "entry": entry.name,
                               "reason": f"{type(exc).__name__}: {str(exc)[:800]}"}
    return out


def entries_of(rec: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A target's dispatch record as {entry name: record}; a target-level status record (not
    applicable, error) and files written before the named entries (one ``pk.call`` softmax
    record) come back as one entry."""
    if "status" in rec:
        return {str(rec.get("entry") or "all entry points"): rec}
    return {k: v for k, v in rec.items() if isinstance(v, Mapping)}
