"""Helpers the test files share: run a case on a target and check it against the oracle."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

import portakern as pk
from portakern.core.sampling import Case, Chooser
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.runtime.verify import Verdict, compare_arrays, native_matrix_unit, own_kernel
from portakern.tools.cases import CASES


class HypothesisChooser(Chooser):
    """Choices through hypothesis, so failing cases shrink towards small, early options."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def choice(self, options):  # noqa: ANN001, ANN201
        return self.data.draw(st.sampled_from(list(options)))

    def boolean(self, p: float = 0.5) -> bool:
        return self.data.draw(st.booleans())

    def seed(self) -> int:
        return self.data.draw(st.integers(0, 2**31 - 1))


def supports(target: str, dtype: str) -> bool:
    return dtype in selection.get(target).supported_dtypes()


def run_case(op: str, target: str, case: Case) -> Any:
    spec = get_op(op)
    return pk.call(spec, backend=target, **{k: v for k, v in case.arrays.items()}, **case.params)


def compare_case(spec: Any, case: Case, got: Any, target: Any = None) -> Verdict:
    """Both checks (worst-case bound, statistical) through portakern.verify: the code path
    of pk.verify and `portakern check`. ``target`` (a label or backend) computed ``got``: a
    C-kernel one's results are judged by the op's model of its kernel's summation order
    (``statistical_ordered``), any other's by the order-free model."""
    arrays, params = spec.bind((), dict(case.arrays) | case.params)
    be = selection.get(target) if isinstance(target, str) else target
    return compare_arrays(spec, arrays, params, got, ordered=own_kernel(be),
                          matrix_unit=native_matrix_unit(be))


def check_case(op: str, target: str, case: Case) -> None:
    got = run_case(op, target, case)
    parts = got if isinstance(got, tuple) else (got,)  # several outputs: a tuple of them
    assert parts and all(isinstance(g, np.ndarray) for g in parts), (
        f"numpy in must give numpy out; got {type(got)}"
        + (f" of {[type(g).__name__ for g in got]}" if isinstance(got, tuple) else ""))
    v = compare_case(get_op(op), case, got, target)
    assert v.ok, f"{op} on {target}: case {case.describe()}\n{v}"


def draw_case(op: str, data: st.DataObject, dtype: str) -> Case:
    case = CASES[op](HypothesisChooser(data), dtype)
    note(case.describe())
    return case


def assert_spec_refused(bad: pk.KernelSpec, field: str, words: list[str],
                        **register_kwargs: Any) -> None:
    """``pk.register_op(bad)`` raises a SpecError naming the spec, the field, a fix and each
    of ``words``, and leaves nothing registered."""
    import pytest

    with pytest.raises(pk.SpecError) as info:
        pk.register_op(bad, **register_kwargs)
    msg = str(info.value)
    assert f"spec {bad.name!r}" in msg and f"field `{field}`" in msg and "Fix:" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    assert bad.name not in pk.ops.OPS
