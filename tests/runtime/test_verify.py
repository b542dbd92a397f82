"""pk.verify: the suite's two checks as a public API (portakern/runtime/verify.py).

What the statistical check must do (issue 14): in float32 at K = 4096 and 16384, catch results
from TF32-rounded inputs, bf16-rounded inputs, a dropped K term and fp16 accumulation — all of
which the worst-case bound lets through — and never fire on correct results (the float64
result rounded, numpy/OpenBLAS, every backend) on normal, all-positive and +-1e4-offset data.
pk.verify uses the order-free model (any summation order): it cannot see TF32 on data without
cancellation. The ordered model of matmul.c's own order (issue 26: the suite and `portakern
check` on C-kernel backends) and its power: tests/runtime/test_statistical_power.py.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import portakern as pk
from portakern.ops import get_op
from portakern.ops.matmul import matmul_values
from portakern.runtime import selection
from portakern.runtime.verify import ALPHA, Verdict, compare_arrays, own_kernel, tau

LONG = (4096, 16384)
M, N = 4, 24  # 96 independent elements: tau(96) = 2.24


def _tf32(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _fp16_accumulation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = np.zeros((a.shape[0], b.shape[1]), np.float16)
    for k in range(a.shape[1]):  # products exact in fp32, every partial sum rounded to fp16
        acc = (acc.astype(np.float32) + np.outer(a[:, k], b[k])).astype(np.float16)
    return acc.astype(np.float32)


def _operands(kind: str, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, k, len(kind)])
    if kind == "offset-one":  # one operand around 1e4, the other centred: cancellation
        a = (rng.standard_normal((M, k)) + 1e4).astype(np.float32)
        return a, rng.standard_normal((k, N)).astype(np.float32)
    if kind == "offset-both":  # both around +-1e4: every product ~ -1e8, no cancellation
        a = (rng.standard_normal((M, k)) + 1e4).astype(np.float32)
        return a, (rng.standard_normal((k, N)) - 1e4).astype(np.float32)
    return matmul_values(rng, kind, (M, k), (k, N), "float32")


def _bad_results(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return {
        "tf32 inputs": (_tf32(a).astype(np.float64) @ _tf32(b).astype(np.float64)),
        "bf16 inputs": (_bf16(a).astype(np.float64) @ _bf16(b).astype(np.float64)),
        "one K term dropped": a64 @ b64 - np.outer(a64[:, a.shape[1] // 2], b64[a.shape[1] // 2]),
        "fp16 accumulation": _fp16_accumulation(a, b),
    }


# --- catches what the worst-case bound lets through -------------------------------------

@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", ["normal", "offset-one"])
def test_statistical_check_catches_what_the_bound_lets_through(k: int, kind: str) -> None:
    a, b = _operands(kind, k)
    for name, bad in _bad_results(a, b).items():
        v = pk.verify("matmul", a, b, got=bad.astype(np.float32))
        assert not v.ok, f"{name} at K={k} ({kind}) passed: {v}"
        if np.isfinite(bad).all():  # fp16 overflow to inf is the worst-case check's to see
            assert v.stat_ratio is not None and v.stat_ratio > 1, f"{name}: {v}"
        if name in ("tf32 inputs", "bf16 inputs"):  # the guarantee alone cannot see these
            assert v.worst_ratio <= 1, f"{name} K={k} {kind}: worst-case already fails: {v}"


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", ["positive", "offset-both"])
def test_structured_data_bf16_dropped_term_fp16_caught(k: int, kind: str) -> None:
    """All-positive and same-sign-offset data have no cancellation, so a correct *sequential*
    fp32 sum errs about as much as TF32 input rounding (documented in matmul.py): no check that
    admits sequential summation, as pk.verify's order-free model must, can tell those two
    apart (the ordered model of matmul.c's own order can: test_statistical_power.py). The
    other three are caught."""
    a, b = _operands(kind, k)
    for name, bad in _bad_results(a, b).items():
        if name == "tf32 inputs":
            continue
        v = pk.verify("matmul", a, b, got=bad.astype(np.float32))
        assert not v.ok, f"{name} at K={k} ({kind}) passed: {v}"


# --- never fires on a correct result -------------------------------------------------------

FAMILIES = ["normal", "positive", "offset-one", "offset-both", "integer"]


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", FAMILIES)
def test_correct_host_results_pass(k: int, kind: str) -> None:
    a, b = _operands(kind, k, seed=1)
    for name, got in {"float64 result rounded": (a.astype(np.float64) @ b).astype(np.float32),
                      "numpy/OpenBLAS": a @ b}.items():
        v = pk.verify("matmul", a, b, got=got)
        assert v.ok, f"{name} at K={k} ({kind}): {v}"
        assert v.stat_ratio is not None and v.stat_ratio < 0.1, f"{name}: {v}"


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_backend_passes_both_checks(target: str, k: int, kind: str) -> None:
    """pk.verify (order-free) on every backend; a C-kernel backend's result also under the
    ordered model, as the suite and `portakern check` judge it."""
    a, b = _operands(kind, k, seed=2)
    got = pk.matmul(a, b, backend=target)
    v = pk.verify("matmul", a, b, got=got)
    assert v.ok and v.stat_ratio is not None, f"{target} at K={k} ({kind}): {v}"
    be = selection.get(target)
    if own_kernel(be):
        v = compare_arrays(get_op("matmul"), {"a": a, "b": b}, {}, got, ordered=True)
        assert v.ok and v.stat_ratio is not None and v.stat_ratio < 0.5, (
            f"{target} at K={k} ({kind}), ordered model: {v}")
        assert "kernel-order model" in v.checks[-1].detail


def test_own_kernel_means_a_c_kernel_backend(target: str) -> None:
    """The suite's and `portakern check`'s choice of model: the ordered one for a backend
    that compiles the spec's C source, the order-free one for numpy and jax (they evaluate
    the semantics in their library's order)."""
    be = selection.get(target)
    assert own_kernel(be) == (type(be).dialect is not None)


# --- the verdict ------------------------------------------------------------------------

def test_verdict_points_at_the_worst_element() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((17, 300)).astype(np.float32)
    b = rng.standard_normal((300, 9)).astype(np.float32)
    good = a @ b
    v = pk.verify("matmul", a, b, got=good)
    assert isinstance(v, Verdict) and v.ok
    assert [c.name for c in v.checks] == ["worst-case", "statistical"]
    assert all(c.ok and 0 <= c.ratio <= 1 for c in v.checks)
    bad = good.copy()
    bad[11, 4] += 1e-2
    v = pk.verify("matmul", a, b, got=bad)
    assert not v.ok and v.index == (11, 4) and v.checks[0].index == (11, 4)
    assert v.checks[1].index == (11, 4) and v.stat_ratio > 1
    assert "FAILED" in str(v) and "(11, 4)" in str(v)


def test_nan_and_inf_positions_must_match_exactly() -> None:
    a = np.array([[1.0, np.inf], [2.0, 3.0]], np.float32)
    b = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)  # inf * 0 = NaN at (0, 1)
    ref = a.astype(np.float64) @ b
    assert np.isinf(ref[0, 0]) and np.isnan(ref[0, 1])
    assert pk.verify("matmul", a, b, got=ref.astype(np.float32)).ok
    for i, j, value in ((0, 1, 0.0), (0, 0, np.nan), (0, 0, -np.inf), (1, 1, np.nan)):
        got = ref.astype(np.float32)
        got[i, j] = value
        v = pk.verify("matmul", a, b, got=got)
        assert not v.ok and v.index == (i, j), (i, j, value, v)


