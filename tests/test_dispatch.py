"""One dispatch path (portakern.plan): every entry point reaches the same bounded plan cache,
and a repeated call is planned once."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern import plan as pkplan
from portakern import selection, tuned
from portakern.backends.base import KernelBackend
from portakern.ops import get_op

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


def test_out_and_automatic_selection_share_the_plan_path() -> None:
    be = _kernel_backend()
    a, b = be.to_native(A), be.to_native(B)
    out = be.empty((4, 3), "float32")
    assert pk.matmul(a, b, out=out) is out  # no backend=: the inputs pick opencl
    with pk.use(be):
        assert pk.call("matmul", a, b, out=out) is out
    np.testing.assert_allclose(be.to_numpy(out), A.astype(np.float64) @ B, rtol=1e-5,
                               atol=1e-5)
    assert pkplan.plan_key(be, get_op("matmul"), (a, b), {}, None) in pkplan.PLANS


def test_a_multi_kernel_plan_is_a_list_of_launches_with_workspace() -> None:
    """attention: a pack kernel writes a workspace buffer the main kernel reads, integer
    scalars in both templates; the Plan holds both launches and the workspace, no special
    case in dispatch."""
    be = _kernel_backend()
    q = be.to_native(Q)
    plan = pkplan.plan_for(get_op("attention"), (q, q, q), {"causal": True}, backend=be)
    assert plan.launches is not None and len(plan.launches) >= 1
    names = {a for _, _, template in plan.launches for a in template if isinstance(a, str)}
    assert set(plan.workspace) <= names
    assert any(isinstance(a, np.integer) for _, _, t in plan.launches for a in t)
    got = pk.attention(q, q, q, causal=True)
    ref = pk.attention(Q, Q, Q, causal=True, backend="numpy")
    np.testing.assert_allclose(be.to_numpy(got), ref, rtol=1e-4, atol=1e-5)


def test_a_new_tuning_generation_is_a_new_plan() -> None:
    be = _kernel_backend()
    x = be.to_native(X)
    pk.softmax(x)
    old = pkplan.plan_for(get_op("softmax"), (x,), {"axis": -1})
    tuned.invalidate()
    new = pkplan.plan_for(get_op("softmax"), (x,), {"axis": -1})
    assert new is not old and new.generation == tuned.GENERATION
