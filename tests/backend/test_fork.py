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


def _child(backend: str | None) -> str:
    """Runs in the forked worker: 'ok <sum>' or the error's class and message."""
    try:
        y = pk.softmax(X, backend=backend)
        return f"ok {float(np.asarray(y).sum()):.3f}"
    except pk.PortakernError as exc:
        return f"{type(exc).__name__}: {exc}"


def _pool_map(backends: list[str | None]) -> list[str]:
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
    want_numpy = f"ok {float(pk.softmax(X, backend='numpy').sum()):.3f}"
    assert got[3] == want_numpy  # numpy works in the child
    for res in got[:3]:  # OpenCL (asked for, or chosen automatically) refuses at once
        if res.startswith("ok"):
            continue
        assert res.startswith("ForkedProcessError"), res
        assert "fork" in res and "spawn" in res and "forkserver" in res, res


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method on this platform")
def test_forked_child_refuses_parent_arrays_and_new_instances() -> None:
    if not _available("opencl"):
        pytest.skip("opencl is not available here")
    pk.softmax(X, backend="opencl")
    got = _pool_map(["opencl:00"])  # a selector the parent never resolved: a new instance
    assert got[0].startswith("ForkedProcessError") and "spawn" in got[0], got


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method on this platform")
def test_forked_pool_after_jax_on_cpu_works() -> None:
    if not _available("jax"):
        pytest.skip("jax is not available here")
    pk.softmax(X, backend="jax:cpu")
    got = _pool_map(["jax:cpu", "numpy"])
    assert got[0] == got[1] and got[0].startswith("ok"), got


def test_spawned_child_after_opencl_works() -> None:
    if not _available("opencl"):
        pytest.skip("opencl is not available here")
    pk.softmax(X, backend="opencl")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.map_async(_child, ["opencl"]).get(timeout=TIMEOUT_S * 2)
    assert got[0].startswith("ok"), got
