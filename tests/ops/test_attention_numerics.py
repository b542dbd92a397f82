"""Attention's non-finite and range semantics (README, "Semantics and dtypes"), on every target.

Deterministic regressions for the cases of issue 14 (huge finite scales: NaN on jax and
Pallas; NaN in a q row: finite on jax, zeros on Pallas; +inf in k: zeros on Pallas; bf16
q.k beyond float32 with a small scale: NaN on jax, 0 on Pallas) and issue 19 item 7 (a fully
masked row was NaN on the oracle and jax when v held a NaN anywhere). Each case is checked by
the shared comparison (NaN exactly where the oracle has NaN, the same infinities, values in
the derived bound) and by the property it is about, on the default schedule and, on C-kernel
targets, on every code path of the kernel (packed and staged vector tiles, the scalar path,
the GPU schedule). The hypothesis suite (test_ops.py) draws the same families at random from
portakern.tools.cases.attention_case. One key (Sk = 1) with a non-finite v gave garbage on
jax:cpu (XLA:CPU folding exp of a NaN constant; docs/guarantees.md): pinned below.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import portakern as pk
from portakern.core.sampling import Case, NumpyChooser
from portakern.ops import get_op
from portakern.ops.attention import MAX_SOFTCAP
from portakern.runtime import selection
from portakern.tools.cases import CASES, compare

SPEC = get_op("attention")
# the kernel's code paths, overlaid on the target's schedule (the default is the first)
PATHS = {
    "default": {},
    "gpu-schedule": None,  # the whole GPU schedule: scalar path, staged tiles, BQ items
    "staged-vector": {"PACK_KV": 0, "BQ": 8, "BK": 16},
    "scalar": {"VEC": 1, "TQ": 2, "RQ": 2, "BQ": 4, "BK": 16},
}


def _normal(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _qkv(seed: int = 0, shape: tuple[int, ...] = (1, 2, 64, 64)
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _normal(shape, seed), _normal(shape, seed + 1), _normal(shape, seed + 2)


def _case(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None,
          **params: object) -> Case:
    return Case({"q": q, "k": k, "v": v, "mask": mask},
                {"causal": bool(params.get("causal", False)), "scale": params.get("scale")})


def _run(target: str, case: Case, path: str = "default") -> np.ndarray:
    be = selection.get(target)
    config = None
    if path != "default":
        config = dict(SPEC.schedules["gpu"]) if PATHS[path] is None else \
            {**SPEC.schedules[be.device_class], **PATHS[path]}
    kw = {"config": config} if config else {}
    got = pk.call(SPEC, backend=be, **kw, **case.arrays, **case.params)
    v = compare(SPEC, case, got)
    assert v.ok, f"attention on {target} ({path}): ratio {v.worst_ratio:.3g} {v.where}"
    return np.asarray(got).astype(np.float64)


def _oracle(case: Case) -> np.ndarray:
    return pk.call(SPEC, backend="numpy", **case.arrays, **case.params).astype(np.float64)


# --- the cases -------------------------------------------------------------------------------
def case_huge_scale(scale: float) -> Case:
    return _case(*_qkv(), scale=scale)


def case_nan_in_q_row() -> Case:
    q, k, v = _qkv()
    q[0, 0, 3, 5] = np.nan
    return _case(q, k, v)


def case_posinf_in_k() -> Case:
    q, k, v = _qkv()
    k[0, 0, 7, 5] = np.inf
    return _case(q, k, v)


def case_bf16_beyond_fp32() -> Case:
    """bf16 q.k about 1e39 (beyond float32), scale 1e-10: scale * q first keeps it finite."""
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    q = (np.abs(rng.standard_normal((1, 2, 8, 16))) * 3e18).astype(bf)
    k = (np.abs(rng.standard_normal((1, 2, 8, 16))) * 3e18).astype(bf)
    v = rng.standard_normal((1, 2, 8, 16)).astype(bf)
    return _case(q, k, v, scale=1e-10)


def case_masked_rows_bad_v() -> Case:
    """Row 5 fully masked, row 6 does not attend key 10 whose v holds NaN, key 20's v holds
    +inf (head 1): fully masked rows are 0, rows that skip the bad keys are finite."""
    q, k, v = _qkv(shape=(1, 2, 40, 24))
    v[0, 0, 10, 3] = np.nan
    v[0, 1, 20, 0] = np.inf
    mask = np.ones((40, 40), bool)
    mask[5, :] = False
    mask[6, 10] = False
    mask[6, 20] = False
    mask[:, 30:] = False  # every tile has masked keys; keys 30.. are never attended
    v[0, :, 33, :] = np.nan
    return _case(q, k, v, mask)


def case_row_scores_all_neginf() -> Case:
    """+inf at q[.., 9, 2] and k[.., :, 2] < 0: every score of row 9 is -inf, the row has
    nothing to attend and is 0; the other rows stay finite (no mask, 64 keys: whole tiles of
    every schedule, so the kernel's unmasked path takes it)."""
    q, k, v = _qkv(shape=(1, 1, 64, 16))
    q[0, 0, 9, 2] = np.inf
    k[0, 0, :, 2] = -np.abs(k[0, 0, :, 2]) - 0.5
    return _case(q, k, v)


def case_neginf_score_drops_key() -> Case:
    """k[.., 11, 0] = -inf and q[.., 0] > 0 in every row: key 11 scores -inf everywhere and
    is dropped, as if masked; its v holds nothing special."""
    q, k, v = _qkv(shape=(1, 1, 20, 8))
    q[..., 0] = np.abs(q[..., 0]) + 0.25
    k[0, 0, 11, 0] = -np.inf
    return _case(q, k, v)


def case_causal_bad_keys_after_the_query() -> Case:
    """Causal, no mask, 64 keys (whole tiles of every schedule: the CPU kernels' diagonal
    tile takes its vector select, not the key-by-key path): key 40's k row is NaN (head 0)
    and key 50's k holds +inf (head 1). Only the rows that attend such a key may be poisoned:
    a key after the query must drop out however it scores, as a -inf, never as a sum with
    one (NaN + -inf is NaN)."""
    q, k, v = _qkv(shape=(1, 2, 64, 64))
    k[0, 0, 40, :] = np.nan
    k[0, 1, 50, 5] = np.inf
    return _case(q, k, v, causal=True)


CASES_BY_NAME = {
    "scale=1e8": lambda: case_huge_scale(1e8),
    "scale=1e12": lambda: case_huge_scale(1e12),
    "scale=1e30": lambda: case_huge_scale(1e30),
    "nan-in-q-row": case_nan_in_q_row,
    "posinf-in-k": case_posinf_in_k,
    "bf16-beyond-fp32": case_bf16_beyond_fp32,
    "masked-rows-bad-v": case_masked_rows_bad_v,
    "row-scores-all-neginf": case_row_scores_all_neginf,
    "neginf-score-drops-key": case_neginf_score_drops_key,
    "causal-bad-keys-after-the-query": case_causal_bad_keys_after_the_query,
}


def _properties(name: str, case: Case, got: np.ndarray) -> None:
    """What each case is about, beyond matching the oracle."""
    if name.startswith("scale="):
        assert np.isfinite(got).all(), f"{name}: {int((~np.isfinite(got)).sum())} non-finite"
    elif name == "nan-in-q-row":
        assert np.isnan(got[0, 0, 3]).all()
        rest = np.ones(got.shape[:-1], bool)
        rest[0, 0, 3] = False
        assert np.isfinite(got[rest]).all()
    elif name == "posinf-in-k":
        q = case.arrays["q"]
        nan_rows = q[0, 0, :, 5] > 0  # the rows whose score of key 7 is +inf
        assert np.isnan(got[0, 0][nan_rows]).all()
        assert np.isfinite(got[0, 0][~nan_rows]).all() and np.isfinite(got[0, 1]).all()
        assert 0 < nan_rows.sum() < 64
    elif name == "bf16-beyond-fp32":
        assert np.isfinite(got).all()
    elif name == "masked-rows-bad-v":
        assert (got[0, :, 5] == 0).all(), "a fully masked row must be 0 whatever v holds"
        assert np.isfinite(got[0, 0, 6]).all() and np.isfinite(got[0, 1, 6]).all()
        assert np.isnan(got[0, 0, 7]).all() and np.isnan(got[0, 1, 7]).all()
    elif name == "row-scores-all-neginf":
        assert (got[0, 0, 9] == 0).all()
        assert np.isfinite(got).all()
    elif name == "causal-bad-keys-after-the-query":
        assert np.isfinite(got[0, 0, :40]).all() and np.isnan(got[0, 0, 40:]).all()
        assert np.isfinite(got[0, 1, :50]).all()
        plus = case.arrays["q"][0, 1, 50:, 5] > 0  # these rows score key 50 +inf: NaN
        assert np.isnan(got[0, 1, 50:][plus]).all() and np.isfinite(got[0, 1, 50:][~plus]).all()
    elif name == "neginf-score-drops-key":
        arrays = dict(case.arrays)
        mask = np.ones((20, 20), bool)
        mask[:, 11] = False
        dropped = _oracle(_case(arrays["q"], arrays["k"], arrays["v"], mask))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, dropped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES_BY_NAME))
