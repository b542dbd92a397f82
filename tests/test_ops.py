"""The shared differential suite: every op x backend x dtype against the float64 oracle.

Each property draws shapes that break kernels and values that break numerics
(portakern.cases) and checks the result under the op's derived error bound
(spec.tolerance) — no hand-tuned atol. The same tests run on every registered backend.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
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


# Code paths the two device-class schedules do not take, one configuration each (overlaid on
# the device's schedule): user configs and tuned winners run through them. Few examples each:
# every new shape is a compilation, and the default schedules already get the full profile.
ALTERNATIVE_CONFIGS = {
    "matmul": [
        {"PACK_B": 0},  # the CPU micro-kernel reading B in place, with its scalar right edge
        {"TM": 8, "TN": 2, "LY": 2},  # two rows of items per group, a narrower register block
        {"VEC": 1, "TM": 4, "TN": 4, "LX": 4, "LY": 4},  # the scalar direct path, packed B
        {"USE_LOCAL": 1, "LX": 8, "LY": 8, "TM": 2, "TN": 2, "TK": 8, "VEC": 1},  # local tiles
    ],
    "softmax": [
        {"STORE_EXP": 0},  # the one-read online path with vectors
        {"WG": 64, "VEC": 4, "UNROLL": 2},  # many items per row, exp-once
    ],
    "attention": [
        {"PACK_KV": 0, "BQ": 8, "BK": 16},  # vector path staging tiles in local memory
        {"TQ": 2, "RQ": 4, "BK": 32},  # several small register blocks per item
        {"TQ": 8, "RQ": 1},  # one large block
        {"VEC": 8, "BK": 16, "TQ": 6, "RQ": 2},
        {"VEC": 1, "TQ": 2, "RQ": 2, "BQ": 4, "BK": 16},  # the scalar path, 4 queries per item
    ],
}


@pytest.mark.parametrize("op,overlay", [(op, cfg) for op, cfgs in ALTERNATIVE_CONFIGS.items()
                                        for cfg in cfgs],
                         ids=[f"{op}-{'-'.join(f'{k}{v}' for k, v in cfg.items())}"
                              for op, cfgs in ALTERNATIVE_CONFIGS.items() for cfg in cfgs])
@settings(max_examples=15)
@given(data=st.data())
def test_alternative_configs_match_oracle(op: str, overlay: dict[str, int], kernel_target: str,
                                          data: st.DataObject) -> None:
    from portakern import selection
    from portakern.ops import get_op

    be = selection.get(kernel_target)
    spec = get_op(op)
    config = {**spec.schedules[be.device_class], **overlay}
    case = draw_case(op, data, "float32")
    got = pk.call(spec, backend=be, config=config, **case.arrays, **case.params)
    v = compare(spec, case, got)
    assert v.ok, f"{op} with {config} on {kernel_target}: ratio {v.worst_ratio:.3g} {v.where}"
