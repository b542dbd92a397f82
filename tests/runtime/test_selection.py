"""Backend selection: backend= > use() > $PORTAKERN_BACKEND > automatic; strict, thread-local."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import portakern as pk
from portakern.runtime import selection

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
        seen["other"] = selection.current_choice() is None and "unset" or "leaked"

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


# --- issue 15: entry points read once; issue 19: one context per device ---------------------
def test_automatic_selection_reads_entry_points_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """importlib.metadata.entry_points() scans every installed distribution (~1 ms); it used
    to run on every call under automatic selection. Now once, and again on request."""
    from portakern.backend import registry

    calls = []
    real = registry.metadata.entry_points

    def counting(*args: object, **kwargs: object) -> object:
        if kwargs.get("group") == registry.ENTRY_POINT_GROUP:
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry.metadata, "entry_points", counting)
    pk.refresh_backends()
    for _ in range(50):
        pk.softmax(A)
        pk.explain()
    assert len(calls) == 1, f"entry points read {len(calls)} times in 50 calls"
    pk.refresh_backends()  # a plugin was installed: read them again, once
    pk.softmax(A)
    pk.softmax(A)
    assert len(calls) == 2


def test_selectors_of_one_device_share_one_instance() -> None:
    """'opencl', 'opencl:0', 'opencl:00' and automatic selection of that device: one backend
    instance, one context (they used to open a context each)."""
    assert selection.get("numpy") is selection.get("numpy:0") is selection.get("numpy:cpu")
    if not pk.backends()["opencl"]["available"]:
        pytest.skip("opencl is not available here")
    be = selection.get("opencl:0")
    assert selection.get("opencl:00") is be and selection.get("opencl") is be
    x = pk.to_backend(np.ones((3, 4), np.float32), "opencl:0")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PORTAKERN_BACKEND", raising=False)
        y = pk.softmax(x)  # automatic selection follows the array to its context
    np.testing.assert_allclose(y.get(), np.full((3, 4), 0.25, np.float32))
    with pytest.raises(pk.UnknownBackendError):
        selection.get("opencl:0_0")


def test_array_from_another_context_names_both_and_the_fix() -> None:
    if not pk.backends()["opencl"]["available"]:
        pytest.skip("opencl is not available here")
    import pyopencl as cl
    import pyopencl.array as cla

    be = selection.get("opencl:0")
    ctx = cl.Context([be.cl_device])  # type: ignore[attr-defined]
    x = cla.to_device(cl.CommandQueue(ctx), np.ones((3, 4), np.float32))
    with pytest.raises(pk.PortakernError) as info:
        pk.softmax(x, backend=be)
    msg = str(info.value)
    assert isinstance(info.value, pk.BackendUnavailable)
    assert "context" in msg and "outside portakern" in msg and "opencl:0" in msg
    assert "to_backend(x.get(), 'opencl:0')" in msg


def test_unregistering_a_plugin_backend_forgets_it() -> None:
    """``unregister_backend`` undoes ``register_backend``: the instances made of it are
    dropped, and its name is refused again (automatic selection never picked it)."""
    from portakern.backend import registry
    from portakern.backend.numpy import NumpyBackend

    class Plugged(NumpyBackend):
        pass

    registry.register_backend("plugged", Plugged)
    try:
        be = selection.get("plugged")
        assert isinstance(be, Plugged) and selection.get("plugged:0") is be
        x = np.ones((2, 4), np.float32)
        np.testing.assert_allclose(pk.softmax(x, backend="plugged"), np.full((2, 4), 0.25))
        assert "plugged" in pk.backends()
    finally:
        assert registry.unregister_backend("plugged")
    assert not registry.unregister_backend("plugged")  # once only
    assert not registry.unregister_backend("numpy")  # in-tree: not registered by the call
    assert "plugged" not in pk.backends()
    for text in ("plugged", "plugged:0"):
        with pytest.raises(pk.UnknownBackendError):
            selection.get(text)
        with pytest.raises(pk.UnknownBackendError):
            pk.softmax(np.ones((2, 4), np.float32), backend=text)
