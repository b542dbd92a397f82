"""vexp.c's PK_VEXP, the vector exp under the CPU schedules of softmax, attention and paged
decode, against float64 exp on every OpenCL device and the simulator.

The op suites see this exp only through whole softmax rows, where one bad lane or one bad
table entry can hide inside a sum; here every lane of every vector width meets arguments that
reach each of the eight table entries, the octave edges, the underflow edge and the special
values. The bound is the one the tolerances assume (softmax.EXP_ERR, attention's
STAT_EXP_ERR): 8u relative, u = 2^-24.
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.core import codegen
from portakern.ops._common import kernel_source
from portakern.ops.attention import STAT_EXP_ERR
from portakern.ops.softmax import EXP_ERR
from portakern.runtime import selection

from conftest import KERNEL_TARGETS, require_simulator, require_tool

PROBE = """
PK_KERNEL void vexp_probe(PK_GLOBAL const float* PK_RESTRICT X, PK_GLOBAL float* PK_RESTRICT Y)
{
    const int i = PK_GROUP_ID(0);
    PK_CAT(vstore, VEC)(PK_VEXP(PK_CAT(vload, VEC)(i, X)), i, Y);
}
"""
UNDERFLOW = np.float32(-87.33)  # below it PK_VEXP returns 0 (vexp.c)
U = 2.0 ** -24


def arguments(count: int, seed: int = 0) -> np.ndarray:
    """Every float32 corner PK_VEXP has, then random arguments in [-87.33, 0] (uniform in value
    and in bit pattern) and a few in [0, 1]: k/8 ln2 and their float neighbours for every k
    (each table entry and the rounding edges between them), the underflow edge, 0, -0, -inf
    and NaN."""
    rng = np.random.default_rng(seed)
    eighths = (-np.arange(0, 1009) * np.log(2) / 8).astype(np.float32)
    halves = (-(np.arange(0, 1009) + 0.5) * np.log(2) / 8).astype(np.float32)
    edges = np.concatenate([eighths, halves])
    edges = np.concatenate([edges, np.nextafter(edges, np.float32(-np.inf)),
                            np.nextafter(edges, np.float32(0))])
    special = np.array([0.0, -0.0, -np.inf, np.nan, UNDERFLOW,
                        np.nextafter(UNDERFLOW, np.float32(0)),
                        np.nextafter(UNDERFLOW, np.float32(-np.inf)),
                        -87.0, -88.0, -100.0, -1e30, -np.finfo(np.float32).max,
                        -np.finfo(np.float32).tiny, -1e-30], np.float32)
    by_value = -rng.uniform(0.0, 87.33, count).astype(np.float32)
    # attention's backward passes s - lse, which rounding can put slightly above 0
    positive = rng.uniform(0.0, 1.0, count // 10).astype(np.float32)
    by_bits = (rng.integers(0, 0x42AEA8F6, count, dtype=np.int64).astype(np.uint32)
               | np.uint32(0x80000000)).view(np.float32)
    return np.concatenate([special, edges, by_value, by_bits, positive])


def run_probe(target: str, x: np.ndarray, vec: int,
              mutation: tuple[str, str] | None = None) -> np.ndarray:
    backend = selection.resolve(target)
    vexp = kernel_source("vexp.c")
    if mutation is not None:
        assert vexp.count(mutation[0]) == 1, f"mutation site {mutation[0]!r} not found once"
        vexp = vexp.replace(*mutation)
    source = codegen.render(vexp + PROBE, "opencl",
                            slots={"T": "float32"}, defines={"VEC": vec})
    kernel = backend.compile(source, ("vexp_probe",))["vexp_probe"]
    pad = -len(x) % vec
    xp = np.concatenate([x, np.zeros(pad, np.float32)])
    xd, yd = backend.to_native(xp), backend.empty(xp.shape, "float32")
    # through the backend's launcher: the simulator's reports (an uninitialised lane) raise
    launch = pk.Launch("vexp_probe", (len(xp) // vec, 1, 1), (1, 1, 1),
                       (pk.Buf("x"), pk.Buf("y")))
    backend.program(kernel, launch, ("x", "y"))([xd.base_data, yd.base_data])
    backend.synchronize()
    return backend.to_numpy(yd)[:len(x)]


def check(x: np.ndarray, y: np.ndarray) -> None:
    ref = np.exp(x.astype(np.float64))
    nan = np.isnan(x)
    assert np.isnan(y[nan]).all(), "exp(NaN) must be NaN"
    zero = ~nan & (x < UNDERFLOW)
    assert (y[zero] == 0).all(), \
        f"below {UNDERFLOW} (and -inf) PK_VEXP must give 0; got {y[zero][y[zero] != 0][:4]}"
    ok = ~nan & ~zero
    rel = np.abs(y[ok] - ref[ok]) / ref[ok]
    worst = int(np.argmax(rel))
    assert rel[worst] <= EXP_ERR * U, (
        f"PK_VEXP({x[ok][worst]!r}) = {y[ok][worst]!r}, float64 exp {ref[ok][worst]!r}: "
        f"{rel[worst] / U:.2f}u relative, above the {EXP_ERR}u the tolerances assume")
    assert (y[x == 0] == 1).all(), "exp(0) and exp(-0) must be exactly 1"


OPENCL_TARGETS = [t for t in KERNEL_TARGETS if t.startswith("opencl")]

# bugs this test must see (each one fails it on every device)
MUTANTS = {
    "two table entries swapped": ("0x3f7837f0, 0x3f75fed7", "0x3f75fed7, 0x3f7837f0"),
    "the exponent shifted one bit too far": ("(kb << 20)", "(kb << 21)"),
    "the underflow edge at -88": ("x < (pk_fv)(-87.33f)", "x < (pk_fv)(-88.0f)"),
    "no low part of ln2/8": ("    r = fma(k, (pk_fv)(2.6524305e-5f), r);\n", ""),
    "no cubic term": ("    pk_fv p = fma((pk_fv)(0.166668579f), r, (pk_fv)(0.500064492f));",
                      "    pk_fv p = (pk_fv)(0.500064492f);"),
    "16 lanes looked up from the low half only": (
        "PK_LOOKUP8(PK_EXP_TABLE, k.hi)", "PK_LOOKUP8(PK_EXP_TABLE, k.lo)"),
}


def test_the_tolerances_assume_one_exp_bound() -> None:
    assert EXP_ERR == STAT_EXP_ERR


def test_an_opencl_device_runs_the_vexp_checks() -> None:
    """The checks below are parametrized over the OpenCL devices present: with none (under CI,
    where the set-up installs PoCL and Intel's runtime) they would all vanish unseen."""
    require_tool(OPENCL_TARGETS, "no OpenCL CPU device for PK_VEXP's checks",
                 "bash scripts/setup.sh (installs PoCL and Intel's OpenCL runtime)")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_broken_vexp_fails_the_check(name: str) -> None:
    require_tool(OPENCL_TARGETS, "no OpenCL CPU device for PK_VEXP's mutants",
                 "bash scripts/setup.sh (installs PoCL and Intel's OpenCL runtime)")
    x = arguments(20_000)
    with pytest.raises(AssertionError):
        check(x, run_probe(OPENCL_TARGETS[0], x, 16, MUTANTS[name]))


@pytest.mark.parametrize("vec", [2, 4, 8, 16])
@pytest.mark.parametrize("opencl_target", OPENCL_TARGETS)
def test_vexp_within_the_assumed_bound(opencl_target: str, vec: int) -> None:
    x = arguments(200_000)
    check(x, run_probe(opencl_target, x, vec))


@pytest.mark.parametrize("vec", [8, 16])
def test_vexp_within_the_assumed_bound_on_the_simulator(vec: int) -> None:
    """Oclgrind has no AVX2: PK_LOOKUP8 takes its shuffle() form there."""
    require_simulator()
    x = arguments(2_000)
    check(x, run_probe("opencl:oclgrind", x, vec))
