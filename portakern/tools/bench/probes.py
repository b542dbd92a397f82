"""Roofline probes: portakern measures each device's copy bandwidth and FMA peak itself.

Why our own probes and not a datasheet: a datasheet peak is what no kernel reaches through
this driver and this compiler, and PoCL on a 2-core VM has no datasheet. The probes are
ordinary portakern kernels (probes.c, rendered by codegen for the backend's dialect and run
through the backend's own ``compile``/``enqueue``), so the roof is what *our toolchain* can
reach on the device, and the same source runs on OpenCL and CUDA. On array-library backends
(jax) the probes are a jitted negation (copy traffic: one read, one write; a plain copy can
be forwarded or elided by XLA, and the input is donated so no fresh pages are faulted in)
and a jitted loop of multiply-adds.

Each probe tries a few launch shapes and keeps the fastest: the roof is the best this code
reached, and the trials are recorded beside it. FMA peak is measured in the compute dtype
(fp32; fp64 where a case needs it): our fp16/bf16 kernels compute in fp32, and no probe uses
tensor cores, so a vendor GEMM on tensor cores can exceed 100% of this roof (docs/bench.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from ...backend.base import Backend, KernelBackend
from ...core import codegen
from ...core.spec import Launch
from ...ops._common import cdiv
from .timing import TimingConfig, measure

PROBE_TIMING = TimingConfig(min_time=0.1, min_reps=3, max_reps=50, budget_s=4.0)

# (elements copied, [(VW, WG), ...]) and (work-items, [(VW, CHAINS, ITERS, WG), ...]) per
# device class. VW is the vector width (OpenCL floatVW; a dialect without vector types runs
# VW = 1). The CPU trials put 8-16 independent 16-lane chains per work-item (AVX-512: one or
# two zmm FMA pipes of 4-cycle latency need >= 8 in flight), and 8 chains of 8 lanes (AVX2:
# 16 ymm registers; 16-lane chains take two each and spill); the scalar trial is kept so a
# device where vectors do worse is still measured at its best.
COPY_SHAPES = {"cpu": (32 << 20, ((16, 64), (8, 128), (1, 1024))),
               "gpu": (64 << 20, ((4, 256), (1, 256), (1, 1024)))}
FMA_SHAPES = {
    "cpu": (1 << 16, ((16, 8, 64, 64), (16, 12, 64, 64), (16, 12, 64, 4), (8, 16, 64, 64),
                      (8, 8, 64, 64), (1, 8, 128, 256))),
    "gpu": (1 << 22, ((1, 8, 128, 256), (1, 16, 64, 256), (4, 8, 64, 256), (1, 4, 256, 128))),
}
JAX_COPY_ELEMS = {"cpu": 32 << 20, "gpu": 64 << 20}
JAX_FMA_SHAPES = {"cpu": ((1 << 18, 8, 400), (1 << 16, 16, 200)),
                  "gpu": ((1 << 24, 8, 400), (1 << 22, 32, 200))}  # (n, unrolled, loop iters)


@dataclass
class Roofline:
    """What the probes found on one device (GB/s, GFLOP/s per compute dtype)."""

    status: str = "ok"  # ok | error | unavailable
    copy_gbs: float | None = None
    fma_gflops: dict[str, float] = field(default_factory=dict)
    method: str = ""
    reason: str = ""
    trials: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # number -> target it came from

    def peak_for(self, compute_dtype: str, dtype: str | None = None) -> float | None:
        """The peak for a case: the entry of its storage dtype when a measured rate lifted
        one (``lift``), else the probe's peak in its compute dtype."""
        got = self.fma_gflops.get(dtype) if dtype else None
        return got if got is not None else self.fma_gflops.get(compute_dtype)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "copy_gbs": self.copy_gbs,
                             "fma_gflops": dict(self.fma_gflops), "method": self.method,
                             "trials": self.trials}
        if self.sources:
            d["sources"] = dict(self.sources)
        if self.reason:
            d["reason"] = self.reason
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Roofline:
        d = d or {}
        return cls(status=d.get("status", "unavailable"), copy_gbs=d.get("copy_gbs"),
                   fma_gflops=dict(d.get("fma_gflops") or {}), method=d.get("method", ""),
                   reason=d.get("reason", ""), trials=list(d.get("trials") or []),
                   sources=dict(d.get("sources") or {}))


