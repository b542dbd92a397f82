"""Tunables the CPU schedule resolves per problem: softmax's STREAM, matmul's PACK_B.

Why: softmax writes an output of STREAM_MIN_BYTES or more once, with streaming stores,
computing exp again instead of re-reading a stored copy; matmul reads a B of PACK_MIN_BYTES
or less in place instead of packing it. Each choice must follow the size, a user's explicit
choice must stand, a problem must get its own choice even where it shares a tuning bucket
with another, and softmax's two paths must give the same bits (the sum is taken in the same
order either way).
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.ops import get_op
from portakern.ops import matmul as mm
from portakern.ops import softmax as sm
from portakern.runtime import configs, selection

SPEC = get_op("softmax")
MATMUL = get_op("matmul")


def _problem(shape: tuple[int, ...], dtype: str = "float32"):  # noqa: ANN202
    x = np.zeros(shape, dtype)
    return SPEC.problem({"x": x}, dict(SPEC.params))


def _mm_problem(m: int, k: int, n: int, dtype: str = "float32"):  # noqa: ANN202
    return MATMUL.problem({"a": np.zeros((m, k), dtype), "b": np.zeros((k, n), dtype)},
                          dict(MATMUL.params))


def test_automatic_pack_follows_the_size_of_b() -> None:
    cpu = dict(MATMUL.schedules["cpu"])
    assert cpu["PACK_B"] == 2 and MATMUL.schedules["gpu"]["PACK_B"] == 0
    side = int((mm.PACK_MIN_BYTES // 4) ** 0.5)  # B of at most PACK_MIN_BYTES
    small = mm.fit_pack(_mm_problem(64, side, side), dict(cpu), 2)
    assert small["PACK_B"] == 0 and small["LY"] == 2
    big = mm.fit_pack(_mm_problem(64, side, side + 1), dict(cpu), 2)
    assert big["PACK_B"] == 1 and big["LY"] == cpu["LY"]
    for forced in (0, 1):
        got = mm.fit_pack(_mm_problem(8, 8, 8), {**cpu, "PACK_B": forced}, 2)
        assert got["PACK_B"] == forced and got["LY"] == cpu["LY"]
    assert mm.packs_b(_mm_problem(8, 8, 8), cpu)  # unresolved (no device): the packed path


def test_each_problem_in_a_bucket_gets_its_own_fit(kernel_target: str) -> None:
    """N = 384 and N = 1024 share one tuning bucket; the memo of configs per bucket must not
    hand the first one's fitted choice to the second (PACK_B, and likewise attention's
    SPLIT)."""
    be = selection.get(kernel_target)
    a, b = _mm_problem(384, 384, 384), _mm_problem(1024, 1024, 1024)
    assert a.derived["K"] * a.derived["N"] * 4 <= mm.PACK_MIN_BYTES < 1024 * 1024 * 4
    assert configs.bucket(a) == configs.bucket(b)
    first, second = configs.config_for(be, MATMUL, a), configs.config_for(be, MATMUL, b)
    if be.device_class == "cpu":
        assert (first["PACK_B"], second["PACK_B"]) == (0, 1)
    assert configs.config_for(be, MATMUL, a) == first


def test_automatic_stream_follows_the_output_size() -> None:
    cpu = dict(SPEC.schedules["cpu"])
    assert cpu["STREAM"] == 2 and SPEC.schedules["gpu"]["STREAM"] == 0
    rows = sm.STREAM_MIN_BYTES // (4096 * 4)
    assert sm.fit_stream(_problem((rows, 4096)), dict(cpu), 2)["STREAM"] == 1
    assert sm.fit_stream(_problem((rows - 1, 4096)), dict(cpu), 2)["STREAM"] == 0
    assert sm.fit_stream(_problem((rows, 4096), "float64"), dict(cpu), 2)["STREAM"] == 1
    for forced in (0, 1):  # an explicit choice is kept, whatever the size
        assert sm.fit_stream(_problem((8, 16)), {**cpu, "STREAM": forced}, 2)["STREAM"] == forced


def test_config_for_resolves_stream_on_a_cpu_device(kernel_target: str) -> None:
    be = selection.get(kernel_target)
    big = configs.config_for(be, SPEC, _problem((4096, 4096)))
    small = configs.config_for(be, SPEC, _problem((64, 4096)))
    assert big["STREAM"] in (0, 1) and small["STREAM"] == 0
    if be.device_class == "cpu":
        assert big["STREAM"] == 1


@pytest.mark.parametrize("shape", [(5, 64), (6, 4101), (3, 16), (2, 7, 48), (4, 4096),
                                   (3, 5008)])
def test_streamed_and_cached_outputs_are_identical(shape: tuple[int, ...],
                                                   kernel_target: str) -> None:
    """Aligned rows stream, unaligned ones (n % 16 != 0 after the first) keep the cached
    path; a streamed row of up to 4096 floats keeps e in local memory, a longer one (5008)
    computes exp again; a fully -inf row gives zeros and a +inf makes its row NaN on all."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32) * 10
    flat = x.reshape(-1, shape[-1])
    flat[1] = -np.inf
    flat[-1, 3] = np.inf
    base = {"STORE_EXP": 1, "VEC": 16, "WG": 1}
    got = {s: np.asarray(pk.call("softmax", x, backend=kernel_target,
                                 config={**base, "STREAM": s})) for s in (0, 1)}
    np.testing.assert_array_equal(got[0], got[1])
    out = got[1].reshape(-1, shape[-1])
    assert np.all(out[1] == 0) and np.all(np.isnan(out[-1]))
    ok = [r for r in range(out.shape[0]) if r not in (1, out.shape[0] - 1)]
    np.testing.assert_allclose(out[ok].sum(axis=-1), 1.0, rtol=1e-5)


