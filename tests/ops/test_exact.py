"""Exact properties: results that must hold bit-for-bit (or to one rounding), on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import EDGE_SIZES

from _oracle import supports

sizes = st.sampled_from(EDGE_SIZES)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@given(m=sizes, k=sizes, n=sizes, seed=st.integers(0, 2**31 - 1))
def test_integer_matmul_is_exact(target: str, dtype: str, m: int, k: int, n: int,
                                 seed: int) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, (m, k)).astype(dtype)
    b = rng.integers(-8, 9, (k, n)).astype(dtype)
    got = pk.matmul(a, b, backend=target)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@given(m=sizes, n=sizes, seed=st.integers(0, 2**31 - 1))
def test_identity_matmul(target: str, dtype: str, m: int, n: int, seed: int) -> None:
    a = dtypes.cast_to(np.random.default_rng(seed).standard_normal((m, n)), dtype)
    eye = np.eye(n).astype(dtypes.info(dtype).storage)
    np.testing.assert_array_equal(pk.matmul(a, eye, backend=target), a)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@given(rows=st.sampled_from([1, 3, 8]), n=st.sampled_from([1, 2, 7, 16, 17, 1000]),
       value=st.sampled_from([0.0, -3.5, 1e4]))
def test_constant_rows_are_uniform(target: str, dtype: str, rows: int, n: int,
                                   value: float) -> None:
    x = np.full((rows, n), value).astype(dtypes.info(dtype).storage)
    y = pk.softmax(x, backend=target).astype(np.float64)
    assert np.all(y == y[:, :1]), "a constant row must give identical weights"
    u = dtypes.info(dtype).unit_roundoff
    np.testing.assert_allclose(y, 1.0 / n, rtol=4 * u)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@given(n=st.sampled_from([2, 17, 256, 1000]), shift=st.sampled_from([64.0, -128.0, 256.0]),
       seed=st.integers(0, 2**31 - 1))
def test_softmax_shift_invariance(target: str, dtype: str, n: int, shift: float,
                                  seed: int) -> None:
    # quarter-integers: x and x + shift are both exact in the dtype, so the rows are equal
    st_ = dtypes.info(dtype).storage
    x = (np.random.default_rng(seed).integers(-16, 16, (4, n)) / 4.0).astype(st_)
    y0 = pk.softmax(x, backend=target).astype(np.float64)
    y1 = pk.softmax((x.astype(np.float64) + shift).astype(st_), backend=target).astype(np.float64)
    np.testing.assert_allclose(y1, y0, rtol=8 * float(np.finfo(np.float32).eps), atol=0)


# 36 shapes, not the 108 of every combination: each new shape is a compilation on the jax
# targets (a pallas interpret one costs ~0.5 s), and the property is about the causal bound,
# which the (sq, sk) grid covers; GQA and an odd head dim each keep one unpadded partner.
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@given(heads=st.sampled_from([(1, 1), (2, 3)]),
       sq=st.sampled_from([1, 5, 17]), sk=st.sampled_from([1, 4, 33]),
       d=st.sampled_from([8, 59]), seed=st.integers(0, 2**31 - 1))
def test_causal_row_zero_is_v0(target: str, dtype: str, heads: tuple[int, int], sq: int,
                               sk: int, d: int, seed: int) -> None:
    hkv, group = heads
    rng = np.random.default_rng(seed)
    cast = lambda s: dtypes.cast_to(rng.standard_normal(s), dtype)  # noqa: E731
    q, k, v = cast((2, hkv * group, sq, d)), cast((2, hkv, sk, d)), cast((2, hkv, sk, d))
    o = pk.attention(q, k, v, causal=True, backend=target)
    np.testing.assert_array_equal(o[:, :, 0, :], np.repeat(v[:, :, 0, :], group, axis=1))


@given(sq=st.sampled_from([1, 6, 17]), sk=st.sampled_from([1, 9, 40]),
       seed=st.integers(0, 2**31 - 1))
def test_fully_masked_rows_are_zero(target: str, sq: int, sk: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((1, 2, sq, 16), (1, 2, sk, 16), (1, 2, sk, 16)))
    mask = rng.random((sq, sk)) < 0.5
    mask[0] = False
    o = pk.attention(q, k, v, mask=mask, backend=target)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:, :, 0, :], 0.0)
    np.testing.assert_array_equal(o[:, :, ~mask.any(axis=1), :], 0.0)


def test_all_neg_inf_softmax_row_is_zero(target: str) -> None:
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]], np.float32)
    np.testing.assert_array_equal(pk.softmax(x, backend=target), [[0, 0, 0], [0.5, 0, 0.5]])


def test_nan_propagates_through_softmax(target: str) -> None:
    x = np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]], np.float32)
    y = pk.softmax(x, backend=target)
    assert np.isnan(y[0]).all() and not np.isnan(y[1]).any()


@pytest.mark.parametrize("case", ["k0", "m0", "n0", "batch0"])
def test_zero_size_matmul(target: str, case: str) -> None:
    shapes = {"k0": ((3, 0), (0, 4)), "m0": ((0, 5), (5, 4)), "n0": ((3, 5), (5, 0)),
              "batch0": ((0, 3, 5), (5, 4))}[case]
    a, b = (np.ones(s, np.float32) for s in shapes)
    got = pk.matmul(a, b, backend=target)
    np.testing.assert_array_equal(got, np.matmul(a, b))
    assert got.dtype == np.float32


def test_zero_size_softmax_and_attention(target: str) -> None:
    x = np.ones((0, 5), np.float32)
    assert pk.softmax(x, backend=target).shape == (0, 5)
    q = np.ones((1, 2, 3, 8), np.float32)
    kv = np.ones((1, 2, 0, 8), np.float32)
    o = pk.attention(q, kv, kv, backend=target)
    np.testing.assert_array_equal(o, np.zeros((1, 2, 3, 8), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_output_dtype_is_input_dtype(target: str, dtype: str) -> None:
    st_ = dtypes.info(dtype).storage
    a = np.ones((4, 4), st_)
    assert pk.matmul(a, a, backend=target).dtype == st_
    assert pk.softmax(a, backend=target).dtype == st_
    q = np.ones((1, 1, 4, 4), st_)
    assert pk.attention(q, q, q, backend=target).dtype == st_


@pytest.mark.parametrize("k", [4096, 16384])
def test_integer_matmul_long_k_is_exact(target: str, k: int) -> None:
    """Integers in [-8, 8]: every partial sum stays below 2^24, so every summation order
    (sequential, blocked, pairwise) is exact, however long K is."""
    rng = np.random.default_rng(k)
    a = rng.integers(-8, 9, (3, k)).astype(np.float32)
    b = rng.integers(-8, 9, (k, 5)).astype(np.float32)
    got = pk.matmul(a, b, backend=target)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
