"""A user op with several outputs, three launches, an int32 index table, an int32 workspace, an
int32 output and an int parameter, registered with ``pk.register_op(spec, check=True)`` and run
through the public paths only: ``pk.call`` by name, ``portakern check``, ``pk.verify`` and
``portakern.tools.cases.compare``, on every target (numpy, opencl, jax here).

``gather_stats(x, idx, offset=0)`` -> ``(y, s, arg)``: ``y = x[idx + offset]`` (M, D), its row
sums ``s`` (M,) and each row's argmax ``arg`` (M,, int32). An index out of range gives a NaN
row, a NaN sum and ``arg = -1``. Launch 1 resolves the indices into an int32 workspace
``rows`` (-1 when out of range), launch 2 gathers into ``y``, launch 3 reads ``y`` and ``rows``
and writes ``s`` and ``arg``. Tolerances per output: ``y`` exact (None), ``s`` the sum's
rounding, ``arg`` exact (int32). The spec brings its own ``cases``: only it knows which index
values are valid (mostly valid, a few deliberately out of range).

Malformed several-output specs are refused at registration naming the spec, the field and the
fix; a kernel that corrupts one output is caught on that output by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import Case, Chooser, NumpyChooser, normal
from portakern.core.spec import ArrayMeta
from portakern.tools.cases import case_generator, compare

from _oracle import HypothesisChooser, assert_spec_refused, supports

SOURCE = """
PK_KERNEL void resolve_rows(PK_GLOBAL const int* PK_RESTRICT Idx, PK_GLOBAL int* PK_RESTRICT Rows,
                            int n_rows, int m, int offset)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (r >= m) return;
    const int j = (int)((unsigned)Idx[r] + (unsigned)offset);  /* int32 wrap-around, as numpy */
    Rows[r] = (j >= 0 && j < n_rows) ? j : -1;
}

PK_KERNEL void gather_rows(PK_GLOBAL const PK_T_T* PK_RESTRICT X,
                           PK_GLOBAL const int* PK_RESTRICT Rows,
                           PK_GLOBAL PK_T_T* PK_RESTRICT Y, int d, int m)
{
    const int i = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (i >= m * d) return;
    const int r = i / d, c = i - r * d;
    const int j = Rows[r];
    /* out of range: a NaN row, and x is never read outside its rows */
    const PK_ACC_T v = j >= 0 ? PK_LOAD_T(X, j * d + c) : (PK_ACC_T)PK_AS_FLOAT(0x7fc00000u);
    PK_STORE_T(Y, i, v);
}

