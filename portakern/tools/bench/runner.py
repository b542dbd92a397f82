"""`portakern bench`: every case on every target, beside its native peers, against the roof.

Honesty rules this module enforces (docs/bench.md lists them for readers):

- what is timed is exactly what the record's ``what`` says; inputs are uploaded with the
  backend's ``to_native`` before timing, so host copies are never timed;
- compilation is done (and timed) before the first call; the first call is timed on its own;
  neither is mixed into the samples;
- every sample ends with the device synchronised (``backend.synchronize()``, or
  ``block_until_ready`` on a jax result);
- our kernel, the unfused chain and the peers are sampled in **interleaved rounds** (one
  sample each per round, the order rotated; timing.run_rounds), and each ratio is the median
  of the per-round ratios, with its spread: a burst of load that hits one side changes the
  ratios of the rounds it hits, not the median (numpy and torch run in child processes, at
  the same time slot, for the reason in numpy_worker.py; each times its own call there);
- a case during which other processes used more than 10% of the CPUs is measured again
  (``BenchConfig.remeasure``); the attempt with the least contention is kept, and the case is
  marked ``contended`` when even that one exceeds 10%;
- a case that cannot run is recorded as such, with the reason; it is never left out;
- Ctrl-C stops the run and still writes everything measured so far (``interrupted: true``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ... import api
from ...api import call
from ...backend import registry
from ...backend.base import Backend, KernelBackend
from ...core.errors import PortakernError
from ...ops import get_op
from ...runtime import configs, selection
from . import environment, metrics
from .dispatch import DispatchConfig, entries_of, measure_dispatch
from .hog import Hog, pick_core
from .interrupt import LATCH
from .peers import NUMPY_PEER, PEER_NAMES, Peers, missing_promised, own_jax_device, peer_name
from .probes import Roofline, combine, lift, probe_jax, probe_kernel_backend
from .report import CONTENTION_NOTE, HOST_COLUMNS, fmt_time
from .suites import (
    TIMING,
    BenchCase,
    bench_config,
    make_inputs,
    metadata_inputs,
    operand_names,
    peer_skip,
    suite_cases,
)
from .timing import Measurement, Sampler, TimingConfig, not_run, prepare, run_rounds

SCHEMA = "portakern-bench/1"


@dataclass
class BenchConfig:
    """Everything `portakern bench` was asked to do (recorded in the result file)."""

    suite: str = "quick"
    ops: tuple[str, ...] | None = None
    targets: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    peers: tuple[str, ...] | None = None
    limit: int | None = None
    out: str = "results.json"
    plots: str | None = None
    probes: bool = True
    unfused: bool = True
    timing: TimingConfig | None = None
    dispatch: bool | None = None  # None: measured in the quick suite only
    dispatch_config: DispatchConfig | None = None
    cases: tuple[str, ...] | None = None  # keep only cases whose id contains one of these
    # measure a case again this many times at most while it is contended (`portakern bench`
    # passes --remeasure, default 1; a program calling run_bench asks for it explicitly)
    remeasure: int = 0
    hog: int | None = None  # a CPU core: each case measured again with a busy loop pinned there
    progress: TextIO = field(default=sys.stderr, repr=False)

    def effective_timing(self) -> TimingConfig:
        return self.timing or TIMING[self.suite]

    def dispatch_enabled(self) -> bool:
        """The dispatch-overhead measurement runs in ``quick`` unless switched off (it is a
        property of the library, not of a size, so one suite carries it)."""
        return self.suite == "quick" if self.dispatch is None else self.dispatch

    def as_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "ops": self.ops, "targets": self.targets,
                "dtypes": self.dtypes, "peers": self.peers, "limit": self.limit,
                "out": environment.no_home(self.out),
                "plots": None if self.plots is None else environment.no_home(self.plots),
                "probes": self.probes,
                "unfused": self.unfused, "timing": self.effective_timing().as_dict(),
                "dispatch": self.dispatch_enabled(),
                "dispatch_config": (self.dispatch_config or DispatchConfig()).as_dict(),
                "cases": self.cases, "remeasure": self.remeasure, "hog": self.hog,
                "contention_threshold": CONTENTION_NOTE}


# --- progress ---------------------------------------------------------------------------------


class Progress:
    """One line per measurement on stderr: what is running now, then how it went."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, text: str) -> None:
        print(text, end="", file=self.stream, flush=True)

    def ready(self, m: Measurement) -> None:
        """An implementation prepared for the rounds: its first call (and compile)."""
        comp = m.info.get("compile_s")
        extra = "" if comp is None else (" (kernel built by an earlier case)"
                                         if m.info.get("compile_cached")
                                         else f" (compile {fmt_time(comp)})")
        self.line(f" first call {fmt_time(m.first_call_s)}{extra}")

    def done(self, m: Measurement) -> None:
        st = m.stats
        if m.ok and st is not None:
            spread = f"±{100 * st.iqr / 2 / st.median:.0f}%" if st.median else ""
            extra = f", first call {fmt_time(m.first_call_s)}" if m.first_call_s else ""
            self.line(f" {fmt_time(st.median)} (IQR {spread}, {st.n} reps{extra})")
        else:
            self.line(f" {m.status}: {m.reason[:160]}")


# --- targets ----------------------------------------------------------------------------------
def _is_oracle(name: str) -> bool:
    """Whether backend ``name`` is the float64 oracle (``Backend.oracle``: numpy), which the
    benchmark measures as a peer, never as a target."""
    got = registry.load(name)
    return isinstance(got, type) and got.oracle


def default_targets() -> tuple[list[str], dict[str, str]]:
    """Every available backend target except the oracle (a peer, not a kernel)."""
    return registry.available_targets(
        exclude=tuple(n for n in registry.names() if _is_oracle(n)))


def open_targets(wanted: tuple[str, ...] | None) -> tuple[list[Backend], dict[str, str]]:
    if wanted:
        sels, skipped = list(wanted), {}
    else:
        sels, skipped = default_targets()
    out: list[Backend] = []
    for sel in sels:
        name = selection.parse(sel, "--backends")[0]
        if _is_oracle(name):
            raise ValueError(f"--backends {name}: {name} is the float64 oracle and a peer (the "
                             "numpy/BLAS column), not a portable kernel; expected opencl, cuda, "
                             "jax or a plugin backend.")
        try:
            be = selection.get(sel, "--backends")
        except Exception as exc:
            if wanted:
                raise
            skipped[sel] = f"{type(exc).__name__}: {exc}"
            continue
        if all(b.label != be.label for b in out):
            out.append(be)
    return out, skipped


def hardware_key(be: Backend) -> str:
    """Targets with the same key run on the same hardware and share one roof (within one run,
    so one machine: every CPU target is the one CPU; ``metrics.device_key`` names it across
    machines)."""
    return "cpu" if be.device.kind == "cpu" else f"{be.device.kind}:{be.device.name.strip()}"


