"""The shared differential suite: every op x backend x dtype against the float64 oracle.

Each property draws shapes that break kernels and values that break numerics
(portakern.cases) and checks the result under the op's derived error bound
(spec.tolerance) — no hand-tuned atol. The same tests run on every registered backend.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import portakern as pk
from portakern.cases import compare
from portakern.ops import OPS

from _oracle import check_case, draw_case, supports

DTYPES = ["float32", "float16", "bfloat16", "float64"]
# Every op in the registry (built-ins, rmsnorm, entry-point plugins) — no list to keep in sync;
# each draws from its generator (portakern.cases.CASES: built-in table, else the spec's own).
OP_NAMES = list(OPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OP_NAMES)
@given(data=st.data())
def test_matches_oracle(op: str, dtype: str, target: str, data: st.DataObject) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    check_case(op, target, draw_case(op, data, dtype))


@pytest.mark.parametrize("schedule", ["cpu", "gpu"])
@pytest.mark.parametrize("op", OP_NAMES)
@given(data=st.data())
def test_every_schedule_matches_oracle(op: str, schedule: str, kernel_target: str,
                                       data: st.DataObject) -> None:
    """Both device-class schedules run on every C-kernel device (a GPU-style local-memory
    schedule is still correct on a CPU runtime, and vice versa)."""
    from portakern import selection
    from portakern.ops import get_op

    be = selection.get(kernel_target)
    spec = get_op(op)
    case = draw_case(op, data, "float32")
    got = pk.call(spec, backend=be, config=spec.config(schedule), **case.arrays, **case.params)
    v = compare(spec, case, got)
    assert v.ok, f"{op}/{schedule} on {kernel_target}: ratio {v.worst_ratio:.3g} {v.where}"