PK_KERNEL void row_stats(PK_GLOBAL const PK_T_T* PK_RESTRICT Y,
                         PK_GLOBAL const int* PK_RESTRICT Rows,
                         PK_GLOBAL PK_T_T* PK_RESTRICT S, PK_GLOBAL int* PK_RESTRICT Arg,
                         int d, int m)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (r >= m) return;
    PK_ACC_T acc = (PK_ACC_T)0;
    PK_ACC_T best = PK_LOAD_T(Y, r * d);
    int arg = 0;
    for (int c = 0; c < d; ++c) {
        const PK_ACC_T v = PK_LOAD_T(Y, r * d + c);
        acc += v;
        if (v > best) { best = v; arg = c; }  /* strict: the first maximum, as argmax */
    }
    PK_STORE_T(S, r, acc);
    Arg[r] = Rows[r] < 0 ? -1 : arg;
}
"""


def semantics(xp: Any, x: Any, idx: Any, offset: int = 0) -> Any:
    n = x.shape[0]
    j = idx + offset
    ok = (j >= 0) & (j < n)
    rows = x[xp.where(ok, j, 0)]
    y = xp.where(ok[:, None], rows, xp.nan)
    arg = xp.where(ok, xp.argmax(rows, axis=-1).astype(xp.int32), -1)
    return y, y.sum(-1), arg


def validate(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
    x, idx = m["x"], m["idx"]
    assert x is not None and idx is not None
    if len(x.shape) != 2 or len(idx.shape) != 1 or x.shape[1] == 0:
        raise pk.ShapeError(f"gather_stats: x must be (N, D) with D >= 1 and idx (M,); got "
                            f"{x.shape} and {idx.shape}.")
    off = params["offset"]
    if isinstance(off, bool) or not isinstance(off, (int, np.integer)) \
            or not -2**31 <= int(off) < 2**31:
        raise pk.InvalidArgumentError(f"gather_stats: offset must be a 32-bit int; got {off!r}.")
    params["offset"] = int(off)
    (n, d), (rows,) = x.shape, idx.shape
    dt = dtypes.dtype_name(x.dtype)
    return pk.Problem("gather_stats", dt, {"x": x.shape, "idx": idx.shape}, params, (rows, d),
                      derived={"N": n, "D": d, "M": rows}, empty_result=rows == 0,
                      outputs={"y": ((rows, d), dt), "s": ((rows,), dt),
                               "arg": ((rows,), "int32")})


def launches(p: pk.Problem, cfg: Mapping[str, int]) -> list[pk.Launch]:
    n, d, rows, wg = p.derived["N"], p.derived["D"], p.derived["M"], cfg["WG"]
    return [
        pk.Launch("resolve_rows", (-(-rows // wg), 1, 1), (wg, 1, 1),
                  (pk.Buf("idx"), pk.Buf("rows"), pk.Scalar(n), pk.Scalar(rows),
                   pk.Scalar(p.params["offset"], "int"))),
        pk.Launch("gather_rows", (-(-rows * d // wg), 1, 1), (wg, 1, 1),
                  (pk.Buf("x"), pk.Buf("rows"), pk.Buf("y"), pk.Scalar(d), pk.Scalar(rows))),
        pk.Launch("row_stats", (-(-rows // wg), 1, 1), (wg, 1, 1),
                  (pk.Buf("y"), pk.Buf("rows"), pk.Buf("s"), pk.Buf("arg"), pk.Scalar(d),
                   pk.Scalar(rows))),
    ]


def tolerance(p: pk.Problem, x: dict[str, np.ndarray], refs: tuple[np.ndarray, ...]
              ) -> dict[str, Any]:
    """y is a gather (exact: None); s a sequential sum of D terms in the compute type, then
    rounded to storage: D u sum|y| + u_out |s| + an underflow floor; arg is int32 (exact)."""
    y, s, _ = refs
    u = float(np.finfo(p.info.compute).eps) / 2
    d = p.derived["D"]
    bound = (d * u * np.abs(y).sum(-1) + p.info.unit_roundoff * np.abs(s) + p.info.subnormal
             + d * float(np.finfo(p.info.compute).smallest_subnormal))
    return {"y": None, "s": bound}


def cases(ch: Chooser, dtype: str) -> Case:
    """Mostly valid indices (idx + offset in range), a few deliberately out of range."""
    n = ch.choice((1, 2, 3, 7, 17, 64))
    d = ch.choice((1, 2, 3, 5, 8, 17, 33, 65))
    rows = ch.choice((0, 1, 2, 5, 16, 17, 65))
    offset = ch.choice((0, 0, 1, -2, 3))
    rng = np.random.default_rng(ch.seed())
    idx = rng.integers(0, n, rows) - offset
    if rows and ch.boolean(0.3):
        bad = rng.random(rows) < 0.2
        idx[bad] = rng.choice([-1 - offset, n - offset, 2**30], int(bad.sum()))
    x = normal(rng, (n, d), dtype, ch.choice((1.0, 1e-3, 30.0)))
    return Case({"x": x, "idx": idx.astype(np.int32)}, {"offset": offset},
                f"N={n} D={d} M={rows} offset={offset}")


SPEC = pk.KernelSpec(
    name="gather_stats",
    operands=(pk.Operand("x"), pk.Operand("idx", "int32")),
    params={"offset": 0},
    validate=validate,
    semantics=semantics,
    source=SOURCE,
    slots=lambda p: {"T": p.dtype},
    defines=lambda p, cfg: dict(cfg),
    launches=launches,
    cost=lambda p: pk.Cost(2.0 * p.derived["M"] * p.derived["D"],
                           (2.0 * p.derived["D"] + 1) * p.derived["M"] * p.info.storage.itemsize
                           + 8.0 * p.derived["M"]),
    tolerance=tolerance,
    tunables=(pk.Tunable("WG", (1, 16, 64, 128), "work-items per group"),),
    schedules={"gpu": {"WG": 128}, "cpu": {"WG": 16}},
    workspace=lambda p, cfg: {"rows": (p.derived["M"], "int32")},
    example=lambda dt: ({"x": ArrayMeta((1000, 64), dt), "idx": ArrayMeta((256,), "int32")},
                        {"offset": 0}),
    cases=cases,
)

HOST_TARGETS = ("numpy", "opencl", "jax")


def _host_target(target: str) -> bool:
    return target.split(":")[0] in HOST_TARGETS


@pytest.fixture(scope="module")
def user_op() -> Iterator[pk.KernelSpec]:
    """Registered with check=True: every spec check, the example compiled on every C backend
    (and NVRTC where importable), the semantics traced by jax, the cases run on the oracle."""
    spec = pk.register_op(SPEC, check=True)
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


def _inputs(seed: int = 0, n: int = 7, d: int = 5, rows: int = 11
            ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)).astype(np.float32),
            rng.integers(0, n, rows).astype(np.int32))


def _oracle(x: np.ndarray, idx: np.ndarray, offset: int = 0
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Written apart from the spec's semantics: a plain loop in float64."""
    y = np.full((len(idx), x.shape[1]), np.nan)
    arg = np.full(len(idx), -1, np.int32)
    for r, i in enumerate(idx):
        j = int(i) + offset
        if 0 <= j < x.shape[0]:
            y[r] = x[j]
            arg[r] = int(np.argmax(x[j]))
    return y, y.sum(-1), arg


