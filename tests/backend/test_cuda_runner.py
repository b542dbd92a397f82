"""CUDA gets the planned runner (the fast path), proven without a GPU.

The runner is generic over a backend's three parts (allocator, compiler, program) plus its
``argument_checker``; nothing in it knows CUDA. Here a CudaBackend is built field by field
with stand-ins where only a device could answer (CuPy arrays, the loaded module), and the
test checks that a repeated call takes the runner, that it enqueues exactly what the
checked path enqueued, and that anything the fast check does not accept goes back to the
checked path. benchmarks/gpu_check.sh measures the same path's overhead on a real GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.backend.base import DeviceInfo, TransferCounter
from portakern.core.lru import LRUCache
from portakern.runtime.plan import PLANS


class FakeCupyArray:
    """What the runner and the checked path read of a CuPy array, in host memory."""

    def __init__(self, data: np.ndarray, device: int = 0) -> None:
        self.data = data
        self.shape, self.dtype, self.strides = data.shape, data.dtype, data.strides
        self.size, self.nbytes, self.ndim = data.size, data.nbytes, data.ndim
        self.flags = data.flags
        self.device = SimpleNamespace(id=device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        iface = dict(self.data.__array_interface__)
        iface["version"] = 3
        return iface


@pytest.fixture
def cuda_stand_in(monkeypatch: pytest.MonkeyPatch) -> Any:
    cuda = importlib.import_module("portakern.backend.cuda")
    if cuda.cp is None:
        pytest.skip("cupy is not importable, so the cuda backend module cannot be built")
    monkeypatch.setattr(cuda, "cp", SimpleNamespace(ndarray=FakeCupyArray))
    launches: list[tuple[str, tuple, tuple, tuple]] = []
    be = object.__new__(cuda.CudaBackend)
    be.selector, be.transfers, be._lock = "0", TransferCounter(), threading.RLock()
    be.launch_lock = be._lock
    be.device = DeviceInfo(0, "stand-in", "gpu", extra={"compute_capability": "8.0"})
    be._cp_device = contextlib.nullcontext()
    be._bf16_native = True
    be._kernels, be._modules = LRUCache(8), LRUCache(8)

    def compile(source: str, entry_points: tuple[str, ...]) -> dict[str, Any]:
        def fn_for(name: str) -> Any:
            def fn(grid: tuple, block: tuple, args: tuple) -> None:
                launches.append((name, grid, block, args))
            return fn
        return {n: cuda._Kernel(fn_for(n), 1024, 32, 0) for n in entry_points}

    be.compile = compile
    be.empty = lambda shape, dtype: FakeCupyArray(np.empty(shape, np.float32))
    yield be, launches
    PLANS.clear()


def _shape(args: tuple) -> list[Any]:
    """A launch's arguments with buffers by identity-free description (their shape)."""
    return [a.shape if isinstance(a, FakeCupyArray) else a for a in args]


def test_a_cuda_plan_builds_the_runner_and_it_launches_what_the_checked_path_did(
        cuda_stand_in: Any) -> None:
    be, launches = cuda_stand_in
    x = FakeCupyArray(np.ones((6, 10), np.float32))
    pk.softmax(x, backend=be)  # first call: the checked path, then the runner is made
    (checked,) = [p for p in PLANS.values() if p.backend is be]
    assert checked.runner is not None, "CUDA must get the planned runner"
    first = list(launches)
    launches.clear()
    out = pk.softmax(x, backend=be)
    assert isinstance(out, FakeCupyArray)
    assert [(n, g, b, _shape(a)) for n, g, b, a in launches] == \
        [(n, g, b, _shape(a)) for n, g, b, a in first]
    assert launches[0][3][0] is x  # the operand itself is the kernel argument


def test_cuda_runner_hands_back_what_its_check_does_not_accept(cuda_stand_in: Any) -> None:
    be, launches = cuda_stand_in
    x = FakeCupyArray(np.ones((6, 10), np.float32))
    pk.softmax(x, backend=be)
    pk.softmax(x, backend=be)
    (plan,) = [p for p in PLANS.values() if p.backend is be]
    runner = plan.runner
    assert runner is not None
    other = FakeCupyArray(np.ones((6, 10), np.float32), device=1)
    from portakern.runtime import plan as planmod

    assert runner((other,), {"axis": -1}, None) is planmod._SLOW  # another device
    out = FakeCupyArray(np.empty((6, 10), np.float32))
    assert runner((x,), {"axis": -1}, out) is planmod._SLOW  # out=: the checked path
    with pytest.raises(pk.BackendUnavailable, match="cuda:1"):
        pk.softmax(other, backend=be)  # and the checked path says why
