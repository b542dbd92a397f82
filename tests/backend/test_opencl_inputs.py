"""pyopencl arrays as inputs: what the kernels could misread is refused or ordered first.

Why: a pyopencl Array of non-native byte order (``>f4``) passed validation by its dtype's
name and the kernels read its bytes in native order (softmax max error 0.98; as ``out=`` the
result read back as ~2e38); an array written through another queue of the same context was
read before the write landed (the kernels ignored its ``events``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.runtime import selection


def _opencl() -> Any:
    try:
        return selection.get("opencl")
    except Exception as exc:  # noqa: BLE001 - any reason opencl cannot open here
        pytest.skip(f"opencl unavailable: {exc}")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_a_non_native_byte_order_array_is_refused_planned_or_not() -> None:
    import pyopencl.array as cla

    be = _opencl()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    swapped = cla.to_device(be.queue, x.astype(">f4"))
    with pytest.raises(pk.InvalidArgumentError, match="non-native byte order"):
        pk.softmax(swapped, backend=be)
    native = pk.to_backend(x, be)
    np.testing.assert_allclose(pk.softmax(native, backend=be).get(), _softmax(x), rtol=1e-5)
    with pytest.raises(pk.InvalidArgumentError, match="non-native byte order"):
        pk.softmax(swapped, backend=be)  # the planned call's fast checks send it back
    with pytest.raises(pk.InvalidArgumentError, match="non-native byte order"):
        pk.softmax(native, backend=be, out=cla.empty(be.queue, x.shape, np.dtype(">f4")))


def test_an_array_written_through_another_queue_is_waited_for() -> None:
    import pyopencl as cl
    import pyopencl.array as cla

    be = _opencl()
    other = cl.CommandQueue(be.ctx)
    x = np.random.default_rng(1).standard_normal((256, 2048)).astype(np.float32)
    for planned in (False, True):  # the checked path, then the planned call's fast path
        a = cla.zeros(other, x.shape, np.float32)
        other.finish()
        # the write waits on a user event, set only after portakern has enqueued its kernels:
        # kernels that did not wait for the array's events would read its zeros
        gate = cl.UserEvent(be.ctx)
        a.add_event(cl.enqueue_copy(other, a.data, x, is_blocking=False, wait_for=[gate]))
        r = pk.softmax(a, backend=be)
        gate.set_status(cl.command_execution_status.COMPLETE)
        np.testing.assert_allclose(r.get(), _softmax(x), rtol=1e-5, atol=1e-7,
                                   err_msg=f"planned={planned}")
