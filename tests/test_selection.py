"""Backend selection: backend= > use() > $PORTAKERN_BACKEND > automatic; strict, thread-local."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import portakern as pk
from portakern import selection

A = np.ones((3, 3), np.float32)


def test_backends_lists_every_registered_backend() -> None:
    info = pk.backends()
    for name in ("numpy", "opencl", "cuda", "jax"):
        assert name in info
        entry = info[name]
        assert isinstance(entry["available"], bool)
        if entry["available"]:
            assert entry["devices"], f"{name} available but lists no device"
        else:
            assert entry["reason"] and entry["fix"], f"{name} unavailable without reason/fix"


def test_explicit_argument_beats_context_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_BACKEND", "numpy")
    with pk.use("numpy"):
        assert selection.resolve("numpy:0").name == "numpy"
    assert selection.resolve().name == "numpy"


def test_context_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    targets = [t for t in _available_targets() if not t.startswith("numpy")]
    if not targets:
        pytest.skip("only numpy is available")
    monkeypatch.setenv("PORTAKERN_BACKEND", "numpy")
    with pk.use(targets[0]) as be:
        assert selection.resolve() is be
    assert selection.resolve().name == "numpy"


def test_env_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_BACKEND", "numpy")
    assert "PORTAKERN_BACKEND" in pk.explain()
    assert selection.resolve().name == "numpy"


@pytest.mark.parametrize("bad", ["", "open cl", "opencl:", ":0", "OpenCL", "opencl:0:1", "x;y"])
def test_malformed_env_raises(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("PORTAKERN_BACKEND", bad)
    if not bad.strip():
        selection.resolve()  # empty means unset
        return
    with pytest.raises(pk.UnknownBackendError) as info:
        pk.matmul(A, A)
    assert "PORTAKERN_BACKEND" in str(info.value) and "expected" in str(info.value)


@pytest.mark.parametrize("bad", ["metal", "cuda2", "opencl:99", "opencl:gpu", "numpy:1", 3])
def test_unknown_backend_or_device(bad: object) -> None:
    with pytest.raises(pk.BackendUnavailable) as info:
        pk.matmul(A, A, backend=bad)  # type: ignore[arg-type]
    assert str(info.value)


def test_unavailable_backend_raises_with_reason_and_fix() -> None:
    info = pk.backends()
    missing = [n for n, v in info.items() if not v["available"]]
    if not missing:
        pytest.skip("every backend is available on this machine")
    for name in missing:
        with pytest.raises(pk.BackendUnavailable) as err:
            pk.matmul(A, A, backend=name)
        assert "cannot run here" in str(err.value) and "Fix:" in str(err.value)


def test_use_does_not_leak_across_threads() -> None:
    seen: dict[str, str] = {}
    start = threading.Event()

    def other() -> None:
        start.wait()
        seen["other"] = selection._current.get() is None and "unset" or "leaked"

    t = threading.Thread(target=other)
    with pk.use("numpy"):
        t.start()
        start.set()
        t.join()
        assert selection.resolve().name == "numpy"
    assert seen["other"] == "unset"


def test_automatic_choice_is_explained() -> None:
    text = pk.explain()
    assert "automatic choice" in text or "PORTAKERN_BACKEND" in text


def test_native_arrays_choose_their_backend() -> None:
    if "opencl" not in {t.split(":")[0] for t in _available_targets()}:
        pytest.skip("opencl unavailable")
    be = selection.get("opencl")
    x = be.to_native(A)
    assert selection.resolve(None, [x]).name == "opencl"


def _available_targets() -> list[str]:
    from conftest import TARGETS

    return TARGETS