def test_nonfinite_and_range_cases(name: str, target: str) -> None:
    case = CASES_BY_NAME[name]()
    if case.arrays["q"].dtype == ml_dtypes.bfloat16 and \
            "bfloat16" not in selection.get(target).supported_dtypes():
        pytest.skip(f"{target} has no bfloat16")
    got = _run(target, case)
    _properties(name, case, got)
    _properties(name, case, _oracle(case))  # the oracle says the same


@pytest.mark.parametrize("path", [p for p in PATHS if p != "default"])
def test_nonfinite_and_range_cases_every_kernel_path(path: str, kernel_target: str) -> None:
    for name, make in CASES_BY_NAME.items():
        case = make()
        _properties(name, case, _run(kernel_target, case, path))


# --- modifier values at the edges of their types ---------------------------------------------
EDGE_MODS = {  # name: (the modifiers, the same call without them: what they must equal)
    "window-right-int32-max": ({"window": (1, 2**31 - 1)}, {"window": 1}),
    "window-both-int32-max": ({"window": (2**31 - 1, 2**31 - 1)}, {}),
    "window-beyond-int32": ({"window": (2**31, 2**40)}, {}),
    "softcap-largest": ({"softcap": MAX_SOFTCAP}, {}),
}


@pytest.mark.parametrize("name", list(EDGE_MODS))
def test_modifier_values_at_the_edges_of_their_types(name: str, target: str) -> None:
    """2**31 - 1 is how users write "no edge", and the largest cap (2**126) caps nothing
    here. jax once dropped every key for window=(1, 2**31 - 1) (i + right overflowed int32),
    raised a raw OverflowError beyond it, and gave every score 0 under a cap of 3e38 (XLA
    flushed s / c, and 1 / c, now refused): each must match the oracle and the call without
    the modifier."""
    mods, plain = EDGE_MODS[name]
    q, k, v = _qkv(shape=(1, 2, 24, 16))
    base = {"q": q, "k": k, "v": v, "mask": None}
    got = _run(target, Case(base, {"causal": False, "scale": None, **mods}))
    want = _run(target, Case(base, {"causal": False, "scale": None, **plain}))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- the comparison sees NaN-ness, infinities and unspecified rows ---------------------------
