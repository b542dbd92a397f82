"""rmsnorm beyond the shared differential suite (which draws it from its spec's own `cases`):
exact properties on every backend, its validation errors, the overflow-safe path, every
work-group size on the C-kernel backends, and composition with jax.jit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.tools.cases import compare

from _oracle import supports
from conftest import require_simulator

ALL = ["float32", "float16", "bfloat16", "float64"]
SIZES = st.sampled_from([1, 2, 3, 16, 17, 255, 257, 1000])


def _st(dtype: str) -> np.dtype:
    return dtypes.info(dtype).storage


# --- exact properties -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL)
@settings(max_examples=8)
@given(n=SIZES, k=st.sampled_from([0, -10, 6, 70]), sign=st.sampled_from([1.0, -1.0]),
       seed=st.integers(0, 2**31 - 1))
def test_constant_power_of_two_rows_give_sign_times_weight(target: str, dtype: str, n: int,
                                                           k: int, sign: float,
                                                           seed: int) -> None:
    """x = +-2^k everywhere: n * 4^k sums exactly, sqrt(4^k) = 2^k exactly, and eps = 1e-30
    is below half an ulp of 4^k, so y = sign * w bit for bit (2^70 takes the scaled path)."""
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    if dtype == "float16" and abs(k) > 6:
        pytest.skip("2^70 and 2^-10 squared are outside what float16 storage exercises here")
    x = np.full((3, n), sign * 2.0**k).astype(_st(dtype))
    w = dtypes.cast_to(np.random.default_rng(seed).standard_normal(n), dtype)
    y = pk.rmsnorm(x, w, eps=1e-30, backend=target)
    np.testing.assert_array_equal(y.astype(np.float64),
                                  np.broadcast_to(sign * w.astype(np.float64), (3, n)))


@pytest.mark.parametrize("dtype", ALL)
def test_zero_rows_give_zeros(target: str, dtype: str) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    x = np.zeros((4, 33), _st(dtype))
    x[1] = 1.0  # the other rows must not see this one (eps below half an ulp of 1)
    y = pk.rmsnorm(x, np.full(33, 2.0, _st(dtype)), eps=1e-30, backend=target).astype(np.float64)
    assert np.all(y[[0, 2, 3]] == 0.0)
    np.testing.assert_array_equal(y[1], 2.0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@settings(max_examples=6)
@given(n=SIZES, k=st.sampled_from([1, 5, 10]), seed=st.integers(0, 2**31 - 1))
def test_scale_invariance(target: str, dtype: str, n: int, k: int, seed: int) -> None:
    """weight = 1: rmsnorm(2^k x, eps 4^k) == rmsnorm(x, eps) bit for bit — every intermediate
    scales by an exact power of two (max|x| >= 2 keeps the XLA form's scale branch fixed)."""
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    x = np.random.default_rng(seed).standard_normal((2, n))
    x[:, 0] = 2.0
    x = dtypes.cast_to(x, dtype)
    ones = np.ones(n, _st(dtype))
    y0 = pk.rmsnorm(x, ones, eps=1e-4, backend=target)
    xs = (x.astype(np.float64) * 2.0**k).astype(_st(dtype))
    y1 = pk.rmsnorm(xs, ones, eps=1e-4 * 4.0**k, backend=target)
    np.testing.assert_array_equal(y1.astype(np.float64), y0.astype(np.float64))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_element_makes_its_row_nan(target: str, bad: float) -> None:
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    w = np.ones(40, np.float32)
    clean = pk.rmsnorm(x, w, backend=target)
    x[1, 7] = bad
    y = pk.rmsnorm(x, w, backend=target)
    assert np.all(np.isnan(y[1]))
    np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])


def test_any_rank_is_rows_of_the_last_axis(target: str) -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 17)).astype(np.float32)
    w = np.linspace(-2, 2, 17).astype(np.float32)
    flat = pk.rmsnorm(x.reshape(6, 17), w, backend=target)
    np.testing.assert_array_equal(pk.rmsnorm(x, w, backend=target), flat.reshape(2, 3, 17))
    np.testing.assert_array_equal(pk.rmsnorm(x[0, 0], w, backend=target), flat[0])


