"""softmax's streamed output (STREAM): chosen by the output's size, identical in value.

Why: the CPU schedule writes an output of STREAM_MIN_BYTES or more once, with streaming
stores, computing exp again instead of re-reading a stored copy. The choice must follow the
size (a small output stays in cache for its consumer), a user's explicit choice must stand,
and both paths must give the same bits: the sum is taken in the same order either way.
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.ops import get_op
from portakern.ops import softmax as sm
from portakern.runtime import configs, selection

SPEC = get_op("softmax")


def _problem(shape: tuple[int, ...], dtype: str = "float32"):  # noqa: ANN202
    x = np.zeros(shape, dtype)
    return SPEC.problem({"x": x}, dict(SPEC.params))


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


@pytest.mark.parametrize("shape", [(5, 64), (6, 4101), (3, 16), (2, 7, 48)])
def test_streamed_and_cached_outputs_are_identical(shape: tuple[int, ...],
                                                   kernel_target: str) -> None:
    """Aligned rows stream, unaligned ones (n % 16 != 0 after the first) keep the cached
    path; a fully -inf row gives zeros and a +inf makes its row NaN on both."""
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