def test_size_chosen_paths_repeat_on_device_arrays(kernel_target: str) -> None:
    """Each size-chosen path called twice on device-resident arrays (no host copies), as a
    plan's runner repeats it: the same bits each time, and the same as from host arrays."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in ((30, 70), (70, 90)))
    xd = pk.to_backend(x, kernel_target)
    ad, bd = pk.to_backend(a, kernel_target), pk.to_backend(b, kernel_target)
    for op, dev, host, cfg in (("softmax", (xd,), (x,), {"STREAM": 1}),
                               ("matmul", (ad, bd), (a, b), None),
                               ("matmul", (ad, bd), (a, b), {"PACK_B": 1})):
        first, again = (np.asarray(pk.call(op, *dev, backend=kernel_target, config=cfg).get())
                        for _ in range(2))
        np.testing.assert_array_equal(first, again)
        np.testing.assert_array_equal(
            first, np.asarray(pk.call(op, *host, backend=kernel_target, config=cfg)))


def test_attention_splits_keep_their_partials_within_32_bit_indexing() -> None:
    """A forced SPLIT on a long prefill: the partials (rows x ranges x (Dv + 2)) are indexed
    with ints in the kernels; 2 ranges over 2**24 query rows made 2.2e9 elements, which
    wrapped and wrote out of bounds. The plan halves the ranges until they fit."""
    from portakern.core.spec import MAX_INDEX, ArrayMeta
    from portakern.ops import attention as at

    def plan(sq: int, split: int) -> tuple[int, dict[str, tuple[int, str]]]:
        spec = get_op("attention")
        metas = {"q": ArrayMeta((1, 1, sq, 64), "float16"),
                 "k": ArrayMeta((1, 1, 64, 64), "float16"),
                 "v": ArrayMeta((1, 1, 64, 64), "float16")}
        prob = spec.problem(metas, dict(spec.params))
        cfg = {**spec.schedules["gpu"], "SPLIT": split}
        return at.split_plan(prob, cfg)[0], at.workspace(prob, cfg)

    ns, ws = plan(1 << 24, 2)
    assert ns == 1 and "part" not in ws
    ns, ws = plan(1 << 20, 2)
    assert ns == 2 and ws["part"][0] <= MAX_INDEX
    ns, ws = plan(1 << 23, 8)  # 8 ranges: 4.4e9 elements; 2: 1.1e9, within the limit
    assert ns == 2 and ws["part"][0] <= MAX_INDEX