# --- the overflow-safe path and extreme magnitudes ---------------------------------------
@pytest.mark.parametrize("dtype,values", [
    ("float32", [3e38, -1e30, 1.0, 1e-30]),   # squares overflow / underflow float32
    ("bfloat16", [3e38, 1e25, -2.0, 0.0]),
    ("float16", [65504.0, -6e-8, 1.0, 3e4]),  # fp16 max and subnormal
    ("float64", [1e308, -1e200, 1.0, 1e-300]),
])
def test_extreme_magnitudes_match_the_oracle(target: str, dtype: str,
                                              values: list[float]) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    rng = np.random.default_rng(2)
    x = dtypes.cast_to(rng.choice(values, size=(5, 300)) * rng.choice([1, -1], (5, 300)), dtype)
    w = dtypes.cast_to(rng.standard_normal(300), dtype)
    case = Case({"x": x, "weight": w}, {"eps": 1e-6})
    v = compare(get_op("rmsnorm"), case, pk.rmsnorm(x, w, backend=target))
    assert v.ok, f"{target} {dtype}: ratio {v.worst_ratio:.3g} {v.where}"


@pytest.mark.parametrize("wg,n", [(1, 24), (4, 1000), (4, 8192)])
@pytest.mark.parametrize("odd", ["large", "inf", "nan"])
def test_one_extreme_element_in_a_normal_row(kernel_target: str, wg: int, n: int,
                                             odd: str) -> None:
    """The vector path sums plain squares and redoes an item's sum with Blue's split only
    when it saw |x| > big: one 1e30 (or inf, or NaN) in a row of normal values, in the
    vector tail (n = 24, VEC 8: three vectors, all tail), or in one item of four beside
    items that stay on the fast path (WG 4) — the rows must match the oracle (a NaN or inf
    makes its row NaN)."""
    spec = get_op("rmsnorm")
    rng = np.random.default_rng(n + wg)
    x = rng.standard_normal((3, n))
    x[1, 17 % n] = {"large": 1e30, "inf": np.inf, "nan": np.nan}[odd]
    x[2, n - 3] = -1e30
    x32, w = x.astype(np.float32), rng.standard_normal(n).astype(np.float32)
    got = pk.rmsnorm(x32, w, backend=kernel_target, config={"WG": wg, "VEC": 8})
    v = compare(spec, Case({"x": x32, "weight": w}, {"eps": 1e-6}), got)
    assert v.ok, f"WG={wg} n={n} {odd}: ratio {v.worst_ratio:.3g} {v.where}"


