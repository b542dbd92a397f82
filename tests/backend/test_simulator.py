"""Every kernel on the Oclgrind simulator (opencl:oclgrind): races, bounds, uninitialised
values and API misuse are errors (KernelFaultError), and every result is held to the oracle.

The sweep covers every registered op x dtype x schedule: the "gpu" and "cpu" schedules in
every dtype, and, in float32, the non-default configurations test_ops.py runs on PoCL
(ALTERNATIVE_CONFIGS over the cpu schedule). The built-in ops run fixed edge shapes — 1,
primes, tile sizes +- 1, Sq != Sk, GQA, masks with fully masked rows, causal, -inf rows,
strided axes, broadcast batches — small enough for an interpreter; any other registered op
(rmsnorm, user ops) draws simulator-sized cases from its own generator
(portakern.tools.conformance.SimulatorChooser). A user kernel that races or reads out of bounds
raises KernelFaultError here (end of file).

Marked ``simulator``; where Oclgrind is not installed, a failure under CI (the set-up installs
it) and elsewhere a skip with the reason (conftest.require_tool).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from test_ops import ALTERNATIVE_CONFIGS

import portakern as pk
from portakern.core import dtypes
from portakern.core.sampling import NumpyChooser
from portakern.ops import OPS, get_op
from portakern.runtime.verify import compare_arrays
from portakern.tools.cases import case_generator
from portakern.tools.conformance import SimulatorChooser

from conftest import require_simulator

pytestmark = pytest.mark.simulator
SIM = "opencl:oclgrind"
DTYPES = ("float32", "float16", "bfloat16", "float64")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return dtypes.cast_to(rng.standard_normal(shape), dtype)


def matmul_cases(dtype: str) -> list[tuple[dict, dict]]:
    """1x1x1; M = 65 (GPU tile 64 + 1), K = 17 (TK 16 + 1), N = 63 (tile - 1); primes with
    M = 7 (CPU block 6 + 1) and N = 65 (NCOL 64 + 1, the scalar right edge); a broadcast
    batch."""
    rng = np.random.default_rng(1)
    shapes = [((1, 1), (1, 1)), ((65, 17), (17, 63)), ((2, 1, 7, 5), (3, 5, 65))]
    return [({"a": _normal(rng, a, dtype), "b": _normal(rng, b, dtype)}, {})
            for a, b in shapes]


def softmax_cases(dtype: str) -> list[tuple[dict, dict]]:
    """n = 1; n = 257 (WG 256 + 1) with a row of only -inf and scattered -inf; n = 65
    (VEC * UNROLL 64 + 1: the vector blocks and their scalar tail); a strided middle axis;
    n = 128 (8 vectors, every row aligned: the streamed path's pairs, also with 4 items)."""
    rng = np.random.default_rng(2)
    x1 = _normal(rng, (1,), dtype)
    x2 = _normal(rng, (3, 257), dtype).copy()
    x2[0] = -np.inf
    x2[1, ::7] = -np.inf
    x3 = _normal(rng, (2, 65), dtype)
    x4 = _normal(rng, (2, 17, 3), dtype)
    x5 = _normal(rng, (2, 128), dtype)
    return [({"x": x1}, {"axis": -1}), ({"x": x2}, {"axis": 1}), ({"x": x3}, {"axis": -1}),
            ({"x": x4}, {"axis": 1}), ({"x": x5}, {"axis": -1})]


def attention_cases(dtype: str) -> list[tuple[dict, dict]]:
    """All ones; GQA (4 query heads on 2 kv heads) with Sq = 17 != Sk = 33 (tiles of 16/32
    + 1), causal; a (Sq, Sk) mask with a fully masked row, D != Dv, both primes; a per-head
    mask, Sk = 65 (BK 64 + 1)."""
    rng = np.random.default_rng(3)
    out = []
    for (b, hq, hkv, sq, sk, d, dv), causal, mask in (
            ((1, 1, 1, 1, 1, 1, 1), False, None),
            ((1, 4, 2, 17, 33, 8, 8), True, None),
            ((2, 2, 1, 5, 7, 3, 5), False, (5, 7)),
            ((1, 2, 2, 3, 65, 4, 4), True, (1, 2, 1, 65))):
        arrays = {"q": _normal(rng, (b, hq, sq, d), dtype),
                  "k": _normal(rng, (b, hkv, sk, d), dtype),
                  "v": _normal(rng, (b, hkv, sk, dv), dtype), "mask": None}
        if mask is not None:
            m = rng.random(mask) < 0.7
            if mask[-2] == sq:
                m[..., 0, :] = False  # a fully masked row gives 0
            arrays["mask"] = m
        out.append((arrays, {"causal": causal}))
    return out


BUILT_IN = {"matmul": matmul_cases, "softmax": softmax_cases, "attention": attention_cases}


def cases_for(op: str, dtype: str) -> list[tuple[dict, dict]]:
    if op in BUILT_IN:
        return BUILT_IN[op](dtype)
    gen = case_generator(get_op(op))
    if gen is None:
        pytest.skip(f"op {op} has no case generator (give its KernelSpec `cases` or `shapes`)")
    ch = SimulatorChooser(NumpyChooser(np.random.default_rng([7, len(op)])))
    return [(c.arrays, c.params) for c in (gen(ch, dtype) for _ in range(2))]


def run(op: str, config: dict, dtype: str) -> None:
    spec = get_op(op)
    for arrays, params in cases_for(op, dtype):
        got = pk.call(spec, backend=SIM, config=config, **arrays, **params)
        bound, bparams = spec.bind((), {**arrays, **params})
        v = compare_arrays(spec, bound, bparams, got)
        shapes = {k: None if a is None else a.shape for k, a in arrays.items()}
        assert v.ok, f"{op} {dtype} {config} {shapes} {params} on {SIM}:\n{v}"


COLLECTED = tuple(OPS)  # the registry when this file was collected: the sweep's ops
# the gpu and cpu schedules of every op, and the AVX2 register blocks (cpu256) where an op has
# them: a CPU device picks those by its vector width, the simulator never would
SWEEP = [(op, sched, dt) for op in COLLECTED
         for sched in ("gpu", "cpu") + (("cpu256",) if "cpu256" in get_op(op).schedules else ())
         for dt in DTYPES]


@pytest.mark.parametrize("op,schedule,dtype", SWEEP,
                         ids=[f"{op}-{s}-{d}" for op, s, d in SWEEP])
def test_schedules_clean_on_simulator(op: str, schedule: str, dtype: str) -> None:
    require_simulator()
    spec = get_op(op)
    if not spec.source:
        pytest.skip(f"{op} has no C kernel")
    run(op, spec.config(schedule), dtype)


# Paths the CPU schedule picks by size, which the sweep's small cases never reach: matmul's
# packed B (a B over 768 KiB) and softmax's streamed output with e kept in local memory (an
# output of 32 MiB or more), the latter also shared by 4 items of a group.
SIZE_CHOSEN = [("matmul", {"PACK_B": 1}), ("softmax", {"STREAM": 1}),
               ("softmax", {"STREAM": 1, "WG": 4})]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op,overlay", SIZE_CHOSEN,
                         ids=[f"{op}-{'-'.join(f'{k}{v}' for k, v in o.items())}"
                              for op, o in SIZE_CHOSEN])
