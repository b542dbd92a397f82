"""Fuzzing the public API (issue 19): junk arguments, odd layouts, native arrays and ``out=``.

Every call either returns a result that agrees with the float64 oracle under the op's
tolerance (``cases.compare``), or raises a ``PortakernError``. Anything else fails: a raw
exception (TypeError, ValueError, RuntimeError, a driver's error), a hang (each example runs
under an alarm of ``EXAMPLE_TIMEOUT_S``), or a wrong result. The budget is fixed
(``MAX_EXAMPLES`` per target, derandomized) so CI time is bounded: about 20 s per target on
the 2-core machine.

The strategies draw, per operand: a numpy array (float32/16/64, bfloat16, and dtypes that
must be refused: int32, complex64, bool, object, strings), in a layout (contiguous,
transposed, negative stride, zero-stride broadcast, big-endian, Fortran order, 0-d), or the
target's native array, or junk (None, a list, a string, a number, a dict); per parameter:
valid values and junk (axis out of range or a bool, NaN/inf/negative scale, non-bool causal,
a mask of the wrong dtype); optionally ``config=`` junk, an unknown keyword, and ``out=``
(a native array of the right or wrong shape or dtype, or an input itself).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.tools.cases import compare

from conftest import TARGETS

MAX_EXAMPLES = 120
EXAMPLE_TIMEOUT_S = 120  # a first compile under load takes tens of seconds; a hang never ends
FUZZ_TARGETS = [t for t in TARGETS if t != "jax:pallas"]  # Pallas interprets: ~1 s per shape

OPS = {
    "matmul": (("a", "b"), {}),
    "softmax": (("x",), {"axis": -1}),
    "attention": (("q", "k", "v"), {"causal": False, "scale": None, "mask": None}),
    "rmsnorm": (("x", "weight"), {"eps": 1e-6}),
}
GOOD_DTYPES = ["float32", "float16", "bfloat16", "float64"]
BAD_DTYPES = [np.int32, np.complex64, np.bool_, object, "U2"]
JUNK = [None, [1.0, 2.0], "abc", 3, 1.5, {"a": 1}, b"xy"]


@contextmanager
def alarm(seconds: int) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"a fuzzed call ran over {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _shape_for(op: str, name: str, dims: dict[str, int]) -> tuple[int, ...]:
    d = dims
    return {
        ("matmul", "a"): (d["M"], d["K"]), ("matmul", "b"): (d["K"], d["N"]),
        ("softmax", "x"): (d["M"], d["N"]),
        ("attention", "q"): (1, 2, d["M"], d["D"]), ("attention", "k"): (1, 1, d["N"], d["D"]),
        ("attention", "v"): (1, 1, d["N"], d["D"]),
        ("rmsnorm", "x"): (d["M"], d["N"]), ("rmsnorm", "weight"): (d["N"],),
    }[(op, name)]


@st.composite
def host_array(draw: Any, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An array of ``shape``/``dtype`` in a drawn layout (the values are modest reals)."""
    storage = dtypes.info(dtype).storage
    layout = draw(st.sampled_from(["plain", "transposed", "negative", "broadcast", "big",
                                   "fortran", "sliced"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    full = (rng.standard_normal(shape) * 2).astype(storage)
    if layout == "transposed" and len(shape) >= 2:
        return np.ascontiguousarray(np.swapaxes(full, -1, -2)).swapaxes(-1, -2)
    if layout == "negative" and len(shape) >= 1 and shape[-1] > 0:
        return np.ascontiguousarray(full[..., ::-1])[..., ::-1]
    if layout == "broadcast" and len(shape) >= 1 and all(shape):
        row = full[..., :1]
        return np.broadcast_to(row, shape)
    if layout == "big" and np.dtype(storage).kind == "f" and storage.itemsize > 1:
        return full.astype(np.dtype(storage).newbyteorder(">"))
    if layout == "fortran":
        return np.asfortranarray(full)
    if layout == "sliced" and len(shape) >= 1:
        wide = np.repeat(full, 2, axis=-1) if shape[-1] else full
        return wide[..., ::2] if shape[-1] else full
    return full


@st.composite
def calls(draw: Any, target: str) -> dict[str, Any]:
    op = draw(st.sampled_from(sorted(OPS)))
    names, defaults = OPS[op]
    dims = {k: draw(st.sampled_from([0, 1, 2, 3, 5, 8])) for k in ("M", "N", "K")}
    dims["D"] = draw(st.sampled_from([1, 4, 8, 16]))
    dtype = draw(st.sampled_from(GOOD_DTYPES))
    operands: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for name in names:
        kind = draw(st.sampled_from(["host"] * 5 + ["native"] * 2 + ["baddtype", "junk",
                                                                      "badshape"]))
        kinds[name] = kind
        shape = _shape_for(op, name, dims)
        if kind in ("host", "native"):
            operands[name] = draw(host_array(shape, dtype))
        elif kind == "baddtype":
            dt = draw(st.sampled_from(BAD_DTYPES))
            operands[name] = np.zeros(shape, dt)
        elif kind == "badshape":
            operands[name] = np.zeros(shape + (2,), dtypes.info(dtype).storage)
        else:
            operands[name] = draw(st.sampled_from(JUNK))
    params: dict[str, Any] = {}
    for p in defaults:
        if draw(st.booleans()):
            continue
        if p == "axis":
            params[p] = draw(st.sampled_from([0, 1, -1, -2, 2, -3, True, 1.0, "0", None]))
        elif p == "scale":
            params[p] = draw(st.sampled_from([None, 0.5, 2.0, 0.0, -1.0, math.nan, math.inf,
                                              "1", True]))
        elif p == "causal":
            params[p] = draw(st.sampled_from([True, False, 1, "yes", None]))
        elif p == "mask":
            keep = np.random.default_rng(1).random((dims["M"], dims["N"])) > 0.3
            params[p] = draw(st.sampled_from([keep, keep.astype(np.float32), "mask", None]))
        elif p == "eps":
            params[p] = draw(st.sampled_from([1e-6, 1e-3, 0.0, -1.0, math.nan, "1e-6", True]))
    extra: dict[str, Any] = {}
    if draw(st.integers(0, 9)) == 0:
        extra["config"] = draw(st.sampled_from([3, "TM=4", [("TM", 4)], {"NOPE": 1},
                                                {"TM": -1}]))
    if draw(st.integers(0, 9)) == 0:
        extra["bogus"] = 1
    out_kind = draw(st.sampled_from(["none"] * 6 + ["right", "wrongshape", "wrongdtype",
                                                     "input", "junk"]))
    return {"op": op, "operands": operands, "kinds": kinds, "params": params, "extra": extra,
            "out": out_kind, "dtype": dtype}


def _native(be: Any, x: Any) -> Any:
    try:
        return pk.to_backend(x, be)
    except pk.PortakernError:
        return x  # e.g. a dtype the device cannot hold: the call sees the host array


def _run(target: str, c: dict[str, Any]) -> None:
    be = selection.get(target)
    args = []
    for name, x in c["operands"].items():
        args.append(_native(be, x) if c["kinds"][name] == "native" else x)
    kw = dict(c["params"], **c["extra"])
    out_kind = c["out"]
    if out_kind != "none":
        if out_kind == "junk":
            kw["out"] = np.zeros(3, np.float32)
        elif out_kind == "input":
            kw["out"] = args[0]
        else:
            try:  # the shape the oracle gives, if the call is valid at all
                shape = np.shape(pk.call(c["op"], *c["operands"].values(), backend="numpy",
                                         **c["params"]))
            except pk.PortakernError:
                shape = (2, 2)
            dt = dtypes.info(c["dtype"]).storage
            if out_kind == "wrongshape":
                shape = tuple(shape) + (1,)
            if out_kind == "wrongdtype":
                dt = np.float32 if c["dtype"] != "float32" else np.float16
            kw["out"] = _native(be, np.zeros(shape, dt))
    with alarm(EXAMPLE_TIMEOUT_S):
        try:
            got = pk.call(c["op"], *args, backend=be, **kw)
        except pk.PortakernError:
            return
        # a result: it must be what the oracle computes, under the op's tolerance
        spec = get_op(c["op"])
        host = {n: np.asarray(x) for n, x in c["operands"].items()}
        params = {k: v for k, v in c["params"].items()}
        verdict = compare(spec, Case(host, params), np.asarray(
            got if isinstance(got, np.ndarray) else be.to_numpy(got)))
    assert verdict.ok, f"{c['op']} on {target} computed a wrong result: {verdict.where}"


@pytest.mark.per_target
@pytest.mark.parametrize("fuzz_target", FUZZ_TARGETS)
def test_public_api_fuzz(fuzz_target: str) -> None:
    target = fuzz_target

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(c=calls(target))
    def check(c: dict[str, Any]) -> None:
        _run(target, c)

    check()
