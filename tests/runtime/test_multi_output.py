"""Several outputs, several launches, an int32 index table and an int scalar, through the
public API only: ``gather_rows_with_sum`` returns y = x[idx + offset] (M, D) and its row sums
s = y.sum(-1) (M,). Launch 1 gathers into y; launch 2 reads y (written by launch 1) and
reduces it into s. An index out of range gives a NaN row and a NaN sum: the kernel never
reads outside x (docs/add-a-kernel.md, "Several outputs, int32 tables").

The op is passed to ``pk.call`` as a KernelSpec (no registration): nothing else sees it. The
last tests register it (with an example, its own index-drawing ``cases`` and a bound per output
that holds in every dtype) through ``pk.register_op(spec, check=True)`` and run it by name;
tests/ops/test_multi_output_user_ops.py does the same for a three-output op at length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.core import dtypes
from portakern.core.errors import AliasingError
from portakern.core.sampling import Case, Chooser, normal
from portakern.core.spec import ArrayMeta
from portakern.runtime.plan import PLANS, plan_for
from portakern.tools.cases import compare

SOURCE = """
PK_KERNEL void gather_rows(PK_GLOBAL const PK_T_T* PK_RESTRICT X,
                           PK_GLOBAL const int* PK_RESTRICT Idx,
                           PK_GLOBAL PK_T_T* PK_RESTRICT Y, int n_rows, int d, int m, int offset)
{
    const int i = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (i >= m * d) return;
    const int r = i / d, c = i - r * d;
    const int j = Idx[r] + offset;
    /* out of range: a NaN row, and x is never read outside its rows */
    const PK_ACC_T v = (j >= 0 && j < n_rows) ? PK_LOAD_T(X, j * d + c)
                                              : (PK_ACC_T)PK_AS_FLOAT(0x7fc00000u);
    PK_STORE_T(Y, i, v);
}

PK_KERNEL void row_sums(PK_GLOBAL const PK_T_T* PK_RESTRICT Y,
                        PK_GLOBAL PK_T_T* PK_RESTRICT S, int d, int m)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (r >= m) return;
    PK_ACC_T acc = (PK_ACC_T)0;
    for (int c = 0; c < d; ++c) acc += PK_LOAD_T(Y, r * d + c);
    PK_STORE_T(S, r, acc);
}
"""


def semantics(xp: Any, x: Any, idx: Any, offset: int = 0) -> Any:
    n = x.shape[0]
    j = idx + offset
    ok = (j >= 0) & (j < n)
    y = xp.where(ok[:, None], x[xp.where(ok, j, 0)], xp.nan)
    return y, y.sum(-1)


def validate(m: Mapping[str, ArrayMeta | None], params: dict[str, Any]) -> pk.Problem:
    x, idx = m["x"], m["idx"]
    assert x is not None and idx is not None
    if len(x.shape) != 2 or len(idx.shape) != 1:
        raise pk.ShapeError(f"gather_rows_with_sum: x must be (N, D) and idx (M,); got "
                            f"{x.shape} and {idx.shape}.")
    off = params["offset"]
    if isinstance(off, bool) or not isinstance(off, (int, np.integer)):
        raise pk.InvalidArgumentError(f"gather_rows_with_sum: offset must be an int; got {off!r}.")
    params["offset"] = int(off)
    (n, d), (rows,) = x.shape, idx.shape
    dt = dtypes.dtype_name(x.dtype)
    return pk.Problem("gather_rows_with_sum", dt, {"x": x.shape, "idx": idx.shape}, params,
                      (rows, d), derived={"N": n, "D": d, "M": rows},
                      empty_result=rows * d == 0,
                      outputs={"y": ((rows, d), dt), "s": ((rows,), dt)})


def launches(p: pk.Problem, cfg: Mapping[str, int]) -> list[pk.Launch]:
    n, d, rows, wg = p.derived["N"], p.derived["D"], p.derived["M"], cfg["WG"]
    return [
        pk.Launch("gather_rows", (-(-rows * d // wg), 1, 1), (wg, 1, 1),
                  (pk.Buf("x"), pk.Buf("idx"), pk.Buf("y"), pk.Scalar(n), pk.Scalar(d),
                   pk.Scalar(rows), pk.Scalar(p.params["offset"], "int"))),
        pk.Launch("row_sums", (-(-rows // wg), 1, 1), (wg, 1, 1),
                  (pk.Buf("y"), pk.Buf("s"), pk.Scalar(d), pk.Scalar(rows))),
    ]


SPEC = pk.KernelSpec(
    name="gather_rows_with_sum",
    operands=(pk.Operand("x"), pk.Operand("idx", "int32")),
    params={"offset": 0},
    validate=validate,
    semantics=semantics,
    source=SOURCE,
    slots=lambda p: {"T": p.dtype},
    defines=lambda p, cfg: dict(cfg),
    launches=launches,
    cost=lambda p: pk.Cost(float(p.derived["M"] * p.derived["D"]),
                           2.0 * p.derived["M"] * p.derived["D"] * p.info.storage.itemsize),
    # several outputs: the oracle's tuple in, one bound per output out
    tolerance=lambda p, x, refs: tuple(np.abs(r) * 1e-5 + 1e-6 for r in refs),
    tunables=(pk.Tunable("WG", (1, 16, 64), "work-items per group"),),
    schedules={"gpu": {"WG": 64}, "cpu": {"WG": 16}},
)


def _inputs(seed: int = 0, n: int = 7, d: int = 5, rows: int = 11
            ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = rng.integers(0, n, rows).astype(np.int32)
    return x, idx


def _oracle(x: np.ndarray, idx: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Written apart from the spec's semantics: a plain loop in float64."""
    y = np.full((len(idx), x.shape[1]), np.nan)
    for r, i in enumerate(idx):
        j = int(i) + offset
        if 0 <= j < x.shape[0]:
            y[r] = x[j]
    return y, y.sum(-1)