@pytest.mark.simulator
def test_the_vector_path_on_the_simulator() -> None:
    """The CPU vector path (WG 1 and 4, VEC 8) on Oclgrind, which raises on any out-of-bounds
    or uninitialised read: rows of 24, 40 and 41 (a scalar tail), each with a 1e30, an inf or
    a NaN beside normal values, and a row of 2 (no vector at all)."""
    require_simulator()
    spec, rng = get_op("rmsnorm"), np.random.default_rng(7)
    for wg, n in ((1, 24), (4, 40), (1, 41), (2, 2)):
        for odd in (1e30, np.inf, np.nan):
            x = rng.standard_normal((2, n)).astype(np.float32)
            x[1, n // 2] = odd
            w = rng.standard_normal(n).astype(np.float32)
            got = pk.rmsnorm(x, w, backend="opencl:oclgrind", config={"WG": wg, "VEC": 8})
            v = compare(spec, Case({"x": x, "weight": w}, {"eps": 1e-6}), got)
            assert v.ok, f"WG={wg} n={n} {odd}: ratio {v.worst_ratio:.3g} {v.where}"


@pytest.mark.parametrize("wg", [1, 2, 64, 1024])
def test_every_work_group_size(kernel_target: str, wg: int) -> None:
    spec = get_op("rmsnorm")
    rng = np.random.default_rng(wg)
    for n in (1, wg - 1 or 1, wg + 1, 1000):
        x = rng.standard_normal((3, n)).astype(np.float32)
        w = rng.standard_normal(n).astype(np.float32)
        got = pk.rmsnorm(x, w, backend=kernel_target, config={"WG": wg})
        v = compare(spec, Case({"x": x, "weight": w}, {"eps": 1e-6}), got)
        assert v.ok, f"WG={wg} n={n}: ratio {v.worst_ratio:.3g} {v.where}"


# --- validation: before any backend is touched ---------------------------------------------
X = np.ones((4, 8), np.float32)
W = np.ones(8, np.float32)
BAD = {
    "weight too short": ((X, W[:7]), {}, pk.ShapeError, ["weight", "(8,)", "(7,)"]),
    "weight 2-D": ((X, X), {}, pk.ShapeError, ["weight", "(8,)", "(4, 8)"]),
    "x scalar": ((np.float32(1.0), W[:1]), {}, pk.ShapeError, ["rank >= 1"]),
    "mixed dtypes": ((X, W.astype(np.float16)), {}, pk.DTypeError,
                     ["mixed", "x=float32", "weight=float16"]),
    "integer x": ((X.astype(np.int32), W.astype(np.int32)), {}, pk.DTypeError, ["int32"]),
    "eps zero": ((X, W), {"eps": 0.0}, pk.InvalidArgumentError, ["eps", "> 0", "eps=1e-6"]),
    "eps negative": ((X, W), {"eps": -1e-6}, pk.InvalidArgumentError, ["eps", "> 0"]),
    "eps nan": ((X, W), {"eps": float("nan")}, pk.InvalidArgumentError, ["finite"]),
    "eps inf": ((X, W), {"eps": float("inf")}, pk.InvalidArgumentError, ["finite"]),
    "eps bool": ((X, W), {"eps": True}, pk.InvalidArgumentError, ["real number", "bool"]),
    "eps string": ((X, W), {"eps": "1e-6"}, pk.InvalidArgumentError, ["real number", "str"]),
    "eps below float32's normal range": ((X, W), {"eps": 1e-300}, pk.InvalidArgumentError,
                                         ["normal number", "float32"]),
    "eps list": ((X, W), {"eps": [1e-6]}, pk.InvalidArgumentError, ["real number"]),
    "unknown tunable": ((X, W), {"config": {"TILE": 4}}, pk.InvalidArgumentError,
                        ["TILE", "WG"]),
    "tunable outside domain": ((X, W), {"config": {"WG": 3}}, pk.InvalidArgumentError,
                               ["WG=3", "domain"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_calls_raise_before_dispatch(target: str, name: str) -> None:
    args, kw, exc, words = BAD[name]
    with pytest.raises(exc) as info:
        pk.rmsnorm(*args, backend=target, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_empty_inputs_give_empty_outputs(target: str) -> None:
    assert pk.rmsnorm(np.ones((0, 8), np.float32), W, backend=target).shape == (0, 8)
    assert pk.rmsnorm(np.ones((3, 0), np.float32), W[:0], backend=target).shape == (3, 0)


def test_cost_counts_compulsory_traffic() -> None:
    spec = get_op("rmsnorm")
    p = spec.problem(*spec.bind((np.ones((64, 4096), np.float16), np.ones(4096, np.float16)),
                                {}))
    c = spec.cost(p)
    assert c.bytes == (2 * 64 * 4096 + 4096) * 2 and c.flops >= 4 * 64 * 4096


def test_composes_with_jax_jit() -> None:
    if not pk.backends()["jax"]["available"]:
        pytest.skip("jax unavailable: " + pk.backends()["jax"]["reason"])
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 64)), jnp.float32)
    w = jnp.ones(64, jnp.float32)
    f = jax.jit(lambda a, b: pk.rmsnorm(a, b, eps=1e-5, backend="jax") * 2)
    ref = pk.rmsnorm(np.asarray(x), np.asarray(w), eps=1e-5, backend="numpy") * 2
    np.testing.assert_allclose(np.asarray(f(x, w)), ref, rtol=1e-5)
