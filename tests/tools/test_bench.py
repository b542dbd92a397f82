"""The benchmark's own logic: statistics, repetition, metrics, roofline, cost models, the
report merge, and one tiny real run on OpenCL that writes JSON, markdown and a PNG.

Each test pins a number computed by hand, so a harness that drops an unsupported platform
from PP, times without synchronising, mixes the compile call into the samples, or
mis-counts an op's flops fails here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from portakern.ops import get_op
from portakern.tools.bench import metrics, report, suites, timing
from portakern.tools.bench.probes import Roofline, combine


# --- statistics ---------------------------------------------------------------------------------
def test_summarize_matches_numpy_quartiles() -> None:
    xs = [0.4, 0.1, 0.3, 0.2, 1.0]
    st = timing.summarize(xs)
    assert st.n == 5 and st.min == 0.1 and st.max == 1.0
    assert st.median == pytest.approx(0.3)
    assert st.q1 == pytest.approx(np.percentile(xs, 25))
    assert st.q3 == pytest.approx(np.percentile(xs, 75))
    assert st.total == pytest.approx(2.0)
    assert st.iqr == pytest.approx(0.2)
    even = timing.summarize([4.0, 1.0, 3.0, 2.0])
    assert even.median == pytest.approx(2.5) and even.q1 == pytest.approx(1.75)


def test_summarize_refuses_empty() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        timing.summarize([])


class FakeDevice:
    """A clock and an 'asynchronous device': fn enqueues work, sync waits for it."""

    def __init__(self, launch_s: float = 0.0, kernel_s: float = 0.1, first_extra_s: float = 0.0,
                 interrupt_at: int | None = None) -> None:
        self.now = 0.0
        self.launch_s, self.kernel_s, self.first_extra = launch_s, kernel_s, first_extra_s
        self.pending = 0.0
        self.calls = 0
        self.syncs = 0
        self.interrupt_at = interrupt_at

    def clock(self) -> float:
        return self.now

    def fn(self) -> None:
        self.calls += 1
        if self.interrupt_at is not None and self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        self.now += self.launch_s
        self.pending += self.kernel_s + (self.first_extra if self.calls == 1 else 0.0)

    def sync(self) -> None:
        self.syncs += 1
        self.now += self.pending
        self.pending = 0.0


def test_measure_repeats_to_min_time_and_excludes_first_call() -> None:
    dev = FakeDevice(kernel_s=0.1, first_extra_s=2.0)  # first call: 2 s of "compile"
    cfg = timing.TimingConfig(min_time=0.5, min_reps=3, max_reps=100, budget_s=100,
                              warmup_reps=1, warmup_below_s=10.0)
    m = timing.measure(dev.fn, dev.sync, cfg, clock=dev.clock)
    assert m.first_call_s == pytest.approx(2.1)
    assert len(m.samples) == 5 and all(s == pytest.approx(0.1) for s in m.samples)
    assert m.stopped_by == "min_time"
    assert dev.calls == 1 + 1 + 5  # first call, one warm-up, five samples
    assert dev.syncs == dev.calls  # every call synchronised
    d = m.as_dict()
    assert d["median_s"] == pytest.approx(0.1)
    assert d["first_call_overhead_s"] == pytest.approx(2.0)


def test_measure_charges_asynchronous_work_to_its_own_sample() -> None:
    # launch returns at once; the kernel's time only appears at sync. Without the sync inside
    # each sample the samples would read ~0.
    dev = FakeDevice(launch_s=0.0, kernel_s=0.25)
    m = timing.measure(dev.fn, dev.sync, timing.TimingConfig(min_time=0.0, min_reps=4,
                                                             budget_s=100), clock=dev.clock)
    assert m.samples == [pytest.approx(0.25)] * 4


def test_measure_min_reps_and_max_reps() -> None:
    dev = FakeDevice(kernel_s=1e-4)
    m = timing.measure(dev.fn, dev.sync, timing.TimingConfig(min_time=10.0, min_reps=3,
                                                             max_reps=7, budget_s=1e6),
                       clock=dev.clock)
    assert len(m.samples) == 7 and m.stopped_by == "max_reps"
    dev = FakeDevice(kernel_s=1.0)
    m = timing.measure(dev.fn, dev.sync, timing.TimingConfig(min_time=0.0, min_reps=3,
                                                             budget_s=1e6), clock=dev.clock)
    assert len(m.samples) == 3 and m.stopped_by == "min_time"


def test_measure_is_time_boxed() -> None:
    # 10 s per call, 25 s box: first call (10) + one sample (20); a second would end at 30.
    dev = FakeDevice(kernel_s=10.0)
    cfg = timing.TimingConfig(min_time=0.2, min_reps=3, budget_s=25.0, warmup_below_s=1.0)
    m = timing.measure(dev.fn, dev.sync, cfg, clock=dev.clock)
    assert len(m.samples) == 1 and m.stopped_by == "budget"
    assert dev.calls == 2  # no warm-up for a slow first call, and nothing past the box


def test_measure_keeps_samples_on_ctrl_c() -> None:
    dev = FakeDevice(kernel_s=0.1, interrupt_at=5)
    cfg = timing.TimingConfig(min_time=100, min_reps=3, max_reps=100, budget_s=1e6)
    with pytest.raises(KeyboardInterrupt) as info:
        timing.measure(dev.fn, dev.sync, cfg, clock=dev.clock)
    part = info.value.partial  # type: ignore[attr-defined]
    # calls: 1 first, 2 warm-up, 3 and 4 samples, 5 interrupted
    assert part.status == "ok" and len(part.samples) == 2 and part.stopped_by == "interrupted"


def test_timing_config_validates() -> None:
    with pytest.raises(ValueError, match="max_reps"):
        timing.TimingConfig(min_reps=5, max_reps=2)
    with pytest.raises(ValueError, match="budget_s"):
        timing.TimingConfig(budget_s=0)


# --- efficiency and performance portability ------------------------------------------------------
def test_efficiency_is_peer_over_ours() -> None:
    assert metrics.efficiency(2.0, 4.0) == pytest.approx(0.5)
    assert metrics.efficiency(4.0, 2.0) == pytest.approx(2.0)  # faster than the peer
    assert metrics.efficiency(4.0, 2.0, cap=True) == 1.0
    assert metrics.efficiency(None, 1.0) is None
    assert metrics.efficiency(1.0, None) is None
    assert metrics.efficiency(0.0, 1.0) is None
    assert metrics.efficiency(1.0, math.nan) is None


def test_best_peer_is_the_fastest_valid_one() -> None:
    assert metrics.best_peer({"numpy": 3.0, "xla": 1.5, "clblast": None}) == ("xla", 1.5)
    assert metrics.best_peer({"numpy": None}) is None


def test_harmonic_mean() -> None:
    assert metrics.harmonic_mean([1.0, 0.5]) == pytest.approx(2 / 3)
    assert metrics.harmonic_mean([0.25]) == pytest.approx(0.25)
    assert metrics.harmonic_mean([0.5, 0.0]) == 0.0
    with pytest.raises(ValueError):
        metrics.harmonic_mean([])


def test_pp_is_harmonic_mean_over_platforms() -> None:
    pp = metrics.performance_portability({"a": 1.0, "b": 0.5, "c": 0.25})
    assert pp.value == pytest.approx(3 / (1 + 2 + 4))
    assert pp.supported_everywhere


def test_pp_is_zero_when_any_platform_cannot_run_the_case() -> None:
    # Ignoring the unsupported platform would give 2/3; Pennycook's definition gives 0.
    pp = metrics.performance_portability({"a": 1.0, "b": 0.5, "c": None})
    assert pp.value == 0.0
    assert pp.unsupported == ("c",)
    assert metrics.performance_portability({}).value is None


# --- roofline ------------------------------------------------------------------------------------
def test_roofline_arithmetic() -> None:
    assert metrics.intensity(100.0, 50.0) == 2.0
    assert metrics.roofline_gflops(100.0, 10.0, 2.0) == pytest.approx(20.0)  # memory-bound
    assert metrics.roofline_gflops(100.0, 10.0, 50.0) == pytest.approx(100.0)  # compute-bound
    # 1 GFLOP and 1 GB on a 100 GFLOP/s, 10 GB/s device: memory takes 0.1 s, compute 0.01 s
    assert metrics.roofline_time(1e9, 1e9, 100.0, 10.0) == pytest.approx(0.1)
    assert metrics.bound_kind(1e9, 1e9, 100.0, 10.0) == "memory"
    assert metrics.bound_kind(1e12, 1e9, 100.0, 10.0) == "compute"
    assert metrics.pct_of_roofline(0.2, 1e9, 1e9, 100.0, 10.0) == pytest.approx(50.0)
    gf, gb = metrics.achieved(0.5, 1e9, 2e9)
    assert (gf, gb) == (pytest.approx(2.0), pytest.approx(4.0))
    with pytest.raises(ValueError, match="positive"):
        metrics.roofline_time(1.0, 1.0, 0.0, 10.0)


def test_combined_roof_takes_the_best_probe_per_number() -> None:
    a = Roofline(copy_gbs=40.0, fma_gflops={"float32": 200.0})
    b = Roofline(copy_gbs=46.0, fma_gflops={"float32": 80.0, "float64": 40.0})
    bad = Roofline(status="error", reason="boom")
    r = combine({"opencl:0": a, "jax:0": b, "x": bad})
    assert r.copy_gbs == 46.0 and r.sources["copy_gbs"] == "jax:0"
    assert r.fma_gflops == {"float32": 200.0, "float64": 40.0}
    assert r.sources["fma_gflops.float32"] == "opencl:0"
    assert combine({"x": bad}).status == "unavailable"


# --- cost models ---------------------------------------------------------------------------------
def _cost(op: str, *shapes: tuple[int, ...], dtype: Any = np.float32, **params: Any
          ) -> tuple[float, float]:
    spec = get_op(op)
    arrays = [np.empty(s, dtype) for s in shapes]
    prob = spec.problem(*spec.bind(arrays, params))
    c = spec.cost(prob)
    return c.flops, c.bytes


def test_matmul_cost() -> None:
    assert _cost("matmul", (2, 4), (4, 3)) == (2 * 2 * 3 * 4, 4 * (8 + 12 + 6))
    # batch of 5 against one broadcast b: b is read once, C written 5 times
    assert _cost("matmul", (5, 2, 4), (4, 3)) == (2 * 5 * 2 * 3 * 4, 4 * (40 + 12 + 30))
    assert _cost("matmul", (2, 4), (4, 3), dtype=np.float16) == (48, 2 * 26)


def test_softmax_cost() -> None:
    assert _cost("softmax", (8, 16), dtype=np.float16) == (5 * 128, 2 * 128 * 2)


def test_attention_cost() -> None:
    q, k = (1, 4, 8, 32), (1, 2, 16, 32)
    flops, nbytes = _cost("attention", q, k, k)
    assert flops == 2 * 4 * 8 * 16 * (32 + 32)
    assert nbytes == 4 * (4 * 8 * 64 + 2 * 16 * 64)  # q and o, k and v read once
    # causal, Sq = Sk = 8: query i attends i + 1 keys -> 36 pairs per head
    flops, _ = _cost("attention", (1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), causal=True)
    assert flops == 2 * 2 * 36 * 32
    # the quick suite's big case is the ~34 GFLOP the issue quotes
    big = next(c for c in suites.suite_cases("quick", ("attention",)) if c.size["Sq"] == 4096)
    flops, _ = _cost("attention", *suites.shapes(big).values())
    assert flops == 2 * 2 * 8 * 4096 * 4096 * 64


def test_attention_bytes_count_only_the_keys_some_query_attends() -> None:
    """A window or a top-left causal with Sq < Sk leaves keys no query reads (the kernels
    skip their tiles): counting them made the byte count, a lower bound the run's roof is
    lifted by, up to Sk / window times too high (a review: 134 MB for one 128-key window)."""
    from portakern.ops.attention import attended_keys

    rng = np.random.default_rng(0)
    for _ in range(300):  # against the set of (query, key) pairs, counted one by one
        sq, sk = int(rng.integers(0, 12)), int(rng.integers(0, 12))
        causal, off = bool(rng.integers(2)), int(rng.integers(-3, 8))
        window = None if rng.integers(3) == 0 else (
            int(rng.integers(0, 6)), None if rng.integers(2) else int(rng.integers(0, 6)))
        keys = {j for i in range(off, off + sq) for j in range(sk)
                if (not causal or j <= i) and (window is None or (
                    i - window[0] <= j and (window[1] is None or j <= i + window[1])))}
        assert attended_keys(sq, sk, causal, window, off) == len(keys), (sq, sk, causal,
                                                                          window, off)
    q, kv = (1, 1, 1, 16), (1, 1, 4096, 16)
    _, full = _cost("attention", q, kv, kv)
    _, windowed = _cost("attention", q, kv, kv, window=(127, 0))
    assert windowed == 4 * (32 + 1 * 32) and full == 4 * (32 + 4096 * 32)  # top-left: key 0
    _, causal_short = _cost("attention", (1, 1, 4, 16), kv, kv, causal=True)
    assert causal_short == 4 * (4 * 32 + 4 * 32)  # top-left: keys 0..3
    # paged decode: a 127-token window over a 4096-token table reads 128 keys' pages
    from portakern.ops import paged_attention as pa

    ex, _ = pa.example("float16", B=1, Hq=8, Hkv=8, MB=256)
    spec = get_op("paged_attention")
    c_full = spec.cost(spec.problem(ex, dict(spec.params)))
    c_win = spec.cost(spec.problem(ex, {**spec.params, "window": 127}))
    assert c_full.bytes == 2 * (8 * 128 * 2 + 8 * 4096 * 256)
    assert c_win.bytes == 2 * (8 * 128 * 2 + 8 * 128 * 256)


# --- suites --------------------------------------------------------------------------------------
def test_quick_suite_covers_the_issue_sizes() -> None:
    cases = suites.suite_cases("quick")
    by_op: dict[str, list[suites.BenchCase]] = {}
    for c in cases:
        by_op.setdefault(c.op, []).append(c)
    assert set(by_op) >= {"matmul", "softmax", "attention", "rmsnorm"}  # every registered op
    assert max(c.size["N"] for c in by_op["matmul"]) == 2048
    assert max(c.size["rows"] * c.size["cols"] for c in by_op["softmax"]) == 8192 * 4096
    s4096 = {"B": 1, "Hq": 8, "Hkv": 8, "Sq": 4096, "Sk": 4096, "D": 64, "Dv": 64}
    assert {bool(c.params.get("causal")) for c in by_op["attention"] if c.size == s4096} == {
        False, True}
    assert len({c.id for c in cases}) == len(cases)
    assert [c.label for c in suites.suite_cases("quick", ("matmul",), limit=1)] == ["N=256"]
    # rmsnorm has no built-in sizes: its spec's example is its quick case
    (rms,) = by_op["rmsnorm"]
    assert rms.size == {"x": [64, 4096], "weight": [4096]}
    assert rms.label == "x=64x4096 weight=4096" and rms.params == {"eps": 1e-6}


def test_full_suite_scales_a_spec_example_up() -> None:
    got = [c.size["x"] for c in suites.suite_cases("full", ("rmsnorm",), ("float32",))]
    assert got == [[64, 4096], [4096, 4096], [16384, 4096]]  # ~2^24 and ~2^26 elements
    assert all(c.size["weight"] == [4096] for c in suites.suite_cases("full", ("rmsnorm",)))


@pytest.mark.parametrize("suite", sorted(suites.SIZES))
def test_every_suite_case_validates_and_has_a_cost(suite: str) -> None:
    from portakern.tools.bench.runner import make_inputs_meta

    for case in suites.suite_cases(suite, dtype_list=("float32", "bfloat16")):
        spec = get_op(case.op)
        prob = spec.problem(*spec.bind(make_inputs_meta(case), dict(case.params)))
        c = spec.cost(prob)
        assert c.flops > 0 and c.bytes > 0, case.id


def test_inputs_are_deterministic_per_case() -> None:
    c = suites.BenchCase("attention", "bfloat16", {"B": 1, "Hq": 2, "Hkv": 1, "Sq": 3, "Sk": 5,
                                              "D": 4, "Dv": 4})
    a, b = suites.make_inputs(c), suites.make_inputs(suites.BenchCase.from_dict(c.as_dict()))
    assert a["k"].shape == (1, 1, 5, 4) and a["k"].dtype.name == "bfloat16"
    assert list(a) == ["q", "k", "v", "mask", "bias", "alibi_slopes"]  # every operand, in order
    assert a["mask"] is None and a["bias"] is None and a["alibi_slopes"] is None  # absent ones
    for n in ("q", "k", "v"):
        x, y = a[n], b[n]
        assert x is not None and y is not None
        assert np.array_equal(x.astype(np.float32), y.astype(np.float32))


def test_unknown_suite_and_dtype_say_what_is_expected() -> None:
    with pytest.raises(Exception, match="expected one of"):
        suites.suite_cases("huge")
    with pytest.raises(Exception, match="float32"):
        suites.suite_cases("quick", dtype_list=("int8",))


# --- numpy peer process --------------------------------------------------------------------------
def test_numpy_worker_measures_and_refuses_fp16() -> None:
    from portakern.tools.bench import numpy_worker

    t = timing.TimingConfig(min_time=0.0, min_reps=2, budget_s=10).as_dict()
    case = suites.BenchCase("attention", "float32", {"B": 1, "Hq": 4, "Hkv": 2, "Sq": 8, "Sk": 8,
                                                "D": 8, "Dv": 8}, {"causal": True})
    got = numpy_worker.handle({"case": case.as_dict(), "timing": t})["measurement"]
    assert got["status"] == "ok" and got["reps"] >= 2
    # the numpy expression is the op's semantics: check it against the oracle once
    x = suites.make_inputs(case)
    fn = numpy_worker.build(case.as_dict(), x)
    want = get_op("attention").semantics(np, *(x[n].astype(np.float64) for n in "qkv"),
                                         causal=True)
    np.testing.assert_allclose(fn(), want, rtol=1e-4, atol=1e-5)
    half = suites.BenchCase("matmul", "float16", {"M": 4, "N": 4, "K": 4, "batch": []})
    got = numpy_worker.handle({"case": half.as_dict(), "timing": t})["measurement"]
    assert got["status"] == "unavailable" and "float16" in got["reason"]


def test_numpy_worker_runs_the_semantics_of_an_op_without_a_handwritten_peer() -> None:
    from portakern.tools.bench import numpy_worker

    t = timing.TimingConfig(min_time=0.0, min_reps=2, budget_s=10).as_dict()
    case = suites.BenchCase("rmsnorm", "float16", {"x": [3, 16], "weight": [16]}, {"eps": 1e-6})
    got = numpy_worker.handle({"case": case.as_dict(), "timing": t})["measurement"]
    assert got["status"] == "ok" and "spec.semantics(numpy" in got["what"]
    assert "float32" in got["what"] and "cast" in got["what"]  # fp16 computes in fp32
    x = suites.make_inputs(case)
    fn, _ = numpy_worker.semantics_peer(case, x)
    res = fn()
    assert res.dtype == np.float16
    want = get_op("rmsnorm").semantics(np, x["x"].astype(np.float64),  # type: ignore[union-attr]
                                       x["weight"].astype(np.float64))  # type: ignore[union-attr]
    np.testing.assert_allclose(res.astype(np.float64), want, rtol=2e-3, atol=1e-3)


# --- report: merging two machines ----------------------------------------------------------------
def _rec(host: str, target: str, op: str, label: str, ours: float | None, peer: float | None,
         flops: float = 1e9, nbytes: float = 1e8, pct: float | None = 10.0) -> dict[str, Any]:
    plat = f"{target} · dev @ {host}"
    ours_m = ({"status": "ok", "median_s": ours, "q1_s": ours, "q3_s": ours, "reps": 3}
              if ours else {"status": "unsupported", "reason": "no float32 here"})
    peers = {"xla": {"status": "ok", "median_s": peer, "name": "XLA"}} if peer else {}
    eff = metrics.efficiency(peer, ours)
    return {"id": f"{op}/float32/{label}", "op": op, "dtype": "float32", "label": label,
            "target": target, "platform": plat, "cost": {"flops": flops, "bytes": nbytes},
            "ours": ours_m, "peers": peers, "best_peer": "xla" if peer else None,
            "efficiency": eff, "supported": ours is not None,
            "achieved": {"ours": {"pct_roofline": pct}} if ours else {}}


def _result(host: str, target: str, created: str, cases: list[dict[str, Any]]
            ) -> dict[str, Any]:
    plat = f"{target} · dev @ {host}"
    return {"schema": "portakern-bench/1", "config": {"suite": "quick"},
            "environment": {"hostname": host, "created": created, "cpu": {"model": "X"},
                            "git": {"commit": "abc"}},
            "targets": {target: {"platform": plat, "device": {"name": "dev"},
                                 "roofline": {"status": "ok", "copy_gbs": 10.0,
                                              "fma_gflops": {"float32": 100.0}}}},
            "cases": cases, "interrupted": False, "wall_s": 1.0}


def test_report_merges_two_machines(tmp_path: Path) -> None:
    a = _result("hostA", "opencl:0", "2024-01-01T00:00:00", [
        _rec("hostA", "opencl:0", "matmul", "N=256", ours=2.0, peer=1.0, pct=50.0),
        _rec("hostA", "opencl:0", "softmax", "64x64", ours=1.0, peer=1.0),
        _rec("hostA", "opencl:0", "matmul", "N=512", ours=1.0, peer=1.0),
    ])
    b = _result("hostB", "cuda:0", "2024-01-02T00:00:00", [
        _rec("hostB", "cuda:0", "matmul", "N=256", ours=4.0, peer=1.0, pct=25.0),
        _rec("hostB", "cuda:0", "softmax", "64x64", ours=None, peer=None),
    ])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    merged = report.merge([report.load(pa), report.load(pb)])
    assert len(merged.platforms) == 2 and len(merged.devices) == 2
    cases = {c.key: c for c in report.portability(merged.records, merged.devices)}
    mm = cases[("matmul", "float32", "N=256")]
    assert mm.pp_app is not None and mm.pp_app.value == pytest.approx(2 / (2 + 4))  # 0.5, 0.25
    assert mm.pp_roof is not None and mm.pp_roof.value == pytest.approx(2 / (2 + 4))
    sm = cases[("softmax", "float32", "64x64")]
    assert sm.pp_app is not None and sm.pp_app.value == 0.0  # hostB cannot run it
    assert sm.pp_app.unsupported == (merged.devices[1],)
    only_a = cases[("matmul", "float32", "N=512")]
    assert only_a.not_measured == [merged.devices[1]]  # unknown, not unsupported
    assert only_a.pp_app is not None and only_a.pp_app.value == pytest.approx(1.0)

    from portakern.tools.cli import main

    out = tmp_path / "rep"
    assert main(["report", str(pa), str(pb), "--out", str(out)]) == 0
    text = (out / "REPORT.md").read_text()
    assert "cannot run on D2" in text and "not measured" in text and "0.333" in text
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == ["report_fleet_float32.png", "report_matmul_float32.png",
                    "report_softmax_float32.png"]
    assert (out / "plots" / pngs[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pp_is_over_devices_with_targets_on_one_device_side_by_side() -> None:
    # three targets on one CPU and one GPU target: two devices, not four platforms
    cpu = "cpu:X @ h"
    recs = [dict(_rec("h", t, "matmul", "N=256", ours=o, peer=1.0), device_key=d)
            for t, o, d in (("opencl:0", 2.0, cpu), ("jax:0", 1.0, cpu),
                            ("jax:pallas_0", 1.0, cpu), ("cuda:0", 4.0, "gpu:x @ h"))]
    (c,) = report.portability(recs, [cpu, "gpu:x @ h"])
    assert c.best[cpu] in ("jax:0", "jax:pallas_0") and c.efficiency[cpu] == 1.0
    assert c.pp_app is not None and c.pp_app.value == pytest.approx(2 / (1 + 4))
    assert c.pp_kind["opencl"].value == pytest.approx(0.5)  # one device has opencl
    assert c.kind_missing["opencl"] == ["gpu:x @ h"]
    assert report.target_kind("jax:pallas_0") == "jax:pallas"
    assert report.target_kind("opencl:1") == "opencl"
    text = "\n".join(report.pp_tables(recs, [cpu, "gpu:x @ h"],
                                      {cpu: "D1", "gpu:x @ h": "D2"}))
    assert "D1 opencl:0" in text and "D1 jax:0" in text and "D2 cuda:0" in text


def test_report_refuses_a_file_that_is_not_a_result(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a portakern bench result"):
        report.load(p)


def test_newer_measurement_of_a_platform_wins(tmp_path: Path) -> None:
    old = _result("h", "opencl:0", "2024-01-01", [_rec("h", "opencl:0", "matmul", "N=256",
                                                        ours=4.0, peer=1.0)])
    new = _result("h", "opencl:0", "2024-02-01", [_rec("h", "opencl:0", "matmul", "N=256",
                                                        ours=2.0, peer=1.0)])
    merged = report.merge([new, old])  # order of files must not matter
    assert [r["efficiency"] for r in merged.records] == [0.5]
    assert merged.notes


XEON, EPYC = "Intel(R) Xeon(R) Processor", "AMD EPYC"


def _cpu_result(model: str, created: str, ours: float, key: str = "cpu @ vm"
                ) -> dict[str, Any]:
    """A run on host 'vm' with CPU ``model``: jax:0 and opencl:0 on the CPU, one matmul each.
    ``key`` is the device key stored in the file: ``cpu @ vm`` as files written before CPU keys
    carried the model."""
    res = _result("vm", "jax:0", created, [])
    res["environment"]["cpu"] = {"model": model}
    res["targets"] = {t: {"backend": t.split(":")[0], "platform": f"{t} · cpu @ vm",
                          "device_key": key, "device": {"name": "cpu", "kind": "cpu"},
                          "roofline": {"status": "ok", "copy_gbs": 10.0,
                                       "fma_gflops": {"float32": 100.0}}}
                      for t in ("jax:0", "opencl:0")}
    res["cases"] = [dict(_rec("vm", t, "matmul", "N=256", ours=ours, peer=1.0), device_key=key,
                         platform=f"{t} · cpu @ vm") for t in ("jax:0", "opencl:0")]
    return res


def test_cpu_device_key_carries_the_cpu_model() -> None:
    assert metrics.device_key("cpu", "pthread-x", "vm", "  AMD   EPYC ") == "cpu:AMD EPYC @ vm"
    assert metrics.device_key("cpu", "cpu", "vm", None) == "cpu @ vm"  # no model: as before
    assert metrics.device_key("gpu", " H100 ", "vm", EPYC) == "gpu:H100 @ vm"
    # an older file's key (bare, or the model alone) is rebuilt from the result's CPU
    assert metrics.device_key_of({"device_key": "cpu @ vm"}, "vm", EPYC) == "cpu:AMD EPYC @ vm"
    assert metrics.device_key_of({"device_key": "cpu:X @ vm"}, "vm", EPYC) == "cpu:AMD EPYC @ vm"
    assert metrics.device_key_of({"device_key": "cpu:X @ vm"}, "vm") == "cpu:X @ vm"
    assert metrics.device_key_of({"device": {"kind": "cpu"}}, "vm", EPYC) == "cpu:AMD EPYC @ vm"
    assert metrics.device_key_of({"device_key": "cpu @ vm"}, "vm") == "cpu @ vm"


def test_two_cpus_behind_one_hostname_are_two_devices(tmp_path: Path) -> None:
    """Our VMs are all called 'vm', one day a Xeon, another an EPYC: two devices in the report,
    each with its own cases, not one 'cpu @ vm' where the newer file replaces the older's
    numbers as if the same silicon had measured them again."""
    xeon = _cpu_result(XEON, "2025-01-01T00:00:00", ours=1.0)
    epyc = _cpu_result(EPYC, "2025-02-01T00:00:00", ours=4.0)
    merged = report.merge([epyc, xeon])
    assert merged.devices == [f"cpu:{XEON} @ vm", f"cpu:{EPYC} @ vm"]
    assert [merged.device_label[d] for d in merged.devices] == [f"{XEON} @ vm", f"{EPYC} @ vm"]
    assert len(merged.records) == 4 and not merged.notes  # nothing "measured again"
    (c,) = report.portability(merged.records, merged.devices)
    assert c.efficiency == {f"cpu:{XEON} @ vm": 1.0, f"cpu:{EPYC} @ vm": 0.25}
    pa, pb = tmp_path / "xeon.json", tmp_path / "epyc.json"
    pa.write_text(json.dumps(_cpu_result(XEON, "2025-01-01T00:00:00", ours=1.0)))
    pb.write_text(json.dumps(_cpu_result(EPYC, "2025-02-01T00:00:00", ours=4.0)))
    from portakern.tools.cli import main

    assert main(["report", str(pa), str(pb), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    devices = (tmp_path / "rep" / "REPORT.md").read_text().split("## Devices")[1].split("###")[0]
    assert f"| D1 | {XEON} @ vm | jax:0, opencl:0 |" in devices
    assert f"| D2 | {EPYC} @ vm | jax:0, opencl:0 |" in devices
    # an older file and a newer one (its key carries the model) of one CPU: still one device
    new_epyc = _cpu_result(EPYC, "2025-03-01T00:00:00", ours=2.0, key=f"cpu:{EPYC} @ vm")
    merged = report.merge([xeon, epyc, new_epyc])
    assert merged.devices == [f"cpu:{XEON} @ vm", f"cpu:{EPYC} @ vm"]
    assert len(merged.records) == 4 and len(merged.notes) == 2  # the newer EPYC run wins
    (c,) = report.portability(merged.records, merged.devices)
    assert c.efficiency[f"cpu:{EPYC} @ vm"] == 0.5


# --- issue 27: the implementations on the same silicon ------------------------------------------
CPU_KEY = "cpu:X @ vm"  # the device key a run on host 'vm' with CPU model 'X' writes
CPU_TARGETS = {"opencl:0": ("opencl", "pocl"), "opencl:1": ("opencl", "intel"),
               "jax:0": ("jax", None), "jax:pallas_0": ("jax", None)}


def _impl_rec(target: str, op: str, label: str, ours: float | str,
              peers: dict[str, float | str], bound: float = 0.5) -> dict[str, Any]:
    """One case on one target of the CPU ``CPU_KEY``: ours a median or a status, each peer a
    median or a status."""
    ours_m = ({"status": "ok", "median_s": ours, "q1_s": ours, "q3_s": ours, "reps": 5}
              if isinstance(ours, float) else {"status": ours, "reason": "why"})
    pm = {k: ({"status": "ok", "median_s": v, "name": k} if isinstance(v, float)
              else {"status": v, "reason": f"{k} does not do this", "name": k})
          for k, v in peers.items()}
    return {"id": f"{op}/float32/{label}", "op": op, "dtype": "float32", "label": label,
            "target": target, "platform": f"{target} · cpu @ vm", "device_key": CPU_KEY,
            "cost": {"flops": 1e9, "bytes": 1e8}, "ours": ours_m, "peers": pm,
            "supported": isinstance(ours, float), "roofline": {"bound_s": bound},
            "achieved": {"ours": {"pct_roofline": 100 * bound / ours}}
            if isinstance(ours, float) else {}}


def _impl_result() -> dict[str, Any]:
    """PoCL and Intel's OpenCL, jax:0 and jax:pallas_0 on one CPU, with numpy and torch peers:
    matmul N=256 everywhere; N=512 without a numpy peer (unavailable); softmax that Intel
    cannot run."""
    cases = []
    for t, ours, numpy in (("opencl:0", 2.0, 2.5), ("opencl:1", 1.0, 2.0),
                           ("jax:0", 4.0, 3.0), ("jax:pallas_0", 8.0, 3.0)):
        cases.append(_impl_rec(t, "matmul", "N=256", ours, {"numpy": numpy, "torch": 1.6}))
    for t, ours in (("opencl:0", 1.0), ("opencl:1", 1.0), ("jax:0", 3.0),
                    ("jax:pallas_0", 2.0)):
        cases.append(_impl_rec(t, "matmul", "N=512", ours,
                               {"numpy": "unavailable", "torch": 0.5}))
    for t, ours2 in (("opencl:0", 1.0), ("opencl:1", "unsupported"), ("jax:0", 2.0),
                     ("jax:pallas_0", 4.0)):
        cases.append(_impl_rec(t, "softmax", "64x64", ours2, {"numpy": 4.0, "torch": 2.0}))
    res = _result("vm", "opencl:0", "2025-01-01T00:00:00", cases)
    res["targets"] = {
        t: {"backend": b, "platform": f"{t} · cpu @ vm", "device_key": CPU_KEY,
            "device": {"name": "cpu", "kind": "cpu", "extra": {"alias": a} if a else {}},
            "roofline": {"status": "ok", "copy_gbs": 10.0, "fma_gflops": {"float32": 100.0}},
            "roofline_effective": {"status": "ok", "copy_gbs": 20.0,
                                   "fma_gflops": {"float32": 200.0},
                                   "sources": {"copy_gbs": "opencl:1",
                                               "fma_gflops.float32": "opencl:0"}}}
        for t, (b, a) in CPU_TARGETS.items()}
    for r in res["cases"]:
        r.pop("implementation", None)  # derived from the targets, as for older files
    return res


def test_a_target_is_labelled_with_its_implementation() -> None:
    t = {"backend": "opencl", "device": {"extra": {"alias": "intel"}}}
    assert metrics.implementation_of("opencl:1", t) == "opencl:intel"
    assert metrics.implementation_of("jax:pallas_0", {"backend": "jax", "device": {}}) == "jax"
    assert metrics.implementation_of("opencl:0", None) == "opencl"  # an older file
    assert metrics.target_title("opencl:1", "opencl:intel") == "opencl:1 = opencl:intel"
    assert metrics.target_title("jax:pallas_0", "jax") == "jax:pallas_0"
    res = _impl_result()
    md = report.run_markdown(res)
    # the run table: one row per target and case, each OpenCL runtime named beside its index
    assert "| matmul | float32 | N=256 | opencl:0 = opencl:pocl |" in md
    assert "| matmul | float32 | N=256 | opencl:1 = opencl:intel |" in md
    assert "| matmul | float32 | N=256 | jax:pallas_0 |" in md
    assert "| opencl:1 = opencl:intel | cpu |" in md  # the targets table
    assert "D1 opencl:1 = opencl:intel" in md  # PP over devices: side by side, one device


def test_targets_of_one_cpu_share_one_roof() -> None:
    """PoCL and Intel's runtime on one CPU are one piece of hardware: one key, one roof, the
    best of each number over both implementations' probes."""
    from portakern.backend.base import DeviceInfo
    from portakern.tools.bench.runner import hardware_key

    class Be:
        def __init__(self, name: str, alias: str) -> None:
            self.name = name
            self.device = DeviceInfo(0, f"{alias} cpu", "cpu", extra={"alias": alias})

    assert hardware_key(Be("opencl", "pocl")) == hardware_key(Be("opencl", "intel")) == "cpu"
    roof = combine({"opencl:0": Roofline(copy_gbs=20.0, fma_gflops={"float32": 300.0}),
                    "opencl:1": Roofline(copy_gbs=35.0, fma_gflops={"float32": 250.0})})
    assert roof.copy_gbs == 35.0 and roof.fma_gflops["float32"] == 300.0
    assert roof.sources == {"copy_gbs": "opencl:1", "fma_gflops.float32": "opencl:0"}


