"""The shared differential suite: every op x backend x dtype against the float64 oracle.

Each property draws shapes that break kernels and values that break numerics
(portakern.cases) and checks the result under the op's derived error bound
(spec.tolerance) — no hand-tuned atol. The same tests run on every registered backend.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _oracle import check_case, draw_case, supports

DTYPES = ["float32", "float16", "bfloat16", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["matmul", "softmax", "attention"])
@given(data=st.data())
def test_matches_oracle(op: str, dtype: str, target: str, data: st.DataObject) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    check_case(op, target, draw_case(op, data, dtype))