def implementation(be: Backend) -> str:
    """What runs the target's kernels (``opencl:pocl``, ``opencl:intel``, ``jax``): targets of
    one device compared as implementations on the same silicon (implementations.py)."""
    return metrics.implementation_of(be.label, {"backend": be.name,
                                                "device": {"extra": be.device.extra}})


def platform_id(be: Backend, hostname: str) -> str:
    """A platform of the PP set: a backend target on one device of one machine."""
    return f"{be.label} · {be.device.name} @ {hostname}"


def run_probes(be: Backend, compute_dtypes: list[str]) -> Roofline:
    try:
        if isinstance(be, KernelBackend):
            return probe_kernel_backend(be, compute_dtypes)
        dev = own_jax_device(be)
        if dev is not None:  # the jax backend: probed with jax on its own device
            return probe_jax(dev, be.device_class, compute_dtypes)
        return Roofline(status="unavailable",
                        reason=f"no probe for {be.name}: it neither compiles portakern C "
                               "kernels nor computes on a jax device of its own")
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        return Roofline(status="error", reason=f"{type(exc).__name__}: {str(exc)[:500]}")


# --- one case on one target ---------------------------------------------------------------------
def _sync_with(be: Backend, holder: dict[str, Any]) -> Any:
    def sync() -> None:
        be.synchronize()
        r = holder.get("r")
        block = getattr(r, "block_until_ready", None)
        if block is not None:  # jax arrays: wait for this result, whatever synchronize() does
            block()
    return sync


def measure_ours(be: Backend, case: BenchCase, native: Mapping[str, Any], timing: TimingConfig
                 ) -> Sampler:
    """Our call, compiled (untimed, recorded), its first call timed and warmed up: ready for
    the case's interleaved rounds."""
    spec = get_op(case.op)
    args = [native.get(n) for n in operand_names(case.op)]  # None: absent optional operand
    # the call users write: the op's public function (pk.softmax(x, backend="opencl:0")),
    # the target named by its label, optional operands by keyword; pk.call for an op
    # without one (a user's). Either way the backend instance is this one.
    named = getattr(api, case.op, None)
    label = be.label if selection.get(be.label) is be else None
    selector: str | Backend = label if label is not None else be
    if callable(named) and named is not api.call:
        pos = [a for o, a in zip(spec.operands, args, strict=True) if not o.optional]
        kw = {o.name: a for o, a in zip(spec.operands, args, strict=True)
              if o.optional and a is not None}
        shown = f"pk.{case.op}(..., backend={selector!r})" if label else \
            f"pk.{case.op}(..., backend=<{be.label} instance>)"

        def invoke(config: Mapping[str, int] | None) -> Any:
            return named(*pos, **kw, backend=selector, config=config, **case.params)
    else:
        shown = f"pk.call({case.op!r}, ..., backend={selector!r})"

        def invoke(config: Mapping[str, int] | None) -> Any:
            return call(case.op, *args, backend=selector, config=config, **case.params)
    what = (f"{shown} on device-resident inputs: validation, launch, output allocation and "
            "kernel, synchronised")
    compile_s, kcfg, cached = None, None, False
    forced = bench_config(case)  # e.g. a decode row's number of key splits
    if forced:
        what += f", config={forced}"
    if isinstance(be, KernelBackend):
        prob = spec.problem(*spec.bind(args, dict(case.params)))
        kcfg = configs.config_for(be, spec, prob, forced)
        known = len(getattr(be, "_kernels", None) or {})
        t0 = time.perf_counter()
        be.kernels_for(spec, prob, kcfg)  # compile (or load from the driver's cache) untimed
        compile_s = time.perf_counter() - t0
        cached = len(getattr(be, "_kernels", None) or {}) == known
    holder: dict[str, Any] = {}

    def fn() -> None:
        holder["r"] = invoke(forced)

    p = prepare(fn, _sync_with(be, holder), timing, what=what)
    if compile_s is not None:
        p.m.info["compile_s"] = compile_s
        p.m.info["compile_cached"] = cached  # True: this program was built by an earlier case
        p.m.info["config"] = kcfg
    return p


# ops with an unfused chain through portakern's own ops (and a memory record beside it)
UNFUSED_OPS = ("attention", "attention_backward")


def measure_unfused(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray | None],
                    timing: TimingConfig) -> Sampler | Measurement:
    """Attention as matmul -> softmax -> matmul through portakern on the same backend (the
    backward: ``unfused_backward``), ready for the rounds (or why it cannot run)."""
    if case.op == "attention_backward":
        got = unfused_backward(be, case, host)
        if isinstance(got, Measurement):
            return got
        chain, chain_what = got
        out: dict[str, Any] = {}

        def run() -> None:
            out["r"] = chain()

        return prepare(run, _sync_with(be, out), timing, what=chain_what)
    what = ("portakern matmul(q*scale, k^T) -> softmax -> matmul(p, v) on the same backend "
            "(q pre-scaled and k pre-transposed outside the timed region; GQA by reshape)")
    if case.params.get("causal") or case.params.get("mask") is not None:
        return not_run("unsupported", "the unfused chain has no masked softmax op in portakern; "
                       "only non-causal, unmasked cases have one", what)
    s = case.size
    B, Hq, Hkv, Sq, D = s["B"], s["Hq"], s["Hkv"], s["Sq"], s["D"]
    g = Hq // Hkv
    scale = float(case.params.get("scale") or 1.0 / math.sqrt(D))
    q, k, v = host["q"], host["k"], host["v"]
    assert q is not None and k is not None and v is not None  # attention's operands
    st = q.dtype
    qs = (q.astype(np.float32) * np.float32(scale)).astype(st).reshape(B, Hkv, g * Sq, D)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    nq, nkt, nv = be.to_native(qs), be.to_native(kt), be.to_native(v)
    holder: dict[str, Any] = {}

    def fn() -> None:
        sc = call("matmul", nq, nkt, backend=be)
        p = call("softmax", sc, backend=be)
        holder["r"] = call("matmul", p, nv, backend=be).reshape(B, Hq, Sq, s["Dv"])

    return prepare(fn, _sync_with(be, holder), timing, what=what)


UNFUSED_BACKWARD_WHAT = (
    "the backward as portakern ops on the same backend: S = matmul(q*scale, k^T); "
    "P = exp(S - lse) (the forward's lse, not a softmax op), written with its transpose P^T by "
    "an elementwise glue kernel; dV = matmul(P^T, dO); dP = matmul(dO, V^T); "
    "delta = rowsum(dO * O) (glue); dS = P * (dP - delta) written over dP, dS^T over P^T "
    "(glue); dQ = matmul(dS, k*scale); dK = matmul(dS^T, q*scale). q*scale, k*scale, k^T and "
    "V^T made once outside the timed region; GQA by reshape (the group's rows side by side, "
    "so dK and dV sum over the group in the matmul); the glue is {glue}")