def test_pp_over_the_implementations_on_one_cpu() -> None:
    from portakern.tools.bench import implementations as impl

    res = _impl_result()
    metrics.attach_devices(res)
    recs = res["cases"]
    assert impl.members(recs, CPU_KEY) == ["opencl:pocl", "opencl:intel", "jax", "numpy"]
    cases = {c.key: c for c in impl.silicon_cases(recs, [CPU_KEY])}
    mm = cases[("matmul", "float32", "N=256")]
    # fastest on the device: Intel's 1.0 (torch 1.6; numpy at its fastest, 2.0)
    assert mm.fastest == "opencl:intel" and mm.fastest_s == 1.0
    eff = {n: m.efficiency for n, m in mm.members.items()}
    assert eff == pytest.approx({"opencl:pocl": 0.5, "opencl:intel": 1.0, "jax": 0.25,
                                 "numpy": 0.5})
    assert mm.members["jax"].source == "jax:0"  # the faster of its two lowerings
    assert mm.peers["torch"].efficiency == pytest.approx(1 / 1.6)
    assert mm.pp_app is not None and mm.pp_app.value == pytest.approx(4 / (2 + 1 + 4 + 2))
    # architectural: roofline time 0.5 s over each time
    assert mm.pp_roof is not None and mm.pp_roof.value == pytest.approx(4 / (4 + 2 + 8 + 4))
    # N=512: numpy's peer was unavailable: not measured, left out and named, not 0
    m5 = cases[("matmul", "float32", "N=512")]
    assert m5.not_measured == ["numpy"] and m5.fastest == "torch"
    assert m5.members["jax"].source == "jax:pallas_0"
    assert m5.pp_app is not None and m5.pp_app.value == pytest.approx(3 / (2 + 2 + 4))
    # softmax: Intel's runtime cannot run it, so PP over the implementations is 0
    sm = cases[("softmax", "float32", "64x64")]
    assert sm.pp_app is not None and sm.pp_app.value == 0.0
    assert sm.pp_app.unsupported == ("opencl:intel",)
    assert sm.pp_roof is not None and sm.pp_roof.value == 0.0
    # the table: one row per case, each implementation's time, efficiency and % roof, PP
    text = "\n".join(report.silicon_tables(recs, [CPU_KEY], {CPU_KEY: "D1"}))
    assert ("| dtype | size | opencl:pocl (opencl:0) | opencl:intel (opencl:1) | "
            "jax (jax:0, jax:pallas_0) | numpy (peer) | torch (peer) | fastest | "
            "PP over H (vs fastest) | PP over H (roofline) |") in text
    assert ("| float32 | N=256 | 2 s · eff 0.5 · 25% roof | 1 s · eff 1 · 50% roof | "
            "4 s · eff 0.25 · 12% roof (jax:0) | 2 s · eff 0.5 · 25% roof | 1.6 s · eff 0.62 | "
            "opencl:intel 1 s | 0.444 | 0.222 |") in text
    assert "| float32 | N=512 |" in text and "0.375 (not measured: numpy)" in text
    assert "cannot run (opencl:1: unsupported)" in text
    assert "0 (cannot run: opencl:intel)" in text