def test_size_chosen_paths_clean_on_simulator(op: str, overlay: dict, dtype: str) -> None:
    require_simulator()
    run(op, get_op(op).config("cpu", overlay), dtype)


@pytest.fixture
def registered_user_op() -> Iterator[pk.KernelSpec]:
    """tests/ops/test_user_ops.py's op, registered through the public API for this test only,
    so the sweep below meets an op that did not exist when this file was collected."""
    from test_user_ops import SPEC as USER_SPEC

    spec = pk.register_op(USER_SPEC.replace(name="sim_scaled_sum"))
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


@pytest.mark.parametrize("schedule", ["gpu", "cpu"])
def test_every_registered_op_clean_on_simulator(registered_user_op: pk.KernelSpec,
                                                schedule: str) -> None:
    """The sweep over the registry as it is when the test runs, not when the file was
    collected: every op with a C kernel that the parametrized sweep above did not meet (ops
    registered later: user ops, plugins) runs its own simulator-sized cases, float32 and
    float16, on both schedules. The user op of the fixture must be among them."""
    require_simulator()
    late = [name for name in list(OPS)
            if name not in COLLECTED and get_op(name).source]
    assert registered_user_op.name in late, late
    for name in late:
        for dtype in ("float32", "float16"):
            run(name, get_op(name).config(schedule), dtype)


ALT = [(op, cfg) for op, cfgs in ALTERNATIVE_CONFIGS.items() for cfg in cfgs]


@pytest.mark.parametrize("op,overlay", ALT,
                         ids=[f"{op}-{'-'.join(f'{k}{v}' for k, v in c.items())}" for op, c in ALT])
