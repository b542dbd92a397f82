"""The autotuner (tools/autotune.py): tuned schedules stay oracle-correct, the database is only
trusted after validation, stale and malicious entries are ignored, and lookups stay cheap.

Every test points PORTAKERN_CACHE_DIR at its own tmp_path (the ``db`` fixture), so none reads
or writes the user's tuning database. Tuning itself runs on OpenCL (PoCL on CI machines) with
budgets of a few seconds.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.backend import registry
from portakern.core import cache, codegen
from portakern.core.errors import InvalidArgumentError
from portakern.core.sampling import NumpyChooser
from portakern.ops import get_op
from portakern.runtime import configs
from portakern.runtime.configs import TuningWarning
from portakern.tools import autotune, cases
from portakern.tools.cli import main as cli_main
from portakern.tools.show import representative_problem

MATMUL = get_op("matmul")
SOFTMAX = get_op("softmax")


def _fit(be: Any, spec: Any, prob: Any, cfg: Any) -> dict[str, int]:
    """What config_for returns for a stored or scheduled ``cfg``: its automatic tunables
    (matmul's PACK_B = 2, ...) fitted to the problem and device."""
    return configs.fitted(be, spec, prob, dict(cfg))


def _default(be: Any, spec: Any, prob: Any) -> dict[str, int]:
    """config_for's fallback: the device class's schedule, fitted."""
    return _fit(be, spec, prob, spec.config(be.schedule_class, None, prob))


def _opencl() -> Any:
    cls = registry.load("opencl")
    if not isinstance(cls, type) or not cls.probe().available:
        pytest.skip("OpenCL is not available here (portakern info says why)")
    return cls


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(d))
    monkeypatch.delenv("PORTAKERN_TUNING", raising=False)
    configs.invalidate()
    yield d
    configs.invalidate()  # later tests must not see this test's entries through backend caches


@pytest.fixture
def be() -> Any:
    """A fresh OpenCL backend instance: its config cache starts empty."""
    return _opencl()("0")


def _prob(spec: Any, dtype: str = "float32", **sizes: int) -> Any:
    return representative_problem(spec, dtype, sizes)