def test_comparison_is_exact_on_nan_and_inf() -> None:
    case = case_masked_rows_bad_v()
    ref = _oracle(case).astype(np.float32)
    assert compare(SPEC, case, ref).ok
    wrong = ref.copy()
    wrong[0, 0, 7] = 0.0  # a NaN row written as zeros (Pallas' old l > 0 test)
    assert not compare(SPEC, case, wrong).ok
    wrong = ref.copy()
    wrong[0, 0, 5, 0] = np.nan  # NaN in a fully masked row
    assert not compare(SPEC, case, wrong).ok
    wrong = ref.copy()
    wrong[0, 0, 6, 0] = np.inf
    assert not compare(SPEC, case, wrong).ok


def test_tolerance_on_nonfinite_inputs() -> None:
    """NaN where the oracle is NaN gets bound 0 (compared by NaN-ness), finite rows a finite
    positive bound whatever the masked keys' v holds; rows beyond the compute type's range
    +inf (unspecified)."""
    case = case_masked_rows_bad_v()
    arrays, params = SPEC.bind((), dict(case.arrays) | case.params)
    prob = SPEC.problem(arrays, params)
    x64 = {n: (a if a.dtype == bool else a.astype(np.float64))
           for n, a in case.arrays.items() if a is not None}
    ref = _oracle(case)
    with np.errstate(all="ignore"):
        bound = SPEC.tolerance(prob, x64, ref)
    assert not np.isnan(bound).any()
    assert (bound[np.isnan(ref)] == 0).all()
    fin = np.isfinite(ref)
    assert np.isfinite(bound[fin]).all() and (bound[fin] > 0).all()
    # a row whose finite score terms overflow float32 is unspecified, the others are not
    q, k, v = _qkv(shape=(1, 1, 4, 8))
    q[0, 0, 2] = 3e19
    k[0, 0, :] = 3e19
    big = _case(q, k, v, scale=1.0)
    arrays, params = SPEC.bind((), dict(big.arrays) | big.params)
    prob = SPEC.problem(arrays, params)
    x64 = {n: a.astype(np.float64) for n, a in big.arrays.items() if a is not None}
    with np.errstate(all="ignore"):
        bound = SPEC.tolerance(prob, x64, _oracle(big))
    assert np.isinf(bound[0, 0, 2]).all() and np.isfinite(bound[0, 0, [0, 1, 3]]).all()


