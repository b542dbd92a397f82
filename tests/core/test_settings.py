"""portakern.core.settings: every PORTAKERN_* variable declared once, as a typed attribute, and
read in one place."""

from __future__ import annotations

import os
import re
import timeit
from pathlib import Path

import pytest

from portakern.core import settings

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "portakern").rglob("*.py"))

# Modules that still read through the low-level settings.get/raw by variable name, until
# their owner migrates them to the typed attributes. No other module may.
PENDING_LOW_LEVEL = {"backend/base.py", "backend/opencl.py", "backend/cuda.py",
                     "backend/oclgrind.py", "runtime/plan.py", "runtime/execute.py"}


def reads_around_settings(texts: dict[str, str]) -> list[str]:
    """Every read of a PORTAKERN_* variable that bypasses portakern.core.settings in
    ``texts`` (name -> source): through os.environ/os.getenv/os.environb, by its name or
    through a constant bound to it (ENV_TUNING = "PORTAKERN_TUNING"), and any use of
    os.environ's private state."""
    aliases = {m for text in texts.values() for m in
               re.findall(r"^\s*([A-Za-z_]\w*)\s*(?::\s*\w+\s*)?=\s*[\"']PORTAKERN_",
                          text, re.M)}
    names = "|".join([r"b?[\"']PORTAKERN_\w+", *(rf"{a}\b" for a in sorted(aliases))])
    read = re.compile(rf"(?:environb?\.(?:get|pop|setdefault)\(|getenvb?\(|environb?\[)"
                      rf"\s*(?:{names})|(?:{names})[\"']?\s+(?:not\s+)?in\s+(?:os\.)?environ")
    private = re.compile(r"environb?\._data\b|\.encodekey\b|\.decodevalue\b")
    found = []
    for name, text in texts.items():
        found += [f"{name}: {m.group(0)}" for m in read.finditer(text)]
        found += [f"{name}: {m.group(0)} (CPython's private state)"
                  for m in private.finditer(text)]
    return found


def test_the_checker_catches_direct_reads_and_reads_through_constants() -> None:
    assert reads_around_settings({"a.py": 'x = os.environ.get("PORTAKERN_TUNING")'})
    assert reads_around_settings({"a.py": "x = os.getenv('PORTAKERN_TUNING')"})
    assert reads_around_settings({"a.py": 'x = os.environ["PORTAKERN_TUNING"]'})
    assert reads_around_settings({"a.py": 'if "PORTAKERN_TUNING" in os.environ: pass'})
    # the constant is bound in one module and read in another
    assert reads_around_settings({"a.py": 'ENV_T = "PORTAKERN_TUNING"\n',
                                  "b.py": "x = os.environ.get(ENV_T)\n"})
    assert reads_around_settings({"a.py": "d = os.environ._data\n"})
    assert not reads_around_settings({"a.py": 'x = os.environ.get("HOME")\n'
                                              "y = settings.tuning.mode\n"})


def test_every_variable_is_declared_and_read_only_through_settings() -> None:
    texts = {path.relative_to(ROOT / "portakern").as_posix(): path.read_text()
             for path in SOURCES}
    undeclared = {n for text in texts.values() for n in re.findall(r"PORTAKERN_[A-Z0-9_]+", text)
                  } - set(settings.SETTINGS)
    assert not undeclared, f"not declared in portakern/core/settings.py: {sorted(undeclared)}"
    direct = reads_around_settings({n: t for n, t in texts.items() if n != "core/settings.py"})
    assert not direct, f"read around portakern.core.settings: {direct}"
    low = [f"{n}: {m}" for n, t in texts.items() if n not in PENDING_LOW_LEVEL
           for m in re.findall(r"settings\.(?:get|raw)\([^)]*\)", t)]
    assert not low, f"read the typed attribute (settings.<topic>.<knob>) instead: {low}"


def test_every_knob_is_declared_once_with_its_metadata() -> None:
    paths = set()
    for group in settings.GROUPS:
        assert getattr(settings, group.topic) is group
        assert type(group).__doc__
        for knob in group.knobs():
            assert settings.SETTINGS[knob.env] is knob
            assert knob.path == f"{group.topic}.{knob.attr}" and knob.path not in paths
            paths.add(knob.path)
            assert getattr(type(group), knob.attr) is knob  # the class attribute: the knob
            assert knob.doc and knob.env in (knob.__doc__ or "")
            assert knob.kind in ("str", "path", "path|off", "int", "switch", "choice")
    assert len(paths) == len(settings.SETTINGS)


def test_knobs_are_read_only() -> None:
    with pytest.raises(AttributeError, match="PORTAKERN_OPENCL_POOL"):
        settings.opencl.pool = False  # type: ignore[misc]  # the very thing refused here
    with pytest.raises(AttributeError):
        settings.opencl.other = 1  # type: ignore[attr-defined]  # no such knob: refused


