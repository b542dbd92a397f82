"""Cases a CI run once failed on, replayed exactly on every target.

Why: a hypothesis database entry lives only on the machine that found the failure, and a
``reproduce_failure`` blob breaks with the next hypothesis release. A pinned case instead
scripts the generator's choices, so it replays the same shapes, parameters and values
(the values come from the scripted seed) wherever and whenever the suite runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from portakern.core.sampling import Chooser
from portakern.ops import attention_backward, softmax

from _oracle import check_case, supports


class ScriptedChooser(Chooser):
    """Answers each draw from a fixed script, in order; running out is an error."""

    def __init__(self, script: Sequence[Any]) -> None:
        self.script = list(script)

    def _next(self) -> Any:
        assert self.script, "the generator drew more than the pinned script holds"
        return self.script.pop(0)

    def choice(self, options: Sequence[Any]) -> Any:
        got = self._next()
        assert got in options, f"pinned answer {got!r} is not among {options!r}"
        return got

    def boolean(self, p: float = 0.5) -> bool:
        return bool(self._next())

    def seed(self) -> int:
        return int(self._next())


# (what it caught, op, dtype, the generator's answers in draw order)
PINNED = [
    # jax:pallas flushed dS below the smallest normal to zero at scale 30: dK -8.5e-37 became
    # 0.0, over a bound whose underflow floor left out the scale (attention_backward.tolerance)
    ("underflow at a large scale", "attention_backward", "float32",
     [0, 1, 2, 3, 2, False, 17, 64, True, False, False, 30.0, 1.0, False, False]),
    # (found by review, then drawn by the suite) rows of -inf and a NaN: the CPU schedules'
    # vector max pass dropped the NaN, the row's max read -inf and the row came out 0
    # (OpenCL, last axis); XLA:CPU's max over a non-last axis of 256 dropped it too (jax)
    ("NaN among -inf, last axis", "softmax", "float32", [0, 256, 2, 3, 1, False, "nan", True]),
    ("NaN among -inf, first axis", "softmax", "float32", [0, 256, 2, 16, 0, False, "nan", True]),
]
GENERATORS = {"attention_backward": attention_backward.backward_case,
              "softmax": softmax.softmax_case}


@pytest.mark.parametrize("what, op, dtype, script", PINNED, ids=[p[0] for p in PINNED])
def test_pinned_case(target: str, what: str, op: str, dtype: str, script: list[Any]) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    chooser = ScriptedChooser(script)
    case = GENERATORS[op](chooser, dtype)
    assert not chooser.script, "the pinned script has answers the generator no longer draws"
    check_case(op, target, case)