def _check(got: Any, x: np.ndarray, idx: np.ndarray, offset: int = 0) -> None:
    assert isinstance(got, tuple) and len(got) == 2
    y, s = got
    assert isinstance(y, np.ndarray) and isinstance(s, np.ndarray)
    assert y.dtype == np.float32 and s.dtype == np.float32
    ry, rs = _oracle(x, idx, offset)
    np.testing.assert_array_equal(y, ry.astype(np.float32))  # a gather is exact
    np.testing.assert_allclose(s, rs, rtol=1e-5, atol=1e-5, equal_nan=True)


def _host_target(target: str) -> bool:
    return target.split(":")[0] in ("numpy", "opencl", "jax")


def test_two_outputs_two_launches_match_oracle(target: str) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    x, idx = _inputs()
    _check(pk.call(SPEC, x, idx, backend=target), x, idx)
    _check(pk.call(SPEC, x, idx, offset=-2, backend=target), x, idx, -2)  # int scalar param


def test_no_rows_gives_empty_outputs(target: str) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    x, _ = _inputs()
    y, s = pk.call(SPEC, x, np.zeros(0, np.int32), backend=target)
    assert y.shape == (0, 5) and s.shape == (0,) and y.dtype == s.dtype == np.float32


def test_out_of_range_index_gives_nan_row_never_reads_outside(target: str) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    x, idx = _inputs(1)
    idx[[0, 3, 5]] = [-1, 7, 2**30]  # below, just past, far past the 7 rows
    y, s = pk.call(SPEC, x, idx, backend=target)
    assert np.isnan(y[[0, 3, 5]]).all() and np.isnan(s[[0, 3, 5]]).all()
    _check((y, s), x, idx)


def test_verify_checks_each_output() -> None:
    x, idx = _inputs(3)
    idx[2] = -5  # a NaN row: got must hold NaN exactly there
    y, s = pk.call(SPEC, x, idx, backend="numpy")
    v = pk.verify(SPEC, x, idx, got=(y, s))
    assert v.ok, str(v)
    assert [c.name for c in v.checks] == ["y: worst-case", "s: worst-case"]
    bad = s.copy()
    bad[4] += 1e-2
    v = pk.verify(SPEC, x, idx, got=(y, bad))
    assert not v.ok and "'s'" in v.where and v.index == (4,)
    with pytest.raises(pk.InvalidArgumentError, match="tuple of 2"):
        pk.verify(SPEC, x, idx, got=y)
    with pytest.raises(pk.ShapeError, match="'s'"):
        pk.verify(SPEC, x, idx, got=(y, s[:3]))


@pytest.mark.parametrize("bad", [np.int64, np.float32, np.int16, np.uint32])
def test_index_table_must_be_int32(bad: Any) -> None:
    x, idx = _inputs()
    with pytest.raises(pk.DTypeError, match="int32"):
        pk.call(SPEC, x, idx.astype(bad), backend="numpy")


def test_plan_made_once_with_both_launches() -> None:
    x, idx = _inputs(n=3, d=2, rows=4)  # shapes no other test uses: no plan yet
    before = len(PLANS)
    p1 = plan_for(SPEC, (x, idx), {}, backend="numpy")
    p2 = plan_for(SPEC, (x, idx), {}, backend="numpy")
    assert p1 is p2 and len(PLANS) == before + 1
    assert p1.problem.output_specs == {"y": ((4, 2), "float32"), "s": ((4,), "float32")}


def _opencl() -> Any:
    from portakern.runtime import selection

    try:
        return selection.get("opencl")
    except Exception as exc:  # noqa: BLE001 - not usable here
        pytest.skip(f"opencl not usable: {exc}")