# --- through the public paths on every target ---------------------------------------------
def test_registered_op_runs_by_name_and_matches_a_plain_loop(user_op: pk.KernelSpec,
                                                             target: str) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    assert pk.ops.get_op("gather_stats") is user_op
    x, idx = _inputs()
    idx[[1, 4]] = [-4, 2**31 - 1]  # out of range; the second wraps with offset=1 as in numpy
    for offset in (0, 1, -2):
        got = pk.call("gather_stats", x, idx, offset=offset, backend=target)
        assert isinstance(got, tuple) and len(got) == 3
        y, s, arg = got
        assert (y.dtype, s.dtype, arg.dtype) == (np.float32, np.float32, np.int32)
        ry, rs, rarg = _oracle(x, idx, offset)
        np.testing.assert_array_equal(y, ry.astype(np.float32))
        np.testing.assert_allclose(s, rs, rtol=1e-5, atol=1e-5, equal_nan=True)
        np.testing.assert_array_equal(arg, rarg)
        assert pk.verify("gather_stats", x, idx, offset=offset, got=got).ok


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@settings(max_examples=10)
@given(data=st.data())
def test_spec_cases_match_oracle_everywhere(user_op: pk.KernelSpec, target: str, dtype: str,
                                            data: st.DataObject) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    if not supports(target, dtype):
        pytest.skip(f"{target} does not support {dtype}")
    gen = case_generator(user_op)
    assert gen is cases  # the spec's own: the derived one cannot know valid indices
    case = gen(HypothesisChooser(data), dtype)
    got = pk.call("gather_stats", backend=target, **case.arrays, **case.params)
    v = compare(user_op, case, got)
    assert v.ok, f"gather_stats on {target}: {case.describe()}\n{v.where}\n{v}"
    assert [c.name for c in v.checks] == ["y: worst-case", "s: worst-case", "arg: worst-case"]