def combine(roofs: Mapping[str, Roofline]) -> Roofline:
    """The roof of one device from several targets' probes on it: the best of each number.

    Every probe result is a lower bound on what the hardware can do, so the maximum over the
    probes of all targets sharing the device (opencl:0 and jax:cpu on one CPU) is the best
    lower bound; using each target's own probe would let a weak probe (XLA's elementwise
    loop) put a vendor GEMM above 100%. ``sources`` says which target each number came from.
    """
    ok = {k: r for k, r in roofs.items() if r.status == "ok"}
    if not ok:
        reasons = "; ".join(f"{k}: {r.reason or r.status}" for k, r in roofs.items())
        return Roofline(status="unavailable", reason=reasons or "no probe ran")
    out = Roofline(method="best of portakern's probes on this device across targets")
    for k, r in ok.items():
        if r.copy_gbs and (out.copy_gbs is None or r.copy_gbs > out.copy_gbs):
            out.copy_gbs, out.sources["copy_gbs"] = r.copy_gbs, k
        for dt, v in r.fma_gflops.items():
            if v > out.fma_gflops.get(dt, 0.0):
                out.fma_gflops[dt], out.sources[f"fma_gflops.{dt}"] = v, k
    if out.copy_gbs is None or not out.fma_gflops:
        out.status, out.reason = "unavailable", "the probes measured no bandwidth or no peak"
    return out


def lift(roof: Roofline, rec: Mapping[str, Any]) -> Roofline:
    """The roof raised to every rate measured in case record ``rec``.

    Every implementation that ran a case (ours, the unfused chain, every peer) did the cost
    model's flops and moved at least its compulsory bytes in its median time, so flops/time is
    a lower bound on the device's peak and bytes/time on its bandwidth, exactly as a probe is.
    The roof used is the maximum of all of them, so no measurement can exceed 100% of it:
    roofline time = max(flops/peak, bytes/bw) <= time for every measured time. A rate can only
    lift the peak of its own case dtype (``fma_gflops[dtype]``: an fp16 GEMM on tensor cores
    lifts the fp16 roof, not the fp32 one); ``sources`` names the measurement that set each
    number. A probe-less or failed roof becomes the measured rates alone."""
    cost = rec.get("cost") or {}
    flops, nbytes = cost.get("flops"), cost.get("bytes")
    if flops is None or nbytes is None:
        return roof
    dtype = rec.get("dtype") or rec.get("compute_dtype") or "float32"
    compute = rec.get("compute_dtype") or dtype
    impls: dict[str, Mapping[str, Any]] = {"ours": rec.get("ours") or {}}
    if rec.get("unfused"):
        impls["unfused"] = rec["unfused"]
    impls.update(rec.get("peers") or {})
    ok = roof.status == "ok"
    out = Roofline(status="ok", copy_gbs=roof.copy_gbs if ok else None,
                   fma_gflops=dict(roof.fma_gflops) if ok else {},
                   method=roof.method if ok else "rates measured in this run (no probe)",
                   trials=roof.trials, sources=dict(roof.sources) if ok else {})
    if ok and dtype not in out.fma_gflops and compute in out.fma_gflops:
        out.fma_gflops[dtype] = out.fma_gflops[compute]
        out.sources.setdefault(f"fma_gflops.{dtype}",
                               out.sources.get(f"fma_gflops.{compute}", "probe"))
    where = f"{rec.get('id', '?')} on {rec.get('target', '?')}"
    for k, m in impls.items():
        t = m.get("median_s")
        if m.get("status") != "ok" or not t or t <= 0:
            continue
        name = "portakern" if k == "ours" else m.get("name", k)
        gf, gb = rate_at_least(flops, t, 1e9), rate_at_least(nbytes, t, 1e9)
        if gf > 0 and gf > out.fma_gflops.get(dtype, 0.0):
            out.fma_gflops[dtype] = gf
            out.sources[f"fma_gflops.{dtype}"] = f"measured: {name}, {where}"
        if gb > 0 and gb > (out.copy_gbs or 0.0):
            out.copy_gbs = gb
            out.sources["copy_gbs"] = f"measured: {name}, {where}"
    if out.copy_gbs is None or not out.fma_gflops:
        return roof
    if (out.sources != roof.sources or not ok) and "raised to rates" not in out.method:
        out.method = (roof.method + "; " if ok else "") + "raised to rates measured in this run"
    return out


