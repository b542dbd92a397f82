"""softmax(x, axis=-1): exp(x - max) / sum(exp(x - max)) along one axis.

Error analysis. With m the row max and u the compute unit roundoff: computing x_i - m costs
u|x_i - m| relative error inside exp, exp itself a few ulps, the sum of n positive terms n*u
relative (Higham 4.2), and the online rescales exp(m_old - m_new) O(n u) more (see
``tolerance``). Output rounding adds u_out. Hence the bound below, relative to y_i, with an
underflow floor for the smallest outputs.

Semantics: a row of only -inf gives 0 (not NaN), like a fully masked attention row; NaN
anywhere in a row makes the whole row NaN (as numpy's max-subtracted form does).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.dtypes import dtype_name
from ..core.errors import InvalidArgumentError
from ..core.sampling import Case, Chooser, normal
from ..core.spec import ArrayMeta, Buf, Cost, KernelSpec, Launch, Operand, Problem, Scalar, Tunable
from ._common import kernel_source, need_rank

# "no value yet" for the vector path: below every finite value of the compute type
LOWEST = {"float32": -3.4028234663852886e38, "float64": -1.7976931348623157e308}


def semantics(xp: Any, x: Any, axis: int = -1) -> Any:
    m = xp.max(x, axis=axis, keepdims=True)
    # a row is dead (all 0) when every value is -inf; a NaN in it makes it NaN instead. The
    # NaN is looked for on its own: XLA:CPU's max over 256 or more drops NaN in some shapes
    # (rows of NaN and -inf read -inf and came out 0 on jax; docs/guarantees.md section 9)
    dead = (m == -xp.inf) & ~xp.any(xp.isnan(x), axis=axis, keepdims=True)
    m = xp.where(dead, xp.zeros_like(m), m)
    e = xp.exp(x - m)
    s = xp.sum(e, axis=axis, keepdims=True)
    return xp.where(dead, xp.zeros_like(e), e / xp.where(dead, xp.ones_like(s), s))


def normalize_axis(axis: object, ndim: int) -> int:
    if isinstance(axis, bool):
        raise InvalidArgumentError(f"softmax: axis must be an int; got bool {axis!r}.")
    try:
        ax = operator.index(axis)  # type: ignore[arg-type]  # any object: TypeError is the check
    except TypeError:
        raise InvalidArgumentError(
            f"softmax: axis must be an int in [-{ndim}, {ndim}); got {type(axis).__name__} "
            f"{axis!r}.") from None
    if not -ndim <= ax < ndim:
        raise InvalidArgumentError(
            f"softmax: axis {ax} is out of range for an array of rank {ndim}; expected "
            f"-{ndim} <= axis < {ndim}.")
    return ax % ndim


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    x = m["x"]
    assert x is not None
    need_rank("softmax", "x", x.shape, min_rank=1)
    ax = normalize_axis(params["axis"], len(x.shape))
    params["axis"] = ax
    outer = int(np.prod(x.shape[:ax]))
    inner = int(np.prod(x.shape[ax + 1:]))
    n = x.shape[ax]
    return Problem("softmax", dtype_name(x.dtype), {"x": x.shape}, params, x.shape,
                   derived={"outer": outer, "n": n, "inner": inner},
                   empty_result=outer * n * inner == 0)


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    d = p.derived
    rows = d["outer"] * d["inner"]
    return [Launch("softmax", (rows, 1, 1), (cfg["WG"], 1, 1),
                   (Buf("x"), Buf("out"), Scalar(d["n"]), Scalar(d["inner"])))]


def cost(p: Problem) -> Cost:
    numel = int(np.prod(p.out_shape))
    return Cost(flops=5.0 * numel, bytes=2.0 * numel * p.info.storage.itemsize)


def tolerance(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    xv = x["x"]
    ax = p.params["axis"]
    n = p.derived["n"]
    u = float(np.finfo(p.info.compute).eps) / 2
    finite = np.isfinite(xv)
    with np.errstate(all="ignore"):
        mx = np.max(np.where(finite, xv, -np.inf), axis=ax, keepdims=True) if n else xv
        dist = np.where(finite & np.isfinite(mx), np.abs(xv - mx), 0.0)
    # Online rescales: element j's term picks up (m - x_j) u relative error, but its weight
    # exp(x_j - m) makes the absolute contribution <= u/e, so they add up to O(n u), not to
    # the row's range.
    rel = u * (2.0 * dist + 6.0 * n + 16.0) + p.info.unit_roundoff
    floor = p.info.subnormal + 4.0 * float(np.finfo(p.info.compute).tiny)
    return np.abs(ref) * rel + floor


# STREAM = 2 streams outputs of at least this size. Side by side on a 2-core Xeon (PoCL /
# Intel, rows of 4096 floats, streamed time against cached): 128 MiB 1.43 / 1.23x faster,
# 64 MiB 1.45 / 1.27x, 32 MiB 1.05 / 0.87x (the edge), 16 MiB 0.92 / 0.81x, 8 MiB 0.91 /
# 0.84x: a small output stays in cache for its consumer, where a streamed one has left.
STREAM_MIN_BYTES = 32 << 20


def fit_stream(p: Problem, cfg: dict[str, int], compute_units: int) -> dict[str, int]:
    """The spec's ``fit_device``: STREAM = 2 becomes 1 for an output of at least
    STREAM_MIN_BYTES, else 0. A raw config keeps 2, which the kernel reads as 0."""
    if cfg.get("STREAM") == 2:
        big = int(np.prod(p.out_shape)) * p.info.storage.itemsize >= STREAM_MIN_BYTES
        cfg["STREAM"] = int(big)
    return cfg


EXP_ERR = 8.0  # exp's error in units of u (4 ulp: OpenCL allows 3, vexp.c and XLA's are less)


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    """Probabilistic model (the statistical check, portakern.verify). With m the row max,
    S = sum_j exp(x_j - m) and y_i = exp(x_i - m) / S:

    * random (sub-Gaussian, variance proxy sigma^2): the sum's n - 1 additions each round a
      partial sum of positive terms, |partial| <= S, with error <= u |partial|; an online
      rescale multiplies a partial sum (<= S) by an exp with error <= EXP_ERR u, at most one
      per element. Independent mean-zero errors (Higham & Mary 2019) give S a relative error
      with proxy u^2 (n - 1)(1 + EXP_ERR^2), in every order (sequential, blocked, lane-wise,
      trees). Rounding y to the output adds u_out |y|. So
          sigma_i = |y_i| sqrt(u^2 (n - 1)(1 + EXP_ERR^2) + u_out^2).
    * deterministic (slack): x_i - m rounds (u |x_i - m| relative after exp), exp errs by
      EXP_ERR u, the same for every term of S (<= u sum_j y_j |x_j - m| + EXP_ERR u), and the
      reciprocal and product 2u:
          slack_i = |y_i| u (2 |x_i - m| + 2 sum_j y_j |x_j - m| + 2 EXP_ERR + 4) + floor.

    A row shares S, so its elements form one group (their errors may be correlated)."""
    from ..core.statmodel import StatModel

    xv = x["x"]
    ax = p.params["axis"]
    n = p.derived["n"]
    u = float(np.finfo(p.info.compute).eps) / 2
    finite = np.isfinite(xv)
    with np.errstate(all="ignore"):
        mx = np.max(np.where(finite, xv, -np.inf), axis=ax, keepdims=True)
        dist = np.where(finite & np.isfinite(mx), np.abs(xv - mx), 0.0)
        y = np.abs(np.nan_to_num(ref, nan=0.0))
        wdist = np.sum(y * dist, axis=ax, keepdims=True)
        sigma = y * np.sqrt(u * u * max(n - 1, 0) * (1 + EXP_ERR ** 2)
                            + p.info.unit_roundoff ** 2)
        slack = y * u * (2.0 * dist + 2.0 * wdist + 2.0 * EXP_ERR + 4.0)
    floor = p.info.subnormal + 4.0 * float(np.finfo(p.info.compute).tiny)
    return StatModel(sigma, slack + floor, (ax,))



# --- test cases: shapes and values that break kernels and numerics (suite, `check`) ---
def softmax_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    n = ch.choice((1, 2, 15, 16, 17, 255, 256, 257, 1000, 4097))
    rank = ch.choice((1, 2, 2, 3))
    others = [ch.choice((1, 2, 3, 7, 16)) for _ in range(rank - 1)]
    axis_pos = ch.choice(range(rank))
    shape = others[:axis_pos] + [n] + others[axis_pos:]
    axis = axis_pos - rank if ch.boolean() else axis_pos
    kind = ch.choice(("normal", "offset", "wide", "neginf", "posinf", "range", "nan", "spike"))
    scale, offset = 1.0, 0.0
    if kind == "offset":
        offset = ch.choice((1e4, -1e4, 300.0))
    elif kind == "wide":
        scale = ch.choice((10.0, 100.0))
    elif kind == "range":
        scale = {"float16": 2e4, "bfloat16": 1e30, "float32": 1e30, "float64": 1e200}[dtype]
    x = normal(rng, tuple(shape), dtype, scale, offset)
    if kind == "neginf":
        x = x.copy()
        x[rng.random(x.shape) < 0.2] = -np.inf
        if x.size and ch.boolean():
            idx: list[slice | int] = [slice(None)] * rank
            for d in range(rank):
                if d != axis_pos:
                    idx[d] = 0
            x[tuple(idx)] = -np.inf  # one fully -inf row -> zeros
    if kind == "posinf" and x.size:  # +inf in a row makes the row NaN, as in the oracle
        x = x.copy()
        x[rng.random(x.shape) < 0.01] = np.inf
        x.reshape(-1)[int(rng.integers(x.size))] = np.inf
        if ch.boolean(0.3):
            x[rng.random(x.shape) < 0.1] = -np.inf
    if kind == "spike" and x.size:
        # one value far above the rest of its row, where a vector path's tail or a chunk
        # boundary puts it (first, last, the first scalar past the vectors): a max pass that
        # misses it overflows exp (a review's mutant skipping the tail's first element
        # survived: a gap over 88.7 came up in 18 of 4,000 ordinary cases)
        x = x.copy()
        pos = ch.choice((0, n - 1, (n // 16) * 16 if n % 16 else n - 1))
        idx2: list[slice | int] = [slice(None)] * rank
        idx2[axis_pos] = pos
        x[tuple(idx2)] = x[tuple(idx2)] + np.asarray(ch.choice((100.0, 1000.0)), x.dtype)
    if kind == "nan" and x.size:  # NaN anywhere in a row makes the row NaN
        x = x.copy()
        x[rng.random(x.shape) < 0.01] = np.nan
        x.reshape(-1)[int(rng.integers(x.size))] = np.nan
        if ch.boolean(0.5):  # NaN among -inf alone: the max skips NaN, and -inf rows are 0
            x[~np.isnan(x)] = -np.inf
    return Case({"x": x}, {"axis": axis}, kind)


# --- representative calls: what `portakern show`/`tune` render and the compile checks compile
def example(dtype: str, *, R: int = 64, N: int = 1024) -> tuple[dict[str, Any], dict[str, Any]]:
    """A typical call: R rows of N along the last axis; ``--shape R=..,N=..`` sets them."""
    return {"x": ArrayMeta((R, N), dtype)}, {"axis": -1}


def examples(dtype: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The compile checks' call (the source changes with dtype and schedule only)."""
    return [("x(8,1000)", {"x": ArrayMeta((8, 1000), dtype)}, {})]


