"""OpenCL's output arrays on the per-call path (backend/opencl.py ``output_maker``): made by
pyopencl's constructor with a kept layout, its arguments by position only when the installed
pyopencl's signature is the one expected, and in either case the same array that
``pyopencl.array.empty`` gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from portakern.runtime import selection


def _opencl() -> Any:
    try:
        return selection.get("opencl")
    except Exception as exc:  # noqa: BLE001 - any reason opencl cannot open here
        pytest.skip(f"opencl unavailable: {exc}")


def _same_array(a: Any, b: Any) -> None:
    for attr in ("shape", "dtype", "strides", "size", "nbytes", "offset", "context",
                 "allocator"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.queue is b.queue
    assert a.events == [] and a.events is not b.events  # an event list of its own
    assert a.base_data.int_ptr != b.base_data.int_ptr  # a buffer of its own
    assert a.base_data.size >= a.nbytes


@pytest.mark.parametrize("positional", [True, False])
def test_output_maker_gives_what_pyopencl_empty_gives(monkeypatch: pytest.MonkeyPatch,
                                                      positional: bool) -> None:
    import pyopencl.array as cla

    from portakern.backend import opencl as ocl

    be = _opencl()
    assert ocl._array_takes_fast_args_by_position(), (
        "the installed pyopencl's Array signature changed: check _ARRAY_FAST_ARGS")
    ocl._array_takes_fast_args_by_position.cache_clear()
    monkeypatch.setattr(ocl, "_array_takes_fast_args_by_position", lambda: positional)
    ref = cla.empty(be.queue, (3, 5, 7), np.float32, allocator=be._new_buffer)
    make = be.output_maker((3, 5, 7), "float32")
    made = [make() for _ in range(3)]
    for arr, handle in made:
        _same_array(arr, ref)
        assert handle is arr.base_data
    arr = made[0][0]
    arr.set(np.arange(105, dtype=np.float32).reshape(3, 5, 7), queue=be.queue)
    np.testing.assert_array_equal((arr * 2).get(), 2 * np.arange(105).reshape(3, 5, 7))


def test_a_reordered_constructor_gets_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pyopencl whose Array takes its parameters in another order is never called by
    position: a misplaced argument would make a wrong array, not an error."""
    import pyopencl.array as cla

    from portakern.backend import opencl as ocl

    def reordered(self: Any, cq: Any, shape: Any, dtype: Any, allocator: Any = None,
                  order: str = "C", **kwargs: Any) -> None:
        raise AssertionError("not called")

    monkeypatch.setattr(cla.Array, "__init__", reordered)
    ocl._array_takes_fast_args_by_position.cache_clear()
    try:
        assert not ocl._array_takes_fast_args_by_position()
    finally:
        monkeypatch.undo()
        ocl._array_takes_fast_args_by_position.cache_clear()
    assert ocl._array_takes_fast_args_by_position()
