"""The shared differential suite: every op x backend x dtype against the float64 oracle.

Each property draws shapes that break kernels and values that break numerics
(portakern.tools.cases) and checks the result under the op's derived error bound
(spec.tolerance) — no hand-tuned atol. The same tests run on every registered backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core.sampling import Case
from portakern.ops import OPS
from portakern.ops.matmul import LONG_K, matmul_values

from _oracle import check_case, compare_case, draw_case, supports

DTYPES = ["float32", "float16", "bfloat16", "float64"]
# Every op in the registry (built-ins, rmsnorm, entry-point plugins) — no list to keep in sync;
# each draws from its generator (portakern.tools.cases.CASES: built-in table, else the spec's own).
OP_NAMES = list(OPS)

# The ops whose cases compile a kernel variant almost every time (head dims, value dims,
# GQA groups, windows and layouts are compile-time constants of the attention kernels) run
# these two properties with their own example count: on a fresh CI machine every compile is
# cold, and under the CI profile's 100 they alone took most of the CI budget. Every mutant and
# targeted test of these ops runs in full; the thorough profile is for long runs of everything.
HEAVY_EXAMPLES = 40
HEAVY = ("attention", "paged_attention", "attention_backward")
LIGHT_OPS = [op for op in OP_NAMES if op not in HEAVY]
HEAVY_OPS = [op for op in OP_NAMES if op in HEAVY]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", LIGHT_OPS)
@given(data=st.data())
def test_matches_oracle(op: str, dtype: str, target: str, data: st.DataObject) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    check_case(op, target, draw_case(op, data, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", HEAVY_OPS)
@settings(max_examples=HEAVY_EXAMPLES)
@given(data=st.data())
def test_heavy_op_matches_oracle(op: str, dtype: str, target: str, data: st.DataObject) -> None:
    """test_matches_oracle for the HEAVY ops, at their own example count."""
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    check_case(op, target, draw_case(op, data, dtype))


def _schedule_case(op: str, schedule: str, kernel_target: str, data: st.DataObject) -> None:
    from portakern.ops import get_op
    from portakern.runtime import selection

    be = selection.get(kernel_target)
    spec = get_op(op)
    case = draw_case(op, data, "float32")
    got = pk.call(spec, backend=be, config=spec.config(schedule), **case.arrays, **case.params)
    v = compare_case(spec, case, got, be)
    assert v.ok, f"{op}/{schedule} on {kernel_target}: {case.describe()}\n{v}"


@pytest.mark.parametrize("schedule", ["cpu", "gpu"])
@pytest.mark.parametrize("op", LIGHT_OPS)
@given(data=st.data())
def test_every_schedule_matches_oracle(op: str, schedule: str, kernel_target: str,
                                       data: st.DataObject) -> None:
    """Both device-class schedules run on every C-kernel device (a GPU-style local-memory
    schedule is still correct on a CPU runtime, and vice versa)."""
    _schedule_case(op, schedule, kernel_target, data)


@pytest.mark.parametrize("schedule", ["cpu", "gpu"])
@pytest.mark.parametrize("op", HEAVY_OPS)
@settings(max_examples=HEAVY_EXAMPLES)
@given(data=st.data())
def test_every_schedule_heavy_op(op: str, schedule: str, kernel_target: str,
                                 data: st.DataObject) -> None:
    """test_every_schedule_matches_oracle for the HEAVY ops, at their own example count."""
    _schedule_case(op, schedule, kernel_target, data)


# Code paths the two device-class schedules do not take, one configuration each (overlaid on
# the device's schedule): user configs and tuned winners run through them. Few examples each:
# every new shape is a compilation, and the default schedules already get the full profile.
ALTERNATIVE_CONFIGS = {
    "matmul": [
        {"PACK_B": 0},  # the CPU micro-kernel reading B in place, with its scalar right edge
        # B packed into panels: the CPU schedule's choice for a B over PACK_MIN_BYTES (768
        # KiB), which only the long-K drawn cases reach
        {"PACK_B": 1},
        {"TM": 8, "TN": 2, "LY": 2},  # two rows of items per group, a narrower register block
        {"TN": 2, "VEC": 8},  # the cpu256 schedule (AVX2): 6x16 per item; or cpu on AVX2
        {"VEC": 1, "TM": 4, "TN": 4, "LX": 4, "LY": 4},  # the scalar direct path, packed B
        {"USE_LOCAL": 1, "LX": 8, "LY": 8, "TM": 2, "TN": 2, "TK": 8, "VEC": 1},  # local tiles
    ],
    "softmax": [
        {"STORE_EXP": 0},  # the one-read online path with vectors
        {"WG": 64, "VEC": 4, "UNROLL": 2},  # many items per row, exp-once
        # exp twice, the output streamed out (the CPU schedule's choice for outputs of 32 MiB
        # and more); rows not aligned to a vector (n % 16 != 0) keep it in cache
        {"STORE_EXP": 1, "VEC": 16, "WG": 1, "STREAM": 1},
    ],
    "attention": [
        {"PACK_KV": 0, "BQ": 8, "BK": 16},  # vector path staging tiles in local memory
        {"TQ": 2, "RQ": 4, "BK": 32},  # small register blocks: the cpu256 schedule (AVX2)
        {"TQ": 8, "RQ": 1},  # one large block
        {"VEC": 8, "BK": 16, "TQ": 6, "RQ": 2},
        {"VEC": 1, "TQ": 2, "RQ": 2, "BQ": 4, "BK": 16},  # the scalar path, 4 queries per item
        {"SPLIT": 4, "BK": 16},  # split-K: four key ranges merged by attention_combine
        {"SPLIT": 2, "VEC": 1, "TQ": 1, "RQ": 1, "BQ": 16, "BK": 8, "PACK_KV": 0},  # GPU path
    ],
    # groups of kv heads a work-group (HEADS: the CPU schedule's choice from 32 MiB of pages,
    # which the drawn cases never reach): every page for each head of the group in turn
    "paged_attention": [
        {"HEADS": 8, "SPLIT": 1},  # all of a drawn layout's kv heads (1, 2 or 4) in one group
        {"HEADS": 2, "SPLIT": 4},  # groups of 2 and key splits
        {"HEADS": 2, "WG": 32, "VEC": 1, "RB": 4, "SPLIT": 1},  # the scalar (GPU) path
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
    from portakern.ops import get_op
    from portakern.runtime import selection

    be = selection.get(kernel_target)
    spec = get_op(op)
    config = {**spec.schedules[be.device_class], **overlay}
    case = draw_case(op, data, "float32")
    got = pk.call(spec, backend=be, config=config, **case.arrays, **case.params)
    v = compare_case(spec, case, got, be)
    assert v.ok, f"{op} with {config} on {kernel_target}: {case.describe()}\n{v}"


# Long reductions in every run, whatever hypothesis draws: each value family at K = 4096 and
# 16384 (the generator draws them too, but a derandomized profile need not), through the same
# two checks (worst-case bound and statistical; portakern.verify).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("values", ["normal", "positive", "integer", "offset", "nonfinite"])
@pytest.mark.parametrize("k", LONG_K)
def test_long_matmul_matches_oracle(target: str, k: int, values: str, dtype: str) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    rng = np.random.default_rng([k, len(values), len(dtype)])
    a, b = matmul_values(rng, values, (3, k), (k, 33), dtype)
    check_case("matmul", target, Case({"a": a, "b": b}, {}, f"long, {values}"))


# --- issue 14: long reductions as accurate as the vendor libraries (blocked sums) -----------

def test_matmul_k_1e6_within_10x_of_openblas(kernel_target: str) -> None:
    """1 x K @ K x 1, positive data, K = 10^6: a single running sum errs by ~1e-4 relative;
    the blocked sum (matmul.c) must be within 10x of numpy/OpenBLAS on the same data."""
    rng = np.random.default_rng(14)
    k = 10**6
    a = rng.random((1, k)).astype(np.float32)
    b = rng.random((k, 1)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    ours = abs(float(pk.matmul(a, b, backend=kernel_target)[0, 0]) / ref[0, 0] - 1)
    blas = abs(float((a @ b)[0, 0]) / ref[0, 0] - 1)
    assert ours <= 10 * max(blas, 2.0**-24), f"relative error {ours:.3g} vs numpy {blas:.3g}"


def test_softmax_1e6_row_within_1e5_of_float64(kernel_target: str) -> None:
    """(float32: in fp16 the outputs of a 10^6 row, ~1e-6, are subnormal.)"""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((1, 10**6)).astype(np.float32)
    ref = OPS["softmax"].semantics(np, x.astype(np.float64))
    got = pk.softmax(x, backend=kernel_target).astype(np.float64)
    rel = np.abs(got / ref - 1)
    assert rel.max() <= 1e-5, f"max relative error {rel.max():.3g}"
    # the sum's own error is shared by the whole row: the median ratio isolates it (blocked
    # sums: 1.3e-7; one running sum per lane, before issue 14: 6.3e-7)
    assert abs(float(np.median(got / ref)) - 1) <= 3e-7


def test_rmsnorm_1e6_row_is_accurate(kernel_target: str) -> None:
    rng = np.random.default_rng(16)
    x = (rng.random((1, 10**6)) + 1.0).astype(np.float32)  # positive squares: no cancellation
    w = np.ones(10**6, np.float32)
    ref = OPS["rmsnorm"].semantics(np, x.astype(np.float64), w.astype(np.float64))
    rel = np.abs(pk.rmsnorm(x, w, backend=kernel_target).astype(np.float64) / ref - 1)
    # blocked sums: 2.0e-7; one running sum per item, before issue 14: 1.0e-6
    assert rel.max() <= 5e-7, f"max relative error {rel.max():.3g}"