@pytest.mark.parametrize("text", ["0", "off", "OFF", " no ", "false", "None"])
def test_off_is_spelled_one_way(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_OPENCL_POOL", text)
    monkeypatch.setenv("PORTAKERN_TUNING", text)
    monkeypatch.setenv("PORTAKERN_CUDA_CACHE", text)
    monkeypatch.setenv("PORTAKERN_OCLGRIND", text)
    assert settings.opencl.pool is False
    assert settings.oclgrind.enabled is False
    assert settings.tuning.mode == "off"
    assert settings.cache.cuda is None
    assert settings.Cache.cuda.text() == text.strip()  # off, told apart from unset


def test_typed_values_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_KERNEL_CACHE_SIZE", "7")
    assert settings.kernels.cache_size == 7
    for bad in ("", "  ", "x", "-3", "0"):
        monkeypatch.setenv("PORTAKERN_KERNEL_CACHE_SIZE", bad)
        assert settings.kernels.cache_size == 128
        monkeypatch.setenv("PORTAKERN_COMPILE_JOBS", bad)
        assert settings.tools.compile_jobs is None
    monkeypatch.setenv("PORTAKERN_COMPILE_JOBS", "3")
    assert settings.tools.compile_jobs == 3
    monkeypatch.setenv("PORTAKERN_TUNING", "Exact")
    assert settings.tuning.mode == "exact"
    monkeypatch.setenv("PORTAKERN_TUNING", "sideways")
    assert settings.tuning.mode == "nearest"
    monkeypatch.delenv("PORTAKERN_TUNING")
    assert settings.tuning.mode == "nearest"
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", "~/somewhere ")
    assert settings.cache.dir == os.path.expanduser("~/somewhere")
    monkeypatch.delenv("PORTAKERN_OPENCL_POOL", raising=False)
    assert settings.opencl.pool is True
    monkeypatch.setenv("PORTAKERN_OPENCL_POOL", "yes")
    assert settings.opencl.pool is True
    monkeypatch.setenv("PORTAKERN_BACKEND", " opencl:1 ")
    assert settings.selection.backend == "opencl:1"


def test_the_low_level_reader_agrees_with_the_attributes(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("PORTAKERN_KERNEL_CACHE_SIZE", "9")
    monkeypatch.setenv("PORTAKERN_HOST_MEMORY_BUDGET", " 2G ")
    for knob in settings.SETTINGS.values():
        assert settings.get(knob.env) == knob.value()
        assert settings.raw(knob.env) == knob.text()
    assert settings.raw("PORTAKERN_HOST_MEMORY_BUDGET") == settings.host.memory_budget == "2G"
    with pytest.raises(KeyError, match="not a declared setting"):
        settings.get("PORTAKERN_NOPE")


def test_describe_lists_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_TUNING", "exact")
    monkeypatch.delenv("PORTAKERN_KERNEL_CACHE_SIZE", raising=False)
    rows = {row.name: row for row in settings.describe()}
    assert set(rows) == set(settings.SETTINGS)
    assert rows["PORTAKERN_TUNING"].shown == "exact (set)"
    assert rows["PORTAKERN_KERNEL_CACHE_SIZE"].shown == "default: 128"
    assert rows["PORTAKERN_KERNEL_CACHE_SIZE"].path == "kernels.cache_size"


def test_the_watcher_follows_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = settings.watcher("PORTAKERN_BACKEND")
    monkeypatch.delenv("PORTAKERN_BACKEND", raising=False)
    assert watch() is None and watch() is None
    monkeypatch.setenv("PORTAKERN_BACKEND", "opencl")
    assert watch() == "opencl" and watch() == "opencl"
    monkeypatch.setenv("PORTAKERN_BACKEND", "numpy")
    assert watch() == "numpy"
    os.environ["PORTAKERN_BACKEND"] = "jax"  # undone by monkeypatch's own record
    assert watch() == "jax"
    del os.environ["PORTAKERN_BACKEND"]
    assert watch() is None
    os.environ.update(PORTAKERN_BACKEND="cuda")
    assert watch() == "cuda" == settings.watcher("PORTAKERN_BACKEND")()
    with pytest.raises(KeyError):
        settings.watcher("PORTAKERN_NOPE")


def test_the_watcher_is_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch path reads it on every call: once read, it does not consult os.environ
    (whose get costs ~0.3-0.7 µs); ~30 ns where this was written."""
    if not settings._hooked():
        pytest.skip("no audit hooks here: the watcher is os.environ.get")
    monkeypatch.delenv("PORTAKERN_BACKEND", raising=False)
    watch = settings.watcher("PORTAKERN_BACKEND")
    assert watch() is None

    class Untouchable(dict):  # type: ignore[type-arg]  # a stand-in, never read
        def get(self, *args: object) -> None:
            raise AssertionError("the watcher read os.environ without a change")

        __getitem__ = get  # type: ignore[assignment]  # same refusal for every read

    with pytest.MonkeyPatch.context() as mp:  # os.environ is back right after
        mp.setattr(os, "environ", Untouchable())
        assert watch() is None
    per_call = min(timeit.repeat(watch, number=20_000, repeat=5)) / 20_000
    assert per_call < 1e-6, f"the watcher costs {per_call * 1e9:.0f} ns a call"


def test_cache_dir_governs_the_cuda_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                          ) -> None:
    from portakern.backend import cuda

    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PORTAKERN_CUDA_CACHE", raising=False)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "theirs"))  # set: left alone
    assert cuda._cache_dir() == str(tmp_path / "cuda")
