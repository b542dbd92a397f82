"""One dispatch path (runtime/plan.py): every entry point reaches the same bounded plan cache,
and a repeated call is planned once."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.backend.base import KernelBackend
from portakern.core.errors import AliasingError, ContextMismatchError
from portakern.ops import get_op
from portakern.runtime import configs, selection
from portakern.runtime import plan as pkplan

f32 = np.float32
RNG = np.random.default_rng(3)
X = RNG.standard_normal((4, 8)).astype(f32)
A = RNG.standard_normal((4, 5)).astype(f32)
B = RNG.standard_normal((5, 3)).astype(f32)
Q = RNG.standard_normal((1, 2, 8, 16)).astype(f32)


def _kernel_backend() -> KernelBackend:
    try:
        be = selection.get("opencl")
    except pk.BackendUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(str(exc))
    assert isinstance(be, KernelBackend)
    return be


@pytest.mark.parametrize("how", ["named", "call keyword", "call positional"])
def test_every_entry_point_is_planned_once(how: str) -> None:
    be = _kernel_backend()
    x = be.to_native(X)
    calls = {"named": lambda: pk.softmax(x, backend=be),
             "call keyword": lambda: pk.call("softmax", x=x, axis=-1, backend=be),
             "call positional": lambda: pk.call("softmax", x, backend=be)}
    calls[how]()
    before = len(pkplan.PLANS)
    made: list[object] = []
    real = pkplan.make_plan
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pkplan, "make_plan", lambda *a, **k: made.append(a) or real(*a, **k))
        for _ in range(3):
            got = calls[how]()
    assert not made, f"{how}: a repeated call was planned again"
    assert len(pkplan.PLANS) == before
    e = np.exp(X - X.max(-1, keepdims=True))
    np.testing.assert_allclose(be.to_numpy(got), e / e.sum(-1, keepdims=True), rtol=1e-5)


def test_a_positional_none_operand_is_planned_once_and_takes_the_runner() -> None:
    """``pk.call('attention', q, k, v, None, None, None)`` (optional operands left out by
    position, as the benchmark passed them) once made no plan key, so every call planned and
    built its launchers again: 4 ms per call on a 2-core CPU, a third of the kernel."""
    be = _kernel_backend()
    q = be.to_native(Q)
    args, kw = (q, q, q, None, None, None), {"causal": True}
    pk.call("attention", *args, **kw, backend=be)
    made: list[object] = []
    real = pkplan.make_plan
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pkplan, "make_plan", lambda *a, **k: made.append(a) or real(*a, **k))
        for _ in range(3):
            got = pk.call("attention", *args, **kw, backend=be)
    assert not made, "a repeated call with None operands was planned again"
    plan = pkplan.PLANS.lookup(pkplan.plan_key(get_op("attention"), args, kw, be))
    assert plan is not None and plan.runner is not None, "the call takes no planned runner"
    np.testing.assert_array_equal(be.to_numpy(got),
                                  be.to_numpy(pk.attention(q, q, q, causal=True, backend=be)))


def test_out_and_automatic_selection_share_the_plan_path() -> None:
    be = _kernel_backend()
    a, b = be.to_native(A), be.to_native(B)
    out = be.empty((4, 3), "float32")
    assert pk.matmul(a, b, out=out) is out  # no backend=: the inputs pick opencl
    assert pkplan.plan_key(get_op("matmul"), (a, b), {}) in pkplan.PLANS
    with pk.use(be):
        assert pk.call("matmul", a, b, out=out) is out
        assert pkplan.plan_key(get_op("matmul"), (a, b), {}) in pkplan.PLANS
    np.testing.assert_allclose(be.to_numpy(out), A.astype(np.float64) @ B, rtol=1e-5,
                               atol=1e-5)


def test_a_multi_kernel_plan_is_a_list_of_launches_with_workspace() -> None:
    """attention: a pack kernel writes a workspace buffer the main kernel reads, integer
    scalars in both templates; the Plan holds both launches and the workspace, no special
    case in dispatch."""
    be = _kernel_backend()
    q = be.to_native(Q)
    plan = pkplan.plan_for(get_op("attention"), (q, q, q), {"causal": True}, backend=be)
    assert len(plan.steps) >= 1
    names = {n for step in plan.steps for n in step.slots}
    assert set(plan.workspace) <= names
    assert any(isinstance(a, np.integer) for step in plan.steps for a in step.template)
    got = pk.attention(q, q, q, causal=True)
    ref = pk.attention(Q, Q, Q, causal=True, backend="numpy")
    np.testing.assert_allclose(be.to_numpy(got), ref, rtol=1e-4, atol=1e-5)


def test_a_new_tuning_generation_is_a_new_plan() -> None:
    be = _kernel_backend()
    x = be.to_native(X)
    pk.softmax(x)
    old = pkplan.plan_for(get_op("softmax"), (x,), {"axis": -1})
    configs.invalidate()
    new = pkplan.plan_for(get_op("softmax"), (x,), {"axis": -1})
    assert new is not old and new.generation == configs.GENERATION


# --- the planned runner checks every call ---------------------------------------------------
def _cl_array_on(be: KernelBackend, shape: tuple[int, ...], nbytes: int,
                 flags: str = "READ_WRITE", data: object = None) -> object:
    import pyopencl as cl
    import pyopencl.array as cla

    buf = data if data is not None else cl.Buffer(be.ctx, getattr(cl.mem_flags, flags), nbytes)
    return cla.Array(be.queue, shape, f32, data=buf)


RUNNER_CASES = {  # op -> (host operands, keywords, output shape)
    "softmax": ((X,), {}, (4, 8)),
    "matmul": ((A, B), {}, (4, 3)),
    "attention": ((Q, Q, Q), {"causal": True}, Q.shape),
}


def _warm_runner(be: KernelBackend, op: str) -> tuple[list, dict, object]:
    """Device operands and a good out= whose calls have run: the plan's runner exists."""
    hosts, kw, shape = RUNNER_CASES[op]
    devs = [be.to_native(h.copy()) for h in hosts]
    good = be.empty(shape, "float32")
    for _ in range(2):
        pk.call(op, *devs, **kw, out=good)
        pk.call(op, *devs, **kw)
    plan = pkplan.PLANS.lookup(pkplan.plan_key(get_op(op), devs, kw))
    assert plan is not None and plan.runner is not None, f"{op}: no runner was made"
    return devs, kw, good