def _entry(be: Any, spec: Any, prob: Any, config: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return autotune.make_entry(configs.fingerprint(be), spec, prob, config, time_s=1e-3,
                           default_time_s=2e-3, **meta)


def _non_default(be: Any, spec: Any, prob: Any) -> dict[str, int]:
    """A valid configuration that differs from the device's default schedule."""
    base = spec.config(be.schedule_class, None, prob)
    for t in spec.tunables:
        for v in t.domain:
            cand = {**base, t.name: v}
            if v == base[t.name]:
                continue
            try:
                cfg = spec.config(be.schedule_class, cand, prob)
            except InvalidArgumentError:
                continue
            wg = max(la.local[0] * la.local[1] * la.local[2] for la in spec.launches(prob, cfg))
            if wg <= be.device.max_work_group_size:
                return cfg
    raise AssertionError("no alternative configuration")


def _check_cases(spec: Any, be: Any, cfg: dict[str, int] | None, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        case = cases.CASES[spec.name](NumpyChooser(rng), "float32")
        got = pk.call(spec, backend=be, config=cfg, **case.arrays, **case.params)
        v = cases.compare(spec, case, got)
        assert v.ok, f"{case.describe()} with {cfg or 'the tuned/default config'}: {v.where}"


# --- buckets ------------------------------------------------------------------------------
def test_size_classes_and_buckets() -> None:
    assert [configs.size_class(v) for v in (0, 1, 2, 4, 5, 16, 17, 64, 65, 256, 257)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    b = configs.bucket(_prob(MATMUL, M=256, N=300, K=64))
    assert b == ("float32", (("K", 3), ("M", 4), ("N", 5)))
    assert configs.bucket_key(b) == "float32.K3.M4.N5"
    assert configs.bucket_label(b) == "float32 K<=64 M<=256 N<=1024"
    assert configs.bucket(_prob(MATMUL, "float16", M=256, N=300, K=64))[0] == "float16"
    assert configs.bucket(_prob(MATMUL, M=1, N=4096, K=4096)) != configs.bucket(_prob(MATMUL))


# --- the tuner end to end -----------------------------------------------------------------
def test_tuned_configuration_is_stored_used_and_correct(db: Path, be: Any) -> None:
    lines: list[str] = []
    res = autotune.tune("matmul", be, budget_s=3.0, sizes={"M": 48, "N": 40, "K": 33},
                    max_candidates=6, checks=1, seed=1, out=lines.append)
    text = "\n".join(lines)
    assert res.best is not None and res.stored is not None and res.stored.exists()
    assert "[  1/" in text and " default " in text and "best" in text and "stored:" in text
    assert res.default is not None and res.default.config == MATMUL.config(be.schedule_class)
    assert all(o.status in ("ok", "slower", "rejected", "failed") for o in res.outcomes)
    assert stat_mode(res.stored) == 0o600
    # ops now use the tuned schedule, validated, for the tuned bucket and (nearest) others
    fresh = _opencl()("0")
    prob = _prob(MATMUL, M=48, N=40, K=33)
    assert configs.config_for(fresh, MATMUL, prob, None) == _fit(fresh, MATMUL, prob,
                                                                 res.best.config)
    assert configs.lookup(fresh, MATMUL, _prob(MATMUL, M=7, N=300, K=9)) == res.best.config
    # ... and give oracle-correct results, as does the default, on random edge cases
    _check_cases(MATMUL, fresh, None, seed=5, n=5)
    _check_cases(MATMUL, fresh, res.best.config, seed=6, n=3)
    _check_cases(MATMUL, fresh, MATMUL.config(fresh.schedule_class), seed=7, n=3)
    # `portakern info` shows it
    summary = configs.tuned_summary("opencl", fresh.device, type(fresh).probe().versions)
    assert [s["op"] for s in summary] == ["matmul"] and not summary[0]["stale"]


def stat_mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_softmax_tuning_through_the_cli(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _opencl()
    rc = cli_main(["tune", "softmax", "--backend", "opencl", "--budget", "2", "--shape",
                   "R=8,N=300", "--max-candidates", "4", "--checks", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tuning softmax on opencl:0" in out and "stored:" in out
    assert cli_main(["tune", "--list"]) == 0
    listing = capsys.readouterr().out
    assert str(db) in listing and "softmax float32" in listing
    assert cli_main(["info"]) == 0
    assert "tuned: softmax float32" in capsys.readouterr().out
    be = _opencl()("0")
    _check_cases(SOFTMAX, be, None, seed=3, n=4)  # tuned schedule applies: still correct
    assert cli_main(["tune", "--clear"]) == 0
    assert "removed 1 tuned entry" in capsys.readouterr().out
    assert configs.lookup(be, SOFTMAX, _prob(SOFTMAX, R=8, N=300)) is None


def test_candidates_failing_the_oracle_are_rejected(db: Path, be: Any) -> None:
    """A kernel that is fast but wrong for some schedules must never win."""
    # every schedule with TM != 8 drops its last row of work-groups (rows of C go missing)
    def launches(prob: Any, cfg: Any) -> list[Any]:
        out = MATMUL.launches(prob, cfg)
        if cfg["TM"] == 8:
            return out
        return [dataclasses.replace(la, groups=(la.groups[0], la.groups[1] - 1, la.groups[2]))
                for la in out if la.groups[1] > 1]  # a single row of groups: nothing runs

    broken = MATMUL.replace(launches=launches)
    lines: list[str] = []
    res = autotune.tune(broken, be, budget_s=3.0, sizes={"M": 300, "N": 24, "K": 16},
                    max_candidates=8, checks=1, save=False, out=lines.append)
    rejected = [o for o in res.outcomes if o.status == "rejected"]
    assert all(o.config["TM"] != 8 for o in rejected)
    assert all(o.config["TM"] == 8 for o in res.outcomes if o.status == "ok")
    assert res.best is None or res.best.config["TM"] == 8
    if rejected:
        assert "rejected: wrong on" in "\n".join(lines)


# --- what is read back is validated -------------------------------------------------------
def test_stale_entry_is_ignored(db: Path, be: Any) -> None:
    prob = _prob(MATMUL)
    cfg = _non_default(be, MATMUL, prob)
    assert autotune.save_entry(_entry(be, MATMUL, prob, cfg)) is not None
    assert configs.lookup(be, MATMUL, prob) == cfg
    changed = MATMUL.replace(source=MATMUL.source + "\n// the kernel changed\n")
    assert codegen.source_hash(changed.source) != codegen.source_hash(MATMUL.source)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)  # stale is normal: ignored silently
        assert configs.lookup(be, changed, prob) is None
        assert configs.config_for(be, changed, prob) == _default(be, changed, prob)
    # an entry recorded for another kernel source is listed as stale
    other = _entry(be, MATMUL, prob, cfg)
    other["source_hash"] = "0123456789abcdef"
    autotune.save_entry(other)
    rows = configs.tuned_summary("opencl", be.device, type(be).probe().versions)
    assert sorted(r["stale"] for r in rows) == [False, True]
    assert configs.lookup(_opencl()("0"), MATMUL, prob) == cfg


BAD_VALUES = ["8 -DX=1", "1;}", "8", "TM", 8.0, True, -1, 3, 10**12, None, [8], {"v": 8}]


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_environment_or_stored_values_never_reach_source(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="outside its domain"):
        MATMUL.config("cpu", {"TM": value})
    with pytest.raises(InvalidArgumentError, match="outside its domain"):
        SOFTMAX.config("gpu", {"WG": value})


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_malicious_entry_with_a_valid_hash_is_rejected(db: Path, be: Any, value: object) -> None:
    prob = _prob(MATMUL)
    payload = _entry(be, MATMUL, prob, MATMUL.config(be.schedule_class, None, prob))
    payload["config"]["TM"] = value  # written through the store: its sha256 is correct
    st = configs.store_for(payload["device_key"])
    assert st.put(configs.entry_key("matmul", payload["bucket"], payload["source_hash"]), payload)
    configs.invalidate()
    with pytest.warns(TuningWarning, match="rejects it"):
        cfg = configs.config_for(be, MATMUL, prob, None)
    assert cfg == _default(be, MATMUL, prob)
    src = MATMUL.render(be.dialect, prob, cfg)
    assert "-DX" not in src and "1;}" not in src
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(pk.matmul(a, a.T, backend=be), a @ a.T)  # exact integers


@pytest.mark.parametrize("damage", ["unknown_tunable", "bad_key_name", "config_not_dict",
                                    "bucket_mismatch", "schema", "device_mismatch"])
def test_malformed_entries_warn_and_fall_back(db: Path, be: Any, damage: str) -> None:
    prob = _prob(MATMUL)
    payload = _entry(be, MATMUL, prob, _non_default(be, MATMUL, prob))
    key = configs.entry_key("matmul", payload["bucket"], payload["source_hash"])
    if damage == "unknown_tunable":
        payload["config"]["EVIL"] = 1
    elif damage == "bad_key_name":
        payload["config"]["TM -DX=1"] = 8
    elif damage == "config_not_dict":
        payload["config"] = [["TM", 8]]
    elif damage == "bucket_mismatch":
        payload["bucket"] = "float32.K1.M1.N1"
    elif damage == "schema":
        payload["schema"] = 99
    elif damage == "device_mismatch":
        payload["device_key"] = "opencl-ffffffffffffffff"
    configs.store_for(configs.device_key(configs.fingerprint(be))).put(key, payload)
    configs.invalidate()
    with pytest.warns(TuningWarning, match="ignored entry"):
        assert configs.config_for(be, MATMUL, prob) == _default(be, MATMUL, prob)
    if damage in ("bad_key_name", "config_not_dict", "bucket_mismatch", "schema"):
        with pytest.raises(InvalidArgumentError, match="malformed"):
            autotune.save_entry(payload)  # and the tuner itself refuses to write such a record


def test_corrupted_database_file_warns_and_is_rebuilt(db: Path, be: Any) -> None:
    prob = _prob(MATMUL)
    cfg = _non_default(be, MATMUL, prob)
    path = autotune.save_entry(_entry(be, MATMUL, prob, cfg))
    assert path is not None
    path.write_bytes(path.read_bytes()[:-40])  # truncated mid-write by a crash, say
    configs.invalidate()
    with pytest.warns(cache.CacheWarning, match="discarded"):
        assert configs.config_for(be, MATMUL, prob) == _default(be, MATMUL, prob)
    assert not path.exists()
    assert autotune.save_entry(_entry(be, MATMUL, prob, cfg)) == path  # rebuilt by the next tune
    assert configs.config_for(_opencl()("0"), MATMUL, prob, None) == _fit(be, MATMUL, prob, cfg)


def test_unusable_cache_directory_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             be: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(blocker / "cache"))
    configs.invalidate()
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            res = autotune.tune("softmax", be, budget_s=1.0, sizes={"R": 4, "N": 64},
                            max_candidates=2, checks=0, out=lambda s: None)
            assert res.best is not None and res.stored is None
            x = np.random.default_rng(0).standard_normal((3, 17)).astype(np.float32)
            for _ in range(3):
                y = pk.softmax(x, backend=be)
            np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-5)
        ours = [w for w in got if issubclass(w.category, cache.CacheWarning)]
        assert len(ours) == 1, [str(w.message) for w in ours]
    finally:
        configs.invalidate()


# --- switches and the hot path ------------------------------------------------------------
def test_env_switch_and_exact_mode(db: Path, be: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prob = _prob(MATMUL)
    far = _prob(MATMUL, M=3, N=3, K=3)
    cfg = _non_default(be, MATMUL, prob)
    autotune.save_entry(_entry(be, MATMUL, prob, cfg))
    assert configs.lookup(be, MATMUL, prob) == cfg
    assert configs.lookup(be, MATMUL, far) == cfg  # nearest tuned bucket
    assert configs.lookup(be, MATMUL, _prob(MATMUL, "float64")) is None  # never across dtypes
    monkeypatch.setenv("PORTAKERN_TUNING", "exact")
    assert configs.lookup(be, MATMUL, prob) == cfg
    assert configs.lookup(be, MATMUL, far) is None
    monkeypatch.setenv("PORTAKERN_TUNING", "0")
    assert configs.lookup(be, MATMUL, prob) is None
    assert configs.config_for(_opencl()("0"), MATMUL, prob) == _default(be, MATMUL, prob)


def test_entry_too_big_for_this_device_is_skipped(db: Path, be: Any) -> None:
    prob = _prob(MATMUL)
    cfg = MATMUL.config("gpu", None, prob)  # 16x16 work-groups
    autotune.save_entry(_entry(be, MATMUL, prob, cfg))
    small = _opencl()("0")
    small.device = SimpleNamespace(**{**small.device.as_dict(), "max_work_group_size": 64})
    assert configs.lookup(small, MATMUL, prob) is None


def test_no_disk_access_after_the_first_lookup(db: Path, be: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prob = _prob(MATMUL)
    cfg = _non_default(be, MATMUL, prob)
    autotune.save_entry(_entry(be, MATMUL, prob, cfg))
    # reads the device's entries once
    assert configs.config_for(be, MATMUL, prob, None) == _fit(be, MATMUL, prob, cfg)

    def no_disk(*a: object, **k: object) -> None:
        raise AssertionError("the hot path touched the disk")

    for name in ("get", "put", "items", "clear", "clear_report"):  # every way to the disk
        monkeypatch.setattr(cache.Store, name, no_disk)
    a = np.ones((5, 7), np.float32)
    for _ in range(20):
        assert configs.config_for(be, MATMUL, prob, None) == _fit(be, MATMUL, prob, cfg)
        pk.matmul(a, a.T, backend=be)  # another bucket: answered from the in-memory index
    t0 = time.perf_counter()
    for _ in range(2000):
        configs.config_for(be, MATMUL, prob, None)
    assert (time.perf_counter() - t0) / 2000 < 50e-6


# --- concurrency --------------------------------------------------------------------------
WRITER = """
import sys, time
from pathlib import Path
from portakern.tools import autotune
from portakern.ops import get_op
from portakern.tools.show import representative_problem
worker, gate = int(sys.argv[1]), Path(sys.argv[2])
spec = get_op("matmul")
fp = {"backend": "opencl", "vendor": "V", "name": "N", "driver": "1", "platform": "P",
      "versions": {"pyopencl": "x"}}
(gate.parent / f"ready-{worker}").touch()
while not gate.exists():
    time.sleep(0.001)
for j in range(6):
    prob = representative_problem(spec, "float32", {"M": 4 ** worker, "N": 4 ** j, "K": 64})
    cfg = spec.config("cpu", None, prob)
    assert autotune.save_entry(autotune.make_entry(fp, spec, prob, cfg, time_s=1e-3, worker=worker))
    shared = representative_problem(spec, "float32", {"M": 999, "N": 999, "K": 999})
    assert autotune.save_entry(autotune.make_entry(fp, spec, shared, cfg, time_s=1e-3,
                                                   worker=worker))
"""


def test_database_survives_concurrent_writers(db: Path, tmp_path: Path) -> None:
    workers = 3
    gate = tmp_path / "gate" / "go"
    gate.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(gate)],
                              env=os.environ.copy()) for w in range(workers)]
    deadline = time.monotonic() + 60
    while len(list(gate.parent.glob("ready-*"))) < workers and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.01)
    gate.touch()
    assert [p.wait(60) for p in procs] == [0] * workers
    fp = {"backend": "opencl", "vendor": "V", "name": "N", "driver": "1", "platform": "P",
          "versions": {"pyopencl": "x"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        rows = list(configs.device_entries(configs.device_key(fp)))
    assert all(isinstance(r, configs.Entry) for r in rows), rows
    buckets = {configs.bucket_key(r.bucket) for r in rows}
    want = {f"float32.K3.M{configs.size_class(4 ** w)}.N{configs.size_class(4 ** j)}"
            for w in range(workers) for j in range(6)} | {"float32.K5.M5.N5"}
    assert buckets == want


def test_tune_and_show_refuse_sizes_the_op_does_not_take(db: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """`tune matmul --shape m=16,n=16,k=16` (lower case) tuned and stored 256^3, the names
    dropped in silence; `show` dropped them too; `tune` of an empty problem timed a no-op and
    would serve every call of its size class."""
    _opencl()
    assert cli_main(["tune", "matmul", "--backend", "opencl", "--budget", "1",
                     "--shape", "m=16,n=16,k=16"]) == 2
    assert "takes no such size; its sizes are K, M, N" in capsys.readouterr().err
    assert cli_main(["show", "matmul", "--backend", "opencl", "--shape", "X=5"]) == 2
    assert "--shape X" in capsys.readouterr().err
    assert cli_main(["tune", "softmax", "--backend", "opencl", "--budget", "1",
                     "--shape", "R=0,N=64"]) == 2
    assert "empty problem" in capsys.readouterr().err
    assert cli_main(["tune", "--list"]) == 0
    assert "matmul" not in capsys.readouterr().out  # nothing stored


def test_the_baseline_is_what_an_untuned_call_runs(be: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device with matrix units an fp16 matmul runs the "mma" schedule (MMA 1) by
    default; tune's "default" baseline was the plain schedule (MMA 0), so its "Nx vs default"
    compared against a configuration such a device never runs."""
    import numpy as np

    prob = _prob(MATMUL, "float16", M=64, N=64, K=64)
    plain = autotune._Search(MATMUL, be, prob, np.random.default_rng(0)).defaults[0]
    assert plain == ("default", dict(MATMUL.config(be.schedule_class, None, prob)))
    monkeypatch.setattr(configs, "has_matrix_unit", lambda b: True)
    name, cfg = autotune._Search(MATMUL, be, prob, np.random.default_rng(0)).defaults[0]
    assert name == "default" and cfg["MMA"] == 1
    assert cfg == dict(MATMUL.config(be.schedule_class, None, prob, matrix=True))
