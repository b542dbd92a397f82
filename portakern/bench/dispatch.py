"""Dispatch overhead: what ``portakern.call`` costs beyond enqueueing the same compiled kernel.

The performance target (issue "Performance"): a call on a tiny shape costs at most 10 µs more
than enqueueing the same compiled kernel with raw PyOpenCL. On a tiny shape the kernel itself
is negligible, so the difference is portakern's Python path: binding, (memoised) validation,
backend resolution, the launch plan, argument packing and, without ``out=``, the output
allocation.

Three implementations on the same device-resident input (softmax, 4x8 float32 by default):

- ``call``: ``portakern.call("softmax", x, backend=be)``;
- ``call_out``: the same with ``out=`` a preallocated array (no allocation);
- ``raw``: the very kernel object portakern's launch plan holds (``be.plan(spec, prob)``, the
  plan the call path memoises), launched by the device API directly: OpenCL
  ``kernel.set_args(*args); pyopencl.enqueue_nd_range_kernel(queue, kernel, gsize, local)``,
  CUDA the cupy ``Function`` call ``fn(grid, block, args)``. Its argument list is built once,
  outside the timed region, from the plan's template, as a user of the raw API would.

A *block* times ``iterations`` back-to-back calls of one implementation followed by one
``backend.synchronize()``, so the per-call time includes the device work (the same kernel for
all three) and the synchronisation is amortised the same way for all three. Blocks are
interleaved round-robin over ``rounds`` rounds (rotating the order each round), and each
implementation's per-call time is the median over its blocks. overhead = median(call) -
median(raw) and median(call_out) - median(raw). The median of the per-round paired differences
is recorded beside it (less sensitive to slow drifts of the machine).

One caveat is stated in the record: when the device is slower than the host at a tiny kernel,
back-to-back enqueues overlap the kernel's execution and the queue, not the host, sets the
pace, which hides host overhead; ``raw`` per call is then the device's rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..backends.base import Backend, KernelBackend
from .timing import Clock, summarize

VARIANTS = ("call", "call_out", "raw")
TARGET_US = 10.0  # the bound on what a call may add over the raw enqueue


@dataclass(frozen=True)
class DispatchConfig:
    """What the dispatch measurement runs: op, tiny shape, and how many calls per block."""

    op: str = "softmax"
    shape: tuple[int, ...] = (4, 8)
    dtype: str = "float32"
    iterations: int = 200  # calls per timed block (then one synchronize)
    rounds: int = 15  # blocks per implementation, interleaved
    warmup: int = 50  # untimed calls per implementation before the first round

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.rounds < 1 or self.warmup < 0:
            raise ValueError(f"invalid DispatchConfig: iterations={self.iterations}, rounds="
                             f"{self.rounds}, warmup={self.warmup}; expected iterations >= 1, "
                             "rounds >= 1, warmup >= 0.")

    @property
    def shape_text(self) -> str:
        return "x".join(map(str, self.shape)) + f" {self.dtype}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def summarize_dispatch(per_call_s: Mapping[str, Sequence[float]],
                       target_us: float = TARGET_US) -> dict[str, Any]:
    """Medians (µs per call), the overheads over ``raw`` and whether they meet the target.

    ``per_call_s[v][r]`` is implementation v's per-call time in round r (seconds); the three
    lists are aligned by round, which the paired differences rely on.
    """
    missing = [v for v in VARIANTS if not per_call_s.get(v)]
    if missing:
        raise ValueError(f"summarize_dispatch needs samples of {list(VARIANTS)}; missing "
                         f"{missing}.")
    n = len(per_call_s["raw"])
    if any(len(per_call_s[v]) != n for v in VARIANTS):
        raise ValueError("summarize_dispatch: the implementations have different numbers of "
                         f"rounds ({ {v: len(per_call_s[v]) for v in VARIANTS} }); expected "
                         "one sample per implementation per round.")
    us = {v: [1e6 * float(t) for t in per_call_s[v]] for v in VARIANTS}
    stats = {v: summarize(us[v]) for v in VARIANTS}
    per_call = {v: {"median": st.median, "q1": st.q1, "q3": st.q3, "min": st.min,
                    "max": st.max, "samples": us[v]} for v, st in stats.items()}
    raw = stats["raw"].median
    overhead = {v: stats[v].median - raw for v in ("call", "call_out")}
    paired = {v: summarize([a - b for a, b in zip(us[v], us["raw"], strict=True)]).median
              for v in ("call", "call_out")}
    return {"per_call_us": per_call, "overhead_us": overhead, "overhead_paired_us": paired,
            "target_us": target_us,
            "meets_target": {v: bool(overhead[v] <= target_us) for v in overhead}}


def _raw_launcher(be: Backend, plan: Sequence[tuple[Any, Any, list[Any]]],
                  bufs: Mapping[str, Any]) -> tuple[Callable[[], None], str] | None:
    """(fn, what) enqueueing the plan's compiled kernels through the device API itself;
    None when ``be`` has no raw API this module knows."""
    bufs = dict(bufs)
    for name, (n, dt) in getattr(plan, "workspace", {}).items():  # made once, like the args
        bufs[name] = be.empty((n,), dt)  # type: ignore[attr-defined]
    items = []
    for kernel, launch, template in plan:
        args = [be.buffer_arg(bufs[a]) if isinstance(a, str) else a for a in template]
        items.append((kernel, launch, args))
    if be.name == "opencl":
        import pyopencl as cl

        queue = be.queue  # type: ignore[attr-defined]
        prepared = [(k, tuple(g * lo for g, lo in zip(la.groups, la.local, strict=True)),
                     tuple(la.local), a) for k, la, a in items]
        enqueue = cl.enqueue_nd_range_kernel

        def fn() -> None:
            for kernel, gsize, local, args in prepared:
                kernel.set_args(*args)
                enqueue(queue, kernel, gsize, local)

        return fn, ("kernel.set_args(*args); pyopencl.enqueue_nd_range_kernel(queue, kernel, "
                    "global, local) with the compiled kernel object of portakern's launch plan "
                    "(arguments built once, outside the timed region)")
    if be.name == "cuda":
        launches = [(k.fn, tuple(la.groups), tuple(la.local), tuple(a)) for k, la, a in items]

        def fn() -> None:
            for f, grid, block, args in launches:
                f(grid, block, args)

        return fn, ("cupy Function call fn(grid, block, args) on the compiled kernel of "
                    "portakern's launch plan (arguments built once, outside the timed region; "
                    "the device made current once per block)")
    return None


def not_applicable(be: Backend, why: str) -> dict[str, Any]:
    return {"status": "not_applicable", "reason": why, "target": be.label}


def measure_dispatch(be: Backend, cfg: DispatchConfig | None = None, *,
                     clock: Clock = time.perf_counter) -> dict[str, Any]:
    """Time ``call``, ``call_out`` and ``raw`` on ``be`` (see the module docstring)."""
    from ..api import _problem, call
    from ..ops import get_op

    cfg = cfg or DispatchConfig()
    if not isinstance(be, KernelBackend):
        return not_applicable(be, f"{be.name} does not launch compiled C kernels, so there is "
                              "no raw enqueue to compare with (measured on OpenCL and CUDA)")
    if cfg.dtype not in be.supported_dtypes():
        return not_applicable(be, f"{be.describe()} does not support {cfg.dtype}")
    spec = get_op(cfg.op)
    from .. import dtypes

    host = np.random.default_rng(0).standard_normal(cfg.shape).astype(
        dtypes.info(cfg.dtype).storage)
    x = be.to_native(host)
    out = be.empty(tuple(host.shape), cfg.dtype)
    arrays, params = spec.bind([x], {})
    prob = _problem(spec, arrays, params)  # the memoised Problem pk.call itself uses
    plan = be.plan(spec, prob, None)  # compiles (untimed) and is the plan pk.call launches
    got = _raw_launcher(be, plan, {"x": x, "out": out})
    if got is None:
        return not_applicable(be, f"no raw enqueue recipe for {be.name} (OpenCL and CUDA only)")
    raw, raw_what = got
    device_ctx: Any = None
    if be.name == "cuda":
        import cupy

        device_ctx = cupy.cuda.Device(be.device.index)

    def f_call() -> None:
        call(cfg.op, x, backend=be)

    def f_call_out() -> None:
        call(cfg.op, x, backend=be, out=out)

    fns: dict[str, Callable[[], None]] = {"call": f_call, "call_out": f_call_out, "raw": raw}
    sync = be.synchronize
    iters = cfg.iterations

    def block(fn: Callable[[], None]) -> float:
        t0 = clock()
        for _ in range(iters):
            fn()
        sync()
        return (clock() - t0) / iters

    # the raw launch really computes the op: its output matches the semantics (untimed)
    ref = np.asarray(spec.semantics(np, host.astype(np.float64), **prob.params))
    if device_ctx is not None:
        device_ctx.__enter__()
    try:
        for v in VARIANTS:
            for _ in range(cfg.warmup):
                fns[v]()
            sync()
        raw()
        sync()
        err = float(np.max(np.abs(be.to_numpy(out).astype(np.float64) - ref)))
        per_call: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(cfg.rounds):
            k = r % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                per_call[v].append(block(fns[v]))
    finally:
        if device_ctx is not None:
            device_ctx.__exit__(None, None, None)
    rec: dict[str, Any] = {"status": "ok", "target": be.label, "op": cfg.op,
                           "shape": list(cfg.shape), "dtype": cfg.dtype,
                           "iterations": iters, "rounds": cfg.rounds}
    rec.update(summarize_dispatch(per_call))
    rec["what"] = {
        "call": f"portakern.call({cfg.op!r}, x, backend=be) on a device-resident "
                f"{cfg.shape_text} array: binding, memoised validation, backend resolution, "
                "launch plan, output allocation and enqueue",
        "call_out": f"portakern.call({cfg.op!r}, x, backend=be, out=o) with o preallocated: "
                    "the same without the output allocation",
        "raw": raw_what,
        "timing": f"per call = (time of {iters} back-to-back calls + one "
                  f"backend.synchronize()) / {iters}; median over {cfg.rounds} "
                  "interleaved rounds, the order rotated each round",
        "caveat": "back-to-back enqueues overlap the kernels' execution: if the device is "
                  "slower than the host at this tiny kernel, the queue sets the pace and part "
                  "of the host overhead is hidden (raw per call is then the device's rate)"}
    kernels = [{"kernel": la.kernel, "groups": list(la.groups), "local": list(la.local)}
               for _, la, _ in plan]
    rec["info"] = {"kernels": kernels, "raw_max_abs_error": err}
    if not (math.isfinite(err) and err < 1e-5):  # then "raw" did not time the op's kernel
        rec["status"] = "error"
        rec["reason"] = (f"the raw enqueue's output differs from the op's semantics (max abs "
                         f"error {err:.3g}); its time would not be the kernel's")
    return rec