def case_inf_minus_inf_score() -> Case:
    """float64, the generator's "range" family (q ~1e38, k entries at the type's max, scale
    1e-3): the one key's score terms are -inf, +inf, +inf. Without FMA the dot is NaN (the
    oracle); with FMA (the C kernels) -inf + exact(a*b) stays -inf, the row is dead: 0."""
    top = float(np.finfo(np.float64).max)
    q = np.array([-7.28962977e37, 8.25803652e37, 1.49898664e38]).reshape(1, 1, 1, 3)
    k = np.full((1, 1, 1, 3), top)
    v = np.ones((1, 1, 1, 4))
    return _case(q, k, v, scale=1e-3)


def test_range_rule_row_unjudged_even_where_the_oracle_is_nan(target: str) -> None:
    """The range rule leaves such a row to IEEE arithmetic (NaN, +-inf or a value: README);
    the bound is +inf there and the comparison judges it by neither check, NaN oracle
    included (spec.unspecified_nonfinite), on every target."""
    case = case_inf_minus_inf_score()
    ref = _oracle(case)  # NaN or 0: the oracle's BLAS may fuse too
    nan_oracle = SPEC.replace(semantics=lambda xp, *a, **k: np.full(ref.shape, np.nan))
    for spec in (SPEC, nan_oracle):
        for got in (ref, np.zeros_like(ref), np.full_like(ref, np.nan)):
            assert compare(spec, case, got).ok
    if "float64" not in selection.get(target).supported_dtypes():
        return
    _run(target, case)
    # a NaN oracle outside the range rule is still compared exactly (NaN must propagate)
    q, k, v = case.arrays["q"].copy(), case.arrays["k"].copy(), case.arrays["v"]
    q[...] = 1.0
    k[..., 0] = np.inf
    k[..., 1] = -np.inf
    inside = _case(q, k, v, scale=1e-3)
    assert np.isnan(_oracle(inside)).all()
    assert not compare(SPEC, inside, np.zeros_like(_oracle(inside))).ok
    _run(target, inside)


