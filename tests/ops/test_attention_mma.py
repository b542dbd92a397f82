"""Attention's fragment schedule (MMA=1, attention_mma.c) proven without a GPU: fp16/bf16
attention runs the fragment API's emulation on PoCL under each vendor's lane map
(PORTAKERN_MMA_LAYOUT) and agrees with the float64 oracle (GQA, causal, masks, a window,
Sq/Sk not multiples of 16, head dims 64 and 40, split-K, the lse, non-finite values and the
score modifiers); Oclgrind finds no race or out-of-bounds access; and a kernel that assumes
one vendor's lane map is caught under the others.

Small shapes only: the emulation is slow by design and Oclgrind is an interpreter.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core import codegen
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.runtime.plan import plan_for

from _oracle import compare_case, draw_case

LAYOUTS = codegen.MMA_LAYOUTS
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
POCL = "opencl:pocl"
SIM = "opencl:oclgrind"
MMA = {"MMA": 1}


def _available(target: str) -> bool:
    try:
        selection.get(target)
        return True
    except pk.PortakernError:
        return False


pocl = pytest.mark.skipif(not _available(POCL), reason="PoCL (opencl:pocl) is not installed")
sim = pytest.mark.skipif(not _available(SIM), reason="Oclgrind (opencl:oclgrind) is absent")


def _case(dtype: str, b: int, hq: int, hkv: int, sq: int, sk: int, d: int, dv: int,
          seed: int = 0, mask: str | None = None, **params: object) -> Case:
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    arrays: dict[str, object] = {
        "q": rng.standard_normal((b, hq, sq, d)).astype(dt),
        "k": rng.standard_normal((b, hkv, sk, d)).astype(dt),
        "v": rng.standard_normal((b, hkv, sk, dv)).astype(dt)}
    if mask == "rows":  # (B, 1, Sq, Sk): a fully masked row and a row with one key
        m = rng.random((b, 1, sq, sk)) < 0.7
        m[..., 0, :] = False
        m[..., 1, :] = False
        m[..., 1, sk // 2] = True
        arrays["mask"] = m
    return Case(arrays, dict(params))


def _run(case: Case, target: str = POCL, config: dict[str, int] | None = None,
         spec: pk.KernelSpec | None = None) -> pk.Verdict:
    spec = spec or get_op("attention")
    got = pk.call(spec, backend=target, config=config or MMA, **case.arrays, **case.params)
    return compare_case(get_op("attention"), case, got, target)


def _kernels(case: Case, config: dict[str, int] | None = None) -> list[str]:
    arrays, params = get_op("attention").bind((), dict(case.arrays) | case.params)
    plan = plan_for(get_op("attention"), tuple(arrays[k] for k in ("q", "k", "v")),
                    {k: v for k, v in (arrays | params).items() if k not in ("q", "k", "v")},
                    backend=POCL, config=config or MMA)
    return [s.launch.kernel for s in plan.steps]


# one case per dtype (each is a compilation per layout): GQA in both; fp16 causal with a
# mask (a dead row, a one-key row), D = 64, Dv = 40; bf16 a two-sided window and the lse,
# D = 40, Dv = 64; no size a multiple of 16
CASES = {
    "float16": dict(b=2, hq=4, hkv=2, sq=20, sk=37, d=64, dv=40, causal=True, mask="rows"),
    "bfloat16": dict(b=1, hq=2, hkv=1, sq=33, sk=18, d=40, dv=64, window=(5, 3),
                     return_lse=True),
}


@pocl
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mma_attention_agrees_with_the_oracle_under_each_layout(
        layout: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
    kw = CASES[dtype]
    case = _case(dtype, seed=len(layout), **kw)
    assert _kernels(case) == ["attention_mma"]
    v = _run(case)
    assert v.ok, f"{layout} {dtype} {kw}:\n{v}"


@pocl
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_mma_attention_split_k_and_lse(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K under the fragment schedule: ranges of whole 16-key tiles, merged by
    attention_combine; decode-like (Sq = 3), causal ranges past the queries included."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "rdna3")
    cfg = {"MMA": 1, "SPLIT": 4}
    for i, kw in enumerate([dict(b=1, hq=2, hkv=1, sq=3, sk=100, d=64, dv=64,
                                 return_lse=True),
                            dict(b=1, hq=1, hkv=1, sq=40, sk=70, d=64, dv=64, causal=True,
                                 return_lse=True)]):
        case = _case(dtype, seed=20 + i, **kw)
        assert _kernels(case, cfg) == ["attention_mma", "attention_combine"]
        v = _run(case, config=cfg)
        assert v.ok, f"{dtype} {kw}:\n{v}"


@pocl
@pytest.mark.parametrize("dtype", ["float16"])
def test_mma_attention_nonfinite_values_and_modifiers(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIMT path's per-key rules, unchanged: a NaN/inf in v makes its key score NaN for
    the rows that attend it (and only those), an inf in q poisons its row, a bias with -inf
    entries drops keys; ALiBi and the soft cap bend the scores."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "cdna")
    case = _case(dtype, b=1, hq=2, hkv=1, sq=19, sk=35, d=40, dv=24, seed=7, causal=True)
    case.arrays["v"][0, 0, 30, 3] = np.nan  # attended only by no row (causal, Sq = 19)
    case.arrays["v"][0, 0, 5, 1] = np.inf   # rows 5.. attend it: NaN
    case.arrays["q"][0, 1, 2, 0] = np.inf   # that row is NaN or inf (the oracle's value)
    assert _run(case).ok
    rng = np.random.default_rng(8)
    case = _case(dtype, b=1, hq=2, hkv=2, sq=18, sk=21, d=64, dv=64, seed=9,
                 softcap=2.0, window=3)
    bias = rng.standard_normal((18, 21)) * 3.0
    bias[rng.random((18, 21)) < 0.2] = -np.inf
    case.arrays["bias"] = bias.astype(DTYPES[dtype])
    case.arrays["alibi_slopes"] = np.array([0.5, 0.25], np.float32)
    v = _run(case)
    assert v.ok, str(v)


@pocl
@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_mma_attention_drawn_cases(dtype: str, data: st.DataObject) -> None:
    """attention's own case generator (non-finite values, scales at the overflow edge,
    values near the type's range, masks, modifiers) with MMA=1: the semantics and the
    bounds, range rule included, hold for the fragment schedule too."""
    case = draw_case("attention", data, dtype)
    v = _run(case)
    assert v.ok, f"{case.describe()}\n{v}"


@sim
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mma_attention_is_race_free_and_in_bounds_on_the_simulator(
        layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oclgrind checks every local/global access of the schedule and the emulation (races,
    out-of-bounds, uninitialised reads raise KernelFaultError); two key tiles, a partial
    one, a mask and causal."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
    dtype = "bfloat16" if layout in ("cdna", "intel") else "float16"
    case = _case(dtype, b=1, hq=2, hkv=1, sq=17, sk=20, d=16, dv=24, seed=3, mask="rows",
                 causal=True, return_lse=True)
    v = _run(case, SIM)
    assert v.ok, f"{layout}:\n{v}"


def test_float32_ignores_mma_and_the_defaults() -> None:
    spec = get_op("attention")
    assert spec.config("gpu")["MMA"] == 0 and spec.config("cpu")["MMA"] == 0
    assert spec.config("gpu", matrix=True)["MMA"] == 1
    case = _case("float16", b=1, hq=1, hkv=1, sq=5, sk=7, d=8, dv=8)
    case32 = Case({k: v.astype(np.float32) for k, v in case.arrays.items()}, {})
    if _available(POCL):
        assert "attention_mma" not in _kernels(case32)


@pocl
def test_bf16_scale_enters_q_as_a_power_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 q.k about 1e39 (beyond fp32), scale 1e-10: the fragment schedule feeds q times
    the largest power of two <= scale, so the dot stays finite as on the SIMT path (where
    the scale is folded into q), and the result matches the oracle."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "sm80")
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    q = (np.abs(rng.standard_normal((1, 2, 8, 16))) * 3e18).astype(bf)
    k = (np.abs(rng.standard_normal((1, 2, 8, 16))) * 3e18).astype(bf)
    v = rng.standard_normal((1, 2, 8, 16)).astype(bf)
    case = Case({"q": q, "k": k, "v": v}, {"scale": 1e-10})
    got = pk.call(get_op("attention"), backend=POCL, config=MMA, q=q, k=k, v=v, scale=1e-10)
    assert np.isfinite(got.astype(np.float64)).all()
    v = compare_case(get_op("attention"), case, got, POCL)
    assert v.ok, str(v)


# --- mutants ------------------------------------------------------------------------------
_RESCALE = "o[i].x[e] *= Cs[PK_MMA_C_ROW(lane, e)];"
_SM80_C_ROW = "((lane) >> 2) + 8 * (((e) >> 1) & 1)"
_K_LOAD = "pk_mma_load_b(&kf, Ks + st * 16 * AM_DQP + kk * 16, 1, AM_DQP, lane);"
MUTANTS = {
    # the rescale hard-codes NVIDIA's C rows: right under sm80 only
    "assumes the sm80 layout": (_RESCALE, _RESCALE.replace("PK_MMA_C_ROW(lane, e)",
                                                           _SM80_C_ROW),
                                ("cdna", "rdna3", "intel")),
    # K loaded untransposed: S = Q K (a wrong product in every layout)
    "K not transposed": (_K_LOAD, _K_LOAD.replace("1, AM_DQP, lane", "AM_DQP, 1, lane"),
                         ("sm80",)),
}
_ALIVE: list[pk.KernelSpec] = []  # mutants stay alive: kernel caches key on spec tokens


def _mutant(old: str, new: str) -> pk.KernelSpec:
    spec = get_op("attention")
    assert old in spec.source, f"mutation site not found: {old!r}"
    m = spec.replace(name="attention_mma_mutant", source=spec.source.replace(old, new))
    _ALIVE.append(m)
    return m


@pocl
@pytest.mark.parametrize("name", list(MUTANTS))
def test_attention_mma_mutants_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new, layouts = MUTANTS[name]
    mutant = _mutant(old, new)
    # 64 keys in 4 tiles: the running max moves after the first tile, so rows rescale
    case = _case("float16", b=1, hq=1, hkv=1, sq=16, sk=64, d=32, dv=32, seed=11)
    for layout in layouts:
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
        assert not _run(case, spec=mutant).ok, f"mutant {name!r} survived under {layout}"
    if name == "assumes the sm80 layout":  # and it survives where its assumption holds
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "sm80")
        assert _run(case, spec=mutant).ok