def test_opencl_device_in_device_out_and_out_tuple() -> None:
    be = _opencl()
    x, idx = _inputs(2)
    xd, idxd = be.to_native(x), be.to_native(idx)
    assert idxd.dtype == np.int32  # uploaded as int32, not converted
    y, s = pk.call(SPEC, xd, idxd, backend="opencl")
    assert be.is_native(y) and be.is_native(s)
    _check((be.to_numpy(y), be.to_numpy(s)), x, idx)
    plan = plan_for(SPEC, (xd, idxd), {}, backend="opencl")
    assert len(plan.steps) == 2
    oy, os_ = be.empty((11, 5), "float32"), be.empty((11,), "float32")
    got = pk.call(SPEC, xd, idxd, backend="opencl", out=(oy, os_))
    assert got[0] is oy and got[1] is os_
    _check((be.to_numpy(oy), be.to_numpy(os_)), x, idx)
    with pytest.raises(pk.InvalidArgumentError, match="tuple of 2"):
        pk.call(SPEC, xd, idxd, backend="opencl", out=oy)
    with pytest.raises(pk.InvalidArgumentError, match="tuple of 2"):
        pk.call(SPEC, xd, idxd, backend="opencl", out=(oy,))
    with pytest.raises(pk.ShapeError, match="'s'"):
        pk.call(SPEC, xd, idxd, backend="opencl", out=(oy, be.empty((10,), "float32")))
    with pytest.raises(pk.DTypeError, match="'y'"):
        pk.call(SPEC, xd, idxd, backend="opencl", out=(be.empty((11, 5), "float16"), os_))
    with pytest.raises(AliasingError):  # the two outputs share memory
        pk.call(SPEC, xd, idxd, backend="opencl", out=(oy, oy.reshape(55)[:11]))
    xs = be.to_native(np.zeros((11, 5), np.float32))
    with pytest.raises(AliasingError):  # an output is an input
        pk.call(SPEC, xs, idxd, backend="opencl", out=(xs, os_))


@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_compiles_for_cuda_under_nvrtc(dt: str) -> None:
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from portakern.core import codegen

    try:
        nvrtc.getVersion()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"NVRTC cannot load: {exc}")
    from portakern.backend.cuda import compile_options

    src = codegen.render(SOURCE, "cuda", slots={"T": dt}, defines={"WG": 64})
    prog = nvrtc.createProgram(src, "gather.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(compile_options()) + ["--gpu-architecture=compute_80"])
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    ptx = bytes(nvrtc.getPTX(prog)).decode()
    assert "gather_rows" in ptx and "row_sums" in ptx


# --- registered: pk.register_op(check=True), then by name through the public paths ---------
def _cases(ch: Chooser, dtype: str) -> Case:
    """Valid indices (idx + offset in range) with a few out of range on purpose."""
    n, d, rows = ch.choice((1, 3, 7)), ch.choice((1, 5, 17)), ch.choice((1, 4, 33))
    offset = ch.choice((0, -1, 2))
    rng = np.random.default_rng(ch.seed())
    idx = rng.integers(0, n, rows) - offset
    idx[rng.random(rows) < 0.1] = n - offset
    return Case({"x": normal(rng, (n, d), dtype), "idx": idx.astype(np.int32)},
                {"offset": offset})


def _tolerance(p: pk.Problem, x: dict[str, np.ndarray], refs: tuple[np.ndarray, ...]
               ) -> tuple[Any, np.ndarray]:
    """y: a gather, exact (None); s: D terms summed in the compute type, rounded to storage."""
    y, s = refs
    u = float(np.finfo(p.info.compute).eps) / 2
    return None, (p.derived["D"] * u * np.abs(y).sum(-1) + p.info.unit_roundoff * np.abs(s)
                  + p.info.subnormal)


def _example(dt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"x": ArrayMeta((100, 64), dt), "idx": ArrayMeta((256,), "int32")}, {"offset": 0}


@pytest.fixture(scope="module")
def registered() -> Iterator[pk.KernelSpec]:
    spec = pk.register_op(SPEC.replace(name="gather_rows_reg", tolerance=_tolerance,
                                       example=_example, cases=_cases), check=True)
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


def test_registered_op_by_name_call_verify_and_check(registered: pk.KernelSpec,
                                                     target: str) -> None:
    if not _host_target(target):
        pytest.skip("numpy, opencl and jax are the targets of this test")
    from portakern.tools.conformance import run_check

    x, idx = _inputs(5)
    got = pk.call("gather_rows_reg", x, idx, offset=-1, backend=target)
    _check(got, x, idx, -1)
    assert pk.verify("gather_rows_reg", x, idx, offset=-1, got=got).ok
    assert compare(registered, Case({"x": x, "idx": idx}, {"offset": -1}), got).ok
    for dt in ("float32", "float16"):
        r = run_check(target, "gather_rows_reg", dt, 3, 0)
        assert r["status"] in ("pass", "n/a"), r


def test_a_bound_too_tight_for_float16_is_refused_at_registration() -> None:
    """SPEC's own bound (1e-5 relative) holds in float32 only: check=True runs the spec's cases
    in every dtype against the oracle and names the dtype, the output and the fix."""
    with pytest.raises(pk.SpecError) as info:
        pk.register_op(SPEC.replace(name="gather_rows_tight", example=_example, cases=_cases),
                       check=True)
    msg = str(info.value)
    assert "field `tolerance`" in msg and "float16" in msg and "output 's'" in msg, msg
    assert "unit_roundoff" in msg and "gather_rows_tight" not in pk.ops.OPS
