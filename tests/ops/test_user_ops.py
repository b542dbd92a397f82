"""User-defined ops through the public API only: an op defined in this file is registered,
checked on every backend against the float64 oracle, run by `portakern check`, rendered by
`portakern show` and compiled by the NVRTC check; malformed specs are refused at registration
with the spec, the field and the fix named; `portakern.ops` entry-point plugins load lazily and
a broken one is reported, not fatal.

The op is registered by a fixture and unregistered afterwards, so other test files that compare
the registry with what they collected never see it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import NumpyChooser
from portakern.core.spec import ArrayMeta
from portakern.tools.cases import case_generator, compare

from _oracle import HypothesisChooser, assert_spec_refused, supports

# --- the user op: out = alpha * x + y, one work-item per element --------------------------
SOURCE = """
PK_KERNEL void scaled_sum(PK_GLOBAL const PK_T_T* PK_RESTRICT X,
                          PK_GLOBAL const PK_T_T* PK_RESTRICT Yin,
                          PK_GLOBAL PK_T_T* PK_RESTRICT Out, int numel, PK_ACC_T alpha)
{
    const int i = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (i < numel) PK_STORE_T(Out, i, alpha * PK_LOAD_T(X, i) + PK_LOAD_T(Yin, i));
}
"""


def semantics(xp: Any, x: Any, y: Any, alpha: float = 1.0) -> Any:
    return alpha * x + y


def validate(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
    x, y = m["x"], m["y"]
    assert x is not None and y is not None
    if tuple(x.shape) != tuple(y.shape):
        raise pk.ShapeError(f"scaled_sum: x {x.shape} and y {y.shape} must have one shape; "
                            "broadcast them first.")
    alpha = params["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha):
        raise pk.InvalidArgumentError(f"scaled_sum: alpha must be a finite number; got {alpha!r}.")
    params["alpha"] = float(alpha)
    numel = int(np.prod(x.shape))
    return pk.Problem("scaled_sum", dtypes.dtype_name(x.dtype), {"x": x.shape, "y": y.shape},
                      params, tuple(x.shape), derived={"numel": numel}, empty_result=numel == 0)


def launches(p: pk.Problem, cfg: Mapping[str, int]) -> list[pk.Launch]:
    numel, wg = p.derived["numel"], cfg["WG"]
    return [pk.Launch("scaled_sum", (-(-numel // wg), 1, 1), (wg, 1, 1),
                      (pk.Buf("x"), pk.Buf("y"), pk.Buf("out"), pk.Scalar(numel),
                       pk.Scalar(p.params["alpha"], "acc")))]


def tolerance(p: pk.Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    """alpha rounds (u), the product rounds (u, or none with FMA), the sum rounds (u), the
    output rounds (u_out): 3u|alpha x| + u|y| + u_out|ref| + an underflow floor."""
    u = float(np.finfo(p.info.compute).eps) / 2
    ax = np.abs(p.params["alpha"] * x["x"])
    return (3 * u * ax + u * np.abs(x["y"]) + p.info.unit_roundoff * np.abs(ref)
            + p.info.subnormal + float(np.finfo(p.info.compute).smallest_subnormal))


SPEC = pk.KernelSpec(
    name="scaled_sum",
    operands=(pk.Operand("x"), pk.Operand("y")),
    params={"alpha": 1.0},
    validate=validate,
    semantics=semantics,
    source=SOURCE,
    slots=lambda p: {"T": p.dtype},
    defines=lambda p, cfg: dict(cfg),
    launches=launches,
    cost=lambda p: pk.Cost(2.0 * p.derived["numel"],
                           3.0 * p.derived["numel"] * p.info.storage.itemsize),
    tolerance=tolerance,
    tunables=(pk.Tunable("WG", (1, 16, 64, 256), "work-items per group"),),
    schedules={"gpu": {"WG": 256}, "cpu": {"WG": 16}},
    shapes={"x": ("rows", "n"), "y": ("rows", "n")},  # no `cases`: the derived generator
)


@pytest.fixture(scope="module")
def user_op() -> Iterator[pk.KernelSpec]:
    """Registered with check=True: compiled on every C backend and by NVRTC right here."""
    spec = pk.register_op(SPEC, check=True)
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


# --- the user op on every backend ---------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@settings(max_examples=12)
@given(data=st.data())
def test_user_op_matches_oracle_everywhere(user_op: pk.KernelSpec, target: str, dtype: str,
                                           data: st.DataObject) -> None:
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    gen = case_generator(user_op)
    assert gen is not None, "shapes= must give the op a derived case generator"
    case = gen(HypothesisChooser(data), dtype)
    case.params["alpha"] = data.draw(st.sampled_from([1.0, -1.5, 1e-3]))
    got = pk.call("scaled_sum", backend=target, **case.arrays, **case.params)
    v = compare(user_op, case, got)
    assert v.ok, f"scaled_sum on {target}: ratio {v.worst_ratio:.3g} {v.where}; {case.describe()}"


def test_derived_generator_follows_the_shape_family(user_op: pk.KernelSpec) -> None:
    gen = case_generator(user_op)
    assert gen is not None
    ch = NumpyChooser(np.random.default_rng(7))
    for _ in range(20):
        case = gen(ch, "bfloat16")
        x, y = case.arrays["x"], case.arrays["y"]
        assert x is not None and y is not None and x.shape == y.shape and x.ndim == 2
        assert x.dtype == dtypes.bfloat16 and case.params == {"alpha": 1.0}


def test_portakern_check_runs_the_user_op(user_op: pk.KernelSpec,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from portakern.tools.cli import main

    rc = main(["check", "--ops", "scaled_sum", "--dtypes", "float32,float16", "--examples", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "scaled_sum" in out and "FAIL" not in out


def test_portakern_show_and_the_nvrtc_check_see_the_user_op(user_op: pk.KernelSpec) -> None:
    from portakern.tools import compile_check
    from portakern.tools.show import show

    src = show("scaled_sum", "cuda", dtype="float16")
    assert "PK_KERNEL void scaled_sum(" in src and "#define WG 256" in src
    assert "__half" in src  # the cuda dialect's fp16 storage type
    probs = compile_check.representative_problems(user_op, "float32")
    assert probs and probs[0][1].shapes["x"] == (8, 1024)  # from shapes=, sizes by position


def test_user_op_through_call_with_native_arrays_and_errors(user_op: pk.KernelSpec) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(pk.call("scaled_sum", x, x, alpha=2.0, backend="numpy"), 3 * x)
    with pytest.raises(pk.ShapeError, match="one shape"):
        pk.call("scaled_sum", x, x[:, :2], backend="numpy")
    with pytest.raises(pk.InvalidArgumentError, match="unexpected argument"):
        pk.call("scaled_sum", x, x, beta=1.0, backend="numpy")


# --- malformed specs: each error names the spec, the field and the fix --------------------
def _no_entry(p: pk.Problem, cfg: Mapping[str, int]) -> list[pk.Launch]:
    return [pk.Launch("other_kernel", (1, 1, 1), (cfg["WG"], 1, 1), (pk.Buf("out"),))]


BAD_SPECS: dict[str, tuple[dict[str, Any], str, list[str]]] = {
    "semantics missing": ({"semantics": None}, "semantics", ["is missing"]),
    "semantics not callable": ({"semantics": "alpha * x + y"}, "semantics", ["callable"]),
    "semantics wrong signature": ({"semantics": lambda xp, x: x}, "semantics",
                                  ["cannot be called", "xp, x, y, alpha=..."]),
    "semantics wrong shape": ({"semantics": lambda xp, x, y, alpha=1.0: x[:1]}, "semantics",
                              ["out_shape"]),
    "tolerance not callable": ({"tolerance": 1e-6}, "tolerance", ["callable"]),
    "schedule outside domain": ({"schedules": {"gpu": {"WG": 3}, "cpu": {"WG": 16}}},
                                "schedules", ["WG=3", "outside", "(1, 16, 64, 256)"]),
    "schedule missing a tunable": (
        {"tunables": SPEC.tunables + (pk.Tunable("VEC", (1, 4)),),
         "schedules": {"gpu": {"WG": 256, "VEC": 4}, "cpu": {"WG": 16}}},
        "schedules", ["'cpu'", "lacks", "VEC"]),
    "schedule names an unknown tunable": (
        {"schedules": {"gpu": {"WG": 256, "TILE": 8}}}, "schedules", ["TILE", "not tunables"]),
    "no gpu schedule": ({"schedules": {"cpu": {"WG": 16}}}, "schedules", ["'gpu'"]),
    "entry point not defined": ({"launches": _no_entry}, "source",
                                ["other_kernel", "scaled_sum", "PK_KERNEL void other_kernel"]),
    "no entry point at all": ({"source": "void scaled_sum(float* x) {}"}, "source",
                              ["no entry point", "PK_KERNEL"]),
    "example refused": ({"example": lambda dt: ({"x": ArrayMeta((2, 3), dt),
                                                 "y": ArrayMeta((3, 2), dt)}, {})},
                        "example", ["refused by validate", "one shape"]),
    "shapes names no operand": ({"shapes": {"x": ("n",), "z": ("n",)}}, "shapes", ["'z'"]),
    "operand named out": ({"operands": (pk.Operand("x"), pk.Operand("out"))}, "operands",
                          ["'out'"]),
    "parameter named backend": ({"params": {"alpha": 1.0, "backend": None}}, "params",
                                ["backend="]),
    "name not an identifier": ({"name": "scaled sum"}, "name", ["identifier"]),
    "buffer names nothing": (
        {"launches": lambda p, cfg: [pk.Launch("scaled_sum", (1, 1, 1), (16, 1, 1),
                                               (pk.Buf("z"),))]}, "launches", ["Buf('z')"]),
    "workspace named like the output": (
        {"workspace": lambda p, cfg: {"out": (16, p.dtype)}}, "workspace", ["'out'"]),
    "workspace of an unknown dtype": (
        {"workspace": lambda p, cfg: {"tmp": (16, "int64")}}, "workspace", ["'tmp'", "int32"]),
}


@pytest.mark.parametrize("name", sorted(BAD_SPECS))
def test_malformed_spec_is_refused_naming_spec_field_and_fix(name: str) -> None:
    changes, field, words = BAD_SPECS[name]
    bad = SPEC.replace(**{"name": "bad_sum", **changes})
    assert_spec_refused(bad, field, words)


def test_kernel_that_does_not_compile_is_refused_with_the_log() -> None:
    kernels = [n for n, v in pk.backends().items()
               if v["available"] and n in ("opencl", "cuda")]
    try:
        from portakern.toolchains import nvrtc

        nvrtc.supported_archs()
        kernels.append("nvrtc")
    except Exception:
        pass
    if not kernels:
        pytest.skip("no C-kernel backend and no NVRTC here: nothing can compile a kernel")
    broken = SPEC.replace(name="scaled_sum_broken",
                          source=SOURCE.replace("PK_LOAD_T(Yin, i)", "undefined_thing"))
    with pytest.raises(pk.SpecError) as info:
        pk.register_op(broken, check=True)
    msg = str(info.value)
    assert "spec 'scaled_sum_broken'" in msg and "field `source`" in msg and "Fix:" in msg
    assert "does not compile" in msg and "undefined_thing" in msg
    assert isinstance(info.value.__cause__, pk.CompileError)
    assert "scaled_sum_broken" not in pk.ops.OPS


def test_an_op_that_refuses_a_dtype_still_registers() -> None:
    def fp32_only(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
        x = m["x"]
        assert x is not None
        if dtypes.dtype_name(x.dtype) != "float32":
            raise pk.DTypeError(f"fp32_sum: only float32; got {dtypes.dtype_name(x.dtype)}.")
        return validate(m, params)

    spec = SPEC.replace(name="fp32_sum", validate=fp32_only)
    try:
        assert pk.register_op(spec) is spec
    finally:
        pk.unregister_op("fp32_sum")
    def refuse_all(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
        raise pk.DTypeError("nothing_sum: no dtype at all.")

    with pytest.raises(pk.SpecError, match="field `shapes`.*every dtype"):
        pk.register_op(SPEC.replace(name="nothing_sum", validate=refuse_all))


def test_a_generator_is_derived_from_the_example_alone() -> None:
    spec = SPEC.replace(name="example_sum", shapes=None, example=lambda dt: (
        {"x": ArrayMeta((4, 96), dt), "y": ArrayMeta((4, 96), dt)}, {"alpha": 2.0}))
    gen = case_generator(spec)
    assert gen is not None
    for seed in range(10):
        case = gen(NumpyChooser(np.random.default_rng(seed)), "float32")
        x, y = case.arrays["x"], case.arrays["y"]
        assert x is not None and y is not None and x.shape == y.shape  # tied: equal sizes
    assert case_generator(SPEC.replace(shapes=None)) is None  # no cases, shapes nor example


def test_same_name_twice_needs_replace(user_op: pk.KernelSpec) -> None:
    with pytest.raises(pk.SpecError, match="already registered.*replace=True"):
        pk.register_op(SPEC.replace(doc="another"))
    assert pk.ops.get_op("scaled_sum") is user_op


# --- entry-point plugins ------------------------------------------------------------------
class FakeEntryPoint:
    def __init__(self, name: str, loader: Any) -> None:
        self.name, self.value, self._loader = name, f"fake_pkg:{name}", loader

    def load(self) -> Any:
        return self._loader()


def _boom() -> Any:
    raise ImportError("fake_pkg needs a library that is not installed")


def test_entry_point_plugins_load_lazily_and_a_broken_one_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from portakern import ops

    calls: list[int] = []
    real_entry_points = metadata.entry_points

    def fake_eps(**kwargs: Any) -> Any:
        if kwargs.get("group") != ops.ENTRY_POINT_GROUP:
            return real_entry_points(**kwargs)
        calls.append(1)
        return [FakeEntryPoint("plugged", lambda: SPEC.replace(name="plugged_sum")),
                FakeEntryPoint("several", lambda: lambda: [SPEC.replace(name="plugged_a"),
                                                           SPEC.replace(name="plugged_b")]),
                FakeEntryPoint("broken", _boom)]

    monkeypatch.setattr(metadata, "entry_points", fake_eps)
    monkeypatch.setitem(ops._PLUGINS, "state", "unloaded")
    try:
        pk.register_op(SPEC.replace(name="registered_first"))  # registering never loads them
        assert calls == []
        with pytest.warns(RuntimeWarning, match="broken.*failed to load"):
            assert "plugged_sum" in ops.OPS  # the first read loads them
        assert calls == [1]
        assert {"plugged_a", "plugged_b"} <= set(ops.OPS)
        assert ops.get_op("plugged_sum").name == "plugged_sum"
        errs = ops.plugin_errors()
        assert list(errs) == ["broken"] and "ImportError" in errs["broken"]
        assert "matmul" in ops.OPS and calls == [1]  # loaded once; built-ins unaffected
    finally:
        for name in ("registered_first", "plugged_sum", "plugged_a", "plugged_b"):
            pk.unregister_op(name)
        monkeypatch.undo()
        ops.load_plugins(force=True)  # back to the real (installed) entry points
