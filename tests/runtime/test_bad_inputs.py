"""Bad input on every backend: refused with the documented error, and never launched.

tests/core/test_errors.py holds the first table (BAD_CALLS: ranks, dims, dtypes, scales, masks,
tunables). This file adds what that table does not reach, and checks for BOTH tables that a
refused call neither launches a kernel, compiles one, allocates an output nor moves a byte
(``no_device_work`` patches each backend's launch points to fail the test if called):

* objects that are not arrays, including ones with ``.shape``/``.dtype`` but no data and ones
  whose data does not match what they claim (a kernel sized from the claim would read past
  the uploaded buffer);
* shapes whose element count (operand or output) overflows 32-bit kernel indexing, built
  WITHOUT allocating: ``as_strided`` views of a one-element array, or shape/dtype stand-ins;
* argument, axis, flag, scale, mask-dtype and ``out=`` mistakes;
* backend selectors: malformed ``$PORTAKERN_BACKEND``, non-string and unknown backends and
  devices;
* layouts: non-contiguous, negative-stride, broadcast, Fortran-order, big-endian and read-only
  numpy views must give the right answer on every backend (checked against the float64 oracle
  under the op's tolerance), and device views that a kernel cannot index (pyopencl) must be
  refused by name.

docs/guarantees.md lists every case id of both tables; ``test_docs_list_every_case`` keeps
that list honest.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_errors import BAD_CALLS

import portakern as pk
from portakern.backend import registry
from portakern.backend.base import ArrayBackend, Backend, KernelBackend
from portakern.core import dtypes
from portakern.core.sampling import Case
from portakern.core.spec import MAX_INDEX
from portakern.ops import get_op
from portakern.runtime import plan as pkplan
from portakern.runtime import selection
from portakern.tools.cases import compare

f32 = np.float32
A = np.arange(20, dtype=f32).reshape(4, 5) / 7
B = np.arange(15, dtype=f32).reshape(5, 3) / 5
X = np.linspace(-3, 3, 20, dtype=f32).reshape(4, 5)
Q = np.ones((1, 2, 3, 8), f32)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "guarantees.md"


# --- the guard: nothing reaches a device ------------------------------------------------------
@contextlib.contextmanager
def no_device_work(*backends: Backend) -> Iterator[None]:
    """Fail the test if any of ``backends`` launches, compiles, allocates or uploads.

    Launch points by kind of backend (found by capability, not by name): a KernelBackend
    launches through ``execute.enqueue_steps``, which holds its ``launch_lock`` (checked path
    and planned runner alike), and compiles through ``compile``; a backend with a
    ``compiled`` hook (jax) launches by calling what that returns; any other backend (numpy,
    plugins) evaluates ``spec.semantics`` inside ``execute``. Uploads are ``to_native``,
    output allocation ``empty``/``zeros``. Validation done inside those steps (a tunable's
    domain checked in ``compiled`` or ``execute``) still runs; only the work is refused.
    """
    mp = pytest.MonkeyPatch()

    def forbid(be: Backend, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            pytest.fail(f"a refused call reached {what} on {be.describe()}")
        return refuse

    try:
        for be in backends:
            mp.setattr(be, "to_native", forbid(be, "an upload (to_native)"))
            mp.setattr(be, "zeros", forbid(be, "an output allocation (zeros)"))
            if isinstance(be, KernelBackend):
                mp.setattr(be, "launch_lock", _Forbidden(forbid(be, "a kernel launch")))
                mp.setattr(be, "compile", forbid(be, "the kernel compiler"))
                mp.setattr(be, "empty", forbid(be, "an output allocation (empty)"))
            elif callable(getattr(be, "compiled", None)):
                mp.setattr(be, "compiled", _validate_then(be.compiled, forbid(be, "a launch")))
            else:
                mp.setattr(be, "execute", _execute_without_semantics(be.execute, be))
            be.transfers.reset()
        yield
        for be in backends:
            snap = be.transfers.snapshot()
            assert snap["h2d"] == snap["d2h"] == 0, f"{be.describe()} moved data: {snap}"
    finally:
        mp.undo()


class _Forbidden:
    """A lock whose acquisition fails the test: every launch takes the backend's lock."""

    def __init__(self, refuse: Callable[..., Any]) -> None:
        self.refuse = refuse

    def __enter__(self) -> None:
        self.refuse()

    def __exit__(self, *exc: Any) -> None:
        return None


def _validate_then(compiled: Callable[..., Any], refuse: Callable[..., Any]
                   ) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        compiled(*args, **kwargs)  # builds (lazily) and validates the config; runs nothing
        return refuse
    return hook


def _execute_without_semantics(execute: Callable[..., Any], be: Backend) -> Callable[..., Any]:
    def hook(spec: Any, prob: Any, ins: Any, config: Any, *rest: Any) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            pytest.fail(f"a refused call reached {spec.name}'s semantics on {be.describe()}")
        return execute(spec.replace(semantics=refuse), prob, ins, config, *rest)
    return hook