@pytest.mark.parametrize("op", sorted(RUNNER_CASES))
@pytest.mark.parametrize("bad", ["out is an input", "out shares an input's buffer",
                                 "read-only out", "out of another shape, same strides",
                                 "out of another dtype", "input of another context",
                                 "input on a short buffer"])
def test_the_planned_runner_still_checks_every_call(op: str, bad: str) -> None:
    """After valid calls made the plan's runner (runtime.plan._runner), each per-call check
    it replaces must still refuse a bad call by name: removing any of them from the runner
    fails this test."""
    import pyopencl as cl
    import pyopencl.array as cla

    be = _kernel_backend()
    devs, kw, good = _warm_runner(be, op)
    shape = good.shape
    nbytes = int(np.prod(shape)) * 4
    args, out, err, needle = list(devs), None, pk.InvalidArgumentError, ""
    if bad == "out is an input":
        out, err, needle = devs[0] if devs[0].shape == shape else devs[-1], AliasingError, \
            "overlaps"
        if out.shape != shape:
            pytest.skip(f"{op}: no operand has the output's shape")
    elif bad == "out shares an input's buffer":
        src = next((d for d in devs if d.nbytes >= nbytes), None)
        if src is None:
            pytest.skip(f"{op}: no operand is as large as the output")
        out, err, needle = _cl_array_on(be, shape, 0, data=src.base_data), AliasingError, \
            "overlaps"
    elif bad == "read-only out":
        out, needle = _cl_array_on(be, shape, nbytes, "READ_ONLY"), "READ_ONLY"
    elif bad == "out of another shape, same strides":
        longer = (shape[0] + 1, *shape[1:])
        out, err = _cl_array_on(be, longer, nbytes * 2), pk.ShapeError
    elif bad == "out of another dtype":
        out, err = be.empty(shape, "int32"), pk.DTypeError  # same itemsize: same strides
    elif bad == "input of another context":
        ctx = cl.Context(devices=be.ctx.devices)
        args[0] = cla.to_device(cl.CommandQueue(ctx), np.ascontiguousarray(devs[0].get()))
        err, needle = ContextMismatchError, "context"
    elif bad == "input on a short buffer":
        args[0] = _cl_array_on(be, devs[0].shape, 16)
        needle = "holds 16"
    with pytest.raises(err) as info:
        pk.call(op, *args, **kw, out=out)
    assert needle in str(info.value), str(info.value)
    got = pk.call(op, *devs, **kw, out=good)  # the runner still serves good calls
    assert got is good