def test_generator_draws_every_numerics_family() -> None:
    """The attention generator (the suite, `portakern check`) reaches every family of
    issue 14: NaN and +-inf in q, k and v, scales over [1e-30, 1e30] and at the overflow
    edge, magnitudes up to 1e4, masks leaving one key, fp16/bf16 near their range."""
    ch = NumpyChooser(np.random.default_rng(0))
    seen: set[str] = set()
    decades: set[int] = set()
    for dtype in ("float32", "float16", "bfloat16"):
        for _ in range(150):
            c = CASES["attention"](ch, dtype)
            for n in ("q", "k", "v"):
                a = c.arrays[n].astype(np.float64)
                if np.isnan(a).any():
                    seen.add(f"nan-{n}")
                if np.isposinf(a).any():
                    seen.add(f"+inf-{n}")
                if np.isneginf(a).any():
                    seen.add(f"-inf-{n}")
                fin = np.abs(a[np.isfinite(a)])
                if fin.size and dtype == "float16" and fin.max() == 65504:
                    seen.add("fp16-max")
                if fin.size and dtype == "bfloat16" and fin.max() > 1e38:
                    seen.add("bf16-near-max")
                if fin.size and 1e3 < fin.max() < 1e5 and "magnitude" in c.note:
                    seen.add("magnitude-1e4")
            if c.params["scale"] is not None:
                decades.add(int(np.floor(np.log10(c.params["scale"]))))
            if "edge" in c.note:
                seen.add("edge")
            m = c.arrays["mask"]
            if m is not None and m.ndim >= 2 and (m.sum(axis=-1) == 1).any():
                seen.add("one-key")
            if m is not None and m.ndim >= 2 and (m.sum(axis=-1) == 0).any():
                seen.add("fully-masked")
    want = {f"{s}-{n}" for s in ("nan", "+inf", "-inf") for n in "qkv"} | {
        "fp16-max", "bf16-near-max", "magnitude-1e4", "edge", "one-key", "fully-masked"}
    assert want <= seen, f"never drawn: {sorted(want - seen)}"
    assert min(decades) <= -20 and max(decades) >= 20, sorted(decades)