SPEC = KernelSpec(
    name="softmax",
    operands=(Operand("x"),),
    params={"axis": -1},
    validate=validate,
    semantics=semantics,
    source=kernel_source("vexp.c", "softmax.c"),
    slots=lambda p: {"T": p.dtype},
    defines=lambda p, cfg: {**cfg, "LOWEST": LOWEST[p.info.compute.name]},
    launches=launches,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    tunables=(Tunable("WG", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                      "work-items per row (a power of two: tree reduction)"),
              Tunable("VEC", (1, 2, 4, 8, 16), "vector lanes (CPU schedule, contiguous rows)"),
              Tunable("UNROLL", (1, 2, 4, 8), "vectors per block between rescales"),
              Tunable("STORE_EXP", (0, 1), "exp once per element: max pass, exp pass into the "
                      "output, scale pass (fp32/fp64 storage; else ignored)"),
              Tunable("STREAM", (0, 1, 2), "with STORE_EXP and VEC > 1: 1 keeps e in a local "
                      "row (exp again past 4096 floats) and streams the output out (written "
                      "once, never read for ownership); 0 keeps it in cache; 2: 1 when the "
                      "output is at least STREAM_MIN_BYTES"),
              Tunable("PF", (0, 1), "the next row's prefetch (CPU schedule): 0 into L1 "
                      "(prefetcht0), 1 into the outer caches (prefetcht2)")),
    schedules={"gpu": {"WG": 256, "VEC": 1, "UNROLL": 1, "STORE_EXP": 0, "STREAM": 0, "PF": 0},
               # AVX-512: the next row into L2 (PF 1): 4096^2 11-14% faster than prefetcht0 on
               # a Zen 4, PoCL and Intel, alternating processes
               "cpu": {"WG": 1, "VEC": 16, "UNROLL": 4, "STORE_EXP": 1, "STREAM": 2, "PF": 1},
               # AVX2: the same, with prefetcht0, the hint it was measured with on a Zen 1
               "cpu256": {"WG": 1, "VEC": 16, "UNROLL": 4, "STORE_EXP": 1, "STREAM": 2,
                          "PF": 0}},
    fit_device=fit_stream,
    cases=softmax_case,
    example=example,
    examples=examples,
    doc="Numerically stable softmax along any axis, fused into one kernel.",
)
