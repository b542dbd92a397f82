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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from .. import codegen
from ..backends.base import Backend, KernelBackend
from ..ops._common import cdiv
from ..spec import Launch
from .timing import TimingConfig, measure

PROBE_TIMING = TimingConfig(min_time=0.1, min_reps=3, max_reps=50, budget_s=4.0)

# (elements copied, work-group sizes) and (work-items, [(CHAINS, ITERS, WG), ...]) per class
COPY_SHAPES = {"cpu": (32 << 20, (256, 1024)), "gpu": (64 << 20, (256, 1024))}
FMA_SHAPES = {
    "cpu": (1 << 20, ((8, 128, 256), (8, 64, 64), (4, 128, 256), (16, 64, 256))),
    "gpu": (1 << 25, ((8, 128, 256), (16, 64, 256), (4, 256, 128))),
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

    def peak_for(self, compute_dtype: str) -> float | None:
        return self.fma_gflops.get(compute_dtype)

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


def probe_source() -> str:
    """The probes' C source (package data beside this module)."""
    try:
        return resources.files("portakern.bench").joinpath("probes.c").read_text()
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(
            f"portakern/bench/probes.c is missing from the installed package ({exc}); expected "
            "it beside probes.py. Fix: reinstall portakern (pip install -e .) or add "
            "'portakern.bench = [\"*.c\"]' to [tool.setuptools.package-data].") from None


def _wg_ok(be: Backend, wg: int) -> bool:
    return wg <= be.device.max_work_group_size


def probe_kernel_backend(be: KernelBackend, compute_dtypes: Sequence[str],
                         timing: TimingConfig = PROBE_TIMING) -> Roofline:
    """Copy bandwidth and FMA peak through ``be.compile``/``be.enqueue`` (probes.c)."""
    klass = be.device_class
    src = probe_source()
    roof = Roofline(method=f"probes.c via {be.name} compile/enqueue")
    n_copy, wgs = COPY_SHAPES[klass]
    x = be.empty((n_copy,), "float32")
    y = be.empty((n_copy,), "float32")
    rendered = codegen.render(src, be.dialect or "", slots={"T": "float32"},
                              defines={"CHAINS": 1, "ITERS": 1})
    copy_k = be.compile(rendered, ("pk_probe_copy",))["pk_probe_copy"]
    best_bw = 0.0
    for wg in (w for w in wgs if _wg_ok(be, w)):
        la = Launch("pk_probe_copy", (cdiv(n_copy, wg), 1, 1), (wg, 1, 1), ())
        args = [be.buffer_arg(x), be.buffer_arg(y), np.int32(n_copy)]
        m = measure(lambda la=la, args=args: be.enqueue(copy_k, la, args), be.synchronize,
                    timing, what=f"pk_probe_copy n={n_copy} wg={wg}")
        bw = 2.0 * n_copy * 4 / m.median / 1e9  # type: ignore[operator]
        roof.trials.append({"probe": "copy", "n": n_copy, "wg": wg, "median_s": m.median,
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
        for chains, iters, wg in shapes:
            if not _wg_ok(be, wg) or n_items % wg:
                continue  # the FMA probe has no bounds test: the launch must cover Y exactly
            rendered = codegen.render(src, be.dialect or "", slots={"T": cdt},
                                      defines={"CHAINS": chains, "ITERS": iters})
            k = be.compile(rendered, ("pk_probe_fma",))["pk_probe_fma"]
            la = Launch("pk_probe_fma", (cdiv(n_items, wg), 1, 1), (wg, 1, 1), ())
            args = [be.buffer_arg(out), scal(0.999), scal(1e-3)]
            m = measure(lambda k=k, la=la, args=args: be.enqueue(k, la, args), be.synchronize,
                        timing, what=f"pk_probe_fma {cdt} chains={chains} iters={iters}")
            gf = 2.0 * n_items * chains * iters / m.median / 1e9  # type: ignore[operator]
            roof.trials.append({"probe": "fma", "dtype": cdt, "n": n_items, "chains": chains,
                                "iters": iters, "wg": wg, "median_s": m.median, "gflops": gf})
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
    bw = 2.0 * n * 4 / m.median / 1e9  # type: ignore[operator]
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
            gf = 2.0 * size * unrolled * iters / m.median / 1e9  # type: ignore[operator]
            roof.trials.append({"probe": "fma", "dtype": cdt, "n": size, "unrolled": unrolled,
                                "iters": iters, "median_s": m.median, "gflops": gf})
            best = max(best, gf)
        if best:
            roof.fma_gflops[cdt] = best
    return roof