def check_refused(exc: BaseException, err: type[BaseException], needles: tuple[str, ...]
                  ) -> None:
    """The documented type, a portakern error that is also the builtin, and a message that
    names what was wrong."""
    assert isinstance(exc, err), f"expected {err.__name__}, got {type(exc).__name__}: {exc}"
    assert isinstance(exc, pk.PortakernError)
    assert isinstance(exc, (ValueError, TypeError, RuntimeError, MemoryError))
    msg = str(exc)
    for needle in needles:
        assert needle in msg, f"message lacks {needle!r}: {msg}"


# --- inputs that need no device -----------------------------------------------------------
def huge(shape: tuple[int, ...], dtype: Any = f32) -> np.ndarray:
    """A read-only view of ONE element with ``shape``: looks enormous, allocates nothing."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape),
                                           writeable=False)


def meta(shape: tuple[int, ...], dtype: Any = f32) -> types.SimpleNamespace:
    """Only .shape and .dtype: validation can read it; there is no data to compute on."""
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


class Lying:
    """Claims (4, 5) float32 but converts to a (2, 2) array: a kernel sized from the claim
    would read 20 elements of a 4-element buffer."""

    shape = (4, 5)
    dtype = np.dtype(f32)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.ones((2, 2), f32)


class ShapeOnly:
    shape = (1, 2, 7, 8)


def _gen() -> Iterator[float]:
    yield 1.0


def _structured() -> np.ndarray:
    return np.zeros((1, 2, 3, 8), [("re", f32), ("im", f32)])


@dataclass(frozen=True)
class Bad:
    """One bad call: ``call(be, **make(be))`` runs under the guard (``make`` builds native
    inputs first, unguarded); ``kernel_only``: only C-kernel backends have it."""

    call: Callable[..., object]
    error: type[Exception]
    needles: tuple[str, ...]
    kernel_only: bool = False
    make: Callable[[Backend], dict[str, Any]] | None = None  # native inputs, made unguarded


def _out_native(shape: tuple[int, ...], dtype: Any) -> Callable[[Backend], dict[str, Any]]:
    return lambda be: {"out": be.to_native(np.zeros(shape, dtype))}


BAD: dict[str, Bad] = {
    # not arrays
    "matmul b dict": Bad(lambda be: pk.matmul(A, {"k": 1}, backend=be),
                         pk.NotAnArrayError, ("'b'", "dict", "np.asarray")),
    "softmax x set": Bad(lambda be: pk.softmax({1.0, 2.0}, backend=be),
                         pk.NotAnArrayError, ("'x'", "set")),
    "softmax x bytes": Bad(lambda be: pk.softmax(b"\x00\x00\x80?", backend=be),
                           pk.NotAnArrayError, ("'x'", "bytes")),
    "softmax x generator": Bad(lambda be: pk.softmax(_gen(), backend=be),
                               pk.NotAnArrayError, ("'x'", "generator")),
    "matmul a memoryview": Bad(lambda be: pk.matmul(memoryview(A), B, backend=be),
                               pk.NotAnArrayError, ("'a'", "memoryview")),
    "attention v python float": Bad(lambda be: pk.attention(Q, Q, 1.5, backend=be),
                                    pk.NotAnArrayError, ("'v'", "float")),
    "attention k shape without dtype": Bad(lambda be: pk.attention(Q, ShapeOnly(), Q, backend=be),
                                           pk.NotAnArrayError, ("'k'", "ShapeOnly")),
    "softmax x stand-in without data": Bad(
        lambda be: pk.softmax(meta((4, 5)), backend=be),
        pk.NotAnArrayError, ("'x'", "does not hold the data", "shape ()", "(4, 5)")),
    "attention mask stand-in without data": Bad(
        lambda be: pk.attention(Q, Q, Q, mask=meta((3, 3), bool), backend=be),
        pk.NotAnArrayError, ("'mask'", "does not hold the data")),
    "matmul a data differs from its shape": Bad(
        lambda be: pk.matmul(Lying(), B, backend=be),
        pk.NotAnArrayError, ("'a'", "(2, 2)", "(4, 5)", "matches its .shape")),
    "softmax x masked array": Bad(
        lambda be: pk.softmax(np.ma.masked_array(X, X > 2), backend=be),
        pk.NotAnArrayError, ("'x'", "masked array", "filled")),
    # 32-bit index overflow, detected from the shape alone
    "matmul output over 2^31-1": Bad(
        lambda be: pk.matmul(huge((70000, 2)), huge((2, 40000)), backend=be),
        pk.ShapeError, ("output", "(70000, 40000)", "2800000000", "32-bit")),
    "matmul broadcast batch output over 2^31-1": Bad(
        lambda be: pk.matmul(meta((70000, 1, 2, 2)), meta((1, 40000, 2, 2)), backend=be),
        pk.ShapeError, ("output", "(70000, 40000, 2, 2)", "11200000000")),
    "softmax x of 2^31 elements": Bad(
        lambda be: pk.softmax(huge((2**31,)), backend=be),
        pk.ShapeError, ("'x'", "2147483648", str(MAX_INDEX), "split")),
    "softmax fp16 x of 2^32 elements": Bad(
        lambda be: pk.softmax(huge((65536, 65536), np.float16), backend=be),
        pk.ShapeError, ("'x'", "4294967296")),
    "attention q over 2^31-1": Bad(
        lambda be: pk.attention(meta((1, 1, 65536, 65536)), meta((1, 1, 2, 65536)),
                                meta((1, 1, 2, 8)), backend=be),
        pk.ShapeError, ("'q'", "32-bit")),
    "attention output over 2^31-1 from small inputs": Bad(
        lambda be: pk.attention(huge((1, 256, 256, 1)), huge((1, 1, 1, 1)),
                                huge((1, 1, 1, 65536)), backend=be),
        pk.ShapeError, ("output", "(1, 256, 256, 65536)", "4294967296")),
    "attention broadcast mask over 2^31-1": Bad(
        lambda be: pk.attention(huge((1, 1, 65536, 1)), huge((1, 1, 65536, 1)),
                                huge((1, 1, 65536, 1)), mask=huge((65536, 65536), bool),
                                backend=be),
        pk.ShapeError, ("'mask'", "(65536, 65536)", "32-bit")),
    # arguments
    "softmax two arrays": Bad(lambda be: pk.call("softmax", X, X, backend=be),
                              pk.InvalidArgumentError, ("takes 1 array", "got 2")),
    "matmul operand given twice": Bad(lambda be: pk.call("matmul", A, B, a=A, backend=be),
                                      pk.InvalidArgumentError, ("'a' given twice",)),
    "matmul operand missing": Bad(lambda be: pk.call("matmul", A, backend=be),
                                  pk.InvalidArgumentError, ("missing", "'b'")),
    "softmax axis None": Bad(lambda be: pk.softmax(X, axis=None, backend=be),  # type: ignore[arg-type]
                             pk.InvalidArgumentError, ("axis", "None")),
    "softmax axis -3 on rank 2": Bad(lambda be: pk.softmax(X, axis=-3, backend=be),
                                     pk.InvalidArgumentError, ("axis -3", "rank 2")),
    "softmax axis 2**40": Bad(lambda be: pk.softmax(X, axis=2**40, backend=be),
                              pk.InvalidArgumentError, ("axis 1099511627776",)),
    "attention causal None": Bad(lambda be: pk.attention(Q, Q, Q, causal=None, backend=be),  # type: ignore[arg-type]
                                 pk.InvalidArgumentError, ("causal", "None")),
    "attention complex scale": Bad(lambda be: pk.attention(Q, Q, Q, scale=1j, backend=be),  # type: ignore[arg-type]
                                   pk.InvalidArgumentError, ("scale", "complex")),
    "attention bool scale": Bad(lambda be: pk.attention(Q, Q, Q, scale=True, backend=be),
                                pk.InvalidArgumentError, ("scale", "bool")),
    "attention float32 inf scale": Bad(
        lambda be: pk.attention(Q, Q, Q, scale=np.float32(np.inf), backend=be),
        pk.InvalidArgumentError, ("scale", "inf")),
    "attention int8 mask": Bad(
        lambda be: pk.attention(Q, Q, Q, mask=np.ones((3, 3), np.int8), backend=be),
        pk.DTypeError, ("'mask'", "boolean", "int8")),
    # dtypes
    "matmul bool operands": Bad(lambda be: pk.matmul(A > 0, B > 0, backend=be),
                                pk.DTypeError, ("bool", "float32")),
    "softmax longdouble": Bad(lambda be: pk.softmax(X.astype(np.longdouble), backend=be),
                              pk.DTypeError, (dtypes.dtype_name(np.longdouble),)),
    "softmax datetime64": Bad(lambda be: pk.softmax(np.zeros(3, "M8[s]"), backend=be),
                              pk.DTypeError, ("datetime64",)),
    "attention structured dtype": Bad(
        lambda be: pk.attention(_structured(), _structured(), _structured(), backend=be),
        pk.DTypeError, ("not supported",)),
    "matmul object dtype": Bad(lambda be: pk.matmul(A.astype(object), B.astype(object),
                                                    backend=be),
                               pk.DTypeError, ("object",)),
    # out=
    "matmul out= numpy array": Bad(
        lambda be: pk.call("matmul", A, B, backend=be, out=np.zeros((4, 3), f32)),
        pk.InvalidArgumentError, ("out=",)),
    "matmul out= wrong shape": Bad(
        lambda be, out: pk.call("matmul", A, B, backend=be, out=out),
        pk.ShapeError, ("out=", "(4, 4)", "(4, 3)"),
        kernel_only=True, make=_out_native((4, 4), f32)),
    "matmul out= wrong dtype": Bad(
        lambda be, out: pk.call("matmul", A, B, backend=be, out=out),
        pk.DTypeError, ("out=", "float16", "float32"),
        kernel_only=True, make=_out_native((4, 3), np.float16)),
}


def _run_bad(name: str, be: Backend) -> BaseException:
    bad = BAD[name]
    made = bad.make(be) if bad.make is not None else {}
    with no_device_work(be), pytest.raises(bad.error) as info:
        bad.call(be, **made)
    return info.value


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_refused_before_any_device_work(target: str, name: str) -> None:
    """Every backend, cuda and plugins included: runtime.execute.run checks non-native operands
    against their claimed shape/dtype (portakern.core.host) before anything is uploaded."""
    bad = BAD[name]
    be = selection.get(target)
    if bad.kernel_only and not isinstance(be, KernelBackend):
        pytest.skip(f"{target} has no out= (not a C-kernel backend)")
    if name == "softmax longdouble" and np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("np.longdouble is float64 on this platform")
    check_refused(_run_bad(name, be), bad.error, bad.needles)


@pytest.mark.parametrize("bad_out", ["numpy array", "wrong shape", "wrong dtype"])
def test_bad_out_is_refused_on_the_planned_fast_path(device_target: str, bad_out: str) -> None:
    """Device-resident operands whose call has run before take the planned fast path
    (runtime.plan: one cache lookup, then the plan's runner); out= must still be checked on
    every call there."""
    be = selection.get(device_target)
    if not isinstance(be, KernelBackend):
        pytest.skip(f"{device_target} has no out= (not a C-kernel backend)")
    a, b = be.to_native(A), be.to_native(B)
    good = be.empty((4, 3), "float32")
    for _ in range(2):
        pk.call("matmul", a, b, backend=be, out=good)
    be.synchronize()
    out, err = {"numpy array": (np.zeros((4, 3), f32), pk.InvalidArgumentError),
                "wrong shape": (be.empty((4, 4), "float32"), pk.ShapeError),
                "wrong dtype": (be.empty((4, 3), "float16"), pk.DTypeError)}[bad_out]
    with no_device_work(be), pytest.raises(err) as info:
        pk.call("matmul", a, b, backend=be, out=out)
    check_refused(info.value, err, ("out=",))


def _warm_positional_backend(kernel_target: str) -> KernelBackend:
    be = selection.get(kernel_target)
    if not isinstance(be, KernelBackend):
        pytest.skip(f"{kernel_target} has no planned launches (not a C-kernel backend)")
    return be


def test_repeated_positional_calls_compute_on_each_calls_operands(kernel_target: str) -> None:
    """A repeated positional pk.call is one lookup in the plan cache (portakern.runtime.plan.PLANS),
    keyed by the operands' metadata: it must launch on this call's arrays (and a fresh
    output), never on the arrays or output of the call that planned it."""
    be = _warm_positional_backend(kernel_target)
    rng = np.random.default_rng(11)
    hosts = [rng.standard_normal((4, 5)).astype(f32) for _ in range(3)]
    bs = [rng.standard_normal((5, 3)).astype(f32) for _ in range(3)]
    devs = [(be.to_native(a), be.to_native(b)) for a, b in zip(hosts, bs)]
    outs = []
    for _ in range(2):
        for a, b in devs:
            outs.append(pk.call("matmul", a, b, backend=be))
    assert len({id(o) for o in outs}) == len(outs), "outputs must be fresh arrays"
    for i, o in enumerate(outs):
        want = hosts[i % 3].astype(np.float64) @ bs[i % 3]
        np.testing.assert_allclose(be.to_numpy(o), want, rtol=1e-5, atol=1e-5)
    key = pkplan.plan_key(get_op("matmul"), devs[0], {}, be)
    assert key in pkplan.PLANS, "the repeated positional call was not planned once"


@pytest.mark.parametrize("kind", ["column slice", "offset view"])
def test_views_are_refused_on_the_call_site_fast_path(kernel_target: str, kind: str) -> None:
    """After valid positional calls of the same shape, a positional call with a view a
    kernel cannot index finds the plan of that shape: it must still be refused by name."""
    be = _warm_positional_backend(kernel_target)
    host = np.arange(64, dtype=f32).reshape(8, 8) / 9
    cut = (slice(None), slice(2, 6)) if kind == "column slice" else (slice(2, 6),)
    view = be.to_native(host)[cut]
    b = be.to_native(np.ones((view.shape[1], 3), f32))
    plain = be.to_native(np.ascontiguousarray(host[cut]))
    for _ in range(2):
        pk.call("matmul", plain, b, backend=be)
    be.synchronize()
    flags = getattr(view, "flags", None)
    if flags is not None and flags.c_contiguous and not getattr(view, "offset", 0):
        pytest.skip(f"a {kind} is a plain array on {kernel_target}")
    with no_device_work(be), pytest.raises(pk.InvalidArgumentError) as info:
        pk.call("matmul", view, b, backend=be)
    check_refused(info.value, pk.InvalidArgumentError, ("'a'",))


def test_call_site_fast_path_follows_a_new_tuning_generation(kernel_target: str) -> None:
    """Tuning bumps the generation; a plan from before must not be reused."""
    from portakern.runtime import configs

    be = _warm_positional_backend(kernel_target)
    a, b = be.to_native(A), be.to_native(B)
    for _ in range(2):
        pk.call("matmul", a, b, backend=be)
    assert pkplan.plan_key(get_op("matmul"), (a, b), {}, be) in pkplan.PLANS
    planned: list[Any] = []
    from portakern.runtime import execute

    real_plan = execute.build_steps

    def spy(*args: Any, **kwargs: Any) -> Any:
        planned.append(args)
        return real_plan(*args, **kwargs)

    gen = configs.GENERATION
    configs.invalidate()  # what saving or clearing a tuning does: the public counter moves
    assert configs.GENERATION == gen + 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(execute, "build_steps", spy)
        got = pk.call("matmul", a, b, backend=be)
    assert planned, "a plan of an older tuning generation was reused"
    np.testing.assert_allclose(be.to_numpy(got), A.astype(np.float64) @ B, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_test_errors_table_never_reaches_a_device(target: str, name: str) -> None:
    """The first table (tests/core/test_errors.py), re-run under the guard."""
    fn, err, needles = BAD_CALLS[name]
    if name.endswith("tunable") and target.startswith("jax"):
        pytest.skip(f"{target} has no C-kernel tunables")
    be = selection.get(target)
    with no_device_work(be), pytest.raises(err) as info:
        fn(be)
    check_refused(info.value, err, tuple(needles))


def test_exactly_max_index_elements_is_accepted_from_metadata() -> None:
    """The limit is 2^31 - 1 elements, not one less: validation only, nothing allocated."""
    spec = get_op("softmax")
    prob = spec.problem(*spec.bind((meta((MAX_INDEX,)),), {}))
    assert prob.out_shape == (MAX_INDEX,)
    with pytest.raises(pk.ShapeError):
        spec.problem(*spec.bind((meta((MAX_INDEX + 1,)),), {}))


# --- backend selectors ------------------------------------------------------------------
OP_CALLS: dict[str, Callable[..., object]] = {
    "matmul": lambda **kw: pk.matmul(A, B, **kw),
    "softmax": lambda **kw: pk.softmax(X, **kw),
    "attention": lambda **kw: pk.attention(Q, Q, Q, **kw),
}
MALFORMED_ENV = ("numpy,opencl", "opencl 0", "jax:pallas:cpu", "../numpy", "opencl\n0",
                 "numpy:", "-opencl", "jax:cpu;rm -rf /")


def _every_live_backend() -> list[Backend]:
    from conftest import TARGETS

    return [selection.get(t) for t in TARGETS]


@pytest.mark.parametrize("op", sorted(OP_CALLS))
@pytest.mark.parametrize("value", MALFORMED_ENV)
def test_malformed_env_backend_is_refused(monkeypatch: pytest.MonkeyPatch, op: str,
                                          value: str) -> None:
    monkeypatch.setenv("PORTAKERN_BACKEND", value)
    with no_device_work(*_every_live_backend()), pytest.raises(pk.UnknownBackendError) as info:
        OP_CALLS[op]()
    check_refused(info.value, pk.UnknownBackendError, ("$PORTAKERN_BACKEND", "expected"))


@pytest.mark.parametrize("op", sorted(OP_CALLS))
def test_unknown_backend_name_in_env_is_refused(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    monkeypatch.setenv("PORTAKERN_BACKEND", "metal")
    with no_device_work(*_every_live_backend()), pytest.raises(pk.UnknownBackendError) as info:
        OP_CALLS[op]()
    check_refused(info.value, pk.UnknownBackendError,
                  ("'metal'", "names no registered backend", "numpy"))


@pytest.mark.parametrize("value", [b"numpy", ["numpy"], 0, 1.5, object()],
                         ids=["bytes", "list", "int", "float", "object"])
def test_non_string_backend_is_refused(value: object) -> None:
    with no_device_work(*_every_live_backend()), pytest.raises(pk.UnknownBackendError) as info:
        pk.matmul(A, B, backend=value)  # type: ignore[arg-type]
    check_refused(info.value, pk.UnknownBackendError, ("must be a string", type(value).__name__))


@pytest.mark.parametrize("name", registry.names())
@pytest.mark.parametrize("device", ["99", "nonsense"])
def test_unknown_device_of_every_backend_is_refused(name: str, device: str) -> None:
    """Each registered backend, available or not, refuses a device it does not have."""
    with no_device_work(*_every_live_backend()), pytest.raises(pk.BackendUnavailable) as info:
        pk.softmax(X, backend=f"{name}:{device}")
    msg = str(info.value)
    check_refused(info.value, pk.BackendUnavailable, (name,))
    # either the device is named and refused, or the whole backend cannot run (reason + fix)
    assert device in msg or ("cannot run here" in msg and "Fix" in msg), msg


def test_use_with_a_bad_backend_fails_at_the_with_statement() -> None:
    before = selection.current_choice()
    with pytest.raises(pk.UnknownBackendError, match=r"portakern\.use\(\.\.\.\) 'bogus'"), \
            pk.use("bogus"):
        pytest.fail("the block must not run")
    assert selection.current_choice() is before


def test_a_long_bad_selector_is_cut_in_the_message() -> None:
    with pytest.raises(pk.UnknownBackendError) as info:
        pk.softmax(np.ones(3, f32), backend="x" * 5000)
    assert len(str(info.value)) < 300 and "5002 characters" in str(info.value)


# --- layouts: numpy views compute correctly everywhere ------------------------------------
def _views() -> dict[str, Callable[[], dict[str, Any]]]:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((12, 10)).astype(f32)
    qbase = rng.standard_normal((1, 2, 10, 16)).astype(f32)
    be_base = base.astype(">f4")
    fortran = np.asfortranarray(base[:6, :5])
    readonly = base[:6, :5].copy()
    readonly.flags.writeable = False
    qreadonly = qbase[..., :5, :8].copy()
    qreadonly.flags.writeable = False
    return {
        "step": lambda: {"a": base[::2, ::2], "x": base[::2, ::2], "q": qbase[..., ::2, ::2]},
        "transposed": lambda: {"a": base[:5, :6].T, "x": base[:5, :6].T,
                               "q": np.swapaxes(qbase[..., :8, :5], -1, -2)[..., :5, :]},
        "negative stride": lambda: {"a": base[5::-1, 4::-1], "x": base[5::-1, ::-2],
                                    "q": qbase[..., 4::-1, ::-2]},
        "offset": lambda: {"a": base[3:9, 2:7], "x": base[3:9, 2:7], "q": qbase[..., 2:7, 1:9]},
        "broadcast (stride 0)": lambda: {
            "a": np.broadcast_to(base[0, :5], (6, 5)), "x": np.broadcast_to(base[:6, :1], (6, 5)),
            "q": np.broadcast_to(qbase[..., :1, :8], (1, 2, 5, 8))},
        "Fortran order": lambda: {"a": fortran, "x": fortran,
                                  "q": np.asfortranarray(qbase[..., :5, :8])},
        "big-endian": lambda: {"a": be_base[:6, :5], "x": be_base[:6, :5],
                               "q": qbase[..., :5, :8].astype(">f4")},
        "read-only": lambda: {"a": readonly, "x": readonly, "q": qreadonly},
    }


VIEWS = _views()


@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_numpy_views_give_the_oracle_answer(target: str, kind: str) -> None:
    v = VIEWS[kind]()
    snapshot = {k: np.array(x, copy=True) for k, x in v.items()}
    b = np.random.default_rng(1).standard_normal((5, 4)).astype(f32)
    q = v["q"]
    k = np.ascontiguousarray(q[:, :1])
    cases = {
        "matmul": Case({"a": v["a"], "b": b}),
        "softmax": Case({"x": v["x"]}, {"axis": 0}),
        "attention": Case({"q": q, "k": k, "v": k, "mask": None},
                          {"causal": True, "scale": None}),
    }
    for op, case in cases.items():
        got = pk.call(op, **case.arrays, **case.params, backend=target)
        verdict = compare(get_op(op), case, got)
        assert verdict.ok, f"{op} on a {kind} view, {target}: {verdict.where}"
        assert isinstance(got, np.ndarray) and got.dtype.isnative
    for name, x in v.items():  # inputs are never written to
        np.testing.assert_array_equal(np.asarray(x), snapshot[name])


# --- layouts: device views ----------------------------------------------------------------
DEVICE_VIEWS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "transposed": ("matmul a", lambda x: x.T),
    "offset rows": ("softmax x", lambda x: x[1:]),
    "row step": ("softmax x", lambda x: x[::2]),
    "column slice": ("matmul a", lambda x: x[:, 1:4]),
    "negative stride": ("softmax x", lambda x: x[::-1]),
    "mask column step": ("attention mask", lambda x: x[:, ::2]),
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-valid-calls"])
@pytest.mark.parametrize("kind", sorted(DEVICE_VIEWS))
def test_device_views_are_refused_by_name_or_computed_right(device_target: str,
                                                            kind: str, warm: bool) -> None:
    """A device view a kernel cannot index must be refused naming the argument and the fix
    (pyopencl); a backend whose views are real arrays (jax) must compute the right answer.

    ``after-valid-calls``: the same call with contiguous arrays of the view's shape ran first,
    so the view arrives on the planned fast path (the plan's runner), which must
    check layout per call, not once per shape."""
    be = selection.get(device_target)
    where, view = DEVICE_VIEWS[kind]
    op, arg = where.split()
    rng = np.random.default_rng(3)
    params: dict[str, Any] = {}
    if op == "attention":
        kv = rng.standard_normal((1, 1, 7, 8)).astype(f32)
        host: dict[str, Any] = {"q": rng.standard_normal((1, 1, 6, 8)).astype(f32), "k": kv,
                                "v": kv, "mask": rng.random((6, 14)) < 0.7}
        params = {"causal": False, "scale": None}
    else:
        host = {arg: rng.standard_normal((8, 6)).astype(f32)}
        if op == "matmul":
            host["b"] = rng.standard_normal((view(host[arg]).shape[1], 3)).astype(f32)
        else:
            params = {"axis": -1}
    native = {k: be.to_native(x) for k, x in host.items()}
    native[arg] = view(native[arg])
    host[arg] = view(host[arg])
    if warm:
        plain = {k: be.to_native(np.ascontiguousarray(x)) for k, x in host.items()}
        for _ in range(2):
            pk.call(op, **plain, **params, backend=be)
        be.synchronize()
    flags = getattr(native[arg], "flags", None)
    if flags is not None and not flags.c_contiguous:  # a kernel would index it wrongly
        with no_device_work(be), pytest.raises(pk.InvalidArgumentError) as info:
            pk.call(op, **native, **params, backend=be)
        check_refused(info.value, pk.InvalidArgumentError, (f"'{arg}'", "non-contiguous"))
        assert "copy()" in str(info.value) or "ascontiguousarray" in str(info.value)
        return
    try:
        got = pk.call(op, **native, **params, backend=be)
    except pk.InvalidArgumentError as exc:  # e.g. a pyopencl offset view: refused, by name
        check_refused(exc, pk.InvalidArgumentError, (f"'{arg}'",))
        assert "copy()" in str(exc) or "ascontiguousarray" in str(exc)
        return
    verdict = compare(get_op(op), Case(host, params), be.to_numpy(got))
    assert verdict.ok, f"{op} on a {kind} device view, {device_target}: {verdict.where}"


# --- regressions: metadata the validation memo and array_meta must refuse ---------------
def test_shape_that_is_not_a_sequence_is_not_an_array() -> None:
    with pytest.raises(pk.NotAnArrayError):
        pk.matmul(types.SimpleNamespace(shape=5, dtype=np.dtype(f32)), B, backend="numpy")


def test_shape_of_strings_is_not_an_array() -> None:
    with pytest.raises(pk.NotAnArrayError):
        pk.matmul(types.SimpleNamespace(shape=("a", "b"), dtype=np.dtype(f32)), B,
                  backend="numpy")


def test_validation_does_not_depend_on_earlier_calls() -> None:
    pkplan.PLANS.clear()  # the valid calls below populate the cache that the bad ones hit
    pk.attention(Q, Q, Q, causal=True, backend="numpy")
    pk.softmax(X, axis=1, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError):
        pk.attention(Q, Q, Q, causal=1, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError):
        pk.softmax(X, axis=1.0, backend="numpy")  # type: ignore[arg-type]


def test_positional_fast_path_leaves_the_specs_defaults_alone() -> None:
    """pk.call(op, *operands) binds by zip and hands the spec's own defaults to the memo;
    validation must get a copy it may write into (KernelSpec.problem copies), and a later
    call with other parameters must not get the defaults' cached problem."""
    base = get_op("softmax")
    seen: list[Any] = []

    def validate(metas: Any, params: dict[str, Any]) -> Any:
        seen.append(params)
        return base.validate(metas, params)

    spec = base.replace(name="softmax_sees_params", validate=validate)
    assert spec.all_positional((X,))  # the call below takes the fast path
    before = dict(spec.params)
    x = np.random.default_rng(5).standard_normal((3, 5)).astype(f32)
    plain = pk.call(spec, x, backend="numpy")
    assert seen and all(p is not spec.params for p in seen)
    assert dict(spec.params) == before
    other = pk.call(spec, x, axis=0, backend="numpy")
    assert not np.allclose(plain, other)
    np.testing.assert_array_equal(pk.call(spec, x, backend="numpy"), plain)


# --- the docs table stays complete ------------------------------------------------------
def all_case_ids() -> list[str]:
    """Every distinct bad input this suite and tests/core/test_errors.py refuse (docs list them)."""
    ids = list(BAD_CALLS) + list(BAD)
    ids += [f"env {v!r}" for v in MALFORMED_ENV] + ["env 'metal'"]
    ids += ["backend= bytes", "backend= list", "backend= int", "backend= float",
            "backend= object", "NAME:99", "NAME:nonsense", "use('bogus')"]
    ids += [f"device view: {k}" for k in DEVICE_VIEWS]
    ids += [f"numpy view: {k}" for k in VIEWS]
    return ids


def test_docs_list_every_case() -> None:
    if not DOCS.exists():
        pytest.fail(f"{DOCS} is missing; it documents these cases")
    text = DOCS.read_text()
    missing = [name for name in list(BAD_CALLS) + list(BAD) + list(DEVICE_VIEWS) + list(VIEWS)
               if f"`{name}`" not in text]
    assert not missing, f"docs/guarantees.md lacks these case ids: {missing}"
    assert f"{len(set(all_case_ids()))} distinct bad inputs" in text, \
        f"docs/guarantees.md must state the count: {len(set(all_case_ids()))} distinct bad inputs"


class _BareBackend(ArrayBackend):
    """A plugin-style backend that implements only the required members and trusts whatever
    reaches them: the host-operand checks must come from runtime.execute.run itself."""

    name = "bare"

    @classmethod
    def _probe(cls) -> Any:
        from portakern.backend.base import Availability

        return Availability(True)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        raise AssertionError("a refused operand reached an allocation")

    def _open(self, selector: str | None) -> Any:
        from portakern.backend.base import DeviceInfo

        return DeviceInfo(0, "bare", "cpu")

    def is_native(self, x: object) -> bool:
        return False

    def to_native(self, x: np.ndarray) -> Any:
        self.uploaded.append(x)
        return x

    def execute(self, spec: Any, prob: Any, ins: dict[str, Any], config: Any) -> Any:
        raise AssertionError("a refused operand reached execute")


@pytest.mark.parametrize("name", sorted({"softmax x stand-in without data",
                                         "matmul a data differs from its shape",
                                         "softmax x masked array"}))
def test_backend_base_checks_host_operands_for_every_backend(name: str) -> None:
    be = _BareBackend()
    be.uploaded = []  # type: ignore[attr-defined]
    with pytest.raises(pk.NotAnArrayError):
        BAD[name].call(be)
    assert be.uploaded == []  # type: ignore[attr-defined]


# --- issue 19: the raw exceptions it listed, each now a PortakernError -----------------------
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_empty_result_into_a_half_precision_out(kernel_target: str, dt: str) -> None:
    """K = 0 with an fp16/bf16 out=: the zero fill raised ValueError('unable to map dtype')."""
    st = dtypes.info(dt).storage
    a, b = np.ones((3, 0), st), np.ones((0, 4), st)
    be = selection.get(kernel_target)
    out = pk.to_backend(np.full((3, 4), 7, st), be)
    got = pk.call("matmul", a, b, backend=be, out=out)
    assert got is out
    assert not np.asarray(be.to_numpy(got)).astype(np.float32).any()


@pytest.mark.parametrize("config", [3, "TM=4", [("TM", 4)], 1.5])
def test_config_that_is_not_a_mapping(target: str, config: object) -> None:
    for call in (lambda: pk.matmul(A, B, backend=target, config=config),
                 lambda: pk.call("softmax", X, backend=target, config=config)):
        with pytest.raises(pk.InvalidArgumentError, match="config must be a mapping"):
            call()


@pytest.mark.parametrize("name", ["matmul", "softmax", "attention", "rmsnorm"])
def test_named_wrappers_refuse_unknown_keywords_like_call(name: str) -> None:
    args = {"matmul": (A, B), "softmax": (X,), "attention": (Q, Q, Q),
            "rmsnorm": (X, np.ones(5, f32))}[name]
    with pytest.raises(pk.InvalidArgumentError, match="bogus"):
        getattr(pk, name)(*args, bogus=1, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError, match="bogus"):
        pk.call(name, *args, bogus=1, backend="numpy")


@pytest.mark.parametrize("bad,err", [
    ("abc", pk.NotAnArrayError), (b"abc", pk.NotAnArrayError), (None, pk.NotAnArrayError),
    ([1.0, 2.0], pk.NotAnArrayError), (np.array([1 + 2j]), pk.DTypeError),
    (np.array(["a", "b"]), pk.DTypeError), (np.array([object()]), pk.DTypeError)],
    ids=["str", "bytes", "None", "list", "complex", "strings", "objects"])
def test_to_backend_validates_like_an_op(target: str, bad: object, err: type) -> None:
    with pytest.raises(err):
        pk.to_backend(bad, target)


def test_to_backend_keeps_a_0d_shape_and_checks_the_budget(
        target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got = pk.to_backend(np.array(3.0, f32), target)
    assert tuple(got.shape) == ()
    if target.startswith("numpy"):
        return  # a numpy array is numpy's own array: nothing is copied
    from portakern.core import host

    monkeypatch.setenv(host.ENV_BUDGET, "1M")
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, f32), (1 << 26,), (0,))
    with pytest.raises(pk.PortakernError) as info:
        pk.to_backend(huge, target)
    assert isinstance(info.value, MemoryError)


_TWO_DEVICES = """
import jax, numpy as np, portakern as pk
d = jax.devices("cpu")
a = jax.device_put(np.ones((2, 2), np.float32), d[0])
b = jax.device_put(np.ones((2, 2), np.float32), d[1])
try:
    pk.matmul(a, b)
except pk.PortakernError as exc:
    print(type(exc).__name__, "|", exc)
"""


def test_jax_arrays_on_two_devices() -> None:
    if not registry.availability("jax").available:
        pytest.skip("jax is not available here")
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ContextMismatchError |"), r.stdout + r.stderr[-2000:]
    assert "cpu:0" in r.stdout and "cpu:1" in r.stdout and "device_put" in r.stdout


@pytest.mark.parametrize("argv", [
    ["check", "--ops", "nosuch", "--backend", "numpy"],
    ["check", "--examples", "-1", "--backend", "numpy", "--ops", "softmax"],
    ["check", "--dtypes", "int8", "--backend", "numpy", "--ops", "softmax"],
    ["show", "matmul", "--shape", "M=-5"],
    ["show", "nosuch"],
    ["show", "matmul", "--shape", "M=x"],
    ["tune", "softmax", "--backend", "opencl", "--shape", "R=-1"],
    ["tune", "softmax", "--backend", "nosuch"],
], ids=lambda a: " ".join(a))
def test_cli_user_errors_are_one_line_and_non_zero(argv: list[str],
                                                   capsys: pytest.CaptureFixture) -> None:
    """A user's mistake: exit 2, one line on stderr, no traceback; a run that would check
    nothing (no examples, no dtype portakern computes in) is such a mistake, not a pass."""
    from portakern.tools.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and err.startswith(f"portakern {argv[0]}: "), err
