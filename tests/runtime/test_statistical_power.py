"""The statistical check's power and its false alarms, per model (issue 26).

matmul has two models (portakern/ops/matmul.py): ``statistical``, order-free, for results of
unknown order (pk.verify of a foreign result, array backends), and ``statistical_ordered``,
built from the node values of matmul.c's own summation tree (512-term sequential blocks, 16
blocks per second-level sum, then a running total), for results of that kernel
(``compare_arrays(..., ordered=True)``: the suite and `portakern check` on C-kernel
backends). What each must do, in float32 at K = 4096 and 16384 on normal, all-positive and
+-1e4-offset data, 96 outputs (tau = 2.24):

* the ordered model catches a result whose error is the kernel's own plus independent random
  errors of 4x the kernel's rms error, and TF32-rounded loads, on every family; the
  order-free one (it must admit one running sum over K) catches the 4x on no family, and
  TF32 not on same-sign-offset data nor, at K = 16384, on all-positive data -- these tests
  fail if a change makes either model blind, or the order-free one sharper than the docs
  say;
* the ordered model never fires on the kernel's own results.

Which results: the power tests judge ``emulate_kernel``, a float32 emulation of matmul.c's
tree (correctly rounded FMAs), not the kernel itself, so that they run, deterministic, on a
machine without OpenCL; ``test_emulation_is_the_kernel`` holds the emulation to the kernel
bit for bit on every C-kernel target, and ``test_the_blocking_is_the_kernels`` its block
lengths to matmul.c's #defines. The false-alarm sweep runs the real kernel on every C-kernel
target (a call is ~5 ms on PoCL; the model's ~0.1 s per problem is the cost):
PORTAKERN_STAT_SEEDS seeds per family and K (default 6, a few seconds); the 1000-seed run
and its result are in docs/guarantees.md ("Correctness checks").
"""

from __future__ import annotations

import functools
import os
import re

import ml_dtypes
import numpy as np
import pytest

import portakern as pk
from portakern.ops import get_op, matmul
from portakern.ops.matmul import matmul_values
from portakern.runtime import selection
from portakern.runtime.verify import Verdict, compare_arrays, own_kernel, tau

LONG = (4096, 16384)
M, N = 4, 24  # 96 independent outputs: tau(96) = 2.24
FAMILIES = ("normal", "positive", "offset", "offset-both", "offset-one")
SEEDS = int(os.environ.get("PORTAKERN_STAT_SEEDS", "6"))


def operands(kind: str, k: int, seed: int = 0, m: int = M, n: int = N
             ) -> tuple[np.ndarray, np.ndarray]:
    """matmul_values' families, plus both operands around +-1e4 with opposite signs (every
    product ~ -1e8: no cancellation) and one around 1e4 with the other centred."""
    rng = np.random.default_rng([seed, k, len(kind), 26])
    if kind == "offset-both":
        a = (rng.standard_normal((m, k)) + 1e4).astype(np.float32)
        return a, (rng.standard_normal((k, n)) - 1e4).astype(np.float32)
    if kind == "offset-one":
        a = (rng.standard_normal((m, k)) + 1e4).astype(np.float32)
        return a, rng.standard_normal((k, n)).astype(np.float32)
    return matmul_values(rng, kind, (m, k), (k, n), "float32")


def _fma32(acc: np.ndarray, p: np.ndarray) -> np.ndarray:
    """fl32(acc + p), one rounding (a float32 FMA whose product p is exact in float64): the
    float64 sum and its exact error (TwoSum), then the float32 rounding, with the tie a
    double rounding would break wrongly broken by the error's sign."""
    a = acc.astype(np.float64)
    s = a + p
    bb = s - a
    r = (a - (s - bb)) + (p - bb)  # a + p = s + r exactly
    f = s.astype(np.float32)
    d = s - f.astype(np.float64)  # exact
    toward = np.nextafter(f, np.where(d > 0, np.float32(np.inf), np.float32(-np.inf)))
    tie = (d != 0) & (2 * d == toward.astype(np.float64) - f) & (r != 0)
    # s is the midpoint between f and toward: the exact sum lies on r's side of it
    return np.where(tie & (np.sign(r) == np.sign(d)), toward, f)