@pytest.mark.parametrize("op,args,params", [
    ("softmax", [(7, 1000)], {"axis": -1}),
    ("softmax", [(300, 5)], {"axis": 0}),
    ("rmsnorm", [(5, 4097), (4097,)], {}),
    ("attention", [(1, 2, 33, 40), (1, 1, 65, 40), (1, 1, 65, 16)], {"causal": True}),
])
def test_other_ops_have_both_checks(target: str, op: str, args: list, params: dict) -> None:
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s).astype(np.float32) for s in args]
    got = pk.call(op, *xs, backend=target, **params)
    v = pk.verify(op, *xs, got=got, **params)
    assert v.ok and v.stat_ratio is not None and v.stat_ratio < 0.5, f"{op} on {target}: {v}"
    wrong = got.copy()
    wrong.reshape(-1)[0] *= 1 + 1e-3
    assert not pk.verify(op, *xs, got=wrong, **params).ok


def test_the_model_is_the_specs_statistical_field() -> None:
    """Issue 15: an op's model is its KernelSpec's ``statistical``, looked up by no name, so a
    renamed copy computing the same thing keeps it. Issue 26: ``ordered`` picks
    ``statistical_ordered`` where the op has one (matmul), else ``statistical``."""
    from portakern.ops import attention, matmul, rmsnorm, softmax
    from portakern.runtime.verify import statistical_model

    for mod in (matmul, softmax, attention, rmsnorm):
        assert mod.SPEC.statistical is mod.statistical
        assert statistical_model(get_op(mod.SPEC.name)) is mod.statistical
        ordered = getattr(mod, "statistical_ordered", mod.statistical)
        assert statistical_model(get_op(mod.SPEC.name), ordered=True) is ordered
    copy = get_op("matmul").replace(name="my_matmul", doc="renamed")
    assert statistical_model(copy) is matmul.statistical
    assert statistical_model(copy, ordered=True) is matmul.statistical_ordered
    rng = np.random.default_rng(5)
    a = rng.standard_normal((8, 512)).astype(np.float32)
    b = rng.standard_normal((512, 16)).astype(np.float32)
    v = pk.verify(copy, a, b, got=a @ b)
    assert v.ok and v.stat_ratio is not None and len(v.checks) == 2