def _backward_glue_opencl(be: Backend, dtype: str) -> tuple[Any, Any, Any] | str:
    """(P kernel, delta kernel, dS kernel) as pyopencl ElementwiseKernels on ``be``'s
    context, or why not. Index math explicit (64-bit): element i of a (BH, R, C) array is
    row rr = i / C (of BH * R) and column c; its transpose's index is (bh * C + c) * R + r."""
    from ...core import dtypes

    if dtype not in ("float32", "float64"):
        return f"the OpenCL glue kernels are written for float32/float64, not {dtype}"
    queue = getattr(be, "queue", None)
    if queue is None:
        return f"{be.label} exposes no OpenCL queue"
    from pyopencl.elementwise import ElementwiseKernel

    t = "float" if dtype == "float32" else "double"
    a = "float" if dtypes.info(dtype).compute.name == "float32" else "double"
    idx = "long c = (long)i % C; long rr = (long)i / C; long r = rr % R; long bh = rr / R; "
    ctx = queue.context
    p_knl = ElementwiseKernel(
        ctx, f"{t} *s, const {a} *lse, {t} *pt, long R, long C",
        idx + f"{t} p = exp(s[i] - ({t})lse[rr]); s[i] = p; pt[(bh * C + c) * R + r] = p;",
        "pk_bench_bwd_p", preamble="#pragma OPENCL EXTENSION cl_khr_fp64 : enable"
        if t == "double" else "")
    d_knl = ElementwiseKernel(
        ctx, f"{a} *delta, const {t} *dout, const {t} *o, long DV",
        f"{a} acc = 0; for (long d = 0; d < DV; ++d) acc += ({a})dout[(long)i * DV + d] * "
        f"({a})o[(long)i * DV + d]; delta[i] = acc;", "pk_bench_bwd_delta",
        preamble="#pragma OPENCL EXTENSION cl_khr_fp64 : enable" if a == "double" else "")
    ds_knl = ElementwiseKernel(
        ctx, f"{t} *dp, const {t} *p, const {a} *delta, {t} *pt, long R, long C",
        idx + f"{t} ds = p[i] * (dp[i] - ({t})delta[rr]); dp[i] = ds; "
        "pt[(bh * C + c) * R + r] = ds;", "pk_bench_bwd_ds",
        preamble="#pragma OPENCL EXTENSION cl_khr_fp64 : enable" if t == "double" else "")
    return p_knl, d_knl, ds_knl


def unfused_backward(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray | None]
                     ) -> tuple[Any, str] | Measurement:
    """(fn, what): attention_backward as portakern matmuls plus elementwise glue on the
    backend's own arrays (UNFUSED_BACKWARD_WHAT); ``fn()`` returns (dq, dk, dv) as native
    arrays. Or the not-run record saying why (causal or masked cases; a backend whose arrays
    the glue cannot be written for: pyopencl's and jax's can)."""
    from ...core import dtypes

    if case.params.get("causal") or host.get("mask") is not None:
        return not_run("unsupported", "the unfused backward chain has no masked form here; "
                       "only non-causal, unmasked cases have one",
                       UNFUSED_BACKWARD_WHAT.format(glue="-"))
    s = case.size
    B, Hq, Hkv, Sq, Sk, D, Dv = (s[k] for k in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))
    R = (Hq // Hkv) * Sq
    scale = float(case.params.get("scale") or 1.0 / math.sqrt(D))
    do, q, k, v, o, lse = (host[n] for n in ("do", "q", "k", "v", "o", "lse"))
    assert do is not None and q is not None and k is not None and v is not None
    assert o is not None and lse is not None
    st = q.dtype
    ct = dtypes.info(case.dtype).compute

    def scaled(x: np.ndarray) -> np.ndarray:
        return (x.astype(ct) * ct.type(scale)).astype(st)

    if "pyopencl" in getattr(be, "array_modules", ()):
        glue = _backward_glue_opencl(be, case.dtype)
        what = UNFUSED_BACKWARD_WHAT.format(glue="three pyopencl ElementwiseKernels on the "
                                            "target's context and queue")
        if isinstance(glue, str):
            return not_run("unsupported", glue, what)
        p_knl, d_knl, ds_knl = glue
        kb: Any = be  # the OpenCL backend: its queue (checked above) and empty()
        queue = kb.queue
        dt = dtypes.info(case.dtype).name

        def p_from_lse(sc: Any, nl: Any) -> tuple[Any, Any]:
            pt = kb.empty((B, Hkv, Sk, R), dt)
            p_knl(sc, nl, pt, np.int64(R), np.int64(Sk), queue=queue)
            return sc, pt

        def delta_of(ndo: Any, no: Any) -> Any:
            delta = kb.empty((B, Hkv, R), ct.name)
            d_knl(delta, ndo, no, np.int64(Dv), queue=queue)
            return delta

        def ds_of(dp: Any, p: Any, delta: Any, pt: Any) -> tuple[Any, Any]:
            ds_knl(dp, p, delta, pt, np.int64(R), np.int64(Sk), queue=queue)
            return dp, pt
    elif own_jax_device(be) is not None:
        import jax.numpy as jnp

        what = UNFUSED_BACKWARD_WHAT.format(glue="jax.numpy on the target's arrays (eager; "
                                            "its transposes are copies)")

        def p_from_lse(sc: Any, nl: Any) -> tuple[Any, Any]:
            p = jnp.exp(sc.astype(ct) - nl[..., None]).astype(st)
            return p, jnp.swapaxes(p, -1, -2)

        def delta_of(ndo: Any, no: Any) -> Any:
            return jnp.sum(ndo.astype(ct) * no.astype(ct), axis=-1)

        def ds_of(dp: Any, p: Any, delta: Any, pt: Any) -> tuple[Any, Any]:
            ds = (p.astype(ct) * (dp.astype(ct) - delta[..., None])).astype(st)
            return ds, jnp.swapaxes(ds, -1, -2)
    else:
        return not_run("unsupported", f"no elementwise glue for {be.name}'s arrays (written for "
                       "pyopencl's and jax's)", UNFUSED_BACKWARD_WHAT.format(glue="-"))
    nqs = be.to_native(scaled(q).reshape(B, Hkv, R, D))
    nks = be.to_native(scaled(k))
    nkt = be.to_native(np.ascontiguousarray(np.swapaxes(k, -1, -2)))
    nvt = be.to_native(np.ascontiguousarray(np.swapaxes(v, -1, -2)))
    ndo = be.to_native(do.reshape(B, Hkv, R, Dv))
    no = be.to_native(o.reshape(B, Hkv, R, Dv))
    nl = be.to_native(lse.reshape(B, Hkv, R))

    def fn() -> tuple[Any, Any, Any]:
        p, pt = p_from_lse(call("matmul", nqs, nkt, backend=be), nl)
        dv = call("matmul", pt, ndo, backend=be)
        dp = call("matmul", ndo, nvt, backend=be)
        ds, dst = ds_of(dp, p, delta_of(ndo, no), pt)
        dq = call("matmul", ds, nks, backend=be).reshape(B, Hq, Sq, D)
        dk = call("matmul", dst, nqs, backend=be)
        return dq, dk, dv

    return fn, what


def attention_backward_memory(be: Backend, case: BenchCase) -> dict[str, Any]:
    """Extra device memory of attention_backward beyond inputs and outputs, from sizes: ours
    is its spec's workspace (delta, B*Hq*Sq words, plus whatever packed copies the target's
    config asks for); the unfused chain's is P, dP and dS (P^T
    and dS^T share one buffer, dS is written over dP: 3 Sq x Sk matrices per head) plus the
    layout copies and delta (not measured)."""
    from ...core import dtypes

    s = case.size
    info = dtypes.info(case.dtype)
    isz, esz = info.storage.itemsize, info.compute.itemsize
    B, Hq, Hkv, Sq, Sk, D, Dv = (s[k] for k in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))
    square = B * Hq * Sq * Sk * isz
    layout = (B * Hq * Sq * D + B * Hkv * Sk * (2 * D + Dv)) * isz
    delta = B * Hq * Sq * esz
    out: dict[str, Any] = {
        "method": "computed from sizes, not measured",
        "unfused": {"probabilities_bytes": square, "dp_bytes": square,
                    "ds_bytes": square, "layout_copies_bytes": layout, "delta_bytes": delta,
                    "extra_bytes": 3 * square + layout + delta,
                    "note": "three Sq*Sk matrices in the storage dtype (P, its transpose "
                            "reused for dS^T, dP overwritten by dS), the pre-scaled q and k and "
                            "the transposed k and V the chain is given, and delta"}}
    if isinstance(be, KernelBackend):
        spec = get_op("attention_backward")
        prob = spec.problem(*spec.bind(metadata_inputs(case), dict(case.params)))
        cfg = configs.config_for(be, spec, prob, None)
        ws = spec.workspace(prob, cfg) if spec.workspace is not None else {}
        out["fused"] = {"extra_bytes": sum(int(n) * dtypes.info(dt).storage.itemsize
                                           for n, dt in ws.values()),
                        "workspace_bytes": {k: int(n) * dtypes.info(dt).storage.itemsize
                                            for k, (n, dt) in ws.items()},
                        "note": "the spec's workspace for this target's config (each buffer in "
                                "workspace_bytes: delta, B*Hq*Sq words, and any packed "
                                "copies, O(S*D)); P is recomputed per tile from lse, never "
                                "stored: no Sq*Sk buffer"}
    else:
        out["fused"] = {"extra_bytes": None, "note": f"{be.name} lowers attention_backward "
                        "through its own library; its working set is that library's choice, "
                        "not computed"}
    return out