def test_portakern_check_runs_the_several_output_op(user_op: pk.KernelSpec,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from portakern.tools.cli import main

    rc = main(["check", "--ops", "gather_stats", "--dtypes", "float32,float16",
               "--examples", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("gather_stats")]
    assert lines and all(" pass " in ln or " n/a " in ln for ln in lines), out
    assert sum(" pass " in ln for ln in lines) >= 2, out  # numpy and more, both dtypes


def test_opencl_device_arrays_and_out_tuple_with_an_int32_output(
        user_op: pk.KernelSpec) -> None:
    from portakern.runtime import selection

    try:
        be = selection.get("opencl")
    except Exception as exc:  # noqa: BLE001 - not usable here
        pytest.skip(f"opencl not usable: {exc}")
    x, idx = _inputs(2)
    xd, idxd = be.to_native(x), be.to_native(idx)
    outs = (be.empty((11, 5), "float32"), be.empty((11,), "float32"), be.empty((11,), "int32"))
    got = pk.call("gather_stats", xd, idxd, offset=1, backend="opencl", out=outs)
    assert all(g is o for g, o in zip(got, outs, strict=True))
    v = pk.verify("gather_stats", x, idx, offset=1, got=got)  # device arrays: copied to host
    assert v.ok, str(v)
    with pytest.raises(pk.DTypeError, match="'arg'"):
        pk.call("gather_stats", xd, idxd, backend="opencl",
                out=(outs[0], outs[1], be.empty((11,), "float32")))


# --- each output judged on its own, by name -----------------------------------------------
def test_compare_judges_every_output_and_names_it(user_op: pk.KernelSpec) -> None:
    x, idx = _inputs(4)
    case = Case({"x": x, "idx": idx}, {"offset": 0})
    y, s, arg = pk.call("gather_stats", x, idx, backend="numpy")
    assert compare(user_op, case, (y, s, arg)).ok
    bad_s = s.copy()
    bad_s[3] *= 1 + 1e-3
    v = compare(user_op, case, (y, bad_s, arg))
    assert not v.ok and "output 's'" in v.where and v.index == (3,)
    assert [c.ok for c in v.checks] == [True, False, True]
    bad_arg = arg.copy()
    bad_arg[5] += 1  # an int32 output: exact, one off fails
    v = compare(user_op, case, (y, s, bad_arg))
    assert not v.ok and "output 'arg'" in v.where and v.index == (5,)
    bad_y = y.copy()
    bad_y[2, 1] = np.nextafter(bad_y[2, 1], np.float32(np.inf))  # y is exact: one ulp fails
    v = compare(user_op, case, (bad_y, s, arg))
    assert not v.ok and "output 'y'" in v.where and v.index == (2, 1)
    v = compare(user_op, case, (y, s, arg.astype(np.int64)))
    assert not v.ok and "'arg'" in v.where and "int64" in v.where and "int32" in v.where
    v = compare(user_op, case, (y, s))
    assert not v.ok and "tuple of 3" in v.where and "y, s, arg" in v.where
    with pytest.raises(pk.DTypeError, match="'arg'.*int32"):
        pk.verify("gather_stats", x, idx, got=(y, s, arg.astype(np.int64)))
    with pytest.raises(pk.ShapeError, match="'y'"):
        pk.verify("gather_stats", x, idx, got=(y[:3], s, arg))


def test_a_kernel_corrupting_one_output_is_caught_on_that_output() -> None:
    """The mutant's arg is the last maximum, not the first: it agrees whenever a row has one
    maximum, so ties are forced (a row of equal values) and only 'arg' may fail."""
    from portakern.runtime import selection

    try:
        selection.get("opencl")
    except Exception as exc:  # noqa: BLE001 - not usable here
        pytest.skip(f"opencl not usable: {exc}")
    mutant = SPEC.replace(name="gather_stats_mutant",
                          source=SOURCE.replace("if (v > best)", "if (v >= best)"))
    x = np.ones((3, 4), np.float32)
    idx = np.array([0, 2, 1], np.int32)
    case = Case({"x": x, "idx": idx}, {"offset": 0})
    assert compare(SPEC, case, pk.call(SPEC, x, idx, backend="opencl")).ok
    v = compare(mutant, case, pk.call(mutant, x, idx, backend="opencl"))
    assert not v.ok and "output 'arg'" in v.where
    assert [c.ok for c in v.checks] == [True, True, False]


# --- the spec's cases and the derived generator --------------------------------------------
def test_the_spec_generator_draws_valid_int32_tables() -> None:
    ch = NumpyChooser(np.random.default_rng(5))
    valid = 0
    for _ in range(40):
        case = cases(ch, "float16")
        x, idx = case.arrays["x"], case.arrays["idx"]
        assert x is not None and idx is not None and idx.dtype == np.int32
        j = idx.astype(np.int64) + case.params["offset"]
        valid += int(((j >= 0) & (j < x.shape[0])).sum())
        assert isinstance(case.params["offset"], int)
    assert valid > 100  # mostly valid indices, a few out of range on purpose


def test_an_int32_operand_gets_no_derived_generator() -> None:
    from portakern.tools.conformance import run_check

    spec = SPEC.replace(name="gather_no_cases", cases=None,
                        shapes={"x": ("n", "d"), "idx": ("m",)})
    assert case_generator(spec) is None
    pk.register_op(spec)
    try:
        r = run_check("numpy", "gather_no_cases", "float32", 1, 0)
    finally:
        pk.unregister_op("gather_no_cases")
    assert r["status"] == "n/a" and "int32" in r["why"] and "cases" in r["why"], r


# --- malformed several-output specs: spec, field and fix named -----------------------------
def _drop_last_output(xp: Any, x: Any, idx: Any, offset: int = 0) -> Any:
    return semantics(xp, x, idx, offset)[:2]


def _float_arg(xp: Any, x: Any, idx: Any, offset: int = 0) -> Any:
    y, s, arg = semantics(xp, x, idx, offset)
    return y, s, arg.astype(xp.float64)


def _bad_output_dtype(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
    p = validate(m, params)
    assert p.outputs is not None
    p.outputs["arg"] = (p.outputs["arg"][0], "int64")
    return p


def _output_named_like_operand(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]
                               ) -> pk.Problem:
    p = validate(m, params)
    assert p.outputs is not None
    p.outputs = {"x" if k == "y" else k: v for k, v in p.outputs.items()}
    return p


def _float_scalar(p: pk.Problem, cfg: Mapping[str, int]) -> list[pk.Launch]:
    la = launches(p, cfg)
    la[0] = pk.Launch(la[0].kernel, la[0].groups, la[0].local,
                      la[0].args[:-1] + (pk.Scalar(0.5, "int"),))
    return la


def _float_idx_cases(ch: Chooser, dtype: str) -> Case:
    case = cases(ch, dtype)
    case.arrays["idx"] = case.arrays["idx"].astype(np.float32)  # type: ignore[union-attr]
    return case


BAD_SPECS: dict[str, tuple[dict[str, Any], bool, str, list[str]]] = {
    "semantics returns too few outputs": ({"semantics": _drop_last_output}, False, "semantics",
                                          ["2 arrays", "3 outputs", "['y', 's', 'arg']"]),
    "int32 output computed as float": ({"semantics": _float_arg}, False, "semantics",
                                       ["'arg'", "int32"]),
    "tolerance of the wrong length": (
        {"tolerance": lambda p, x, r: (None, None)}, False, "tolerance",
        ["2 bounds", "3 outputs"]),
    "tolerance dict misses an output": (
        {"tolerance": lambda p, x, r: {"y": None}}, False, "tolerance", ["missing: ['s']"]),
    "tolerance dict names no output": (
        {"tolerance": lambda p, x, r: {"y": None, "s": 1.0, "z": 1.0}}, False, "tolerance",
        ["unknown: ['z']"]),
    "tolerance negative for one output": (
        {"tolerance": lambda p, x, r: (None, -np.ones_like(r[1]), None)}, False, "tolerance",
        ["negative", "output 's'"]),
    "tolerance of the wrong shape": (
        {"tolerance": lambda p, x, r: (None, np.ones(3), None)}, False, "tolerance",
        ["output 's'", "broadcast"]),
    "output of an unknown dtype": ({"validate": _bad_output_dtype}, False, "validate",
                                   ["'arg'", "int64", "int32"]),
    "output named like an operand": ({"validate": _output_named_like_operand}, False,
                                     "validate", ["'x'", "operand"]),
    "float passed as an int scalar": ({"launches": _float_scalar}, False, "launches",
                                      ["Scalar(0.5, 'int')", "32-bit int"]),
    "a buffer that is no output": (
        {"launches": lambda p, cfg: [pk.Launch("row_stats", (1, 1, 1), (16, 1, 1),
                                               (pk.Buf("out"),))]}, False, "launches",
        ["Buf('out')", "'arg'", "'rows'", "Problem.outputs"]),
    "operand of an unknown kind": (
        {"operands": (pk.Operand("x"), pk.Operand("idx", "int64"))}, False, "operands",
        ["'int64'", "'int32'"]),
    "generator draws a float index table": ({"cases": _float_idx_cases}, True, "cases",
                                            ["'idx'", "int32"]),
    "tolerance too tight for the rounded oracle": (
        {"tolerance": lambda p, x, r: (None, 0.0, None)}, True, "tolerance",
        ["fails the spec's own bound", "output 's'"]),
}


@pytest.mark.parametrize("name", sorted(BAD_SPECS))
def test_malformed_several_output_spec_is_refused(name: str) -> None:
    changes, check, field, words = BAD_SPECS[name]
    bad = SPEC.replace(**{"name": "bad_gather", **changes})
    assert_spec_refused(bad, field, words, check=check)


def test_tolerance_forms_agree() -> None:
    """A tuple, a dict and one bound for all are the same contract (output_bounds)."""
    from portakern.core.spec_checks import output_bounds

    outs = {"y": ((2, 3), "float32"), "s": ((2,), "float32"), "arg": ((2,), "int32")}
    assert output_bounds("t", outs, (None, 1.0, 5.0)) == (None, 1.0, None)  # int32: exact
    assert output_bounds("t", outs, {"s": 1.0, "y": 2.0}) == (2.0, 1.0, None)
    assert output_bounds("t", outs, 3.0) == (3.0, 3.0, None)
