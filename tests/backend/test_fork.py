"""fork safety (issue 19): a child made by fork() after the parent touched a device runtime
either works or fails at once with a PortakernError naming fork and the fix; never a hang.

OpenCL drivers do not survive fork (PoCL: the child's first upload waits forever, even on a
context the child makes itself), so after the parent initialised OpenCL a forked child
refuses every OpenCL operation with ``ForkedProcessError``; numpy keeps working there, and so
does jax on the CPU. Each pool below runs under a timeout: a hang fails the test instead of
hanging CI.
"""

from __future__ import annotations

import multiprocessing
import warnings

import numpy as np
import pytest

import portakern as pk
from portakern.backend import registry

X = np.arange(32, dtype=np.float32).reshape(4, 8)
TIMEOUT_S = 60


def _available(name: str) -> bool:
    return registry.availability(name).available


def _child(backend: str | None) -> tuple[str, object]:
    """Runs in the worker: ('ok', the result as a numpy array) or (the error's class name,
    its message). The whole array comes back, so the parent checks the values, not a word."""
    try:
        y = pk.softmax(X, backend=backend)
        return "ok", np.asarray(y.get() if hasattr(y, "get") else y)
    except pk.PortakernError as exc:
        return type(exc).__name__, str(exc)


def _assert_right(got: tuple[str, object]) -> None:
    """An 'ok' from a child holds softmax(X) (float32 agreement with the float64 oracle)."""
    kind, value = got
    assert kind == "ok", got
    want = np.exp(X.astype(np.float64) - X.max(axis=-1, keepdims=True))
    want /= want.sum(axis=-1, keepdims=True)
    assert isinstance(value, np.ndarray) and value.shape == X.shape, got
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-7)


def _pool_map(backends: list[str | None]) -> list[tuple[str, object]]:
    ctx = multiprocessing.get_context("fork")
    with warnings.catch_warnings():  # jax warns that fork and threads do not mix
        warnings.simplefilter("ignore")
        pool = ctx.Pool(2)
    try:
        return pool.map_async(_child, backends).get(timeout=TIMEOUT_S)
    except multiprocessing.TimeoutError:
        pytest.fail(f"a forked child hung for {TIMEOUT_S} s on {backends}")
    finally:
        pool.terminate()
        pool.join()


@pytest.mark.skipif(not hasattr(multiprocessing, "get_context") or
                    "fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method on this platform")
def test_forked_pool_after_opencl_fails_fast_or_works() -> None:
    if not _available("opencl"):
        pytest.skip("opencl is not available here")
    pk.softmax(X, backend="opencl")  # the parent initialises OpenCL (a context, a kernel)
    pk.explain()  # and automatic selection
    got = _pool_map(["opencl", "opencl:0", None, "numpy"])
    _assert_right(got[3])  # numpy works in the child, with the right values
    automatic_is_opencl = pk.explain().startswith("opencl")
    for res in got[:3] if automatic_is_opencl else got[:2]:
        # OpenCL (asked for, or chosen automatically) refuses at once: the guard is
        # deterministic (base.ForkGuard), so an 'ok' here would mean it did not run
        kind, msg = res
        assert kind == "ForkedProcessError", res
        assert isinstance(msg, str) and all(w in msg for w in ("fork", "spawn", "forkserver"))
    if not automatic_is_opencl:
        _assert_right(got[2])


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method on this platform")
def test_forked_child_refuses_parent_arrays_and_new_instances() -> None:
    if not _available("opencl"):
        pytest.skip("opencl is not available here")
    pk.softmax(X, backend="opencl")
    got = _pool_map(["opencl:00"])  # a selector the parent never resolved: a new instance
    assert got[0][0] == "ForkedProcessError" and "spawn" in str(got[0][1]), got


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method on this platform")
def test_forked_pool_after_jax_on_cpu_works() -> None:
    if not _available("jax"):
        pytest.skip("jax is not available here")
    pk.softmax(X, backend="jax:cpu")
    got = _pool_map(["jax:cpu", "numpy"])
    _assert_right(got[0])
    _assert_right(got[1])


def test_spawned_child_after_opencl_works() -> None:
    if not _available("opencl"):
        pytest.skip("opencl is not available here")
    pk.softmax(X, backend="opencl")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.map_async(_child, ["opencl"]).get(timeout=TIMEOUT_S * 2)
    _assert_right(got[0])
