"""Device arrays in -> device arrays out with zero host copies; numpy in -> one copy each way."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.runtime import selection

rng = np.random.default_rng(0)
A = rng.standard_normal((2, 17, 9)).astype(np.float32)
B = rng.standard_normal((9, 5)).astype(np.float32)
Q = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)


def _calls():  # noqa: ANN202
    return [("matmul", (A, B), {}), ("softmax", (A,), {"axis": 1}),
            ("attention", (Q, Q, Q), {"causal": True})]


def test_native_in_native_out_without_host_copies(device_target: str) -> None:
    be = selection.get(device_target)
    for op, arrays, params in _calls():
        native = [be.to_native(x) for x in arrays]
        be.transfers.reset()
        out = pk.call(op, *native, backend=be, **params)
        assert be.is_native(out), f"{op}: native in must give native out, got {type(out)}"
        assert be.transfers.snapshot()["h2d"] == 0 and be.transfers.snapshot()["d2h"] == 0, \
            f"{op} made host copies: {be.transfers.snapshot()}"
        ref = pk.call(op, *arrays, backend="numpy", **params)
        np.testing.assert_allclose(be.to_numpy(out), ref, rtol=1e-4, atol=1e-5)


def test_numpy_in_numpy_out_counts_one_copy_each_way(device_target: str) -> None:
    be = selection.get(device_target)
    be.transfers.reset()
    out = pk.matmul(A, B, backend=be)
    assert isinstance(out, np.ndarray)
    snap = be.transfers.snapshot()
    assert snap["h2d"] == 2 and snap["d2h"] == 1, snap
    assert snap["h2d_bytes"] == A.nbytes + B.nbytes and snap["d2h_bytes"] == out.nbytes


def test_non_contiguous_numpy_views_are_handled(target: str) -> None:
    big = rng.standard_normal((20, 30)).astype(np.float32)
    views = [big[::2, ::3], big.T, big[::-1], big[:, 5:17]]
    for v in views:
        np.testing.assert_allclose(pk.matmul(v, v.T, backend=target), v.astype(np.float64) @
                                   v.T.astype(np.float64), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(pk.softmax(v, axis=0, backend=target),
                                   pk.softmax(np.ascontiguousarray(v), axis=0, backend="numpy"),
                                   rtol=1e-5, atol=1e-7)


def test_out_argument_writes_in_place(kernel_target: str) -> None:
    be = selection.get(kernel_target)
    out = be.to_native(np.zeros((2, 17, 5), np.float32))
    be.transfers.reset()
    got = pk.call("matmul", be.to_native(A), be.to_native(B), backend=be, out=out)
    assert got is out
    np.testing.assert_allclose(be.to_numpy(out), A.astype(np.float64) @ B, rtol=1e-4, atol=1e-5)
    with pytest.raises(pk.ShapeError):
        pk.call("matmul", A, B, backend=be, out=be.to_native(np.zeros((3, 3), np.float32)))
    with pytest.raises(pk.DTypeError):
        pk.call("matmul", A, B, backend=be, out=be.to_native(np.zeros((2, 17, 5), np.float64)))
    with pytest.raises(pk.InvalidArgumentError):
        pk.call("matmul", A, B, backend=be, out=np.zeros((2, 17, 5), np.float32))


def test_out_is_refused_where_arrays_are_immutable(target: str) -> None:
    be = selection.get(target)
    if be.supports_out:
        pytest.skip(f"{target} supports out=")
    with pytest.raises(pk.InvalidArgumentError, match="out="):
        pk.call("matmul", A, B, backend=be, out=np.zeros((2, 17, 5), np.float32))