def memory_record(be: Backend, case: BenchCase) -> dict[str, Any]:
    """The extra-memory record of an op in UNFUSED_OPS."""
    if case.op == "attention_backward":
        return attention_backward_memory(be, case)
    return attention_memory(be, case)


def attention_memory(be: Backend, case: BenchCase) -> dict[str, Any]:
    """Extra device memory beyond inputs and output, computed from sizes (not measured)."""
    from ...core import dtypes

    s = case.size
    info = dtypes.info(case.dtype)
    isz, esz = info.storage.itemsize, info.compute.itemsize
    B, Hq, Hkv, Sq, Sk, D, Dv = (s[k] for k in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv"))
    scores = B * Hq * Sq * Sk * isz
    layout = B * Hq * Sq * D * isz + B * Hkv * Sk * D * isz
    out: dict[str, Any] = {
        "method": "computed from sizes, not measured",
        "unfused": {"scores_bytes": scores, "probabilities_bytes": scores,
                    "layout_copies_bytes": layout, "extra_bytes": 2 * scores + layout,
                    "note": "Sq*Sk score and probability matrices in the storage dtype, plus "
                            "the pre-scaled q and transposed k the chain is given"}}
    if isinstance(be, KernelBackend):
        spec = get_op("attention")
        prob = spec.problem(*spec.bind(metadata_inputs(case), dict(case.params)))
        cfg = configs.config_for(be, spec, prob, None)
        d = spec.defines(prob, cfg)
        ws = spec.workspace(prob, cfg) if spec.workspace is not None else {}
        scratch = sum(int(n) * dtypes.info(dt).storage.itemsize for n, dt in ws.values())
        if "BQ" in d and "BK" in d:
            packed = bool(d.get("PACK_KV"))
            local = 0 if packed else d["BK"] * (D + Dv) * esz
            private = (D + Dv + d["BK"]) * esz * d.get("TQ", 1)
            per_group = local + d["BQ"] * private
            groups = B * Hq * -(-Sq // (d["BQ"] * d.get("TQ", 1)))
            out["fused"] = {"extra_bytes": scratch,
                            "workspace_bytes": {k: int(n) * dtypes.info(dt).storage.itemsize
                                                for k, (n, dt) in ws.items()},
                            "local_bytes_per_group": local,
                            "private_bytes_per_item": private,
                            "on_chip_bytes_per_group": per_group, "groups": groups,
                            "BQ": d["BQ"], "BK": d["BK"], "TQ": d.get("TQ", 1),
                            "note": ("K transposed and V copied once into padded workspaces "
                                     "(PACK_KV, O(Sk) in size), tiles read from them in place; "
                                     if packed else "no global scratch; K/V tiles in local "
                                     "memory; ") + "the q rows, accumulators and score tile "
                                    "per work-item (private): O(1) in Sq*Sk"}
        else:
            out["fused"] = {"extra_bytes": scratch, "note": "attention.c defines changed; the "
                            "on-chip working set could not be derived"}
    else:
        out["fused"] = {"extra_bytes": None, "note": f"{be.name} lowers attention through its "
                        "own library; its working set is that library's choice, not computed"}
    return out


def make_inputs_meta(case: BenchCase) -> list[Any]:
    """Shape/dtype stand-ins of a case's operands (see suites.metadata_inputs)."""
    return metadata_inputs(case)


def derive(rec: dict[str, Any], roof: Roofline) -> None:
    """Efficiency, achieved rates and % of roofline of every measured implementation."""
    flops, nbytes = rec["cost"]["flops"], rec["cost"]["bytes"]
    compute = rec.get("compute_dtype") or rec.get("dtype") or "float32"
    peak = roof.peak_for(compute, rec.get("dtype")) if roof.status == "ok" else None
    bw = roof.copy_gbs if roof.status == "ok" else None
    if flops is None or nbytes is None:  # the op refused the case: no cost model to rate
        peak = bw = None
        rec["roofline"] = {"status": "unavailable", "reason": "the op's validate refused this "
                           "case, so it has no cost"}
    elif peak and bw:
        rec["roofline"] = {
            "peak_gflops": peak, "bw_gbs": bw,
            "bound_gflops": metrics.roofline_gflops(peak, bw, metrics.intensity(flops, nbytes)),
            "bound_s": metrics.roofline_time(flops, nbytes, peak, bw),
            "bound": metrics.bound_kind(flops, nbytes, peak, bw)}
    else:
        rec["roofline"] = {"status": roof.status, "reason": roof.reason or "probe missing "
                           f"for {rec['compute_dtype']}"}
    impls: dict[str, dict[str, Any]] = {"ours": rec["ours"]}
    if rec.get("unfused"):
        impls["unfused"] = rec["unfused"]
    impls.update(rec["peers"])
    ach: dict[str, Any] = {}
    for k, m in impls.items():
        t = m.get("median_s")
        if m.get("status") != "ok" or not t or flops is None:
            continue
        gf, gb = metrics.achieved(t, flops, nbytes)
        ach[k] = {"gflops": gf, "gbs": gb}
        if peak and bw:
            ach[k]["pct_roofline"] = metrics.pct_of_roofline(t, flops, nbytes, peak, bw)
    rec["achieved"] = ach
    peer_times = {k: (m.get("median_s") if m.get("status") == "ok" else None)
                  for k, m in rec["peers"].items()}
    bp = metrics.best_peer(peer_times)
    ours_t = rec["ours"].get("median_s") if rec["ours"].get("status") == "ok" else None
    # the median of the per-round ratios where the case ran in rounds (every case since issue
    # 26), else (older files, a peer without paired samples) the ratio of the medians
    paired = rec.get("ratios") or {}

    def eff(k: str, t: float | None) -> float | None:
        r = paired.get(k)
        if r is not None and t is not None and ours_t is not None:
            return float(r["median"])
        return metrics.efficiency(t, ours_t)

    rec["efficiencies"] = {k: eff(k, t) for k, t in peer_times.items()}
    # the best peer by the same statistic its efficiency is: the lowest per-round ratio
    # (the fastest median picked XLA's 1.113 over numpy's 1.154 at N=2048 and reported
    # numpy's); ties, and peers without paired samples, by the median time
    ranked = [(e, peer_times[k] or math.inf, k) for k, e in rec["efficiencies"].items()
              if e is not None and peer_times.get(k) is not None]
    if ranked:
        k_best = min(ranked)[2]
        bp = (k_best, float(peer_times[k_best] or 0.0))
    rec["best_peer"] = bp[0] if bp else None
    rec["efficiency"] = rec["efficiencies"][bp[0]] if bp else None
    spread = paired.get(bp[0]) if bp and rec["efficiency"] is not None else None
    rec["efficiency_spread"] = ({k: spread[k] for k in ("q1", "q3", "min", "max", "n")}
                                if spread else None)
    # cannot run here (unsupported dtype, kernel error, interrupted): PP counts it as 0
    rec["supported"] = rec["ours"].get("status") == "ok"


def run_case(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray | None], peers: Peers,
             cfg: BenchConfig, roof: Roofline, platform: str, progress: Progress
             ) -> dict[str, Any]:
    from ...core import dtypes

    spec = get_op(case.op)
    timing = cfg.effective_timing()
    names = operand_names(case.op)
    refused = ""
    try:
        prob = spec.problem(*spec.bind([host[n] for n in names], dict(case.params)))
        cost = spec.cost(prob)
        cost_rec = {"flops": cost.flops, "bytes": cost.bytes,
                    "intensity": metrics.intensity(cost.flops, cost.bytes)}
    except PortakernError as exc:  # e.g. a user op that does not take this dtype
        refused = f"{type(exc).__name__}: {exc}"
        cost_rec = {"flops": None, "bytes": None, "intensity": None}
    rec: dict[str, Any] = {
        "id": case.id, "op": case.op, "dtype": case.dtype, "label": case.label,
        "size": case.size, "params": case.params,
        "compute_dtype": dtypes.info(case.dtype).compute.name,
        "shapes": {n: list(x.shape) for n, x in host.items() if x is not None},
        "cost": cost_rec,
        "target": be.label, "backend": be.name, "device": be.device.name, "platform": platform,
        "peers": {}, "unfused": None if case.op in UNFUSED_OPS else not_run(
            "not_applicable", "the unfused chains are attention's and its backward's "
            f"(matmuls and glue through portakern); {case.op} is a single kernel with no "
            "unfused form here"
        ).as_dict(), "loadavg_1m": _loadavg(),
    }
    if refused:
        rec["ours"] = not_run("unsupported", f"{case.op} refuses this case: {refused}").as_dict()
        derive(rec, roof)
        progress.line(f"        ours: unsupported ({refused[:120]})")
        return rec
    if case.dtype not in be.supported_dtypes():
        rec["ours"] = not_run("unsupported", f"{be.describe()} does not support {case.dtype} "
                              f"(it supports {', '.join(be.supported_dtypes())})").as_dict()
        derive(rec, roof)
        progress.line(f"        ours: unsupported ({case.dtype} on {be.label})")
        return rec
    skip = None if isinstance(be, KernelBackend) else peer_skip(case)
    if skip:  # an array backend runs the op's semantics: the unfused peers' limits hold
        rec["ours"] = not_run("not_applicable", f"{be.label} evaluates the semantics (gather "
                              f"+ attention) as the unfused peers do: {skip}").as_dict()
        derive(rec, roof)
        progress.line(f"        ours: not applicable ({skip[:100]})")
        return rec
    try:
        native = {n: be.to_native(x) for n, x in host.items() if x is not None}
    except Exception as exc:
        rec["ours"] = not_run("error", f"uploading inputs failed: {type(exc).__name__}: "
                              f"{exc}").as_dict()
        derive(rec, roof)
        return rec
    ready: dict[str, Sampler] = {}  # key -> prepared implementation: ours, unfused, peers
    peer_names: dict[str, str] = {}
    try:
        progress.start("        ours (portakern)        ")
        try:
            got: Sampler | Measurement = measure_ours(be, case, native, timing)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            got = not_run("error", f"{type(exc).__name__}: {str(exc)[:800]}")
        if isinstance(got, Measurement):  # ours cannot run: no peer is worth measuring
            progress.done(got)
            rec["ours"] = got.as_dict()
            if case.op in UNFUSED_OPS:
                rec["memory"] = memory_record(be, case)
            derive(rec, roof)
            return rec
        ready["ours"] = got
        progress.ready(got.m)
        LATCH.check()
        if case.op in UNFUSED_OPS:
            rec["memory"] = memory_record(be, case)
            if cfg.unfused:
                progress.start("        unfused chain (portakern) ")
                try:
                    gu: Sampler | Measurement = measure_unfused(be, case, host, timing)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    gu = not_run("error", f"{type(exc).__name__}: {str(exc)[:800]}")
                if isinstance(gu, Measurement):
                    progress.done(gu)
                    rec["unfused"] = gu.as_dict()
                else:
                    ready["unfused"] = gu
                    progress.ready(gu.m)
                gc.collect()
                LATCH.check()
        for key in peers.keys(case.op, be):
            name = peer_name(key, case.op)
            progress.start(f"        {name:<24s}")
            gp = peers.prepare(key, be, case, host, native, timing)
            info = gp.info if isinstance(gp, Measurement) else gp.m.info
            if key == NUMPY_PEER and info.get("blas") and name == PEER_NAMES[NUMPY_PEER]:
                name = f"numpy/{info['blas']}"
            peer_names[key] = name
            if isinstance(gp, Measurement):
                progress.done(gp)
                rec["peers"][key] = {**gp.as_dict(), "name": name}
            else:
                ready[key] = gp
                progress.ready(gp.m)
            LATCH.check()
        t0 = time.perf_counter()
        progress.start(f"        interleaved rounds of {', '.join(ready)} ...")
        # the time box: the suite's budget per implementation, from our first call on
        begin = ready["ours"].begin if ready["ours"].begin is not None else t0
        n = run_rounds(ready, timing, begin=begin, budget_s=timing.budget_s * len(ready),
                       anchor="ours")
        progress.line(f" {n} rounds [{time.perf_counter() - t0:.1f} s]")
        for sm in ready.values():
            sm.close()
        _fill(rec, ready, peer_names, n)
        for key, sm in ready.items():
            label = {"ours": "ours (portakern)", "unfused": "unfused chain (portakern)"}.get(
                key, peer_names.get(key, key))
            progress.start(f"        {label:<24s}")
            progress.done(sm.m)
    except KeyboardInterrupt as exc:
        part = getattr(exc, "partial", None)
        for sm in ready.values():
            if not sm.m.samples and sm.m.status == "ok":
                sm.m.status, sm.m.stopped_by = "interrupted", "interrupted"
        if ready:
            _fill(rec, ready, peer_names, None)
        if "ours" not in rec or rec["ours"].get("status") is None:
            rec["ours"] = (part.as_dict() if isinstance(part, Measurement) else
                           not_run("interrupted", "Ctrl-C during this measurement").as_dict())
        rec["interrupted"] = True
        derive(rec, roof)
        exc.record = rec  # type: ignore[attr-defined]  # the record rides on the interrupt
        raise
    finally:
        for sm in ready.values():
            sm.close()
        ready.clear()
        native = {}
        gc.collect()
    derive(rec, lift(roof, rec))  # this case's own rates are lower bounds on the peak too
    eff = rec.get("efficiency")
    pct = rec["achieved"].get("ours", {}).get("pct_roofline")
    bits = []
    if eff is not None:
        sp = rec.get("efficiency_spread") or {}
        bits.append(f"efficiency {eff:.3g}"
                    + (f" [IQR {sp['q1']:.3g}-{sp['q3']:.3g}, {sp['n']} rounds]" if sp else "")
                    + f" vs {rec['peers'][rec['best_peer']]['name']}")
    if pct is not None:
        bits.append(f"{pct:.3g}% of roofline")
    if bits:
        progress.line("        → " + ", ".join(bits))
    return rec


def _fill(rec: dict[str, Any], ready: Mapping[str, Sampler], names: Mapping[str, str],
          rounds: int | None) -> None:
    """The measurements of a case's rounds into its record, with each peer's (and the unfused
    chain's) per-round ratio to ours (metrics.paired_ratios)."""
    ours = ready.get("ours")
    if ours is not None:
        rec["ours"] = ours.m.as_dict()
    rec["ratios"] = {}
    for key, sm in ready.items():
        if key == "ours":
            continue
        d = sm.m.as_dict()
        if key == "unfused":
            rec["unfused"] = d
        else:
            rec["peers"][key] = {**d, "name": names.get(key, key)}
        r = (metrics.paired_ratios(sm.m.samples, ours.m.samples)
             if ours is not None and sm.m.ok and ours.m.ok else None)
        if r is None:
            continue
        if key == "unfused":
            rec["unfused_ratio"] = r
        else:
            rec["ratios"][key] = r
    rec["rounds"] = {"n": rounds, "implementations": list(ready), "order": "rotated each round",
                     "ratio": "peer sample / ours sample of the same round (efficiency); "
                              "unfused_ratio: unfused / ours"}


# --- contention: measure again, keep the quietest attempt, mark what stays contended ------------
def other_share(rec: Mapping[str, Any]) -> float | None:
    """The share of all CPUs that other processes used while the case ran (None: unknown)."""
    c = rec.get("contention") or {}
    v = c.get("other_share")
    return None if v is None else float(v)


def _carry_first_calls(first: Mapping[str, Any], kept: dict[str, Any]) -> None:
    """A re-measured case's first calls (and ours' compile) are those of its first attempt:
    in later attempts the kernels, traces and caches are warm, so their "first call" is
    not one."""
    pairs = [(first.get("ours"), kept.get("ours")), (first.get("unfused"), kept.get("unfused"))]
    pairs += [((first.get("peers") or {}).get(k), m) for k, m in (kept.get("peers") or {}).items()]
    for a, b in pairs:
        if not a or not b or a.get("first_call_s") is None or b.get("first_call_s") is None:
            continue
        b["first_call_s"] = a["first_call_s"]
        if b.get("median_s") is not None:
            b["first_call_overhead_s"] = max(0.0, a["first_call_s"] - b["median_s"])
        ai, bi = a.get("info") or {}, b.setdefault("info", {})
        for k in ("compile_s", "compile_cached"):
            if k in ai:
                bi[k] = ai[k]


def measure_case(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray | None],
                 peers: Peers, cfg: BenchConfig, roof: Roofline, platform: str,
                 progress: Progress, meter: environment.CpuMeter, hog_pid: int | None = None
                 ) -> dict[str, Any]:
    """``run_case`` with its contention measured; while other processes used more than
    ``CONTENTION_NOTE`` of the CPUs, measured again (``cfg.remeasure`` times at most). The
    attempt with the least contention is kept (``remeasured`` lists them all) and marked
    ``contended`` when even it exceeds the threshold. ``hog_pid``: a load started on purpose
    (``--hog``), counted apart (``contention.hog_share``), not as contention."""
    attempts: list[dict[str, Any]] = []

    def known() -> tuple[int, ...]:
        return peers.pids() + ((hog_pid,) if hog_pid else ())

    try:
        while True:
            snap = meter.snapshot(known())
            hog0 = meter.cpu_seconds(hog_pid) if hog_pid else 0.0
            rec = run_case(be, case, host, peers, cfg, roof, platform, progress)
            c = meter.since(snap, known())
            if c is not None and hog_pid:
                c["hog_share"] = min(1.0, (meter.cpu_seconds(hog_pid) - hog0)
                                     / (c["wall_s"] * meter.ncpu))
            rec["contention"] = c
            attempts.append(rec)
            share = other_share(rec)
            if share is None or share <= CONTENTION_NOTE or len(attempts) > cfg.remeasure:
                break
            progress.line(f"        other processes used {share:.0%} of the CPUs (over "
                          f"{CONTENTION_NOTE:.0%}): measuring this case again "
                          f"({len(attempts)}/{cfg.remeasure})")
    except KeyboardInterrupt as exc:
        if attempts and getattr(exc, "record", None) is not None:
            exc.record = _keep(attempts)  # type: ignore[attr-defined]  # a whole attempt
        raise
    return _keep(attempts)