def emulate_kernel(a: np.ndarray, b: np.ndarray, fused: bool = True) -> np.ndarray:
    """matmul.c's summation tree in float32: per output, KB1-term sequential blocks (FMAs, or
    with fused=False rounded products then adds), each block sum added into a second-level
    sum, which goes into the total every KB2 blocks and at the end."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    K = a.shape[1]
    shape = (a.shape[0], b.shape[1])
    tot, mid = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    blocks = -(-K // matmul.KB1)
    for blk in range(blocks):
        acc = np.zeros(shape, np.float32)
        for k in range(blk * matmul.KB1, min(K, (blk + 1) * matmul.KB1)):
            p = np.outer(a64[:, k], b64[k])  # exact
            acc = _fma32(acc, p) if fused else acc + p.astype(np.float32)
        mid = mid + acc
        if blk % matmul.KB2 == matmul.KB2 - 1 or blk == blocks - 1:
            tot, mid = tot + mid, np.zeros(shape, np.float32)
    return tot


@functools.cache
def _kernel_result(kind: str, k: int, rounding: str = "") -> np.ndarray:
    a, b = operands(kind, k)
    if rounding == "tf32":  # the kernel with TF32-rounded loads (test_mutants' mutant)
        a, b = _tf32(a), _tf32(b)
    return emulate_kernel(a, b)


def _tf32(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _verdicts(a: np.ndarray, b: np.ndarray, got: np.ndarray) -> tuple[Verdict, Verdict]:
    spec = get_op("matmul")
    arrays = {"a": a, "b": b}
    return (compare_arrays(spec, arrays, {}, got, ordered=True),
            compare_arrays(spec, arrays, {}, got))


# --- the emulation is the kernel ------------------------------------------------------------

def test_the_blocking_is_the_kernels() -> None:
    src = get_op("matmul").source
    for name in ("KB1", "KB2"):
        found = re.search(rf"#define {name} (\d+)", src)
        assert found and int(found.group(1)) == getattr(matmul, name), name


@pytest.mark.parametrize("schedule,overlay", [("cpu", {}), ("cpu", {"PACK_B": 1}),
                                              ("gpu", {})], ids=["cpu", "cpu-packed", "gpu"])
def test_emulation_is_the_kernel(kernel_target: str, schedule: str,
                                 overlay: dict[str, int]) -> None:
    """Both schedules (the CPU micro-kernel with explicit fma(), B read in place as these
    small shapes get it, or packed as a B over 768 KiB gets it; the local-tile path) on every
    C-kernel target: bit for bit the emulation, fused or not, with K not a
    multiple of 512 and a last second-level sum of one block (K = 8193: 17 blocks). Measured
    also: the direct vector path (PACK_B=0) and the scalar direct path (VEC=1, USE_LOCAL=0)
    are bit for bit on PoCL; Intel's CPU OpenCL compiler reassociates the scalar direct path
    (neither emulation; errors ~2x smaller, ordered T/tau <= 0.17), a compiler's liberty the
    ordered model cannot see."""
    be = selection.get(kernel_target)
    spec = get_op("matmul")
    for kind, k in (("normal", 700), ("positive", 8193), ("offset", 4096)):
        a, b = operands(kind, k, seed=1, m=5, n=33)
        got = pk.call(spec, a, b, backend=be, config=spec.config(schedule, overlay))
        fused, plain = emulate_kernel(a, b), emulate_kernel(a, b, fused=False)
        assert np.array_equal(got, fused) or np.array_equal(got, plain), (
            f"{kind} K={k}: {int(np.sum(got != fused))} of {got.size} outputs differ from the "
            "fused emulation: matmul.c's summation order changed; update "
            "matmul.statistical_ordered and emulate_kernel together")


# --- power: what each model catches ---------------------------------------------------------

@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", FAMILIES)
def test_ordered_model_catches_4x_the_kernels_error(kind: str, k: int) -> None:
    """The kernel's result passes the ordered model; with independent normal errors of 4x its
    rms error added it fails it (T ~ (1 + 16)/3 against tau 2.24), while the order-free model
    passes both (it needs ~20x on normal data, ~165x on all-positive and ~450x on same-sign
    offsets at K = 16384)."""
    a, b = operands(kind, k)
    got = _kernel_result(kind, k)
    ordered, free = _verdicts(a, b, got)
    assert ordered.ok and ordered.stat_ratio is not None and ordered.stat_ratio < 0.3, ordered
    assert "kernel-order model" in ordered.checks[-1].detail
    ref = a.astype(np.float64) @ b.astype(np.float64)
    rms = float(np.sqrt(np.mean((got - ref) ** 2)))
    noise = np.random.default_rng([k, len(kind), 4]).standard_normal(got.shape)
    bad = (got + 4.0 * rms * noise).astype(np.float32)
    ordered, free = _verdicts(a, b, bad)
    assert not ordered.ok and ordered.stat_ratio is not None and ordered.stat_ratio > 1.3, (
        f"4x the kernel's error passed the ordered model: {ordered}")
    assert ordered.worst_ratio <= 1, "the worst-case bound alone already fails it"
    assert free.ok, f"the order-free model caught 4x ({kind}, K={k}): update the docs: {free}"


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", ["positive", "offset-both"])
def test_tf32_loads_caught_only_by_the_ordered_model(kind: str, k: int) -> None:
    """The kernel with TF32-rounded loads, on data without cancellation: the order-free
    model cannot tell it from a correct sequential sum (30 seeds: all-positive caught 5/30 at
    K = 4096, 0/30 at 16384; same-sign offsets 0/30), the ordered one fails it by a factor >
    10 (measured >= 14 over 30 seeds x every family)."""
    a, b = operands(kind, k)
    ordered, free = _verdicts(a, b, _kernel_result(kind, k, "tf32"))
    assert ordered.stat_ratio is not None and ordered.stat_ratio > 10, ordered
    if (kind, k) != ("positive", 4096):  # there: passes on most seeds, caught on some
        assert free.ok, f"the order-free model caught TF32 ({kind}, K={k}): update the docs"


def _running_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        acc = _fma32(acc, np.outer(a[:, k].astype(np.float64), b[k].astype(np.float64)))
    return acc


def test_a_correct_foreign_order_fails_the_ordered_model() -> None:
    """Why pk.verify keeps the order-free model: one running fp32 sum over K = 4096 positive
    products is a correct float32 matmul, and the order-free model passes it; the ordered
    model, which assumes 512-term blocks, rejects it (as it rejects numpy/OpenBLAS' sgemm on
    this data, measured T/tau ~5)."""
    a, b = operands("positive", 4096)
    got = _running_sum(a, b)
    ordered, free = _verdicts(a, b, got)
    assert free.ok and not ordered.ok, (free, ordered)
    assert pk.verify("matmul", a, b, got=got).ok


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_running_sum_passes_the_order_free_model(kind: str, k: int) -> None:
    """One running fp32 sum (rounded products, and fused) is a correct float32 matmul, as
    jax:cpu's XLA dot and numpy's gemv compute it: the order-free model must pass it on every
    family. On same-sign offsets its rounding errors share a sign (~6 sigma at K = 16384
    without the running-sum slack)."""
    a, b = operands(kind, k, m=2, n=8)
    prods = a[:, None, :].astype(np.float64) * b.T[None, :, :].astype(np.float64)
    rounded = np.cumsum(prods.astype(np.float32), axis=2, dtype=np.float32)[..., -1]
    spec = get_op("matmul")
    for got in (rounded, _running_sum(a, b)):
        v = compare_arrays(spec, {"a": a, "b": b}, {}, got)
        assert v.ok, f"{kind} K={k}: {v}"


def test_float64_results_keep_the_order_free_model() -> None:
    """In float64 the oracle errs as much as the kernel, in its own order: both models are the
    order-free one there."""
    a, b = operands("positive", 600)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    spec = get_op("matmul")
    prob = spec.problem({"a": a64, "b": b64}, {})
    ref = a64 @ b64
    free = matmul.statistical(prob, {"a": a64, "b": b64}, ref)
    ordered = matmul.statistical_ordered(prob, {"a": a64, "b": b64}, ref)
    assert np.array_equal(free.sigma, ordered.sigma)


# --- false alarms: the kernel's own results -------------------------------------------------

@pytest.mark.parametrize("k", LONG)
def test_no_false_alarm_on_the_kernels_results(kernel_target: str, k: int) -> None:
    """PORTAKERN_STAT_SEEDS seeds x every family on the real kernel (the device's schedule),
    judged by the ordered model as the suite judges it (compare_arrays(ordered=True) where
    own_kernel(backend)). The kernel's own results sit near T = 1/3 (T/tau ~ 0.16 at 96
    outputs); the largest T/tau over the 1000-seed sweep is in docs/guarantees.md."""
    be = selection.get(kernel_target)
    assert own_kernel(be)
    spec = get_op("matmul")
    worst = 0.0
    for seed in range(SEEDS):
        for kind in FAMILIES:
            a, b = operands(kind, k, seed=1000 + seed)
            got = pk.call(spec, a, b, backend=be)
            v = compare_arrays(spec, {"a": a, "b": b}, {}, got, ordered=own_kernel(be))
            assert v.ok, f"false alarm on {kernel_target}, seed {1000 + seed}, {kind}: {v}"
            assert v.stat_ratio is not None
            worst = max(worst, v.stat_ratio)
    print(f"{kernel_target} K={k}: largest T/tau over {SEEDS} seeds x {len(FAMILIES)} "
          f"families: {worst:.3f} (tau = {tau(M * N):.2f})")
    assert worst < 0.5


# --- matrix units: truncating adds (statistical_ordered's `truncation`) ---------------------

def _toward_zero(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """x truncated toward zero to a multiple of 2**e."""
    q = np.ldexp(1.0, e)
    return np.trunc(x / q) * q


def _matrix_unit_step(c: np.ndarray, p: np.ndarray) -> np.ndarray:
    """One matrix-unit instruction as Fasi et al. measured NVIDIA's (fp32 accumulate): the
    accumulator c plus the 16 exact products p[..., :], each aligned to the largest
    magnitude's exponent and truncated 24 bits below its leading bit, summed, the sum
    truncated to 24 significant bits. Errors of one sign, not round-to-nearest."""
    _, e = np.frexp(np.maximum(np.abs(c), np.abs(p).max(axis=-1)))
    s = _toward_zero(p, e[..., None] - 24).sum(axis=-1) + _toward_zero(c, e - 24)
    _, es = np.frexp(s)
    return np.where(s == 0, 0.0, _toward_zero(s, es - 24))


def emulate_matrix_unit(a: np.ndarray, b: np.ndarray, fault: str = "") -> np.ndarray:
    """matmul.c's fragment schedule (MMA=1) on a truncating matrix unit: each KB1 block in
    MMA_K-deep instructions, the block sums added outside them in float32 as matmul.c does.
    fault: "fp16-acc" rounds the accumulator to fp16 after every instruction; "drop" loses
    the product of k = 7."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if fault == "drop":
        a64[:, 7] = 0.0
    K = a.shape[1]
    shape = (a.shape[0], b.shape[1])
    tot, mid = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    blocks = -(-K // matmul.KB1)
    for blk in range(blocks):
        acc = np.zeros(shape)
        for k0 in range(blk * matmul.KB1, min(K, (blk + 1) * matmul.KB1), matmul.MMA_K):
            p = a64[:, None, k0:k0 + matmul.MMA_K] * b64.T[None, :, k0:k0 + matmul.MMA_K]
            acc = _matrix_unit_step(acc, p)
            if fault == "fp16-acc":
                acc = acc.astype(np.float16).astype(np.float64)
        mid = mid + acc.astype(np.float32)
        if blk % matmul.KB2 == matmul.KB2 - 1 or blk == blocks - 1:
            tot, mid = tot + mid, np.zeros(shape, np.float32)
    return tot


MU_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _mu_operands(kind: str, k: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """normal; all-positive; "compensated": positive terms whose last 16 take the sum back
    near 0 (large partial sums, a small result: where a biased error shows most)."""
    rng = np.random.default_rng([k, len(kind), 30])
    t = MU_DTYPES[dtype]
    if kind == "normal":
        return rng.standard_normal((M, k)).astype(t), rng.standard_normal((k, N)).astype(t)
    b = rng.random((k, N)).astype(t).astype(np.float64)
    if kind == "compensated":
        b[k - 16:] = -(b[:k - 16].sum(axis=0) / 16)
    return np.ones((M, k)).astype(t), b.astype(t)


def _mu_verdicts(a: np.ndarray, b: np.ndarray, got: np.ndarray) -> tuple[Verdict, Verdict]:
    spec, arrays = get_op("matmul"), {"a": a, "b": b}
    return (compare_arrays(spec, arrays, {}, got, ordered=True),
            compare_arrays(spec, arrays, {}, got, ordered=True, matrix_unit=True))


@pytest.mark.parametrize("k", LONG)
@pytest.mark.parametrize("kind", ["normal", "positive", "compensated"])
@pytest.mark.parametrize("dtype", list(MU_DTYPES))
def test_truncating_matrix_unit_results_pass(dtype: str, kind: str, k: int) -> None:
    """A truncating matrix unit's result passes the ordered model with the truncation slack
    (what the suite and `portakern check` use on a device with a native lowering), and, on
    these families, the plain ordered model too: the 512-term blocks bound the partial sums
    the truncation acts on, and the fp16/bf16 store's rounding dominates (measured T/tau
    <= 0.23 plain, K = 16384, compensated)."""
    a, b = _mu_operands(kind, k, dtype)
    got = emulate_matrix_unit(a, b).astype(MU_DTYPES[dtype])
    plain, trunc = _mu_verdicts(a, b, got)
    assert trunc.ok and plain.ok, (plain, trunc)
    assert "kernel-order model" in trunc.checks[-1].detail
    assert trunc.stat_ratio is not None and plain.stat_ratio is not None
    assert trunc.stat_ratio <= plain.stat_ratio


@pytest.mark.parametrize("fault", ["fp16-acc", "drop"])
def test_the_truncation_slack_still_sees_faults(fault: str) -> None:
    """The slack (MMA_STEP_ULPS float32 ulps per instruction) leaves the model able to see an
    fp16 accumulator and a lost product, in fp16 at K = 4096 on normal data. (On all-positive
    data both hide below the fp16 output's own rounding: a result near 2048 is stored to a
    spacing of 2, so no check can see them there.)"""
    a, b = _mu_operands("normal", 4096, "float16")
    got = emulate_matrix_unit(a, b, fault).astype(np.float16)
    plain, trunc = _mu_verdicts(a, b, got)
    assert not trunc.ok, f"{fault} passed the truncation-aware model: {trunc}"
    assert not plain.ok


def test_cpu_devices_keep_the_plain_ordered_model(kernel_target: str) -> None:
    """The CPU devices have no native lowering: their fragment schedule runs the emulation,
    which rounds to nearest, so their results keep the plain ordered model."""
    from portakern.runtime.verify import native_matrix_unit

    be = selection.get(kernel_target)
    if be.device_class != "cpu":
        pytest.skip(f"{kernel_target} is not a CPU device")
    assert not native_matrix_unit(be)


def test_only_matrix_unit_devices_get_the_slack() -> None:
    """native_matrix_unit: True only where the dialect table gives the device a native
    lowering. A user's ordered model without a `truncation` keyword gives way to the
    order-free one there."""
    from types import SimpleNamespace

    from portakern.runtime.verify import native_matrix_unit, statistical_model

    assert native_matrix_unit(SimpleNamespace(matrix_unit="sm80"))
    assert not native_matrix_unit(SimpleNamespace(matrix_unit=None))
    spec = get_op("matmul")
    model = statistical_model(spec, ordered=True, matrix_unit=True)
    assert isinstance(model, functools.partial) and model.keywords == {"truncation": True}
    assert statistical_model(spec, ordered=True) is spec.statistical_ordered
    user = spec.replace(statistical_ordered=lambda p, x, ref: matmul.statistical_ordered(
        p, x, ref))
    assert statistical_model(user, ordered=True, matrix_unit=True) is user.statistical
