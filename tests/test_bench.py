"""The benchmark's own logic: statistics, repetition, metrics, roofline, cost models, the
report merge, and one tiny real run on OpenCL that writes JSON, markdown and a PNG.

Each test pins a number computed by hand, so a harness that drops an unsupported platform
from PP, times without synchronising, mixes the compile call into the samples, or
mis-counts an op's flops fails here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from portakern.bench import metrics, report, suites, timing
from portakern.bench.probes import Roofline, combine
from portakern.ops import get_op


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


# --- suites --------------------------------------------------------------------------------------
def test_quick_suite_covers_the_issue_sizes() -> None:
    cases = suites.suite_cases("quick")
    by_op: dict[str, list[suites.Case]] = {}
    for c in cases:
        by_op.setdefault(c.op, []).append(c)
    assert set(by_op) == {"matmul", "softmax", "attention"}
    assert max(c.size["N"] for c in by_op["matmul"]) == 1024
    assert max(c.size["rows"] * c.size["cols"] for c in by_op["softmax"]) == 8192 * 4096
    assert any(c.size == {"B": 1, "Hq": 8, "Hkv": 8, "Sq": 4096, "Sk": 4096, "D": 64, "Dv": 64}
               for c in by_op["attention"])
    assert len({c.id for c in cases}) == len(cases)
    assert [c.label for c in suites.suite_cases("quick", ("matmul",), limit=1)] == ["N=256"]


@pytest.mark.parametrize("suite", sorted(suites.SIZES))
def test_every_suite_case_validates_and_has_a_cost(suite: str) -> None:
    from portakern.bench.runner import make_inputs_meta

    for case in suites.suite_cases(suite, dtype_list=("float32", "bfloat16")):
        spec = get_op(case.op)
        prob = spec.problem(*spec.bind(make_inputs_meta(case), dict(case.params)))
        c = spec.cost(prob)
        assert c.flops > 0 and c.bytes > 0, case.id


def test_inputs_are_deterministic_per_case() -> None:
    c = suites.Case("attention", "bfloat16", {"B": 1, "Hq": 2, "Hkv": 1, "Sq": 3, "Sk": 5,
                                              "D": 4, "Dv": 4})
    a, b = suites.make_inputs(c), suites.make_inputs(suites.Case.from_dict(c.as_dict()))
    assert a["k"].shape == (1, 1, 5, 4) and a["k"].dtype.name == "bfloat16"
    for n in a:
        assert np.array_equal(a[n].astype(np.float32), b[n].astype(np.float32))


def test_unknown_suite_and_dtype_say_what_is_expected() -> None:
    with pytest.raises(Exception, match="expected one of"):
        suites.suite_cases("huge")
    with pytest.raises(Exception, match="float32"):
        suites.suite_cases("quick", dtype_list=("int8",))


# --- numpy peer process --------------------------------------------------------------------------
def test_numpy_worker_measures_and_refuses_fp16() -> None:
    from portakern.bench import numpy_worker

    t = timing.TimingConfig(min_time=0.0, min_reps=2, budget_s=10).as_dict()
    case = suites.Case("attention", "float32", {"B": 1, "Hq": 4, "Hkv": 2, "Sq": 8, "Sk": 8,
                                                "D": 8, "Dv": 8}, {"causal": True})
    got = numpy_worker.handle({"case": case.as_dict(), "timing": t})["measurement"]
    assert got["status"] == "ok" and got["reps"] >= 2
    # the numpy expression is the op's semantics: check it against the oracle once
    x = suites.make_inputs(case)
    fn = numpy_worker.build(case.as_dict(), x)
    want = get_op("attention").semantics(np, *(x[n].astype(np.float64) for n in "qkv"),
                                         causal=True)
    np.testing.assert_allclose(fn(), want, rtol=1e-4, atol=1e-5)
    half = suites.Case("matmul", "float16", {"M": 4, "N": 4, "K": 4, "batch": []})
    got = numpy_worker.handle({"case": half.as_dict(), "timing": t})["measurement"]
    assert got["status"] == "unavailable" and "float16" in got["reason"]


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
    assert len(merged.platforms) == 2
    cases = {c.key: c for c in report.portability(merged.records, merged.platforms)}
    mm = cases[("matmul", "float32", "N=256")]
    assert mm.pp_app is not None and mm.pp_app.value == pytest.approx(2 / (2 + 4))  # 0.5, 0.25
    assert mm.pp_roof is not None and mm.pp_roof.value == pytest.approx(2 / (2 + 4))
    sm = cases[("softmax", "float32", "64x64")]
    assert sm.pp_app is not None and sm.pp_app.value == 0.0  # hostB cannot run it
    assert sm.pp_app.unsupported == (merged.platforms[1],)
    only_a = cases[("matmul", "float32", "N=512")]
    assert only_a.not_measured == [merged.platforms[1]]  # unknown, not unsupported
    assert only_a.pp_app is not None and only_a.pp_app.value == pytest.approx(1.0)

    from portakern.cli import main

    out = tmp_path / "rep"
    assert main(["report", str(pa), str(pb), "--out", str(out)]) == 0
    text = (out / "REPORT.md").read_text()
    assert "cannot run on P2" in text and "not measured" in text and "0.333" in text
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == ["report_matmul_float32.png", "report_softmax_float32.png"]
    assert (out / "plots" / pngs[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


# --- derive: one record's efficiency and roofline ------------------------------------------------
def test_derive_picks_best_peer_and_roofline() -> None:
    from portakern.bench.runner import derive

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
    from portakern.backends.base import DeviceInfo
    from portakern.bench import runner

    class Stub:
        name, label = "stub", "stub:0"
        device = DeviceInfo(0, "stub device", "accelerator")

        def describe(self) -> str:
            return "stub:0"

    calls = {"n": 0}

    def fake_case(be: Any, case: suites.Case, *a: Any, **k: Any) -> dict[str, Any]:
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


# --- probes under CUDA (compile only: no GPU needed) ---------------------------------------------
def test_probe_kernels_compile_for_cuda_with_nvrtc() -> None:
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from portakern import codegen
    from portakern.bench.probes import probe_source

    try:
        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"NVRTC cannot load: {exc}")
    try:
        from portakern.backends.cuda import compile_options

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
    from portakern.bench.environment import CpuMeter

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
    from portakern import backends as registry

    av = registry.availability("opencl")
    if not av.available or not av.devices:
        pytest.skip(f"no OpenCL device: {av.reason}")
    return "opencl:0"


def test_tiny_real_run_writes_json_markdown_and_png(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    target = _opencl_target()
    from portakern.cli import main

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
    assert "| matmul | float32 | N=256 |" in md and "PP (vs peers)" in md
    assert "| matmul | float32 | N=256 |" in capsys.readouterr().out
    png = plots / "matmul_float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