def test_a_target_the_bench_skipped_is_not_measured_not_unable() -> None:
    """jax's paged decode rows past the gather budget are ``not_applicable`` (the bench's own
    choice): left out of PP and named, not a member that cannot run (PP 0), as REPORT.md
    once said of 7 of 8 decode rows."""
    from portakern.tools.bench import implementations as impl

    res = _impl_result()
    for t, ours in (("opencl:0", 1.0), ("opencl:1", 2.0), ("jax:0", "not_applicable"),
                    ("jax:pallas_0", "not_applicable")):
        res["cases"].append(_impl_rec(t, "paged_attention", "B8", ours, {"numpy": 4.0}))
    metrics.attach_devices(res)
    cases = {c.key: c for c in impl.silicon_cases(res["cases"], [CPU_KEY])}
    pa = cases[("paged_attention", "float32", "B8")]
    assert pa.members["jax"].status == "not measured" and "jax" in pa.not_measured
    assert pa.pp_app is not None and pa.pp_app.value > 0
    unable = next(c for k, c in cases.items() if k[0] == "softmax")
    assert unable.members["opencl:intel"].status == "cannot run"  # unsupported still is
    # PP over devices, per kind of target: jax measured nothing here, so no PP (not 0)
    (dec,) = [c for c in report.portability(res["cases"], [CPU_KEY])
              if c.key[0] == "paged_attention"]
    assert "jax" not in dec.pp_kind and dec.kind_missing["jax"] == [CPU_KEY]
    jax_rec = dec.records[CPU_KEY]["jax:0"]
    assert report.target_cell(jax_rec) == "not measured: not_applicable"