def test_alternative_configs_clean_on_simulator(op: str, overlay: dict) -> None:
    """test_ops.py's non-default paths in float32, overlaid on the "cpu" schedule as that
    test overlays them on PoCL (a CPU device): the same kernels, now run GPU-style."""
    require_simulator()
    spec = get_op(op)
    run(op, {**spec.config("cpu"), **overlay}, "float32")


# --- a user kernel that races or reads out of bounds raises ----------------------------------
SHIFT = r"""
PK_KERNEL void shift(PK_GLOBAL const PK_T_T* PK_RESTRICT X, PK_GLOBAL PK_T_T* PK_RESTRICT Y,
                     int n)
{
    PK_LOCAL PK_ACC_T t[WG];
    const int l = PK_LOCAL_ID(0);
    const int i = PK_GROUP_ID(0) * WG + l;
    t[l] = i < n ? PK_LOAD_T(X, i) : (PK_ACC_T)0;
#if BARRIER
    PK_BARRIER();
#endif
    const PK_ACC_T next = t[(l + 1) % WG];
#if PAST_END
    const PK_ACC_T extra = (PK_ACC_T)0 * PK_LOAD_T(X, n);  /* one past the end, times 0 */
#else
    const PK_ACC_T extra = (PK_ACC_T)0;
#endif
    if (i < n) PK_STORE_T(Y, i, next + extra);
}
"""


def _shift_spec(name: str, barrier: int, past_end: int) -> pk.KernelSpec:
    def validate(metas, params):  # noqa: ANN001, ANN202
        x = metas["x"]
        return pk.Problem(name, dtypes.dtype_name(x.dtype), {"x": x.shape}, params, x.shape,
                          derived={"n": int(np.prod(x.shape))})

    def launches(p, cfg):  # noqa: ANN001, ANN202
        n, wg = p.derived["n"], cfg["WG"]
        return [pk.Launch("shift", (-(-n // wg), 1, 1), (wg, 1, 1),
                          (pk.Buf("x"), pk.Buf("out"), pk.Scalar(n)))]

    def semantics(xp, x):  # noqa: ANN001, ANN202
        return x  # not what shift computes per group; these tests look at faults only

    return pk.KernelSpec(
        name=name, operands=(pk.Operand("x"),), params={}, validate=validate,
        semantics=semantics, source=SHIFT, slots=lambda p: {"T": p.dtype},
        defines=lambda p, cfg: {**cfg, "BARRIER": barrier, "PAST_END": past_end},
        launches=launches, cost=lambda p: pk.Cost(0.0, 8.0 * p.derived["n"]),
        tolerance=lambda p, x, ref: np.abs(ref) + 1.0,
        tunables=(pk.Tunable("WG", (16, 32), "items per group"),),
        schedules={"gpu": {"WG": 16}}, shapes={"x": ("n",)})


@pytest.mark.parametrize("barrier,past_end,kind,line_has", [
    (0, 0, "race", "t["), (1, 1, "out-of-bounds", "PK_LOAD_T(X, n)")])
def test_user_kernel_fault_raises(barrier: int, past_end: int, kind: str, line_has: str) -> None:
    require_simulator()
    spec = _shift_spec(f"shift_{kind.replace('-', '_')}", barrier, past_end)
    x = np.arange(40, dtype=np.float32)
    with pytest.raises(pk.KernelFaultError) as info:
        pk.call(spec, x, backend=SIM)
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, pk.PortakernError)
    assert err.kernel == "shift" and err.kind == kind
    assert line_has in err.source_line and err.line is not None
    assert err.work_items and "Global(" in err.work_items[0]
    assert kind in str(err) and "shift" in str(err)
    # the same kernel with the barrier and in bounds is clean, and right
    ok = _shift_spec("shift_ok", 1, 0)
    y = pk.call(ok, x, backend=SIM)
    groups = np.concatenate([x, np.zeros(8, np.float32)]).reshape(3, 16)
    assert np.array_equal(y, np.roll(groups, -1, axis=1).reshape(-1)[:40])


def test_simulator_is_never_automatic() -> None:
    require_simulator()
    from portakern.backend import registry
    from portakern.runtime import selection

    targets, _ = registry.available_targets()
    assert all("oclgrind" not in t for t in targets)
    sel, _ = selection.automatic()
    assert selection.get(sel).label != SIM
    be = selection.get(SIM)
    assert be.label == SIM and be.device.extra.get("simulator")
    assert be.memory_pool is None  # exact-size buffers
