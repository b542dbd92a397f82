"""The fragment API (docs/fragments.md) proven without a GPU: fp16/bf16 matmul with MMA=1
runs the emulation on PoCL under each vendor's lane map (PORTAKERN_MMA_LAYOUT) and agrees
with the float64 oracle; on Oclgrind it is race-free and in bounds; and mutants of the
fragment path (a swapped lane map, a kernel that assumes one vendor's layout, a missing
barrier in the emulation, an fp16 accumulator, an off-by-one K step) are caught.

Small shapes only: the emulation is slow by design and Oclgrind is an interpreter.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import portakern as pk
from portakern.core import codegen, settings
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.runtime.plan import plan_for, plan_key
from portakern.runtime.verify import compare_arrays, native_matrix_unit, own_kernel
from portakern.tools.cases import compare

LAYOUTS = codegen.MMA_LAYOUTS
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
POCL = "opencl:pocl"
SIM = "opencl:oclgrind"
MMA = {"MMA": 1}
# shapes that cross every edge of the schedule: a partial 64x64 block, K not a multiple of
# 16, K past one KB1 = 512 block (the sums outside pk_mma), several groups, a batch
SHAPES = [((17, 33), (33, 45)), ((70, 530), (530, 20)), ((2, 16, 20), (20, 31))]


def _available(target: str) -> bool:
    try:
        selection.get(target)
        return True
    except pk.PortakernError:
        return False


pocl = pytest.mark.skipif(not _available(POCL), reason="PoCL (opencl:pocl) is not installed")
sim = pytest.mark.skipif(not _available(SIM), reason="Oclgrind (opencl:oclgrind) is absent")


def _operands(shapes, dtype: str, seed: int = 0, kind: str = "normal"):  # noqa: ANN001, ANN202
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        x = rng.standard_normal(s) if kind == "normal" else rng.random(s)
        out.append(x.astype(DTYPES[dtype]))
    return out


def _check(spec: pk.KernelSpec, target: str, a: np.ndarray, b: np.ndarray,
           config: dict[str, int] | None = None) -> pk.Verdict:
    got = pk.call(spec, a, b, backend=target, config=config or MMA)
    return compare_arrays(get_op("matmul"), {"a": a, "b": b}, {}, got,
                          ordered=own_kernel(selection.get(target)),
                          matrix_unit=native_matrix_unit(selection.get(target)))


@pocl
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mma_matmul_agrees_with_the_oracle_under_each_layout(
        layout: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation of each vendor's lane map gives what the oracle allows, judged by the
    worst-case bound and by the ordered statistical model (the fragment path sums in
    matmul.c's order: 16-term products chained over a KB1 block, block sums outside)."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
    spec = get_op("matmul")
    for i, shapes in enumerate(SHAPES):
        a, b = _operands(shapes, dtype, seed=i, kind="normal" if i != 1 else "positive")
        plan = plan_for(spec, (a, b), {}, backend=POCL, config=MMA)
        assert [s.launch.kernel for s in plan.steps] == ["matmul_mma"]
        v = _check(spec, POCL, a, b)
        assert v.ok, f"{layout} {dtype} {shapes}:\n{v}"


@pocl
def test_mma_sums_in_matmul_c_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit the SIMT local-memory path's result on PoCL (the same tree: the fragment
    path's statistical model is matmul.c's own), under every lane map, non-finite values
    included."""
    a, b = _operands(((9, 1100), (1100, 21)), "float16", seed=5)
    a[3, 7] = np.inf
    b[100, 4] = np.nan
    simt = pk.matmul(a, b, backend=POCL, config={"USE_LOCAL": 1, "VEC": 1, "PACK_B": 0,
                                                 "LX": 16, "LY": 16, "TM": 4, "TN": 4})
    for layout in LAYOUTS:
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
        got = pk.matmul(a, b, backend=POCL, config=MMA)
        assert np.array_equal(got.view(np.uint16), simt.view(np.uint16)), layout