def rate_at_least(amount: float, seconds: float, unit: float) -> float:
    """amount / seconds / unit, rounded up to the float for which amount / (rate * unit) is
    at most ``seconds``: a roof lifted to a measured rate must give that measurement a
    roofline time no longer than its own, or its % roof reads 100.0000001 (seen: torch's
    N=512 matmul, the rate that set the run's roof, one ulp above it)."""
    rate = amount / seconds / unit
    while rate > 0 and amount / (rate * unit) > seconds:
        rate = math.nextafter(rate, math.inf)
    return rate


def probe_source() -> str:
    """The probes' C source (package data beside this module)."""
    try:
        return resources.files("portakern.tools.bench").joinpath("probes.c").read_text()
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(
            f"tools/bench/probes.c is missing from the installed package ({exc}); expected "
            "it beside probes.py. Fix: reinstall portakern (pip install -e .) or add "
            "'portakern.tools.bench = [\"*.c\"]' to [tool.setuptools.package-data].") from None


def _wg_ok(be: Backend, wg: int) -> bool:
    return wg <= be.device.max_work_group_size


def copy_operands(be: KernelBackend, n: int) -> tuple[Any, Any]:
    """The copy probe's source and destination. The source is written on the host first:
    a buffer never written is untouched pages, which a CPU device's OS maps to its one shared
    zero page, so a copy from it reads a single cache-resident page and times only the
    writes. That probe read 45-52 GB/s on PoCL on a 2-core Zen 4 VM where a copy of real
    data reads 29-33 in the same minutes: every "% of copy" read 1.4-1.6x too low. (The
    destination's pages are faulted in by the first, untimed call.)"""
    return be.to_native(np.ones(n, np.float32)), be.empty((n,), "float32")