def _plus_one(xp: object, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a @ b + 1.0


def test_a_copy_with_other_semantics_loses_the_model() -> None:
    """matmul's model describes matmul's rounding errors: a copy given other semantics is
    judged by its tolerance alone (the old name+semantics check's guard), unless it gives a
    model of its own; a user op without one gets the worst-case check only."""
    from portakern.ops import matmul
    from portakern.runtime.verify import statistical_model

    mm = get_op("matmul")
    other = mm.replace(name="matmul_plus_one", semantics=_plus_one)
    assert other.statistical is None and statistical_model(other) is None
    assert other.statistical_ordered is None and statistical_model(other, ordered=True) is None
    # other source: another summation order, so the ordered model goes; the order-free stays
    resourced = mm.replace(name="matmul_v2", source=mm.source.replace("KB1 512", "KB1 256"))
    assert resourced.statistical is matmul.statistical
    assert resourced.statistical_ordered is None
    assert statistical_model(resourced, ordered=True) is matmul.statistical
    assert mm.replace(source=mm.source).statistical_ordered is matmul.statistical_ordered
    rng = np.random.default_rng(6)
    a = rng.standard_normal((8, 512)).astype(np.float32)
    b = rng.standard_normal((512, 16)).astype(np.float32)
    got = (a.astype(np.float64) @ b + 1.0).astype(np.float32)
    v = pk.verify(other, a, b, got=got)
    assert v.ok and v.stat_ratio is None and [c.name for c in v.checks] == ["worst-case"]
    # the same semantics given again, or a model given with the new ones, is kept
    assert mm.replace(semantics=mm.semantics).statistical is matmul.statistical
    own = mm.replace(name="matmul_plus_one", semantics=_plus_one,
                     statistical=matmul.statistical)
    assert statistical_model(own) is matmul.statistical
    assert pk.verify(own, a, b, got=got).stat_ratio is not None
    user = get_op("softmax").replace(name="softmax_copy", semantics=lambda xp, x, axis=-1: x)
    assert statistical_model(user) is None


def _sigma_of_wrong_shape(p: pk.Problem, x: dict, ref: np.ndarray) -> pk.StatModel:
    return pk.StatModel(np.ones(ref.shape[-1] + 1))


def test_a_malformed_ordered_model_is_refused() -> None:
    from _oracle import assert_spec_refused

    bad = get_op("matmul").replace(name="matmul_bad_model",
                                   statistical_ordered=_sigma_of_wrong_shape)
    assert_spec_refused(bad, "statistical_ordered", ["does not broadcast"])


def test_threshold_false_alarm_probability() -> None:
    for g in (1, 10, 100, 1000, 10**5):
        t = tau(g)
        assert t > 1 and math.exp(-(g / 2) * (t - 1 - math.log(t))) <= ALPHA * 1.0001
    assert 46 < tau(1) < 47 and tau(10) > tau(100) > tau(1000) > 1


def test_numpy_readme_example() -> None:
    a = np.random.rand(64, 4096).astype(np.float32)
    b = np.random.rand(4096, 32).astype(np.float32)
    v = pk.verify("matmul", a, b, got=a @ b)
    assert v.ok and v.worst_ratio < 1 and v.stat_ratio < 1 and len(v.index) == 2


# --- refuses bad input like the ops ---------------------------------------------------------

A = np.ones((3, 4), np.float32)
B = np.ones((4, 5), np.float32)


@pytest.mark.parametrize("call,error,words", [
    (lambda: pk.verify("matmul", A, B, got=np.ones((3, 4), np.float32)), pk.ShapeError,
     "(3, 5)"),
    (lambda: pk.verify("matmul", A, B, got=np.ones((3, 5), np.float64)), pk.DTypeError,
     "float32"),
    (lambda: pk.verify("matmul", A, B), pk.InvalidArgumentError, "got="),
    (lambda: pk.verify("matmul", A, B, got=[[0.0] * 5] * 3), pk.NotAnArrayError, "array"),
    (lambda: pk.verify("matmul", A, A, got=np.ones((3, 4), np.float32)), pk.ShapeError,
     "inner"),
    (lambda: pk.verify("matmul", A, B.astype(np.float16), got=np.ones((3, 5), np.float32)),
     pk.DTypeError, "mixed"),
    (lambda: pk.verify("matmul", A, B, got=np.ones((3, 5), np.float32), bogus=1),
     pk.InvalidArgumentError, "bogus"),
    (lambda: pk.verify("softmax", A, got=A, axis=5), pk.InvalidArgumentError, "axis"),
    (lambda: pk.verify("matmul", [[1.0]], B, got=B), pk.NotAnArrayError, "array"),
])
def test_bad_input_is_refused(call, error: type, words: str) -> None:  # noqa: ANN001
    with pytest.raises(error) as exc:
        call()
    assert isinstance(exc.value, pk.PortakernError) and words in str(exc.value)