@sim
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mma_matmul_is_race_free_and_in_bounds_on_the_simulator(
        layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oclgrind checks every local/global access of the emulation and the schedule (races,
    out-of-bounds, uninitialised reads raise KernelFaultError) and the values agree."""
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
    dtype = "bfloat16" if layout == "cdna" else "float16"
    a, b = _operands(((18, 20), (20, 17)), dtype, seed=3)
    v = _check(get_op("matmul"), SIM, a, b)
    assert v.ok, f"{layout}:\n{v}"


def test_layout_setting_is_validated_and_keys_plans_and_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "volta")
    with pytest.raises(pk.InvalidArgumentError, match="PORTAKERN_MMA_LAYOUT.*sm80, cdna"):
        settings.mma.layout  # noqa: B018
    spec = get_op("matmul")
    a, b = _operands(((4, 4), (4, 4)), "float16")
    keys, lowerings = set(), set()
    for layout in LAYOUTS:
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
        keys.add(plan_key(spec, (a, b), {}, POCL, MMA))
        lowerings.add(codegen.lowering("opencl").key)
    assert len(keys) == len(LAYOUTS) and len(lowerings) == len(LAYOUTS)


def test_matrix_units_are_data_of_the_dialects() -> None:
    """Which architecture reaches which lowering is the dialect table's data; the emulation
    covers everything else (and hip's ids are builtins, so gfx11 needs no device library)."""
    assert codegen.matrix_unit("cuda", "sm_80") == "sm80"
    assert codegen.matrix_unit("cuda", "sm_90") == "sm80"
    assert codegen.matrix_unit("cuda", "sm_75") is None
    assert codegen.matrix_unit("hip", "gfx90a") == "cdna"
    assert codegen.matrix_unit("hip", "gfx1100") == "rdna3"
    assert codegen.matrix_unit("hip", "gfx1030") is None
    assert codegen.matrix_unit(
        "opencl", "cl_intel_subgroup_matrix_multiply_accumulate") == "intel"
    assert codegen.matrix_unit("opencl", "") is None
    for name, f in codegen.FRAGMENTS.items():
        assert f.a_elems * f.wave >= 256 and f.c_elems * f.wave == 256, name
        assert codegen.lowering(next(iter(f.native)), {
            "sm80": "sm_80", "cdna": "gfx90a", "rdna3": "gfx1100",
            "intel": "cl_intel_subgroup_matrix_multiply_accumulate"}[name]).native


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_lane_map_covers_every_tile_element(name: str) -> None:
    """A lane map is a bijection onto the 16x16 tile for C, and covers A and B (once per
    owner lane): evaluated from the C expressions the renderer emits."""
    f = codegen.FRAGMENTS[name]

    def ev(expr: str, lane: int, i: int) -> int:
        return int(eval(expr.replace("(l)", f"({lane})").replace("(i)", f"({i})")))

    for what, n, owner in (("a", f.a_elems, f.a_owner), ("b", f.b_elems, f.b_owner),
                           ("c", f.c_elems, "1")):
        seen = [(ev(getattr(f, f"{what}_row"), ln, i), ev(getattr(f, f"{what}_col"), ln, i))
                for ln in range(f.wave) if ev(owner.replace("(l)", "(l)"), ln, 0)
                for i in range(n)]
        assert sorted(seen) == [(r, c) for r in range(16) for c in range(16)], (name, what)


def test_float32_stays_simt_and_bad_mma_configs_are_refused() -> None:
    spec = get_op("matmul")
    a, b = _operands(((5, 7), (7, 3)), "float16")
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    plan = plan_for(spec, (a32, b32), {}, backend="opencl:pocl" if _available(POCL)
                    else "opencl", config=MMA)
    assert all(s.launch.kernel != "matmul_mma" for s in plan.steps)
    with pytest.raises(pk.InvalidArgumentError, match="MMA=1 takes TK a multiple of 16"):
        spec.config("cpu", {"MMA": 1, "TK": 8})
    with pytest.raises(pk.InvalidArgumentError, match="do not split evenly"):
        spec.config("cpu", {"MMA": 1, "MBM": 32, "MBN": 32, "MITEMS": 256})
    # default schedules: fragments only where the device has matrix units
    assert spec.config("gpu")["MMA"] == 0 and spec.config("cpu")["MMA"] == 0
    assert spec.config("gpu", matrix=True)["MMA"] == 1


# --- mutants ------------------------------------------------------------------------------
_STORE_ROW = "const int r = row0 + (tm0 + i) * 16 + PK_MMA_C_ROW(lane, e);"
_STORE_COL = "const int c = col0 + (tn0 + j) * 16 + PK_MMA_C_COL(lane, e);"
_SM80_C_ROW = "((lane) >> 2) + 8 * (((e) >> 1) & 1)"
_SM80_C_COL = "((lane) & 3) * 2 + ((e) & 1) + 8 * ((e) >> 2)"
_EMU_ACC = "        c->x[i] = acc;\n    }\n    PK_BARRIER();\n}"
# fp16's significand (11 bits, round to nearest even) on the running accumulator
_FP16_ACC = ("        c->x[i] = PK_AS_FLOAT((PK_AS_UINT(acc) + 0xFFFu + ((PK_AS_UINT(acc) >> 13) "
             "& 1u)) & 0xFFFFE000u);\n    }\n    PK_BARRIER();\n}")
_ALIVE: list[pk.KernelSpec] = []  # mutants stay alive: kernel caches key on spec tokens

MUTANTS = {
    # C's row and column queries swapped at the store: the tile comes out transposed
    "swapped lane map": ((_STORE_ROW, _STORE_COL),
                         (_STORE_ROW.replace("PK_MMA_C_ROW", "PK_MMA_C_COL"),
                          _STORE_COL.replace("PK_MMA_C_COL", "PK_MMA_C_ROW")), LAYOUTS),
    # a kernel that hard-codes NVIDIA's lane map: right under sm80, wrong under the others
    "assumes the sm80 layout": ((_STORE_ROW, _STORE_COL),
                                (_STORE_ROW.replace("PK_MMA_C_ROW(lane, e)", _SM80_C_ROW),
                                 _STORE_COL.replace("PK_MMA_C_COL(lane, e)", _SM80_C_COL)),
                                ("cdna", "rdna3", "intel")),
    "fp16 accumulator": ((_EMU_ACC,), (_FP16_ACC,), ("sm80",)),
    # the fragment loop steps 16 deep but the staged slice advances one element short
    "off-by-one K step": (("for (int k0 = 0; k0 < K; k0 += TK) {\n        for (int idx = tid; "
                           "idx < MBM * TK",),
                          ("for (int k0 = 0; k0 < K; k0 += TK - 1) {\n        for (int idx = "
                           "tid; idx < MBM * TK",), ("sm80",)),
}


def _mutant(old: tuple[str, ...], new: tuple[str, ...]) -> pk.KernelSpec:
    spec = get_op("matmul")
    source = spec.source
    for o, n in zip(old, new, strict=True):
        assert o in source, f"mutation site not found: {o!r}"
        source = source.replace(o, n)
    m = spec.replace(name="matmul_mma_mutant", source=source)
    _ALIVE.append(m)
    return m


@pocl
@pytest.mark.parametrize("name", list(MUTANTS))
def test_fragment_mutants_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new, layouts = MUTANTS[name]
    mutant = _mutant(old, new)
    spec = get_op("matmul")
    for layout in layouts:
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", layout)
        caught = False
        for i, shapes in enumerate(SHAPES[:2]):
            a, b = _operands(shapes, "float16", seed=10 + i)
            got = pk.call(mutant, a, b, backend=POCL, config=MMA)
            if not compare(spec, Case({"a": a, "b": b}, {}), got).ok:
                caught = True
                break
        assert caught, f"mutant {name!r} survived under the {layout} layout"
    if name == "assumes the sm80 layout":  # and it survives where its assumption holds
        monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "sm80")
        a, b = _operands(SHAPES[0], "float16")
        got = pk.call(mutant, a, b, backend=POCL, config=MMA)
        assert compare(spec, Case({"a": a, "b": b}, {}), got).ok


@sim
def test_missing_emulation_barrier_is_a_race_on_the_simulator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the barrier between the lanes' writes of A and B and the products that read
    them, PoCL still gets the values right (work-items run in order); Oclgrind reports the
    race."""
    old = ("            s[256 + PK_MMA_B_ROW(lane, i) * 16 + PK_MMA_B_COL(lane, i)] = b->x[i];\n"
           "    PK_BARRIER();")
    mutant = _mutant((old,), (old.replace("    PK_BARRIER();", ""),))
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "sm80")
    a, b = _operands(((5, 16), (16, 7)), "float16")
    with pytest.raises(pk.KernelFaultError) as info:
        pk.call(mutant, a, b, backend=SIM, config=MMA)
    assert info.value.kind == "race", str(info.value)