def probe_kernel_backend(be: KernelBackend, compute_dtypes: Sequence[str],
                         timing: TimingConfig = PROBE_TIMING) -> Roofline:
    """Copy bandwidth and FMA peak through ``be.compile``/``be.program`` (probes.c)."""
    klass = be.device_class
    src = probe_source()
    roof = Roofline(method=f"probes.c via {be.name} compile/enqueue")
    vector = bool(codegen.DIALECTS[be.dialect or ""].vectors) if be.dialect else False
    n_copy, copy_shapes = COPY_SHAPES[klass]
    x, y = copy_operands(be, n_copy)
    best_bw = 0.0
    tried: set[tuple[int, ...]] = set()
    for vw, wg in copy_shapes:
        vw = vw if vector else 1
        if not _wg_ok(be, wg) or n_copy % vw or (vw, wg) in tried:
            continue
        tried.add((vw, wg))
        rendered = codegen.render(src, be.dialect or "", slots={"T": "float32"},
                                  defines={"CHAINS": 1, "ITERS": 1, "VW": vw})
        copy_k = be.compile(rendered, ("pk_probe_copy",))["pk_probe_copy"]
        la = Launch("pk_probe_copy", (cdiv(n_copy // vw, wg), 1, 1), (wg, 1, 1), ())
        prog = be.program(copy_k, la, ("x", "y", np.int32(n_copy)))
        args = [be.buffer_arg(x), be.buffer_arg(y)]
        m = measure(lambda prog=prog, args=args: prog(args),
                    be.synchronize, timing, what=f"pk_probe_copy n={n_copy} vw={vw} wg={wg}")
        bw = 2.0 * n_copy * 4 / m.median / 1e9  # type: ignore[operator]  # measure() always samples
        roof.trials.append({"probe": "copy", "n": n_copy, "vw": vw, "wg": wg,
                            "median_s": m.median, "min_s": m.stats.min if m.stats else None,
                            "gbs": bw})
        best_bw = max(best_bw, bw)
    del x, y
    roof.copy_gbs = best_bw or None
    n_items, shapes = FMA_SHAPES[klass]
    for cdt in compute_dtypes:
        if cdt == "float64" and not be.device.fp64:
            continue
        out = be.empty((n_items,), cdt)
        scal = np.float64 if cdt == "float64" else np.float32
        best = 0.0
        tried = set()
        for vw, chains, iters, wg in shapes:
            vw = vw if vector else 1
            if not _wg_ok(be, wg) or n_items % wg or (vw, chains, iters, wg) in tried:
                continue  # the FMA probe has no bounds test: the launch must cover Y exactly
            tried.add((vw, chains, iters, wg))
            rendered = codegen.render(src, be.dialect or "", slots={"T": cdt},
                                      defines={"CHAINS": chains, "ITERS": iters, "VW": vw})
            k = be.compile(rendered, ("pk_probe_fma",))["pk_probe_fma"]
            la = Launch("pk_probe_fma", (cdiv(n_items, wg), 1, 1), (wg, 1, 1), ())
            prog = be.program(k, la, ("y", scal(0.999), scal(1e-3)))
            args = [be.buffer_arg(out)]
            m = measure(lambda prog=prog, args=args: prog(args), be.synchronize,
                        timing, what=f"pk_probe_fma {cdt} vw={vw} chains={chains} "
                        f"iters={iters}")
            flops = 2.0 * n_items * vw * chains * iters
            gf = flops / m.median / 1e9  # type: ignore[operator]  # measure() always samples
            roof.trials.append({"probe": "fma", "dtype": cdt, "n": n_items, "vw": vw,
                                "chains": chains, "iters": iters, "wg": wg,
                                "median_s": m.median, "gflops": gf})
            best = max(best, gf)
        if best:
            roof.fma_gflops[cdt] = best
    return roof


def probe_jax(device: Any, klass: str, compute_dtypes: Sequence[str],
              timing: TimingConfig = PROBE_TIMING) -> Roofline:
    """Copy bandwidth (donated jitted negation) and FMA peak (jitted loop) on a jax device."""
    import jax

    roof = Roofline(method=f"jax.jit negation (donated) and fori_loop of a*b+c on {device}")
    n = JAX_COPY_ELEMS[klass]
    neg = jax.jit(lambda v: -v, donate_argnums=0)
    state = {"x": jax.device_put(np.ones(n, np.float32), device)}

    def step() -> None:
        state["x"] = neg(state["x"])

    m = measure(step, lambda: state["x"].block_until_ready(), timing,
                what=f"jax negation n={n}")
    bw = 2.0 * n * 4 / m.median / 1e9  # type: ignore[operator]  # measure() always samples
    roof.trials.append({"probe": "copy", "n": n, "median_s": m.median, "gbs": bw})
    roof.copy_gbs = bw
    del state["x"]
    for cdt in compute_dtypes:
        if cdt == "float64" and not jax.config.jax_enable_x64:
            continue
        best = 0.0
        for size, unrolled, iters in JAX_FMA_SHAPES[klass]:
            def body(_i: Any, a: Any, b: Any, c: Any, unrolled: int = unrolled) -> Any:
                for _ in range(unrolled):
                    a = a * b + c
                return a

            def fma(a: Any, b: Any, c: Any, iters: int = iters, body: Any = body) -> Any:
                return jax.lax.fori_loop(0, iters, lambda i, acc: body(i, acc, b, c), a)

            f = jax.jit(fma)
            a0 = jax.device_put((np.arange(size) % 1024 * 1e-4).astype(cdt), device)
            b = jax.device_put(np.asarray(0.999, cdt), device)
            c = jax.device_put(np.asarray(1e-3, cdt), device)
            res: dict[str, Any] = {}

            def run(f: Any = f, a0: Any = a0, b: Any = b, c: Any = c, res: Any = res) -> None:
                res["y"] = f(a0, b, c)

            m = measure(run, lambda res=res: res["y"].block_until_ready(), timing,
                        what=f"jax fma loop {cdt} n={size} x{unrolled} x{iters}")
            flops = 2.0 * size * unrolled * iters
            gf = flops / m.median / 1e9  # type: ignore[operator]  # measure() always samples
            roof.trials.append({"probe": "fma", "dtype": cdt, "n": size, "unrolled": unrolled,
                                "iters": iters, "median_s": m.median, "gflops": gf})
            best = max(best, gf)
        if best:
            roof.fma_gflops[cdt] = best
    return roof
