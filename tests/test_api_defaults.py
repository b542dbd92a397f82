"""The named wrappers (portakern/api.py) leave a parameter out when it is the default they
declare, so the spec's binding fills in its own: both defaults must be the same value and
type, or a call without the keyword would run with another value than the docs say."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import portakern as pk
from portakern.ops import get_op


@pytest.mark.parametrize("name", ["softmax", "attention", "rmsnorm", "matmul"])
def test_wrapper_defaults_are_the_specs(name: str) -> None:
    spec = get_op(name)
    sig = inspect.signature(getattr(pk, name))
    for param, default in spec.params.items():
        declared = sig.parameters[param].default
        assert declared is not inspect.Parameter.empty, f"pk.{name} lacks {param}="
        assert type(declared) is type(default) and declared == default, (
            f"pk.{name}({param}={declared!r}) but the spec's default is {default!r}")


def test_the_default_written_or_not_gives_one_plan_and_one_result() -> None:
    from portakern.runtime import plan as plans

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    plain = pk.attention(q, q, q, backend="numpy")
    spelled = pk.attention(q, q, q, causal=False, mask=None, scale=None, backend="numpy")
    np.testing.assert_array_equal(plain, spelled)
    key = plans.plan_key(get_op("attention"), (q, q, q), {}, "numpy")
    assert plans.PLANS.lookup(key) is not None
    # a value equal to the default but of another type is still passed, and refused
    with pytest.raises(pk.InvalidArgumentError):
        pk.softmax(q, axis=True, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError):
        pk.attention(q, q, q, causal=0, backend="numpy")