# --- one key, a non-finite v: XLA:CPU once turned exp(where(b, nan, x)) into garbage ----------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_one_key_nonfinite_v_gives_nan_rows(target: str, dtype: str) -> None:
    """Sk = 1, Sq >= 2, NaN or +-inf in v's only row: every row that attends the key is NaN
    (README), also causal, with GQA and with a mask that leaves a row nothing (that row is 0);
    repeated identical calls agree bit for bit. Before (jaxlib 0.10.2, jax:cpu): finite values,
    +-inf or subnormal garbage from uninitialised memory, different on every call."""
    if dtype not in selection.get(target).supported_dtypes():
        pytest.skip(f"{target} has no {dtype}")
    storage = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(1)
    for (b, hq, hkv, sq, d), value, causal, masked in [
            ((1, 1, 1, 4, 8), np.nan, False, False), ((1, 1, 1, 4, 8), np.inf, True, False),
            ((1, 1, 1, 2, 8), -np.inf, False, False), ((2, 4, 2, 5, 16), np.nan, True, False),
            ((2, 2, 2, 7, 16), np.inf, False, True), ((1, 2, 1, 3, 8), -np.inf, True, True)]:
        q = rng.standard_normal((b, hq, sq, d)).astype(storage)
        k = rng.standard_normal((b, hkv, 1, d)).astype(storage)
        v = rng.standard_normal((b, hkv, 1, d)).astype(storage)
        v[..., 0, d // 2] = value  # every head's only key is bad
        mask = None
        if masked:
            mask = np.ones((sq, 1), bool)
            mask[1] = False  # row 1 attends nothing: 0, whatever v holds
        case = _case(q, k, v, mask, causal=causal)
        what = f"{target} {dtype} q{q.shape} v={value} causal={causal} mask={masked}"
        got = _run(target, case)
        attends = np.ones(sq, bool)
        if masked:
            attends[1] = False
            assert (got[:, :, 1] == 0).all(), f"{what}: a row with no key must be 0"
        assert np.isnan(got[:, :, attends]).all(), f"{what}: rows attending the key not NaN"
        np.testing.assert_array_equal(got, _oracle(case), err_msg=what)
        for _ in range(3):
            np.testing.assert_array_equal(_run(target, case), got, err_msg=f"{what}: repeat")


def _nonfinite_in(case: Case) -> set[str]:
    return {n for n in "qkv" if not np.isfinite(case.arrays[n].astype(np.float64)).all()}


def small_sk_nonfinite_cases() -> list[tuple[str, Case]]:
    """Cases the generator draws (a fixed seed) with Sk in {1, 2} and non-finite entries:
    one at least for each of Sk = 1 and 2 with a non-finite q, k and v, over the dtypes."""
    ch = NumpyChooser(np.random.default_rng(7))
    want = {(sk, n) for sk in (1, 2) for n in "qkv"}
    out = []
    dtypes = ("float32", "float16", "bfloat16")
    for i in range(4000):
        dtype = dtypes[i % 3]
        c = CASES["attention"](ch, dtype)
        sk = c.arrays["k"].shape[2]
        new = {(sk, n) for n in _nonfinite_in(c)} & want
        if new and c.arrays["q"].shape[2] >= 2:
            want -= new
            out.append((dtype, c))
        if not want:
            return out
    raise AssertionError(f"the attention generator never drew Sk, non-finite: {sorted(want)}")


def test_generator_draws_small_sk_with_nonfinite_values() -> None:
    """attention_case draws Sk = 1 and 2 with NaN/+-inf in q, in k and in v (the shared
    hypothesis suite takes the same branch), in a few hundred draws."""
    ch = NumpyChooser(np.random.default_rng(0))
    seen = set()
    for dtype in ("float32", "float16", "bfloat16"):
        for _ in range(150):
            c = CASES["attention"](ch, dtype)
            sk = c.arrays["k"].shape[2]
            if sk in (1, 2):
                seen |= {(sk, n) for n in _nonfinite_in(c)}
    want = {(sk, n) for sk in (1, 2) for n in "qkv"}
    assert want <= seen, f"never drawn: {sorted(want - seen)}"


def test_generator_small_sk_nonfinite_cases_match_oracle(target: str) -> None:
    """The generator's one- and two-key cases with non-finite q, k, v, run on every target
    through the shared comparison (NaN and infinities exactly, values within the bound)."""
    for dtype, case in small_sk_nonfinite_cases():
        if dtype not in selection.get(target).supported_dtypes():
            continue
        got = pk.call(SPEC, backend=target, **case.arrays, **case.params)
        v = compare(SPEC, case, got)
        assert v.ok, f"attention on {target}: {case.describe()}: {v.worst_ratio:.3g} {v.where}"


def test_every_modifier_combination_shares_one_compiled_kernel(kernel_target: str) -> None:
    """The modifiers, return_lse and split-K are run-time arguments (attention_mods.c): after
    one call with a modifier, the fourteen other combinations of a shape compile nothing, and
    the unmodified call compiles its own kernel once (AT_MODS off, the default's speed)."""
    be = selection.get(kernel_target)
    rng = np.random.default_rng(3)
    # head dims no other test draws (the cache is the process's: its keys must be new here)
    q = rng.standard_normal((1, 2, 5, 23)).astype(np.float32)
    k = rng.standard_normal((1, 2, 37, 23)).astype(np.float32)
    v = rng.standard_normal((1, 2, 37, 7)).astype(np.float32)
    mods = {"window": (3, 2), "softcap": 2.0,
            "bias": rng.standard_normal((5, 37)).astype(np.float32),
            "alibi_slopes": np.array([0.5, 0.25], np.float32)}
    combos = [{n: mods[n] for j, n in enumerate(mods) if bits >> j & 1} for bits in range(1, 16)]

    def inserts() -> int:
        return be.cache_info()["kernels"]["inserts"]

    start = inserts()
    pk.attention(q, k, v, backend=kernel_target, **combos[0])
    before = inserts()
    assert before == start + 1, "the first modified call of a new shape compiles one kernel"
    for kw in combos[1:]:
        for lse in (False, True):
            got = pk.attention(q, k, v, backend=kernel_target, return_lse=lse, **kw)
            out = got[0] if lse else got
            ref = pk.attention(q, k, v, backend="numpy", **kw)
            np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5, err_msg=str(kw))
    assert inserts() == before, "a modifier combination or return_lse compiled a kernel"
    pk.attention(q, k, v, backend=kernel_target)
    assert inserts() == before + 1, "the unmodified call must have its own kernel"