def _keep(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The least contended attempt, with the record of all of them."""
    shares = [other_share(a) for a in attempts]
    order = [sh if sh is not None else 0.0 for sh in shares]
    i = order.index(min(order))
    rec = attempts[i]
    if len(attempts) > 1:
        if i:
            _carry_first_calls(attempts[0], rec)
        rec["remeasured"] = {
            "why": f"other processes used more than {CONTENTION_NOTE:.0%} of the CPUs",
            "kept": i + 1,
            "attempts": [{"other_share": sh, "efficiency": a.get("efficiency"),
                          "best_peer": a.get("best_peer"),
                          "ours_median_s": (a.get("ours") or {}).get("median_s")}
                         for a, sh in zip(attempts, shares)],
            "first_calls_from": "attempt 1 (later attempts ran warm)"}
    sh = shares[i]
    rec["contended"] = bool(sh is not None and sh > CONTENTION_NOTE)
    return rec


def compare_hogged(quiet: Mapping[str, Any], hogged: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per peer (and the unfused chain) of one case: the ratio quiet and under the hog, and how
    far apart (``diff_pct`` = 100 * (hogged / quiet - 1))."""
    out = []
    pairs = [(k, (quiet.get("ratios") or {}).get(k), (hogged.get("ratios") or {}).get(k),
              (quiet.get("peers") or {}).get(k, {}).get("name", k))
             for k in (quiet.get("ratios") or {})]
    if quiet.get("unfused_ratio"):
        pairs.append(("unfused", quiet["unfused_ratio"], hogged.get("unfused_ratio"),
                      "unfused chain / ours"))
    for key, q, h, name in pairs:
        if not q or not h:
            continue
        diff = 100.0 * (h["median"] / q["median"] - 1.0) if q["median"] else None
        out.append({"id": quiet["id"], "op": quiet["op"], "label": quiet["label"],
                    "target": quiet["target"], "peer": key, "name": name,
                    "best_peer": key == quiet.get("best_peer"),
                    "quiet": {k: q[k] for k in ("median", "q1", "q3", "min", "max", "n")},
                    "hogged": {k: h[k] for k in ("median", "q1", "q3", "min", "max", "n")},
                    "diff_pct": diff, "within_10pct": diff is not None and abs(diff) <= 10.0,
                    "quiet_other_share": other_share(quiet),
                    "hogged_other_share": other_share(hogged),
                    "hog_share": (hogged.get("contention") or {}).get("hog_share")})
    return out


def _loadavg() -> float | None:
    """1-minute load average: other processes on the device make absolute times unreliable."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# --- the run ------------------------------------------------------------------------------------
def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, np.generic):
        return _finite(x.item())
    return x


def write_json(result: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Atomic write (a reader never sees half a file), strict JSON (no NaN/Infinity)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(_finite(result), indent=1, default=str, allow_nan=False) + "\n")
    tmp.replace(p)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; write and return the result record.

    Ctrl-C stops it at once and the record measured so far is written; an interrupt swallowed
    by a gc callback or ``__del__`` is caught by the latch (bench/interrupt.py) at the next
    measurement boundary."""
    with LATCH.installed():
        return _run_bench(cfg)


def _run_bench(cfg: BenchConfig) -> dict[str, Any]:
    progress = Progress(cfg.progress)
    t_start = time.perf_counter()
    prev_tf32 = os.environ.get("CUPY_TF32")
    os.environ["CUPY_TF32"] = "0"  # cuBLAS fp32 GEMM must be fp32, not TF32
    ops_skipped: dict[str, str] = {}
    cases = suite_cases(cfg.suite, cfg.ops, cfg.dtypes, cfg.limit, skipped=ops_skipped)
    if cfg.cases:
        every = cases
        cases = [c for c in cases if any(f in c.id for f in cfg.cases)]
        if not cases:
            raise ValueError(f"--case {', '.join(cfg.cases)}: no case of the selection has an "
                             "id containing it; the ids are: "
                             + "; ".join(c.id for c in every))
    hog = Hog(pick_core(cfg.hog)) if cfg.hog is not None else None
    targets, skipped = open_targets(cfg.targets)
    env = environment.collect()
    env["CUPY_TF32_before_bench"] = prev_tf32
    env["loadavg_1m_at_start"] = _loadavg()
    result: dict[str, Any] = {"schema": SCHEMA, "config": cfg.as_dict(), "environment": env,
                              "targets": {}, "targets_unavailable": skipped,
                              "ops_without_sizes": ops_skipped, "dispatch": {},
                              "cases": [], "interrupted": False, "complete": False}
    if hog is not None:
        result["hog"] = {**hog.as_dict(), "cases": [], "comparison": [],
                         "what": "every case measured twice: quiet (cases), then with the hog "
                                 "running (hog.cases); comparison: each ratio quiet and hogged"}
    if not targets:
        progress.line("portakern bench: no target can run here: "
                      + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    peers = Peers(cfg.peers)
    missing = missing_promised(targets, peers.wanted)
    result["peers_missing"] = missing
    hostname = env["hostname"]
    compute = sorted({"float32"} | ({"float64"} if any(c.dtype == "float64" for c in cases)
                                    else set()))
    progress.line(f"portakern bench: suite {cfg.suite}, {len(cases)} cases x {len(targets)} "
                  f"target(s) ({', '.join(b.label for b in targets) or 'none'}) -> {cfg.out}")
    for key, why in missing.items():
        progress.line(f"WARNING: promised peer {key} is missing: {why}")
    for name, why in skipped.items():
        progress.line(f"  skipped {name}: {why}")
    for name, why in ops_skipped.items():
        progress.line(f"  skipped op {name}: {why}")
    roofs: dict[str, Roofline] = {}
    device_roof: dict[str, Roofline] = {}  # hardware key -> the roof used (see below)
    n_done = 0
    try:
        for be in targets:
            t0 = time.perf_counter()
            progress.start(f"probing {be.describe()} ...")
            roof = run_probes(be, compute) if cfg.probes else Roofline(
                status="unavailable", reason="probes disabled (--no-probes)")
            roofs[be.label] = roof
            if roof.status == "ok":
                peaks = ", ".join(f"{k} FMA {v:.4g} GFLOP/s" for k, v in roof.fma_gflops.items())
                progress.line(f" copy {roof.copy_gbs:.4g} GB/s, {peaks} "
                              f"[{time.perf_counter() - t0:.1f} s]")
            else:
                progress.line(f" {roof.status}: {roof.reason}")
            result["targets"][be.label] = {
                "backend": be.name, "device": be.device.as_dict(),
                "implementation": implementation(be),
                "platform": platform_id(be, hostname), "roofline": roof.as_dict()}
        groups: dict[str, list[str]] = {}
        for be in targets:
            groups.setdefault(hardware_key(be), []).append(be.label)
        # the roof of a device: the best probe of the targets on it, then raised by every
        # rate measured on it in this run (probes.lift), so no efficiency exceeds 100%
        probed: dict[str, Roofline] = {}
        for key, labels in groups.items():
            probed[key] = combine({lab: roofs[lab] for lab in labels})
        device_roof.update(probed)
        for be in targets:
            result["targets"][be.label]["roofline_probes"] = probed[hardware_key(be)].as_dict()
            result["targets"][be.label]["roofline_effective"] = probed[
                hardware_key(be)].as_dict()
            result["targets"][be.label]["device_key"] = metrics.device_key(
                be.device.kind, be.device.name, hostname, metrics.cpu_model_of(result))
        if NUMPY_PEER in peers.wanted and any(b.device.kind == "cpu" for b in targets):
            env["numpy_peer"] = peers.numpy_info()
        write_json(result, cfg.out)
        if cfg.dispatch_enabled():
            run_dispatch(targets, cfg, result, progress)
            write_json(result, cfg.out)
        total = len(cases) * len(targets)
        meter = environment.CpuMeter()
        for case in cases:
            host = make_inputs(case)
            for be in targets:
                n_done += 1
                progress.line(f"[{n_done:>3}/{total}] {case.op} {case.dtype} {case.label} on "
                              f"{be.label}")
                hk = hardware_key(be)
                platform = result["targets"][be.label]["platform"]
                try:
                    rec = measure_case(be, case, host, peers, cfg, device_roof[hk], platform,
                                       progress, meter)
                    rec["device_key"] = result["targets"][be.label]["device_key"]
                    rec["implementation"] = result["targets"][be.label]["implementation"]
                    device_roof[hk] = lift(device_roof[hk], rec)
                    derive(rec, device_roof[hk])
                except KeyboardInterrupt as exc:
                    rec = getattr(exc, "record", None)
                    if rec is not None:
                        result["cases"].append(rec)
                    raise
                result["cases"].append(rec)
                write_json(result, cfg.out)  # a crash later still leaves this case on disk
                if hog is not None:
                    progress.line(f"      the same with a busy loop on core {hog.core}:")
                    try:
                        with hog.running():
                            hrec = measure_case(be, case, host, peers, cfg, device_roof[hk],
                                                platform, progress, meter, hog_pid=hog.pid)
                    except KeyboardInterrupt as exc:
                        part = getattr(exc, "record", None)
                        if part is not None:
                            result["hog"]["cases"].append(part)
                        raise
                    hrec["device_key"] = rec["device_key"]
                    hrec["implementation"] = rec["implementation"]
                    hrec["hogged"] = True
                    derive(hrec, device_roof[hk])  # rated, but never raising the roof
                    result["hog"]["cases"].append(hrec)
                    result["hog"]["comparison"] += compare_hogged(rec, hrec)
                    write_json(result, cfg.out)
            del host
            gc.collect()
            LATCH.check()
        result["complete"] = True
    except KeyboardInterrupt:
        result["interrupted"] = True
        progress.line("\ninterrupted: writing what was measured so far")
    finally:
        if hog is not None:
            hog.stop()
        peers.close()
        final_roofs(result, targets, device_roof)
        if prev_tf32 is None:
            os.environ.pop("CUPY_TF32", None)
        else:
            os.environ["CUPY_TF32"] = prev_tf32
        result["wall_s"] = time.perf_counter() - t_start
        env["loadavg_1m_at_end"] = _loadavg()
        write_json(result, cfg.out)
    return result


def final_roofs(result: dict[str, Any], targets: list[Backend],
                device_roof: Mapping[str, Roofline]) -> None:
    """Re-rate every case against its device's final roof (the probes raised by every rate
    measured on the device in the whole run): then no % of roofline exceeds 100."""
    if not device_roof:
        return
    by_label = {be.label: hardware_key(be) for be in targets}
    for be in targets:
        roof = device_roof.get(by_label[be.label])
        if roof is not None:
            result["targets"][be.label]["roofline_effective"] = roof.as_dict()
    for rec in [*result["cases"], *(result.get("hog") or {}).get("cases", [])]:
        roof = device_roof.get(by_label.get(rec.get("target"), ""))
        if roof is not None and rec.get("ours") is not None:
            derive(rec, roof)


def run_dispatch(targets: list[Backend], cfg: BenchConfig, result: dict[str, Any],
                 progress: Progress) -> None:
    """The dispatch-overhead measurement (dispatch.py) on every target, into result."""
    dcfg = cfg.dispatch_config or DispatchConfig()
    for be in targets:
        progress.line(f"dispatch overhead on {be.label} ({dcfg.shape_text}):")
        try:
            rec = measure_dispatch(be, dcfg)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            rec = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:800]}"}
        result["dispatch"][be.label] = rec
        for name, d in entries_of(rec).items():
            if d.get("status") == "ok":
                o = d["overhead_us"]
                h = d.get("host")
                hs = ("host " + ", ".join(f"{k} {h['overhead_us'][v]:+.3g}"
                                          for v, k in HOST_COLUMNS.items()
                                          if v in h["overhead_us"]) + " µs; " if h else "")
                progress.line(f"    {name:<13s} {hs}wall +{o['call']:.3g} µs, out= "
                              f"+{o['call_out']:.3g} µs over the raw enqueue "
                              f"({d['per_call_us']['raw']['median']:.3g} µs; target "
                              f"{d['target_us']:g} µs, judged on {d.get('judged_on', 'wall')})")
            else:
                progress.line(f"    {name:<13s} {d.get('status')}: "
                              f"{str(d.get('reason', ''))[:160]}")


def with_timing_overrides(base: TimingConfig, **kw: Any) -> TimingConfig:
    """The suite's timing with CLI overrides (None = keep the suite's value)."""
    return replace(base, **{k: v for k, v in kw.items() if v is not None})