@pytest.mark.parametrize("op", sorted(RUNNER_CASES))
@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_the_planned_runner_computes_each_calls_answer(op: str, dt: str) -> None:
    """The runner (its own kernel objects with the plan's scalars set once, buffers set per
    call, a kept workspace) must compute every call on that call's arrays: several calls of
    one plan, new data each time, with and without out=, each against the numpy oracle."""
    be = _kernel_backend()
    hosts, kw, shape = RUNNER_CASES[op]
    st = np.float16 if dt == "float16" else f32
    rng = np.random.default_rng(7)
    spec = get_op(op)
    calls = 0
    for i in range(4):
        data = [rng.standard_normal(h.shape).astype(st) for h in hosts]
        devs = [be.to_native(d) for d in data]
        out = be.empty(shape, dt) if i % 2 else None
        got = pk.call(op, *devs, **kw, out=out)
        if out is not None:
            assert got is out
        want = pk.call(op, *[d.astype(np.float64) for d in data], **kw, backend="numpy")
        tol = 2e-2 if dt == "float16" else 1e-5
        np.testing.assert_allclose(be.to_numpy(got).astype(np.float64), want, rtol=tol,
                                   atol=tol, err_msg=f"{op} {dt} call {i}")
        plan = pkplan.PLANS.lookup(pkplan.plan_key(spec, devs, kw))
        calls += plan is not None and plan.runner is not None
    assert calls >= 3, f"{op} {dt}: the runner served {calls} of the calls"


@pytest.mark.parametrize("op", ["matmul", "attention"])
def test_threads_sharing_a_plan_and_its_kept_workspace_get_their_own_answers(op: str) -> None:
    """matmul and attention keep a small workspace per plan (a pack kernel writes it, the
    main kernel reads it): calls from several threads on one plan must never read another
    call's packed copy."""
    import threading

    be = _kernel_backend()
    hosts, kw, _ = RUNNER_CASES[op]
    rng = np.random.default_rng(5)
    datas = [[rng.standard_normal(h.shape).astype(f32) for h in hosts] for _ in range(4)]
    wants = [pk.call(op, *[d.astype(np.float64) for d in data], **kw, backend="numpy")
             for data in datas]
    devs = [[be.to_native(d) for d in data] for data in datas]
    pk.call(op, *devs[0], **kw)
    pk.call(op, *devs[0], **kw)  # the runner exists before the threads start
    errors: list[str] = []

    def work(t: int) -> None:
        outs = [pk.call(op, *devs[t], **kw) for _ in range(50)]
        for o in outs:
            got = be.to_numpy(o).astype(np.float64)
            if not np.allclose(got, wants[t], rtol=1e-4, atol=1e-5):
                errors.append(f"thread {t}: max error {np.max(np.abs(got - wants[t])):.3g}")
                return

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