def test_the_implementations_view_is_in_the_run_and_the_report(tmp_path: Path) -> None:
    from portakern.tools.bench.plots import plot_run
    from portakern.tools.cli import main

    res = _impl_result()
    md = report.run_markdown(res)
    assert "The portability gap between implementations on the same silicon" in md
    assert "D1: {opencl:pocl, opencl:intel, jax, numpy}, one roof: 20 GB/s (from opencl:1)" in md
    assert "### matmul on D1: implementations side by side" in md
    files = plot_run(res, tmp_path / "plots")
    png = tmp_path / "plots" / "implementations_float32.png"
    assert png in files and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    p = tmp_path / "r.json"
    p.write_text(json.dumps(res))
    assert main(["report", str(p), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "REPORT.md").read_text()
    assert "## Implementations on the same silicon" in text
    assert "| float32 | 64x64 |" in text and "0 (cannot run: opencl:intel)" in text
    assert "opencl:1 = opencl:intel" in text.split("## Devices")[1].split("###")[0]
    assert (tmp_path / "rep" / "plots" / "report_implementations_float32.png").exists()
    # one implementation on a device: nothing to put side by side, no table and no plot
    one = _result("h", "opencl:0", "2025", [_rec("h", "opencl:0", "matmul", "N=256",
                                                 ours=2.0, peer=1.0)])
    assert "implementations on the same silicon" not in report.run_markdown(one)
    assert not any("implementations" in f.name for f in plot_run(one, tmp_path / "p1"))


# --- derive: one record's efficiency and roofline ------------------------------------------------
def test_derive_picks_best_peer_and_roofline() -> None:
    from portakern.tools.bench.runner import derive

    rec: dict[str, Any] = {
        "compute_dtype": "float32", "cost": {"flops": 1e9, "bytes": 1e9},
        "ours": {"status": "ok", "median_s": 0.4},
        "peers": {"numpy": {"status": "ok", "median_s": 0.2},
                  "xla": {"status": "ok", "median_s": 0.1},
                  "clblast": {"status": "unavailable", "reason": "x"}},
    }
    derive(rec, Roofline(copy_gbs=10.0, fma_gflops={"float32": 100.0}))
    assert rec["best_peer"] == "xla" and rec["efficiency"] == pytest.approx(0.25)
    assert rec["efficiencies"]["clblast"] is None
    assert rec["roofline"]["bound_s"] == pytest.approx(0.1)
    assert rec["achieved"]["ours"]["pct_roofline"] == pytest.approx(25.0)
    assert rec["achieved"]["xla"]["pct_roofline"] == pytest.approx(100.0)
    assert rec["supported"] is True
    rec2: dict[str, Any] = {"compute_dtype": "float32", "cost": {"flops": 1.0, "bytes": 1.0},
                            "ours": {"status": "unsupported"}, "peers": {}}
    derive(rec2, Roofline(status="error", reason="no probe"))
    assert rec2["supported"] is False and rec2["efficiency"] is None


# --- Ctrl-C writes what was measured -------------------------------------------------------------
def test_interrupt_still_writes_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from portakern.backend.base import DeviceInfo
    from portakern.tools.bench import runner

    class Stub:
        name, label = "stub", "stub:0"
        device = DeviceInfo(0, "stub device", "accelerator")

        def describe(self) -> str:
            return "stub:0"

    calls = {"n": 0}

    def fake_case(be: Any, case: suites.BenchCase, *a: Any, **k: Any) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return _rec("h", "stub:0", case.op, case.label, ours=1.0, peer=1.0)

    monkeypatch.setattr(runner, "open_targets", lambda wanted: ([Stub()], {}))
    monkeypatch.setattr(runner, "run_case", fake_case)
    out = tmp_path / "r.json"
    cfg = runner.BenchConfig(ops=("matmul",), out=str(out), probes=False, peers=("xla",))
    res = runner.run_bench(cfg)
    assert res["interrupted"] is True and not res["complete"]
    on_disk = json.loads(out.read_text())
    assert on_disk["interrupted"] is True and len(on_disk["cases"]) == 1


def test_the_cpu_key_tells_processors_of_one_model_name_apart() -> None:
    """"AMD EPYC" named a Zen 1 (AVX2) and a Zen 4 (AVX-512) VM alike: the ISA, and the family
    and model numbers where a file records them, keep their results two devices."""
    def result(simd: list[str], **nums: int) -> dict[str, Any]:
        return {"environment": {"cpu": {"model": EPYC, "simd": simd, **nums}}}

    zen1 = metrics.cpu_model_of(result(["avx", "avx2", "fma"]))
    zen4 = metrics.cpu_model_of(result(["avx2", "avx512f", "avx512bw"]))
    zen4n = metrics.cpu_model_of(result(["avx2", "avx512f"], family=25, model_number=17))
    assert (zen1, zen4, zen4n) == (f"{EPYC} (AVX2)", f"{EPYC} (AVX-512)",
                                   f"{EPYC} (AVX-512, family 25 model 17)")
    stored = {"device_key": f"cpu:{EPYC} @ vm"}  # what both files stored before
    assert metrics.device_key_of(stored, "vm", zen1) != metrics.device_key_of(stored, "vm", zen4)
    assert metrics.cpu_model_of({"environment": {"cpu": {"model": EPYC}}}) == EPYC
    from portakern.tools.bench.environment import cpu_info
    info = cpu_info()
    if "model" in info and info.get("machine") == "x86_64":
        assert isinstance(info.get("family"), int) and isinstance(info.get("model_number"), int)


def test_a_run_writes_the_cpu_model_into_the_device_key(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from portakern.backend.base import DeviceInfo
    from portakern.tools.bench import environment, runner

    class Stub:
        name, label = "stub", "stub:0"
        device = DeviceInfo(0, "stub cpu", "cpu")

        def describe(self) -> str:
            return "stub:0"

    real = environment.collect

    def collect() -> dict[str, Any]:
        env = real()
        env["hostname"], env["cpu"] = "vm", {**env["cpu"], "model": EPYC}
        return env

    monkeypatch.setattr(runner.environment, "collect", collect)
    monkeypatch.setattr(runner, "open_targets", lambda wanted: ([Stub()], {}))
    monkeypatch.setattr(runner, "run_case", lambda be, case, *a, **k: _rec(
        "vm", "stub:0", case.op, case.label, ours=1.0, peer=1.0))
    cfg = runner.BenchConfig(ops=("matmul",), out=str(tmp_path / "r.json"), probes=False,
                             peers=("xla",), dispatch=False)
    res = runner.run_bench(cfg)
    cpu = metrics.cpu_model_of(res)  # the model, with this machine's ISA and numbers
    assert cpu is not None and cpu.startswith(EPYC)
    assert res["targets"]["stub:0"]["device_key"] == f"cpu:{cpu} @ vm"
    assert res["cases"] and {r["device_key"] for r in res["cases"]} == {f"cpu:{cpu} @ vm"}


# --- probes under CUDA (compile only: no GPU needed) ---------------------------------------------
def test_probe_kernels_compile_for_cuda_with_nvrtc() -> None:
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from portakern.core import codegen
    from portakern.tools.bench.probes import probe_source

    try:
        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"NVRTC cannot load: {exc}")
    try:
        from portakern.backend.cuda import compile_options

        opts = list(compile_options())
    except Exception:
        import nvidia.cuda_runtime as rt  # type: ignore[import-not-found]

        opts = [f"-I{Path(list(rt.__path__)[0]) / 'include'}"]
    for dt in ("float32", "float64"):
        src = codegen.render(probe_source(), "cuda", slots={"T": dt},
                             defines={"CHAINS": 8, "ITERS": 16})
        prog = nvrtc.createProgram(src, "probe.cu", [], [])
        try:
            nvrtc.compileProgram(prog, opts + ["--gpu-architecture=compute_80"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
        ptx = bytes(nvrtc.getPTX(prog)).decode()
        assert "pk_probe_copy" in ptx and "pk_probe_fma" in ptx
        assert ptx.count("fma.rn") >= 8 * 16  # the chains really are FMAs, unrolled


def test_cpu_meter_reports_shares() -> None:
    from portakern.tools.bench.environment import CpuMeter

    m = CpuMeter()
    snap = m.snapshot()
    if snap is None:
        pytest.skip("no /proc/stat here")
    x = 0.0
    for i in range(200000):
        x += i
    got = m.since(snap)
    assert got is not None and 0.0 <= got["other_share"] <= 1.0 and got["wall_s"] > 0


# --- a tiny real run -----------------------------------------------------------------------------
def _opencl_target() -> str:
    pytest.importorskip("pyopencl")
    from portakern.backend import registry

    av = registry.availability("opencl")
    if not av.available or not av.devices:
        pytest.skip(f"no OpenCL device: {av.reason}")
    return "opencl:0"


def test_tiny_real_run_writes_json_markdown_and_png(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    target = _opencl_target()
    from portakern.tools.cli import main

    # the numpy peer must run without these even when the test environment sets them
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    out = tmp_path / "res.json"
    plots = tmp_path / "plots"
    rc = main(["bench", "--ops", "matmul", "--limit", "1", "--backends", target,
               "--peers", "numpy,clblast", "--out", str(out), "--plots", str(plots),
               "--min-time", "0.02", "--min-reps", "3", "--budget", "15"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["complete"] and not res["interrupted"]
    assert res["environment"]["cpu"] and res["environment"]["versions"]["numpy"]
    (case,) = res["cases"]
    assert case["label"] == "N=256" and case["target"] == target
    assert case["ours"]["status"] == "ok" and case["ours"]["reps"] >= 3
    assert case["cost"]["flops"] == 2 * 256**3
    npeer = case["peers"]["numpy"]
    assert npeer["status"] == "ok"
    assert npeer["info"]["env_seen"]["OPENBLAS_CORETYPE"] is None
    assert "OPENBLAS_CORETYPE" in npeer["info"]["unset_for_this_process"]
    assert npeer["info"]["threads"] >= 1 and npeer["info"]["blas"]
    assert "clblast" in case["peers"]
    roof = res["targets"][target]["roofline"]
    assert roof["status"] == "ok" and roof["copy_gbs"] > 0 and roof["fma_gflops"]["float32"] > 0
    assert case["achieved"]["ours"]["pct_roofline"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| matmul | float32 | N=256 |" in md and "PP best (vs peers)" in md
    assert "| matmul | float32 | N=256 |" in capsys.readouterr().out
    png = plots / "matmul_float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the dispatch-overhead measurement ran on the OpenCL target and is in both outputs
    disp = res["dispatch"][target]["pk.softmax"]
    assert disp["status"] == "ok" and set(disp["overhead_us"]) == {
        "call", "call_out", "call_backend", "call_use"}
    for k in ("fma_gflops", "copy_gbs"):  # the roof used is never below the probes'
        used = res["targets"][target]["roofline_effective"][k]
        probed = res["targets"][target]["roofline_probes"][k]
        assert (used["float32"] >= probed["float32"]) if k == "fma_gflops" else used >= probed
    assert "Dispatch overhead" in md and f"| {target} |" in md.split("Dispatch overhead")[1]


# --- a user-defined op, through the public API only, is benchmarked without edits ----------------
ROW_CENTER_SOURCE = """
PK_KERNEL void row_center(PK_GLOBAL const PK_T_T* PK_RESTRICT X, PK_GLOBAL PK_T_T* PK_RESTRICT Out,
                          int rows, int n)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (r >= rows) return;
    PK_ACC_T s = 0;
    for (int j = 0; j < n; ++j) s += PK_LOAD_T(X, r * n + j);
    const PK_ACC_T m = s / (PK_ACC_T)n;
    for (int j = 0; j < n; ++j) PK_STORE_T(Out, r * n + j, PK_LOAD_T(X, r * n + j) - m);
}
"""


def _row_center_semantics(xp: Any, x: Any) -> Any:
    return x - xp.mean(x, axis=-1, keepdims=True)


def _row_center_validate(m: dict[str, Any], params: dict[str, Any]) -> Any:
    import portakern as pk
    from portakern.core import dtypes

    x = m["x"]
    if len(x.shape) < 1:
        raise pk.ShapeError("row_center: x must have rank >= 1; got a scalar.")
    n = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    return pk.Problem("row_center", dtypes.dtype_name(x.dtype), {"x": tuple(x.shape)}, params,
                      tuple(x.shape), derived={"rows": rows, "n": n},
                      empty_result=rows * n == 0)


def _row_center_tolerance(p: Any, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    """The row sum errs by (n-1)u relative to sum|x|, the division by u, the subtraction and
    the output rounding by u and u_out of the result."""
    u = float(np.finfo(p.info.compute).eps) / 2
    n = p.derived["n"]
    mean_abs = np.mean(np.abs(x["x"]), axis=-1, keepdims=True)
    return ((n + 2) * u * mean_abs + u * np.abs(x["x"]) + p.info.unit_roundoff * np.abs(ref)
            + p.info.subnormal)


def _row_center_spec() -> Any:
    import portakern as pk

    return pk.KernelSpec(
        name="bench_row_center", operands=(pk.Operand("x"),), params={},
        validate=_row_center_validate, semantics=_row_center_semantics,
        source=ROW_CENTER_SOURCE.replace("row_center(", "bench_row_center("),
        slots=lambda p: {"T": p.dtype}, defines=lambda p, cfg: dict(cfg),
        launches=lambda p, cfg: [pk.Launch(
            "bench_row_center", (-(-p.derived["rows"] // cfg["WG"]), 1, 1), (cfg["WG"], 1, 1),
            (pk.Buf("x"), pk.Buf("out"), pk.Scalar(p.derived["rows"]),
             pk.Scalar(p.derived["n"])))],
        cost=lambda p: pk.Cost(2.0 * p.derived["rows"] * p.derived["n"],
                               2.0 * p.derived["rows"] * p.derived["n"]
                               * p.info.storage.itemsize),
        tolerance=_row_center_tolerance,
        tunables=(pk.Tunable("WG", (1, 4, 16)),), schedules={"gpu": {"WG": 16}, "cpu": {"WG": 4}},
        shapes={"x": ("rows", "n")})


@pytest.fixture
def row_center_op() -> Any:
    """A user op registered in this test's code (so the numpy peer process cannot see it)."""
    import portakern as pk

    spec = pk.register_op(_row_center_spec())
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


def test_a_user_op_is_benchmarked_with_its_semantics_peer(row_center_op: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import io

    from portakern.tools.bench import runner

    target = _opencl_target()
    name = row_center_op.name
    assert name in suites.all_ops() and name in {c.op for c in suites.suite_cases("quick")}
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # in-process: must be reported as set
    cfg = runner.BenchConfig(
        ops=(name,), targets=(target,), limit=1, peers=("numpy", "xla"), probes=False,
        dispatch=False, out=str(tmp_path / "r.json"), progress=io.StringIO(),
        timing=timing.TimingConfig(min_time=0.01, min_reps=2, max_reps=20, budget_s=10))
    res = runner.run_bench(cfg)
    assert res["complete"] and res["dispatch"] == {}
    (case,) = res["cases"]
    # shapes= ('rows', 'n') gives the derived example: 8 rows of 1024
    assert case["label"] == "x=8x1024" and case["shapes"] == {"x": [8, 1024]}
    assert case["ours"]["status"] == "ok" and case["ours"]["reps"] >= 2
    assert case["cost"]["flops"] == 2 * 8 * 1024
    assert case["unfused"]["status"] == "not_applicable"
    npeer = case["peers"]["numpy"]
    assert npeer["status"] == "ok" and npeer["name"] == "numpy (spec semantics)"
    assert "benchmark's own process" in npeer["what"]
    assert "OPENBLAS_CORETYPE=Haswell" in npeer["what"]
    assert npeer["info"]["env_seen"]["OPENBLAS_CORETYPE"] == "Haswell"
    xpeer = case["peers"]["xla"]
    assert xpeer["name"] == "XLA (spec semantics)" and "lower_semantics" in xpeer["what"]
    from portakern.backend import registry

    if registry.availability("jax").available:
        assert xpeer["status"] == "ok"
        assert case["best_peer"] in ("numpy", "xla") and case["efficiency"] > 0


def test_the_numpy_process_knows_builtin_but_not_in_code_ops(row_center_op: Any) -> None:
    from portakern.tools.bench.peers import NumpyWorker

    w = NumpyWorker()
    try:
        assert w.knows("rmsnorm") and w.knows("matmul")
        assert not w.knows(row_center_op.name)
    finally:
        w.close()


def test_semantics_peers_apply_per_device_kind() -> None:
    from portakern.tools.bench.peers import applicable, peer_name

    assert applicable("rmsnorm", Target("opencl", "cpu")) == ["numpy", "torch", "xla"]  # type: ignore[arg-type]
    assert applicable("rmsnorm", Target("cuda", "gpu")) == ["xla", "cupy"]  # type: ignore[arg-type]
    assert "clblast" in applicable("matmul", Target("opencl", "cpu"))  # type: ignore[arg-type]
    assert peer_name("cupy", "rmsnorm") == "cupy (spec semantics)"
    assert peer_name("cupy", "softmax") == "cupy (elementwise)"


def test_peers_follow_the_backends_data_not_its_name() -> None:
    """CLBlast goes with the targets whose arrays are pyopencl's (the OpenCL backend and its
    simulator), the cupy/cuBLAS/cuDNN peers with every GPU, numpy and torch with every CPU."""
    from portakern.tools.bench.peers import applicable

    def peers(op: str, name: str, kind: str) -> list[str]:
        return applicable(op, Target(name, kind))  # type: ignore[arg-type]

    assert peers("matmul", "opencl", "cpu") == ["numpy", "torch", "xla", "clblast"]
    assert peers("matmul", "opencl", "gpu") == ["xla", "clblast", "cublas"]
    assert peers("matmul", "cuda", "gpu") == ["xla", "cublas"]
    assert peers("matmul", "jax", "gpu") == ["xla", "cublas"]
    assert peers("matmul", "jax", "cpu") == ["numpy", "torch", "xla"]
    assert peers("softmax", "opencl", "gpu") == ["xla", "cupy"]
    assert peers("softmax", "cuda", "gpu") == ["xla", "cupy"]
    assert peers("attention", "cuda", "gpu") == ["xla", "cudnn"]
    assert peers("attention", "opencl", "cpu") == ["numpy", "torch", "xla"]
    # a stand-in without the backend's data (a duck-typed plugin) gets the per-kind peers only
    stub = Target("opencl", "gpu")
    del stub.array_modules
    assert applicable("matmul", stub) == ["xla", "cublas"]  # type: ignore[arg-type]


def test_the_oracle_is_a_peer_never_a_target() -> None:
    """The numpy backend is the float64 oracle (``Backend.oracle``): left out of the default
    targets, refused when named."""
    from portakern.tools.bench import runner

    targets, _ = runner.default_targets()
    assert not any(t.split(":")[0] == "numpy" for t in targets)
    with pytest.raises(ValueError, match="float64 oracle"):
        runner.open_targets(("numpy:0",))


# --- dispatch overhead ---------------------------------------------------------------------------
def test_dispatch_summary_arithmetic() -> None:
    from portakern.tools.bench.dispatch import summarize_dispatch

    per_call = {"call": [30e-6, 34e-6, 31e-6], "call_out": [18e-6, 21e-6, 19e-6],
                "raw": [10e-6, 12e-6, 11e-6]}
    s = summarize_dispatch(per_call, target_us=10.0)
    assert s["per_call_us"]["call"]["median"] == pytest.approx(31.0)
    assert s["per_call_us"]["raw"]["median"] == pytest.approx(11.0)
    assert s["overhead_us"]["call"] == pytest.approx(20.0)  # 31 - 11
    assert s["overhead_us"]["call_out"] == pytest.approx(8.0)  # 19 - 11
    # paired: round by round 20, 22, 20 and 8, 9, 8
    assert s["overhead_paired_us"]["call"] == pytest.approx(20.0)
    assert s["overhead_paired_us"]["call_out"] == pytest.approx(8.0)
    assert s["meets_target"] == {"call": False, "call_out": True}
    with pytest.raises(ValueError, match="rounds"):
        summarize_dispatch({"call": [1.0], "call_out": [1.0], "raw": [1.0, 2.0]})
    with pytest.raises(ValueError, match="missing"):
        summarize_dispatch({"call": [1.0], "raw": [1.0]})


def test_dispatch_is_measured_for_the_named_entry_points_on_opencl() -> None:
    from portakern.runtime import selection
    from portakern.tools.bench.dispatch import TARGET_US, DispatchConfig, measure_dispatch

    be = selection.get(_opencl_target())
    got = measure_dispatch(be, DispatchConfig(iterations=10, rounds=3, warmup=2))
    assert set(got) == {"pk.softmax", "pk.matmul", "pk.attention", "pk.rmsnorm"}
    assert got["pk.attention"]["call"] == "pk.attention(q, k, v, causal=True)"
    for name, rec in got.items():
        assert rec["status"] == "ok", (name, rec.get("reason"))
        for v in ("call", "call_out", "raw"):
            m = rec["per_call_us"][v]
            assert len(m["samples"]) == 3 and m["median"] > 0
        assert rec["overhead_us"]["call"] == pytest.approx(
            rec["per_call_us"]["call"]["median"] - rec["per_call_us"]["raw"]["median"])
        assert rec["target_us"] == TARGET_US == 5.0
        assert "raw_launcher" in rec["what"]["raw"] and "out=" in rec["what"]["call_out"]
        assert rec["info"]["raw_max_abs_error"] < 1e-4  # the raw launch computed the op
        # OpenCL holds its queue: the host's side is measured and the target judged on it
        assert rec["judged_on"] == "host"
        h = rec["host"]
        for v in ("call", "call_out", "call_backend", "call_use", "raw"):
            assert len(h["per_call_us"][v]["samples"]) == 3 and h["per_call_us"][v]["median"] > 0
        # the three selection modes the issue names are each measured and judged
        assert set(rec["meets_target"]) == {"call", "call_out", "call_backend", "call_use"}
        assert "backend='opencl:" in rec["what"]["call_backend"]
        assert "pk.use(" in rec["what"]["call_use"]
        assert h["overhead_us"]["call"] == pytest.approx(
            h["per_call_us"]["call"]["median"] - h["per_call_us"]["raw"]["median"])
        assert rec["meets_target"]["call"] == (h["overhead_us"]["call"] <= TARGET_US)
    assert got["pk.softmax"]["info"]["kernels"][0]["kernel"] == "softmax"
    table = "\n".join(report.dispatch_markdown({be.label: got}))
    assert "overhead: call (host / wall)" in table and "(judged on host)" in table


def test_dispatch_flags_a_raw_path_that_launches_nothing(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The raw enqueue's result is checked before any other call writes the shared output
    (NaN until then): a raw launcher that does nothing cannot borrow call_out's result (it
    did: status ok, error 1e-8, with a no-op in its place)."""
    from portakern.runtime import selection
    from portakern.tools.bench import dispatch

    be = selection.get(_opencl_target())
    monkeypatch.setattr(dispatch, "_raw_launcher", lambda *a, **k: (lambda: None))
    got = dispatch.measure_dispatch(be, dispatch.DispatchConfig(iterations=2, rounds=1,
                                                                warmup=1))
    for name, rec in got.items():
        assert rec["status"] == "error", name
        assert "raw enqueue's output differs" in rec["reason"]


def test_dispatch_has_no_backend_name_branches() -> None:
    src = Path(suites.__file__).with_name("dispatch.py").read_text()
    assert "be.name ==" not in src and '.name == "' not in src


def test_dispatch_is_not_applicable_without_c_kernels_and_renders() -> None:
    from portakern.tools.bench.dispatch import measure_dispatch, summarize_dispatch
    from portakern.tools.bench.report import dispatch_markdown

    class Stub:
        name, label = "stub", "stub:0"

    rec = measure_dispatch(Stub())  # type: ignore[arg-type]
    assert rec["status"] == "not_applicable" and "raw enqueue" in rec["reason"]
    ok = {"status": "ok", "entry": "pk.softmax", "call": "pk.softmax(x)", "dtype": "float32",
          "iterations": 10, "rounds": 3,
          **summarize_dispatch({"call": [30e-6] * 3, "call_out": [15e-6] * 3,
                                "raw": [10e-6] * 3}, target_us=5.0)}
    text = "\n".join(dispatch_markdown({"opencl:0": {"pk.softmax": ok}, "stub:0": rec}))
    # host / wall side by side in every overhead cell (no host measure here: n/a / wall)
    assert ("| opencl:0 | pk.softmax(x) | n/a / +20 µs | n/a / +5 µs | n/a | n/a | "
            "n/a / 10 µs ±0% | 30 µs ±0% | call no, out= yes (judged on wall) |") in text
    assert "| stub:0 | all entry points | not_applicable |" in text
    host = summarize_dispatch({"call": [6e-6] * 3, "call_out": [4e-6] * 3,
                               "call_backend": [5e-6] * 3, "call_use": [8e-6] * 3,
                               "raw": [2e-6] * 3})
    held = {**ok, "host": {k: host[k] for k in ("per_call_us", "overhead_us",
                                                "overhead_paired_us")},
            "meets_target": host["meets_target"], "judged_on": "host"}
    text = "\n".join(dispatch_markdown({"opencl:0": {"pk.softmax": held}}))
    assert ("| opencl:0 | pk.softmax(x) | +4 / +20 µs | +2 / +5 µs | +3 / n/a µs | +6 / n/a µs "
            "| 2 µs ±0% / 10 µs ±0% | 30 µs ±0% | call yes, out= yes, backend= yes, pk.use no "
            "(judged on host) |") in text
    assert "overhead: call (host / wall)" in text and "**host / wall**" in text


def test_an_op_without_sizes_is_named_not_fatal_in_the_default_op_list() -> None:
    import portakern as pk

    spec = pk.register_op(_row_center_spec().replace(name="bench_no_sizes", shapes=None))
    try:
        skipped: dict[str, str] = {}
        cases = suites.suite_cases("quick", skipped=skipped)
        assert "bench_no_sizes" in skipped and "example" in skipped["bench_no_sizes"]
        assert {c.op for c in cases} >= {"matmul", "rmsnorm"}
        with pytest.raises(pk.InvalidArgumentError, match="neither `example` nor `shapes`"):
            suites.suite_cases("quick", ("bench_no_sizes",), skipped={})
    finally:
        pk.unregister_op(spec.name)


def test_handwritten_xla_peer_gets_only_present_operands() -> None:
    """attention's optional mask is None in every suite case; the hand-written XLA expression
    (q, k, v) must not be handed it (a regression of the generic operand order)."""
    from portakern.backend import registry
    from portakern.runtime import selection
    from portakern.tools.bench.peers import prepare_xla

    if not registry.availability("jax").available:
        pytest.skip("jax is not available here")
    be = selection.get(_opencl_target())
    case = suites.BenchCase("attention", "float32", {"B": 1, "Hq": 2, "Hkv": 1, "Sq": 8, "Sk": 8,
                                                "D": 8, "Dv": 8}, {"causal": False})
    host = suites.make_inputs(case)
    assert host["mask"] is None
    got = prepare_xla(be, case, host, timing.TimingConfig(min_time=0.0, min_reps=2,
                                                          budget_s=10))
    assert isinstance(got, timing.Sampler), got
    got.sample()
    got.close()
    assert got.m.status == "ok" and len(got.m.samples) == 1, got.m.reason


def test_attention_memory_counts_the_fused_kernels_workspace(kernel_target: str) -> None:
    """The fused kernel's extra memory is what its spec's workspace allocates per call (PACK_KV
    copies of K and V on the CPU schedule), not a hard-coded 0; the issue's bound is 64 MiB."""
    from portakern.runtime import configs, selection
    from portakern.tools.bench.runner import attention_memory

    be = selection.get(kernel_target)
    case = suites.BenchCase("attention", "float32", suites._att(4096), {"causal": False})
    mem = attention_memory(be, case)
    spec = get_op("attention")
    prob = spec.problem(*spec.bind(suites.metadata_inputs(case), {"causal": False}))
    ws = spec.workspace(prob, configs.config_for(be, spec, prob, None))
    expected = sum(n * np.dtype(dt).itemsize for n, dt in ws.values())
    assert mem["fused"]["extra_bytes"] == expected
    if be.device_class == "cpu":  # PACK_KV: K^T and V, 8 heads x 4096 keys x 64 x 4 B each
        assert expected == 2 * 8 * 4096 * 64 * 4
    assert mem["fused"]["extra_bytes"] <= 64 << 20 < mem["unfused"]["extra_bytes"]


class Target:
    """A stand-in backend: a name, the data its registered class declares (the array types it
    owns: what ties a target to CLBlast and cupy) and a device of a kind."""

    def __init__(self, name: str, kind: str) -> None:
        from portakern.backend import registry
        from portakern.backend.base import DeviceInfo

        cls = registry.load(name)
        assert isinstance(cls, type), cls
        self.name, self.device = name, DeviceInfo(0, "dev", kind)
        self.array_modules = cls.array_modules


# --- issue 18: an honest roof, every promised peer ------------------------------------------------
def test_no_efficiency_exceeds_the_roof_by_construction() -> None:
    """Whatever the probes measured (here a roof 10x too low), the roof used is raised to every
    rate measured on the device, so no implementation can be above 100% of it."""
    from portakern.tools.bench.probes import lift
    from portakern.tools.bench.runner import derive

    rng = np.random.default_rng(18)
    weak = Roofline(copy_gbs=1.0, fma_gflops={"float32": 1.0})
    recs = []
    for i in range(40):
        flops, nbytes = float(rng.uniform(1e6, 1e11)), float(rng.uniform(1e5, 1e10))
        t = lambda: float(rng.uniform(1e-5, 1.0))  # noqa: E731
        recs.append({"id": f"c{i}", "target": "opencl:0", "dtype": "float32",
                     "compute_dtype": "float32", "cost": {"flops": flops, "bytes": nbytes},
                     "ours": {"status": "ok", "median_s": t()},
                     "unfused": {"status": "ok", "median_s": t()},
                     "peers": {"numpy": {"status": "ok", "median_s": t(), "name": "numpy"},
                               "xla": {"status": "error", "reason": "x"}}})
    roof = weak
    for r in recs:
        roof = lift(roof, r)
    for r in recs:
        derive(r, roof)
        for k, a in r["achieved"].items():
            assert a["pct_roofline"] <= 100.0, (r["id"], k, a)
    assert any(a["pct_roofline"] == pytest.approx(100.0)
               for r in recs for a in r["achieved"].values())  # the one that set the roof
    assert roof.sources["fma_gflops.float32"].startswith("measured: ")
    # the case that put one run's % roof at 100.0000001: torch's N=512 matmul set the roof,
    # and flops / t / 1e9 rounded down gave it a roofline time one ulp above its own
    n512 = {"id": "matmul/float32/N=512", "target": "opencl:0", "dtype": "float32",
            "compute_dtype": "float32", "cost": {"flops": 268435456.0, "bytes": 3145728.0},
            "ours": {"status": "ok", "median_s": 0.00396},
            "peers": {"torch": {"status": "ok", "median_s": 0.003158793999318732}}}
    derive(n512, lift(weak, n512))
    assert n512["roofline"]["bound_s"] <= 0.003158793999318732
    assert n512["achieved"]["torch"]["pct_roofline"] <= 100.0
    # an fp16 rate lifts the fp16 roof only (tensor cores must not raise the fp32 one)
    half = dict(recs[0], dtype="float16", id="h",
                ours={"status": "ok", "median_s": 1e-9})
    lifted = lift(roof, half)
    assert lifted.fma_gflops["float32"] == roof.fma_gflops["float32"]
    assert lifted.peak_for("float32", "float16") > roof.fma_gflops["float32"]


def test_fma_probe_reaches_numpy_sgemm() -> None:
    """The FMA probe reaches >= 90% of numpy/OpenBLAS SGEMM at N=2048 (and at most 1.5x), the
    peer measured in its own process without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (they halve
    OpenBLAS here). Paired rounds, each judged by its own ratio: under pytest-xdist the other
    worker's load can land on one side of a round (CI once read the probe at 211 GFLOP/s
    against an SGEMM of 111 slowed by a neighbour; 219-221 against 206 quiet, on a Zen 4),
    so the bound must hold in some round, which a probe that credits work it does not do
    (4x) fails in all."""
    import os
    import subprocess
    import sys

    from portakern.runtime import selection
    from portakern.tools.bench.probes import probe_kernel_backend

    be = selection.get(_opencl_target())
    if be.device.kind != "cpu":
        pytest.skip("the numpy comparison is for a CPU OpenCL device")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    code = ("import numpy as np, time\n"
            "a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)\n"
            "a @ a; best = 1e9\n"
            "for _ in range(4):\n"
            "    t = time.perf_counter(); a @ a; best = min(best, time.perf_counter() - t)\n"
            "print(2 * 2048 ** 3 / best / 1e9)\n")
    rounds = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        sgemm = float(out.stdout.split()[-1])
        roof = probe_kernel_backend(be, ["float32"], timing.TimingConfig(
            min_time=0.05, min_reps=3, max_reps=20, budget_s=3.0))
        rounds.append((roof.fma_gflops["float32"], sgemm))
    text = ", ".join(f"{p:.0f} vs {s:.0f}" for p, s in rounds)
    ratios = [p / s for p, s in rounds]
    assert max(ratios) >= 0.9, f"FMA probe vs numpy SGEMM, GFLOP/s per round: {text}"
    # and not far above it: a tuned SGEMM runs at 80-95% of the FMA peak, so a probe 1.5x
    # above it credits work it does not do (the splat-folded probe read 4x on a Zen machine)
    assert min(ratios) <= 1.5, f"FMA probe vs numpy SGEMM, GFLOP/s per round: {text}"
    vws = {t.get("vw") for t in roof.trials if t["probe"] == "fma"}
    assert 16 in vws  # the dialect's float16 vectors were tried


def test_copy_probe_reads_written_memory() -> None:
    """The copy probe's source holds data written before the timing: an untouched buffer is
    the OS's shared zero page on a CPU device, one cache-resident page, and the probe then
    timed only the writes (45-52 GB/s on PoCL where real data copies at 29-33)."""
    from portakern.runtime import selection
    from portakern.tools.bench.probes import copy_operands

    be = selection.get(_opencl_target())
    x, y = copy_operands(be, 1 << 20)
    assert np.array_equal(be.to_numpy(x), np.ones(1 << 20, np.float32))
    assert y.shape == x.shape


@pytest.mark.parametrize("selector", ["opencl:pocl", "opencl:intel"])
@pytest.mark.parametrize("vw", [16, 8])
def test_fma_probe_lanes_are_distinct_work(selector: str, vw: int) -> None:
    """Every lane the FMA probe credits is computed: each lane starts from its own value, so
    a compiler cannot compute one lane and broadcast it. With the old splat start, Intel's
    runtime did exactly that and "measured" 307 GFLOP/s on two Zen cores whose peak is ~78
    (gcc's FMA loop, MKL's SGEMM). The output must equal the lane-by-lane emulation; a
    broadcast of one lane misses it by far more than the rounding."""
    pytest.importorskip("pyopencl")
    from portakern.backend import registry
    from portakern.core import codegen
    from portakern.core.spec import Launch
    from portakern.runtime import selection
    from portakern.tools.bench.probes import probe_source

    av = registry.availability("opencl")
    if not av.available or not any(d.extra.get("alias") == selector.split(":")[1]
                                   for d in av.devices):
        pytest.skip(f"{selector} is not installed here")
    be = selection.get(selector)
    n, chains, iters, wg = 256, 8, 64, 64
    src = codegen.render(probe_source(), be.dialect or "", slots={"T": "float32"},
                         defines={"CHAINS": chains, "ITERS": iters, "VW": vw})
    k = be.compile(src, ("pk_probe_fma",))["pk_probe_fma"]
    out = be.empty((n,), "float32")
    prog = be.program(k, Launch("pk_probe_fma", (n // wg, 1, 1), (wg, 1, 1), ()),
                      ("y", np.float32(0.999), np.float32(1e-3)))
    prog([be.buffer_arg(out)])
    be.synchronize()
    got = np.asarray(be.to_numpy(out), dtype=np.float64)

    def emulate(lane_offsets: np.ndarray) -> np.ndarray:
        i = np.arange(n)[:, None, None]
        acc = ((i & 1023) + np.arange(chains)[None, :, None]) * 1e-4 + lane_offsets[None, None]
        for _ in range(iters):
            acc = acc * 0.999 + 1e-3
        return acc.sum(axis=(1, 2))

    want = emulate(np.arange(vw) * 1e-3)
    broadcast = emulate(np.zeros(vw))  # lane 0 computed, its value credited vw times
    err = np.max(np.abs(got - want) / np.abs(want))
    assert err < 1e-4, f"{selector} vw={vw}: the probe's lanes are not its lanes (rel {err:.2g})"
    assert np.max(np.abs(broadcast - want) / np.abs(want)) > 100 * 1e-4  # the test can see it


def test_torch_peer_records_threads_and_the_sdpa_kernel() -> None:
    pytest.importorskip("torch")
    import os

    from portakern.tools.bench import numpy_worker
    from portakern.tools.bench.peers import applicable

    t = timing.TimingConfig(min_time=0.0, min_reps=2, budget_s=10).as_dict()
    case = suites.BenchCase("attention", "float32", {"B": 1, "Hq": 2, "Hkv": 2, "Sq": 64, "Sk": 64,
                                                "D": 16, "Dv": 16}, {"causal": True})
    got = numpy_worker.handle({"case": case.as_dict(), "timing": t, "peer": "torch"})
    m = got["measurement"]
    assert m["status"] == "ok", m.get("reason")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert m["info"]["threads"] == cores and m["info"]["torch"]
    assert m["info"]["sdpa_kernels"]  # which SDPA kernel ran, from torch's profiler
    x = suites.make_inputs(case)
    fn, _ = numpy_worker.build_torch(case, x)
    want = get_op("attention").semantics(np, *(x[n].astype(np.float64) for n in "qkv"),
                                         causal=True)
    np.testing.assert_allclose(fn().numpy(), want, rtol=1e-4, atol=1e-5)
    # bfloat16: torch computes in bfloat16 on views of the inputs' bits (it ran in float32,
    # reading twice the bytes ours does)
    bcase = suites.BenchCase("matmul", "bfloat16", {"M": 32, "N": 32, "K": 32})
    bx = suites.make_inputs(bcase)
    bfn, _ = numpy_worker.build_torch(bcase, bx)
    r = bfn()
    assert str(r.dtype) == "torch.bfloat16"
    np.testing.assert_allclose(r.float().numpy(), bx["a"].astype(np.float32)
                               @ bx["b"].astype(np.float32), rtol=2e-2, atol=2e-1)
    assert "torch" in applicable("rmsnorm", Target("opencl", "cpu"))  # type: ignore[arg-type]
    assert "torch" not in applicable("matmul", Target("cuda", "gpu"))  # type: ignore[arg-type]


def test_numpy_softmax_peer_subtracts_the_max_once() -> None:
    import inspect

    from portakern.tools.bench import numpy_worker

    case = suites.BenchCase("softmax", "float32", {"rows": 3, "cols": 5})
    x = suites.make_inputs(case)
    fn = numpy_worker.build(case.as_dict(), x)
    np.testing.assert_allclose(fn(), get_op("softmax").semantics(np, x["x"].astype(np.float64)),
                               rtol=1e-6)
    src = inspect.getsource(numpy_worker.build)
    body = src[src.index("def softmax"):src.index("return softmax")]
    assert body.count(".max(") == 1 and "-=" not in body and "_softmax_inplace" not in body


def test_a_missing_promised_peer_is_warned_at_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from portakern.tools.bench import peers as peers_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("pyclblast", "torch") else real(name))
    missing = peers_mod.missing_promised([Target("opencl", "cpu")])
    assert set(missing) == {"clblast", "torch"} and "pip install" in missing["torch"]
    assert "cublas" not in missing  # not promised on a CPU
    res = {"config": {"suite": "quick"}, "environment": {"hostname": "h"}, "targets": {},
           "cases": [], "peers_missing": missing}
    md = report.run_markdown(res).splitlines()
    assert any("WARNING" in line and "CLBlast" in line for line in md[:4])


# --- interleaved rounds: a benchmark that load cannot bend (issue 26, item 4) ---------------------
class LoadedMachine:
    """A fake clock and CPU: a call of ``base`` seconds takes ``factor`` times as long when it
    starts inside a load burst [start, end)."""

    def __init__(self, bursts: list[tuple[float, float, float]]) -> None:
        self.now = 0.0
        self.bursts = bursts
        self.log: list[str] = []

    def clock(self) -> float:
        return self.now

    def impl(self, name: str, base: float) -> Any:
        def fn() -> None:
            f = next((k for a, b, k in self.bursts if a <= self.now < b), 1.0)
            self.log.append(name)
            self.now += base * f
        return fn


def test_a_burst_on_one_side_bends_sequential_ratios_not_the_interleaved_median() -> None:
    cfg = timing.TimingConfig(min_time=0.0, min_reps=15, max_reps=15, budget_s=1e6,
                              warmup_reps=0)
    # sequentially: ours' 15 samples (0.1 s each) end near t=1.6; the burst (3x) then covers
    # the peer's whole measurement, as another job starting at the wrong moment would
    seq = LoadedMachine([(1.7, 10.0, 3.0)])
    ours = timing.measure(seq.impl("ours", 0.1), lambda: None, cfg, clock=seq.clock)
    peer = timing.measure(seq.impl("peer", 0.2), lambda: None, cfg, clock=seq.clock)
    assert ours.median and peer.median
    sequential = peer.median / ours.median
    assert sequential == pytest.approx(6.0)  # 3x wrong: the burst hit only the peer's side
    # the same burst (same time, same length) during interleaved rounds hits both sides of
    # the rounds it spans; the rounds at its edges are the only ones it bends
    il = LoadedMachine([(1.7, 10.0, 3.0)])
    p_ours = timing.prepare(il.impl("ours", 0.1), lambda: None, cfg, clock=il.clock,
                            rewarm=False)
    p_peer = timing.prepare(il.impl("peer", 0.2), lambda: None, cfg, clock=il.clock,
                            rewarm=False)
    n = timing.run_rounds({"ours": p_ours, "peer": p_peer}, cfg, begin=0.0, clock=il.clock)
    assert n == 15 and len(p_ours.m.samples) == len(p_peer.m.samples) == 15
    r = metrics.paired_ratios(p_peer.m.samples, p_ours.m.samples)
    assert r is not None and r["n"] == 15
    assert r["median"] == pytest.approx(2.0)  # the quiet ratio
    assert r["max"] > 2.0 or r["min"] < 2.0  # an edge round was bent, and the spread says so
    # a burst that hits a single sample changes one round's ratio, not the median
    one = LoadedMachine([(1.0, 1.05, 5.0)])
    a = timing.prepare(one.impl("ours", 0.1), lambda: None, cfg, clock=one.clock, rewarm=False)
    b = timing.prepare(one.impl("peer", 0.2), lambda: None, cfg, clock=one.clock, rewarm=False)
    timing.run_rounds({"ours": a, "peer": b}, cfg, begin=0.0, clock=one.clock)
    r1 = metrics.paired_ratios(b.m.samples, a.m.samples)
    assert r1 is not None and r1["median"] == pytest.approx(2.0)
    assert sorted(r1["per_round"])[0] < 1.0 or sorted(r1["per_round"])[-1] > 5.0


def test_rounds_rotate_the_order_and_stop_like_a_single_measurement() -> None:
    m = LoadedMachine([])
    cfg = timing.TimingConfig(min_time=0.6, min_reps=2, max_reps=100, budget_s=1e6,
                              warmup_reps=0)
    impls = {k: timing.prepare(m.impl(k, t), lambda: None, cfg, clock=m.clock, rewarm=False)
             for k, t in (("ours", 0.1), ("a", 0.1), ("b", 0.1))}
    m.log.clear()
    n = timing.run_rounds(impls, cfg, begin=0.0, clock=m.clock)
    # min_time is per implementation on average: 3 x 0.6 s of samples = 6 rounds of 0.3 s
    assert n == 6 and all(p.m.stopped_by == "min_time" for p in impls.values())
    assert m.log[:9] == ["ours", "a", "b", "a", "b", "ours", "b", "ours", "a"]
    assert all(p.m.info["rounds"] == 6 for p in impls.values())
    # the time box is the budget per implementation, from `begin`
    m2 = LoadedMachine([])
    cfg2 = timing.TimingConfig(min_time=100.0, min_reps=3, max_reps=100, budget_s=1.0,
                               warmup_reps=0)
    two = {k: timing.prepare(m2.impl(k, 0.3), lambda: None, cfg2, clock=m2.clock,
                             rewarm=False) for k in ("ours", "peer")}
    n2 = timing.run_rounds(two, cfg2, begin=0.0, clock=m2.clock)
    # first calls 0.6 s; each round 0.6 s; a box of 2 x 1.0 s holds two rounds
    assert n2 == 2 and two["ours"].m.stopped_by == "budget"


def test_a_failing_implementation_leaves_the_rounds_and_the_anchor_ends_them() -> None:
    m = LoadedMachine([])
    cfg = timing.TimingConfig(min_time=0.0, min_reps=5, max_reps=5, budget_s=1e6,
                              warmup_reps=0)
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] > 3:  # first call and two samples, then it breaks
            raise RuntimeError("device lost")
        m.now += 0.1

    ours = timing.prepare(m.impl("ours", 0.1), lambda: None, cfg, clock=m.clock, rewarm=False)
    peer = timing.prepare(flaky, lambda: None, cfg, clock=m.clock, rewarm=False)
    n = timing.run_rounds({"ours": ours, "peer": peer}, cfg, begin=0.0, anchor="ours",
                          clock=m.clock)
    assert n == 5 and len(ours.m.samples) == 5 and ours.m.ok
    assert peer.m.status == "error" and "device lost" in peer.m.reason
    assert len(peer.m.samples) == 2 and not peer.m.ok
    calls["n"] = 0
    bad = timing.prepare(flaky, lambda: None, cfg, clock=m.clock, rewarm=False)
    other = timing.prepare(m.impl("x", 0.1), lambda: None, cfg, clock=m.clock, rewarm=False)
    timing.run_rounds({"ours": bad, "x": other}, cfg, begin=m.now, anchor="ours",
                      clock=m.clock)
    assert bad.m.status == "error" and bad.m.stopped_by == "ours failed"


def test_a_short_call_is_rewarmed_before_each_timed_sample() -> None:
    m = LoadedMachine([])
    cfg = timing.TimingConfig(min_time=0.0, min_reps=4, max_reps=4, budget_s=1e6,
                              warmup_reps=1, rewarm_below_s=0.05, rewarm_s=0.025)
    fast = timing.prepare(m.impl("fast", 0.01), lambda: None, cfg, clock=m.clock)
    slow = timing.prepare(m.impl("slow", 0.2), lambda: None, cfg, clock=m.clock)
    m.log.clear()
    timing.run_rounds({"fast": fast, "slow": slow}, cfg, begin=0.0, clock=m.clock)
    # fast: untimed calls for >= 25 ms (three of 10 ms) before each of its 4 timed ones;
    # slow: none
    assert m.log.count("fast") == 4 * (3 + 1) and m.log.count("slow") == 4
    assert fast.m.samples == [pytest.approx(0.01)] * 4  # untimed calls are not in a sample
    fast.close()
    assert fast.m.info["untimed_calls_before_samples"] == 12
    # measure() (one implementation, back to back) never rewarms
    m.log.clear()
    timing.measure(m.impl("alone", 0.01), lambda: None, cfg, clock=m.clock)
    assert m.log.count("alone") == 1 + 1 + 4


def test_paired_ratios_and_derive_report_the_median_of_rounds() -> None:
    from portakern.tools.bench.runner import derive

    r = metrics.paired_ratios([2.0, 2.2, 9.0, 2.1], [1.0, 1.0, 1.0, 1.0])
    assert r is not None and r["median"] == pytest.approx(2.15) and r["n"] == 4
    assert r["min"] == pytest.approx(2.0) and r["max"] == pytest.approx(9.0)
    assert r["q1"] == pytest.approx(float(np.percentile([2.0, 2.2, 9.0, 2.1], 25)))
    assert metrics.paired_ratios([], []) is None
    assert metrics.paired_ratios([1.0, 0.0], [0.0, 1.0]) is None  # no valid round
    rec: dict[str, Any] = {
        "compute_dtype": "float32", "cost": {"flops": 1e9, "bytes": 1e6},
        "ours": {"status": "ok", "median_s": 1.0},
        "peers": {"torch": {"status": "ok", "median_s": 3.2, "name": "PyTorch (CPU)"},
                  "numpy": {"status": "ok", "median_s": 5.0, "name": "numpy"}},
        "ratios": {"torch": r}}  # numpy ran without paired rounds (an older file)
    derive(rec, Roofline(status="error", reason="none"))
    assert rec["best_peer"] == "torch" and rec["efficiency"] == pytest.approx(2.15)
    assert rec["efficiencies"]["numpy"] == pytest.approx(5.0)  # ratio of the medians
    assert rec["efficiency_spread"]["q3"] == pytest.approx(r["q3"])
    assert report.eff_cell(rec) == "2.2 [2.1–3.9]"  # median 2.15 [IQR 2.075-3.9]
    # the best peer is picked by the per-round ratio its efficiency is, not the median time:
    # XLA's median is a hair slower than numpy's, its rounds beside ours a hair faster
    xla = metrics.paired_ratios([1.10, 1.11, 1.12], [1.0, 1.0, 1.0])
    npr = metrics.paired_ratios([1.20, 1.15, 1.16], [1.0, 1.0, 1.0])
    two: dict[str, Any] = {
        "compute_dtype": "float32", "cost": {"flops": 1e9, "bytes": 1e6},
        "ours": {"status": "ok", "median_s": 1.0},
        "peers": {"xla": {"status": "ok", "median_s": 1.17, "name": "XLA"},
                  "numpy": {"status": "ok", "median_s": 1.16, "name": "numpy"}},
        "ratios": {"xla": xla, "numpy": npr}}
    derive(two, Roofline(status="error", reason="none"))
    assert two["best_peer"] == "xla" and two["efficiency"] == pytest.approx(1.11)


def test_the_numpy_process_serves_prepared_peers_sample_by_sample() -> None:
    from portakern.tools.bench import numpy_worker

    case = suites.BenchCase("matmul", "float32", {"M": 16, "N": 16, "K": 16})
    t = timing.TimingConfig(min_time=0.0, min_reps=2, budget_s=10).as_dict()
    got = numpy_worker.handle({"op": "prepare", "id": 7, "case": case.as_dict(), "timing": t})
    assert got["kind"] == "prepared" and got["measurement"]["first_call_s"] > 0
    assert "samples_s" not in got["measurement"]
    for _ in range(3):
        s = numpy_worker.handle({"op": "sample", "id": 7})
        assert s["kind"] == "sample" and s["s"] > 0
    assert numpy_worker.handle({"op": "release", "id": 7})["kind"] == "released"
    assert 7 not in numpy_worker._PREPARED
    fp16 = numpy_worker.handle({"op": "prepare", "id": 8, "timing": t, "case": suites.BenchCase(
        "matmul", "float16", {"M": 8, "N": 8, "K": 8}).as_dict()})
    assert fp16["kind"] == "result" and fp16["measurement"]["status"] == "unavailable"


def test_a_real_case_runs_in_rounds_with_paired_ratios(tmp_path: Path) -> None:
    target = _opencl_target()
    from portakern.tools.bench import runner

    out = tmp_path / "r.json"
    cfg = runner.BenchConfig(ops=("softmax",), targets=(target,), limit=1, out=str(out),
                             probes=False, peers=("numpy", "xla"), dispatch=False,
                             timing=timing.TimingConfig(min_time=0.02, min_reps=4, budget_s=10),
                             remeasure=0, progress=open(os.devnull, "w"))  # noqa: SIM115
    try:
        res = runner.run_bench(cfg)
    finally:
        cfg.progress.close()
    (rec,) = res["cases"]
    assert rec["rounds"]["implementations"][0] == "ours"
    n = rec["rounds"]["n"]
    assert n >= 4 and rec["ours"]["reps"] == n
    for k, m in rec["peers"].items():
        if m["status"] == "ok":
            assert m["reps"] == n and rec["ratios"][k]["n"] == n
            assert rec["efficiencies"][k] == pytest.approx(rec["ratios"][k]["median"])
    # what is timed is still the user-facing call and the peer's own expression
    assert rec["ours"]["what"].startswith("pk.softmax(..., backend='opencl:")
    assert "on device-resident" in rec["ours"]["what"]
    assert rec["peers"]["numpy"]["what"].startswith("numpy max-subtracted exp")


# --- contention: measured again, then marked ------------------------------------------------------
class ScriptedMeter:
    """A CpuMeter whose 'others' share is scripted, one value per measurement."""

    ncpu = 2

    def __init__(self, shares: list[float]) -> None:
        self.shares = list(shares)

    def snapshot(self, pids: tuple[int, ...] = ()) -> dict[str, float]:
        return {}

    def since(self, before: Any, pids: tuple[int, ...] = ()) -> dict[str, float]:
        return {"wall_s": 1.0, "other_cpu_s": 0.0, "other_share": self.shares.pop(0),
                "steal_share": 0.0}

    def cpu_seconds(self, pid: int) -> float:
        return 0.0


def _contended(monkeypatch: pytest.MonkeyPatch, shares: list[float], remeasure: int
               ) -> tuple[dict[str, Any], int]:
    from portakern.tools.bench import runner

    calls = {"n": 0}

    def fake_case(be: Any, case: Any, *a: Any, **k: Any) -> dict[str, Any]:
        calls["n"] += 1
        rec = _rec("h", "opencl:0", "matmul", "N=256", ours=1.0, peer=1.0 + calls["n"])
        rec["efficiency"] = 1.0 + calls["n"]
        rec["ours"]["first_call_s"] = 5.0 if calls["n"] == 1 else 1.2
        return rec

    class NoPeers:
        def pids(self) -> tuple[int, ...]:
            return ()

    monkeypatch.setattr(runner, "run_case", fake_case)
    cfg = runner.BenchConfig(remeasure=remeasure, progress=open(os.devnull, "w"))  # noqa: SIM115
    try:
        rec = runner.measure_case(None, None, {}, NoPeers(), cfg, None, "p",  # type: ignore[arg-type]  # stubs: run_case is faked
                                  runner.Progress(cfg.progress), ScriptedMeter(shares))  # type: ignore[arg-type]  # a scripted meter
    finally:
        cfg.progress.close()
    return rec, calls["n"]


def test_a_contended_case_is_measured_again_and_the_quietest_attempt_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec, n = _contended(monkeypatch, [0.3, 0.04], remeasure=1)
    assert n == 2 and rec["contention"]["other_share"] == 0.04 and rec["contended"] is False
    assert rec["remeasured"]["kept"] == 2
    assert [a["other_share"] for a in rec["remeasured"]["attempts"]] == [0.3, 0.04]
    assert rec["ours"]["first_call_s"] == 5.0  # the first attempt's: later ones ran warm
    assert rec["efficiency"] == 3.0  # the second attempt's ratio
    cell = report._busy_cell(rec)
    assert cell == "4% (measured 2×: 30% / 4%)"
    # quiet at once: measured once, nothing to mark
    rec, n = _contended(monkeypatch, [0.02], remeasure=1)
    assert n == 1 and "remeasured" not in rec and rec["contended"] is False


def test_a_case_still_contended_after_measuring_again_is_marked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec, n = _contended(monkeypatch, [0.5, 0.2, 0.35], remeasure=2)
    assert n == 3 and rec["contention"]["other_share"] == 0.2 and rec["contended"] is True
    assert rec["remeasured"]["kept"] == 2
    assert report._busy_cell(rec) == "20% (measured 3×: 50% / 20% / 35%) ⚠"
    assert report.eff_cell(rec).endswith("⚠")
    rec["id"], rec["target"] = "matmul/float32/N=256", "opencl:0"
    note = "\n".join(report.contention_lines([rec]))
    assert "measured again" in note and "⚠ 1 still exceeded it" in note
    assert "matmul/float32/N=256 on opencl:0" in note
    # --remeasure 0: never measured again, marked all the same
    rec, n = _contended(monkeypatch, [0.5], remeasure=0)
    assert n == 1 and rec["contended"] is True and "remeasured" not in rec


# --- the CPU hog and the stability plot -----------------------------------------------------------
def test_the_hog_is_a_busy_loop_pinned_to_one_core() -> None:
    from portakern.tools.bench.environment import CpuMeter
    from portakern.tools.bench.hog import Hog, pick_core, usable_cores

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    core = pick_core()
    assert core == usable_cores()[-1]
    with pytest.raises(ValueError, match="may use cores"):
        pick_core(10_000)
    hog = Hog(core)
    with hog.running():
        pid = hog.pid
        assert pid is not None and os.sched_getaffinity(pid) == {core}
        meter = CpuMeter()
        t0 = meter.cpu_seconds(pid)
        import time

        time.sleep(0.3)
        assert meter.cpu_seconds(pid) - t0 > 0.03  # it spins (a share of a busy core at least)
    assert hog.pid is None and not Path(f"/proc/{pid}").exists()  # stopped and reaped


def _hog_result() -> dict[str, Any]:
    from portakern.tools.bench.runner import compare_hogged

    def case(label: str, quiet: float, hogged: float) -> tuple[dict[str, Any], dict[str, Any]]:
        out = []
        for ratio, share in ((quiet, 0.02), (hogged, 0.03)):
            rec = _rec("vm", "opencl:0", "attention", label, ours=0.1, peer=0.1 * ratio)
            rec["ratios"] = {"torch": metrics.paired_ratios([ratio * 0.95, ratio, ratio * 1.05],
                                                           [1.0, 1.0, 1.0])}
            rec["peers"] = {"torch": {"status": "ok", "median_s": 0.1 * ratio,
                                      "name": "PyTorch (CPU)"}}
            rec["best_peer"] = "torch"
            rec["contention"] = {"other_share": share, "hog_share": 0.5}
            out.append(rec)
        return out[0], out[1]

    q1, h1 = case("B1 H8 S4096 D64 causal", 1.29, 1.35)
    q2, h2 = case("B1 H8 S1024 D64 kv2", 0.99, 0.80)
    comp = compare_hogged(q1, h1) + compare_hogged(q2, h2)
    res = _result("vm", "opencl:0", "2025-01-01T00:00:00", [q1, q2])
    res["hog"] = {"core": 1, "cases": [h1, h2], "comparison": comp}
    res["config"]["suite"] = "quick"
    return res


def test_compare_hogged_gives_the_difference_per_peer() -> None:
    res = _hog_result()
    a, b = res["hog"]["comparison"]
    assert a["diff_pct"] == pytest.approx(100 * (1.35 / 1.29 - 1)) and a["within_10pct"]
    assert b["diff_pct"] == pytest.approx(100 * (0.80 / 0.99 - 1)) and not b["within_10pct"]
    assert a["best_peer"] and a["hog_share"] == 0.5
    text = "\n".join(report.hog_lines(res["hog"]))
    assert "Within 10% of the quiet ratio: 1 of 2" in text
    assert "| attention | B1 H8 S4096 D64 causal | opencl:0 | PyTorch (CPU) (best) | 1.29 " in text
    assert "+4.7% | yes | 2% | 3% | 50% |" in text and "-19.2% | **no** |" in text


def test_the_stability_plot_is_written_with_the_run_plots(tmp_path: Path) -> None:
    from portakern.tools.bench.plots import plot_run

    files = plot_run(_hog_result(), tmp_path / "plots")
    png = tmp_path / "plots" / "ratio_stability.png"
    assert png in files and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    # no --hog: no stability plot
    plain = _hog_result()
    del plain["hog"]
    assert not any(f.name == "ratio_stability.png" for f in plot_run(plain, tmp_path / "p2"))


# --- the raw-enqueue baseline binds its scalars once, as the plan does ----------------------------
def test_raw_enqueue_sets_per_call_exactly_the_arguments_the_plan_sets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch baseline is fair in both directions: per launch the raw enqueue sets the
    same kernel arguments (the buffers) as portakern's own program, and neither re-sets a
    scalar. Counted on the very kernel objects, through a stand-in for pyopencl's Kernel."""
    _opencl_target()
    import types

    import pyopencl as cl

    import portakern as pk
    from portakern.backend import opencl as ocl
    from portakern.ops import get_op as _get_op
    from portakern.runtime import selection
    from portakern.runtime.plan import plan_for
    from portakern.tools.bench.dispatch import _raw_launcher

    made: list[Any] = []

    class Counting:
        def __init__(self, real: Any) -> None:
            self.real = real
            self.sets: list[int] = []
            made.append(self)

        def set_arg(self, i: int, v: Any) -> None:
            self.sets.append(i)
            self.real.set_arg(i, v)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    fake = types.SimpleNamespace(**{k: getattr(cl, k) for k in dir(cl) if not k.startswith("__")})
    fake.Kernel = lambda *a: Counting(cl.Kernel(*(x.real if isinstance(x, Counting) else x
                                                  for x in a)))
    fake.enqueue_nd_range_kernel = lambda q, k, *a, **kw: cl.enqueue_nd_range_kernel(
        q, k.real if isinstance(k, Counting) else k, *a, **kw)
    monkeypatch.setattr(ocl, "cl", fake)
    be = selection.get(_opencl_target())
    x = be.to_native(np.random.default_rng(3).standard_normal((3, 37)).astype(np.float32))
    spec = _get_op("softmax")
    before = len(made)
    plan = plan_for(spec, [x], {}, backend=be)  # a new shape: a new plan, new programs
    pk.softmax(x)
    be.synchronize()
    ours = made[before:]
    assert ours, "the plan made no kernel object of its own"
    (step,) = plan.steps
    buffers = [i for i, a in enumerate(step.template) if a.__class__ is str]
    scalars = [i for i, a in enumerate(step.template) if a.__class__ is not str]
    assert buffers and scalars
    for k in ours:
        k.sets.clear()
    for _ in range(3):
        pk.softmax(x)
    plan_sets = [i for k in ours for i in k.sets]
    out = be.empty((3, 37), "float32")
    before = len(made)
    raw = _raw_launcher(be, plan, {"x": x, "out": out})
    assert raw is not None
    (own,) = made[before:]
    assert sorted(own.sets) == scalars  # scalars bound once, when it is made
    own.sets.clear()
    for _ in range(3):
        raw()
    be.synchronize()
    assert sorted(own.sets) == sorted(plan_sets) == sorted(buffers * 3)
    np.testing.assert_allclose(be.to_numpy(out), be.to_numpy(pk.softmax(x)), rtol=1e-6)


# --- the main job leaves the checkout clean (issue 26, item 5) ------------------------------------
REPO = Path(__file__).resolve().parents[2]


def _main_sh_bench_args() -> list[str]:
    import shlex

    for line in (REPO / "scripts" / "main.sh").read_text().splitlines():
        if "portakern bench --" in line and not line.lstrip().startswith(("#", "if")):
            words = shlex.split(line)
            return [w for w in words[words.index("bench") + 1:] if w != "$@"]
    raise AssertionError("scripts/main.sh runs no `portakern bench`")


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=False)


def test_the_main_job_writes_only_untracked_ignored_files(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import argparse
    import datetime
    import shutil

    from portakern.tools.bench import cli

    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    args_list = _main_sh_bench_args()
    assert "--out" not in args_list  # the committed results change only with an explicit --out
    parser = argparse.ArgumentParser()
    cli.add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *args_list])
    monkeypatch.chdir(REPO)  # where main.sh runs it
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    where = cli.resolve_outputs(args.out, args.plots, args.no_plots, hostname="vm", now=now)
    assert where.default and where.plots is not None
    assert where.json == Path("benchmarks/runs/vm-20260102T030405Z/results.json")
    written = [where.json, where.markdown, where.plots / "attention_float32.png",
               where.plots / "ratio_stability.png"]
    for p in written:
        rel = (REPO / p).relative_to(REPO).as_posix()
        assert _git("ls-files", "--error-unmatch", rel).returncode != 0, f"{rel} is tracked"
        assert _git("check-ignore", "-q", rel).returncode == 0, f"{rel} is not git-ignored"
    # an explicit --out is the maintainer's way to write the committed files
    mine = cli.resolve_outputs("benchmarks/results/vm.json", None, False)
    assert mine.json == Path("benchmarks/results/vm.json") and not mine.default
    assert mine.plots == Path("benchmarks/results/vm-plots")


def test_outside_a_checkout_runs_go_to_the_user_cache(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    from portakern.tools.bench import cli

    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    where = cli.resolve_outputs(None, None, True, hostname="my host")
    assert where.plots is None
    assert where.json.parts[:4] == ("cache", "bench", "runs", where.json.parts[3])
    assert where.json.parts[3].startswith("my_host-") and where.json.name == "results.json"


# --- attention_backward (issue 28, point 4) ------------------------------------------------------
def _bwd_case(**kw: Any) -> suites.BenchCase:
    size = {"B": 1, "Hq": 4, "Hkv": 2, "Sq": 24, "Sk": 24, "D": 16, "Dv": 16, **kw}
    return suites.BenchCase("attention_backward", "float32", size, {"causal": False})


def _bwd_reference(x: dict[str, Any]) -> tuple[np.ndarray, ...]:
    import portakern as pk

    return tuple(pk.attention_backward(*(x[n] for n in ("do", "q", "k", "v", "o", "lse")),
                                       backend="numpy"))


def test_attention_backward_sizes_and_deterministic_inputs() -> None:
    import portakern as pk

    for suite in ("quick", "full"):
        got = [c.label for c in suites.suite_cases(suite, ("attention_backward",),
                                                   ("float32",))]
        assert got == ["B1 H8 S1024 D64", "B1 H8 S4096 D64"], suite
    big = suites.suite_cases("quick", ("attention_backward",))[-1]
    assert big.params == {"causal": False}
    assert suites.shapes(big) == {"do": (1, 8, 4096, 64), "q": (1, 8, 4096, 64),
                                  "k": (1, 8, 4096, 64), "v": (1, 8, 4096, 64),
                                  "o": (1, 8, 4096, 64), "lse": (1, 8, 4096)}
    case = _bwd_case()
    a: dict[str, Any] = suites.make_inputs(case)
    b: dict[str, Any] = suites.make_inputs(suites.BenchCase.from_dict(case.as_dict()))
    assert list(a) == ["do", "q", "k", "v", "o", "lse", "mask"] and a["mask"] is None
    assert a["lse"] is not None and a["lse"].dtype == np.float32
    for n in ("do", "q", "k", "v", "o", "lse"):
        assert np.array_equal(a[n], b[n]), n
    # the host forward (chunked per head, fp32) is the forward's o and lse (GQA: Hq 4, Hkv 2)
    o, lse = pk.attention(a["q"], a["k"], a["v"], return_lse=True, backend="numpy")
    np.testing.assert_allclose(a["o"], o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a["lse"], lse, rtol=1e-5, atol=1e-5)
    half = suites.make_inputs(suites.BenchCase("attention_backward", "bfloat16", case.size,
                                               {"causal": False}))
    assert half["o"] is not None and half["o"].dtype.name == "bfloat16"
    assert half["lse"] is not None and half["lse"].dtype == np.float32


def test_attention_backward_numpy_xla_and_torch_peers_compute_the_gradient() -> None:
    from portakern.tools.bench import numpy_worker
    from portakern.tools.bench.peers import applicable, peer_name

    case = _bwd_case()
    x: dict[str, Any] = suites.make_inputs(case)
    want = _bwd_reference(x)
    built: Any = numpy_worker.build(case.as_dict(), x)
    for got, w in zip(built(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    assert applicable("attention_backward", Target("opencl", "cpu")) == [  # type: ignore[arg-type]
        "numpy", "torch", "xla"]
    assert peer_name("xla", "attention_backward") == "XLA (jax.jit)"  # hand-written, not semantics
    try:
        import jax  # noqa: F401
    except ImportError:
        pass
    else:
        from portakern.tools.bench.peers import _xla_fn

        f = _xla_fn(case)
        for got, w in zip(f(*(x[n] for n in ("do", "q", "k", "v", "o", "lse"))), want,
                          strict=True):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-4, atol=1e-5)
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    tfn, info = numpy_worker.build_torch(case, x)
    tout: Any = tfn()
    for got, w in zip(tout, want, strict=True):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-5)
    assert info["sdpa_kernels"] and all("backward" in k for k in info["sdpa_kernels"])


def test_attention_backward_unfused_chain_equals_the_fused_op() -> None:
    import portakern as pk
    from portakern.runtime import selection
    from portakern.tools.bench.runner import measure_unfused, unfused_backward

    be = selection.get(_opencl_target())
    case = _bwd_case()
    x: dict[str, Any] = suites.make_inputs(case)
    built = unfused_backward(be, case, x)
    assert isinstance(built, tuple), built
    fn, what = built
    assert "exp(S - lse)" in what and "ElementwiseKernel" in what
    ours = pk.attention_backward(*(be.to_native(x[n]) for n in ("do", "q", "k", "v", "o", "lse")),
                                 backend=be)
    for got, w, r in zip(fn(), ours, _bwd_reference(x), strict=True):
        np.testing.assert_allclose(be.to_numpy(got), be.to_numpy(w), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(be.to_numpy(got), r, rtol=1e-4, atol=1e-5)
    causal = suites.BenchCase("attention_backward", "float32", case.size, {"causal": True})
    got = measure_unfused(be, causal, suites.make_inputs(causal), timing.TimingConfig())
    assert isinstance(got, timing.Measurement) and got.status == "unsupported"


def test_attention_backward_memory_record_and_table(kernel_target: str) -> None:
    """Ours: the spec's workspace (O(S*D)) within the issue's 64 MiB; the unfused chain: three
    Sq x Sk matrices, over 1 GiB at S=4096; the run table shows both and the unfused ratio."""
    from portakern.runtime import configs, selection
    from portakern.tools.bench.runner import memory_record

    be = selection.get(kernel_target)
    case = suites.BenchCase("attention_backward", "float32", suites._att(4096),
                            {"causal": False})
    mem = memory_record(be, case)
    spec = get_op("attention_backward")
    prob = spec.problem(*spec.bind(suites.metadata_inputs(case), {"causal": False}))
    assert spec.workspace is not None
    ws = spec.workspace(prob, configs.config_for(be, spec, prob, None))
    assert mem["fused"]["extra_bytes"] == sum(n * np.dtype(dt).itemsize for n, dt in ws.values())
    assert mem["fused"]["workspace_bytes"]["delta"] == 8 * 4096 * 4
    sq = 8 * 4096 * 4096 * 4
    unf = mem["unfused"]
    assert unf["probabilities_bytes"] == unf["dp_bytes"] == unf["ds_bytes"] == sq
    assert unf["layout_copies_bytes"] == 4 * 8 * 4096 * 64 * 4  # q*scale, k*scale, k^T, V^T
    assert unf["extra_bytes"] == 3 * sq + unf["layout_copies_bytes"] + 8 * 4096 * 4
    assert mem["fused"]["extra_bytes"] <= 64 << 20 and unf["extra_bytes"] > 1 << 30
    rec = _rec("h", kernel_target, "attention_backward", case.label, ours=2.0, peer=3.0)
    rec.update(memory=mem, unfused={"status": "ok", "median_s": 4.0, "q1_s": 4.0, "q3_s": 4.0,
                                    "reps": 3},
               unfused_ratio={"median": 2.0, "q1": 2.0, "q3": 2.0, "min": 2.0, "max": 2.0,
                              "n": 3})
    md = report.run_markdown(_result("h", kernel_target, "2024-01-01T00:00:00", [rec]))
    row = next(line for line in md.splitlines() if "| attention_backward |" in line)
    assert "B1 H8 S4096 D64" in row and "= 2x ours" in row and "GiB" in row


# --- decode rows (issue 29): paged_attention ------------------------------------------------------
def test_quick_suite_has_the_decode_rows_split_beside_unsplit() -> None:
    """The row users get (no config: the splits the call chooses) beside none forced; the
    peers beside the first."""
    rows = [c for c in suites.suite_cases("quick") if c.op == "paged_attention"]
    assert {c.dtype for c in rows} == {"float16"}  # an fp16 cache unless --dtypes says
    got = {(c.size["B"], c.size["ctx"], c.size["split"]) for c in rows}
    assert got == {(b, ctx, s) for b in (1, 8) for ctx in (4096, 32768) for s in (0, 1)}
    assert all((c.size["Hq"], c.size["Hkv"], c.size["D"]) == (32, 8, 128) for c in rows)
    auto = next(c for c in rows if c.size["B"] == 1 and c.size["ctx"] == 32768
                and c.size["split"] == 0)
    assert auto.label == "B1 H32 kv8 D128 ctx32768 split auto"
    assert suites.bench_config(auto) is None  # exactly the user's call
    one = next(c for c in rows if c.size["B"] == 1 and c.size["ctx"] == 32768
               and c.size["split"] == 1)
    assert one.label == "B1 H32 kv8 D128 ctx32768 unsplit"
    assert suites.bench_config(one) == {"SPLIT": 1}
    assert "split-auto row" in (suites.peer_skip(one) or "")
    forced = suites.BenchCase("paged_attention", "float16", {**auto.size, "split": 8})
    assert suites.paged_label(forced.size).endswith(" split8")
    assert suites.bench_config(forced) == {"SPLIT": 8}
    big = next(c for c in rows if c.size["B"] == 8 and c.size["ctx"] == 32768
               and c.size["split"] == 0)
    assert "MiB" in (suites.peer_skip(big) or "")  # the gathered cache would not fit
    small = next(c for c in rows if c.size["B"] == 1 and c.size["ctx"] == 4096
                 and c.size["split"] == 0)
    assert suites.peer_skip(small) is None
    assert suites.bench_config(suites.BenchCase("softmax", "float32", {"rows": 1, "cols": 1})) \
        is None
    # --dtypes still decides when given
    assert {c.dtype for c in suites.suite_cases("quick", ("paged_attention",),
                                                ("float32",))} == {"float32"}


def test_decode_inputs_are_valid_tables_and_the_peer_agrees() -> None:
    """A small decode case: full sequences over a permuted pool, accepted by the tables'
    check; the numpy semantics peer (int tables passed as ints) agrees with the oracle."""
    from portakern.tools.bench import numpy_worker

    case = suites.BenchCase("paged_attention", "float16", {"B": 2, "Hq": 4, "Hkv": 2, "D": 16,
                                                          "ctx": 64, "BS": 16, "split": 1})
    x = suites.make_inputs(case)
    assert x["block_table"].dtype == np.int32 and x["seq_lens"].tolist() == [64, 64]
    assert sorted(x["block_table"].ravel().tolist()) == list(range(8))  # a permutation
    assert x["k_cache"].shape == (8, 2, 16, 16) and x["q"].shape == (2, 4, 1, 16)
    import portakern as pk

    want = pk.paged_attention(*(x[n] for n in suites.operand_names("paged_attention")
                                if x[n] is not None), backend="numpy")
    fn, what = numpy_worker.semantics_peer(case, x)
    np.testing.assert_allclose(fn().astype(np.float32), want.astype(np.float32), rtol=1e-2,
                               atol=1e-3)
    assert "spec.semantics(numpy" in what


def test_rounds_wait_for_another_implementations_spinning_threads() -> None:
    """A library's helper threads spin after its call (OpenBLAS ~0.1 s): the next sample in
    the rounds must not share the cores with them. settle() waits until no other thread of
    the benchmark's processes runs (a spinning thread here: 0.15 s), and returns at once
    when none does; the rounds record what they waited."""
    import threading

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc: settle() cannot see threads here and returns at once")
    assert timing.settle(0.0) == 0.0
    timing.settle(0.5)  # whatever ran before this test settles first
    assert timing.settle(0.5) < 0.05
    stop = time.perf_counter() + 0.15

    def spin() -> None:
        while time.perf_counter() < stop:
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        waited = timing.settle(1.0)
    finally:
        t.join()
    assert 0.08 < waited < 0.6, waited
    m = timing.Measurement(what="x")
    p = timing.Prepared(m, lambda: None, lambda: None, timing.TimingConfig(), time.perf_counter,
                        time.perf_counter(), 1e-6, False, None)
    q = timing.Prepared(timing.Measurement(what="y"), lambda: None, lambda: None,
                        timing.TimingConfig(), time.perf_counter, time.perf_counter(), 1e-6,
                        False, None)
    timing.run_rounds({"a": p, "b": q}, timing.TimingConfig(min_reps=2, min_time=0.0),
                      begin=time.perf_counter())
    assert "settled_s" in m.info


def test_settle_does_not_wait_for_the_hog() -> None:
    """bench --hog's busy loop is a child that never stops running: settle() leaves it out
    (else every sample under load would wait settle_max_s), and forgets it when it stops."""
    from portakern.tools.bench.hog import Hog

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc: settle() returns at once here")
    hog = Hog(0)
    with hog.running():
        assert hog.pid in timing.SETTLE_IGNORED
        assert timing.settle(0.5) < 0.3
    assert not timing.SETTLE_IGNORED
