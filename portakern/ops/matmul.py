"""matmul: (..., M, K) @ (..., K, N) -> (..., M, N), batch dims broadcast as in numpy.

Error analysis (Higham, Accuracy and Stability of Numerical Algorithms, 3.5): a K-term dot
product accumulated in a format with unit roundoff u satisfies
|fl(a.b) - a.b| <= gamma_K * |a|.|b|, gamma_K = K u / (1 - K u). Rounding the result to the
output dtype adds u_out |c|. Inputs are exact in the compute format (fp16/bf16 widen exactly),
so the bound below is what any correct kernel, in any summation order, with or without FMA,
must meet; a kernel that accumulates in fp16 or drops a tile breaks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.errors import ShapeError
from ..core.sampling import EDGE_SIZES, Case, Chooser, batch_pair, finite_cast
from ..core.spec import (
    MAX_INDEX,
    ArrayMeta,
    Buf,
    Cost,
    KernelSpec,
    Launch,
    Operand,
    Problem,
    Scalar,
    Tunable,
)
from ._common import (
    MAX_GRID_YZ,
    batch_chunks,
    broadcast_strides,
    cdiv,
    collapse_dims,
    kernel_source,
    need_rank,
)


def semantics(xp: Any, a: Any, b: Any) -> Any:
    return xp.matmul(a, b)


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    a, b = m["a"], m["b"]
    assert a is not None and b is not None
    need_rank("matmul", "a", a.shape, min_rank=2, layout="(..., M, K)")
    need_rank("matmul", "b", b.shape, min_rank=2, layout="(..., K, N)")
    M, K = a.shape[-2:]
    K2, N = b.shape[-2:]
    if K != K2:
        raise ShapeError(f"matmul: inner dimensions differ: a is {a.shape} (K={K}) but b is "
                         f"{b.shape} (K={K2}); expected a[..., M, K] and b[..., K, N].")
    try:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except ValueError:
        raise ShapeError(f"matmul: batch dims {a.shape[:-2]} and {b.shape[:-2]} do not "
                         "broadcast; expected equal dims or 1 at each position.") from None
    out = batch + (M, N)
    from ..core.dtypes import dtype_name

    return Problem("matmul", dtype_name(a.dtype), {"a": a.shape, "b": b.shape}, params, out,
                   derived={"M": M, "N": N, "K": K, "batch": batch},
                   empty_result=(0 in out) or K == 0)


def slots(p: Problem) -> dict[str, Any]:
    return {"T": p.dtype}


PACK_KB = 64  # rows of B one packing item copies (matmul.c)


def packs_b(p: Problem, cfg: Mapping[str, int]) -> bool:
    """Whether B is copied into column panels first (PACK_B, see matmul.c): asked for, on the
    direct (USE_LOCAL=0) path, and the packed copy indexable with 32-bit ints."""
    if not cfg.get("PACK_B") or cfg["USE_LOCAL"]:
        return False
    return _packed_elements(p, cfg) <= MAX_INDEX


def _packed_elements(p: Problem, cfg: Mapping[str, int]) -> int:
    bn = cfg["LX"] * cfg["TN"] * cfg["VEC"]
    N, K = p.derived["N"], p.derived["K"]
    return max(n0 * n1 for _, n0, n1, _, _ in _chunks(p)) * cdiv(N, bn) * bn * K


def _chunks(p: Problem) -> list[tuple[list[int], int, int, list[int], list[int]]]:
    M, N, K, batch = (p.derived[k] for k in ("M", "N", "K", "batch"))
    sa = broadcast_strides(p.shape("a")[:-2], batch, M * K)
    sb = broadcast_strides(p.shape("b")[:-2], batch, K * N)
    sc = broadcast_strides(batch, batch, M * N)
    dims, strides = collapse_dims(list(batch), [sa, sb, sc])
    return batch_chunks(dims, strides)


def defines(p: Problem, cfg: Mapping[str, int]) -> dict[str, Any]:
    return {**cfg, "PACK_B": int(packs_b(p, cfg))}


def workspace(p: Problem, cfg: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    return {"bp": (_packed_elements(p, cfg), p.dtype)} if packs_b(p, cfg) else {}


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    M, N, K, batch = (p.derived[k] for k in ("M", "N", "K", "batch"))
    bm, bn = cfg["LY"] * cfg["TM"], cfg["LX"] * cfg["TN"] * cfg["VEC"]
    gy = cdiv(M, bm)
    if gy > MAX_GRID_YZ:
        raise ShapeError(f"matmul: M={M} needs {gy} row tiles of {bm}, more than {MAX_GRID_YZ} "
                         "work-groups along y; split a along M.")
    pack = packs_b(p, cfg)
    out = []
    for off, n0, n1, s0, s1 in _chunks(p):
        if pack:  # in-order queue: chunk i's panels are packed, used, then overwritten
            out.append(Launch("matmul_pack_b", (cdiv(N, bn), cdiv(K, PACK_KB), n0 * n1),
                              (1, 1, 1), (Buf("b"), Buf("bp"), Scalar(N), Scalar(K),
                                          Scalar(n1), Scalar(s0[1]), Scalar(s1[1]),
                                          Scalar(off[1]))))
        bufs = (Buf("a"), Buf("b"), Buf("bp")) if pack else (Buf("a"), Buf("b"))
        args = bufs + (Buf("out"), Scalar(M), Scalar(N), Scalar(K), Scalar(n1),
                       Scalar(s0[0]), Scalar(s1[0]), Scalar(s0[1]), Scalar(s1[1]),
                       Scalar(s0[2]), Scalar(s1[2]), Scalar(off[0]), Scalar(off[1]),
                       Scalar(off[2]))
        out.append(Launch("matmul", (cdiv(N, bn), gy, n0 * n1), (cfg["LX"], cfg["LY"], 1), args))
    return out


def cost(p: Problem) -> Cost:
    M, N, K, batch = (p.derived[k] for k in ("M", "N", "K", "batch"))
    nb = int(np.prod(batch)) if batch else 1
    isz = p.info.storage.itemsize
    na = int(np.prod(p.shape("a")))
    nbb = int(np.prod(p.shape("b")))
    return Cost(flops=2.0 * nb * M * N * K, bytes=float(isz * (na + nbb + nb * M * N)))


def tolerance(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    K = p.derived["K"]
    u = float(np.finfo(p.info.compute).eps) / 2
    gamma = 2.0 * K * u / max(1e-300, 1.0 - K * u)  # factor 2: input-side/summation slack
    mag = np.matmul(np.abs(x["a"]), np.abs(x["b"]))
    floor = p.info.subnormal + K * float(np.finfo(p.info.compute).tiny)
    return gamma * mag + p.info.unit_roundoff * np.abs(ref) + floor


# Probabilistic model (the statistical check, portakern.verify). For one output element let
# p_k = a_k b_k (exact, float64) and P_j = p_1 + ... + p_j (P_0 = 0) its prefix sums. Any
# summation tree whose every node adds a contiguous run of k -- sequential, blocked (tiles of
# TK or KBLOCK partial sums added into the running sum), pairwise, any mix -- has K - 1 nodes,
# and each node's value s is a difference of two prefix sums, so |s| <= R := max_j P_j -
# min_j P_j. Each node rounds with error eps*s, |eps| <= u; each product with delta*p, |delta|
# <= u (0 with FMA); storing the result to the output dtype adds eta*c, |eta| <= u_out. With
# these errors independent and mean-zero (Higham & Mary 2019), Hoeffding's lemma makes the
# total error sub-Gaussian with variance proxy
#     sigma^2 = u^2 (sum_k p_k^2 + (K - 1) R^2) + u_out^2 c^2
# in every such order, with or without FMA (first order in u; K u << 1). For random-sign data
# R ~ 1.6 sqrt(K) max|p|, so sigma ~ 1.3 K u where the worst-case bound has 2 K u |A||B|;
# inputs rounded to TF32 err by ~ 2^-11 sqrt(sum p^2) ~ 2^-11 sqrt(K): at K = 16384 that is
# ~400 sigma^2 in z^2 (normal data), bf16-rounded inputs ~3e4, a dropped K term ~3e5.
# Where the hypothesis fails: a *sequential* fp32 sum over thousands of terms with a large
# common offset (+-1e4 operands) rounds every step the same way once the running sum's ulp
# exceeds the terms' spread, and its error grows like K, not sqrt(K) (measured 6 sigma at
# K = 16384): portakern's kernels therefore add KBLOCK-term partial sums into a compensated
# running sum (matmul.c), as BLAS libraries block K. Underflow: the worst-case floor is the
# deterministic slack. Errors of different output elements are independent (one group each).
STAT_CHUNK = 1 << 20  # float64 products materialised at once (8 MiB)


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    from ..core.statmodel import StatModel

    K = p.derived["K"]
    u = float(np.finfo(p.info.compute).eps) / 2
    a, b = x["a"], x["b"]
    batch = p.derived["batch"]
    M, N = p.derived["M"], p.derived["N"]
    a3 = np.broadcast_to(a, batch + a.shape[-2:]).reshape(-1, M, K)
    b3 = np.broadcast_to(b, batch + b.shape[-2:]).reshape(-1, K, N)
    bt = np.ascontiguousarray(np.swapaxes(b3, -1, -2))  # (batch, N, K): K contiguous
    rng = np.empty((a3.shape[0], M, N))
    sq = np.empty((a3.shape[0], M, N))
    rows = max(1, STAT_CHUNK // max(1, K * N))
    with np.errstate(all="ignore"):
        for z in range(a3.shape[0]):
            for i0 in range(0, M, rows):
                pre = a3[z, i0:i0 + rows, None, :] * bt[z, None, :, :]  # (r, N, K) products
                sq[z, i0:i0 + rows] = np.einsum("rnk,rnk->rn", pre, pre)  # sum_k p_k^2
                np.cumsum(pre, axis=2, out=pre)  # prefix sums P_1..P_K
                rng[z, i0:i0 + rows] = (np.maximum(pre.max(axis=2), 0.0)
                                        - np.minimum(pre.min(axis=2), 0.0))
        var = sq.reshape(ref.shape) + (K - 1) * (rng * rng).reshape(ref.shape)
        sigma2 = u * u * var + (p.info.unit_roundoff * ref) ** 2
    floor = p.info.subnormal + K * float(np.finfo(p.info.compute).tiny)
    return StatModel(np.sqrt(sigma2), floor)


def config_check(p: Problem | None, cfg: Mapping[str, int]) -> str | None:
    if cfg["TM"] * cfg["TN"] * cfg["VEC"] > 512:
        return "TM*TN*VEC exceeds 512 accumulators per work-item; lower one of them."
    bn = cfg["LX"] * cfg["TN"] * cfg["VEC"]
    if cfg["USE_LOCAL"] and cfg["TK"] * (cfg["LY"] * cfg["TM"] + 1 + bn) > 8192:
        return "local tiles exceed 8192 elements (32 KiB in fp32); lower TK, TM, TN, LX or LY."
    return None


TUNABLES = (
    Tunable("TM", (1, 2, 4, 6, 8, 12, 16), "rows of C per work-item (register block)"),
    Tunable("TN", (1, 2, 4, 8), "columns of C per work-item, strided by LX"),
    Tunable("LX", (1, 2, 4, 8, 16, 32, 64), "work-group width (columns)"),
    Tunable("LY", (1, 2, 4, 8, 16, 32), "work-group height (rows)"),
    Tunable("TK", (1, 4, 8, 16, 32), "depth of the local-memory K slice (USE_LOCAL=1)"),
    Tunable("USE_LOCAL", (0, 1), "stage tiles through local/shared memory"),
    Tunable("VEC", (1, 2, 4, 8, 16), "vector lanes per column group (CPU schedule)"),
    Tunable("PACK_B", (0, 1), "copy B into column panels first (USE_LOCAL=0; ignored with 1)"),
)


# --- test cases: shapes and values that break kernels and numerics (suite, `check`) ---
LONG_K = (4096, 16384)  # reductions long enough to tell fp32 from TF32/bf16 inputs (verify)
MATMUL_VALUES = ("normal", "normal", "positive", "integer", "offset", "nonfinite")


def matmul_values(rng: np.random.Generator, kind: str, shape_a: tuple[int, ...],
                  shape_b: tuple[int, ...], dtype: str, scale: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Operands of one value family: normal; positive (uniform [0, 1), no cancellation);
    integer-valued (exact in every order while partial sums stay below 2^24); offset (a's
    entries around +-1e4, b's around +-1e4 or 0: a common offset the rounding must not
    bias); nonfinite (normal with a few NaN / +inf / -inf entries, which must land exactly
    where the oracle puts them). fp16 keeps its results below its range (65504)."""
    k = shape_a[-1]
    if kind == "positive":
        a, b = rng.random(shape_a) * scale, rng.random(shape_b)
    elif kind == "integer":
        hi = 2 if dtype == "float16" else 8
        a, b = (rng.integers(-hi, hi + 1, s).astype(np.float64) for s in (shape_a, shape_b))
    elif kind == "offset":
        off = 1e4 if dtype != "float16" else 64.0 / max(1.0, np.sqrt(k))
        sign_a = 1.0 if rng.random() < 0.5 else -1.0
        sign_b = float(rng.choice([1.0, -1.0, 0.0]))
        a = rng.standard_normal(shape_a) + sign_a * off
        b = rng.standard_normal(shape_b) + sign_b * off
    else:
        a, b = rng.standard_normal(shape_a) * scale, rng.standard_normal(shape_b)
    if kind == "nonfinite":
        for x in (a, b):
            if x.size and rng.random() < 0.7:
                flat = x.reshape(-1)
                for _ in range(int(rng.integers(1, 4))):
                    flat[int(rng.integers(flat.size))] = rng.choice([np.nan, np.inf, -np.inf])
    return finite_cast(a, dtype), finite_cast(b, dtype)


def matmul_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    shape_kind = ch.choice(("edge", "edge", "edge", "tall", "wide", "deep", "long"))
    if shape_kind == "tall":
        m, k, n = ch.choice((257, 1000)), ch.choice((1, 3, 5)), ch.choice((1, 3, 17))
    elif shape_kind == "wide":
        m, k, n = ch.choice((1, 3)), ch.choice((5, 17)), ch.choice((513, 1000))
    elif shape_kind == "deep":
        m, k, n = ch.choice((2, 9)), ch.choice((700, 2049)), ch.choice((2, 33))
    elif shape_kind == "long":
        m, k, n = ch.choice((1, 3, 9)), ch.choice(LONG_K), ch.choice((1, 5, 33))
    else:
        m, k, n = ch.choice(EDGE_SIZES), ch.choice(EDGE_SIZES), ch.choice(EDGE_SIZES)
    ba, bb = batch_pair(ch) if shape_kind != "long" and ch.boolean(0.4) else ((), ())
    scale = ch.choice((1.0, 1e-3, 30.0)) if dtype != "float16" else ch.choice((1.0, 1e-2, 4.0))
    if dtype == "float16" and k > 1000:
        scale = min(scale, 1.0)  # sums of 16384 products stay inside fp16's range
    values = ch.choice(MATMUL_VALUES)
    a, b = matmul_values(rng, values, ba + (m, k), bb + (k, n), dtype, scale)
    return Case({"a": a, "b": b}, {}, f"{shape_kind}, {values}")


# --- representative calls: what `portakern show`/`tune` render and the compile checks compile
Example = tuple[str, dict[str, Any], dict[str, Any]]


def example(dtype: str, *, M: int = 256, N: int = 256, K: int = 256
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A typical call, (M, K) @ (K, N); ``--shape M=..,N=..,K=..`` sets the sizes."""
    return {"a": ArrayMeta((M, K), dtype), "b": ArrayMeta((K, N), dtype)}, {}


def examples(dtype: str) -> list[Example]:
    """The compile checks' call: a batched ``a`` against a 2-D ``b``, no size a tile multiple
    (the source changes with dtype and schedule only)."""
    return [("a(2,64,48)@b(48,80)",
             {"a": ArrayMeta((2, 64, 48), dtype), "b": ArrayMeta((48, 80), dtype)}, {})]


SPEC = KernelSpec(
    name="matmul",
    operands=(Operand("a"), Operand("b")),
    params={},
    validate=validate,
    semantics=semantics,
    source=kernel_source("matmul.c"),
    slots=slots,
    defines=defines,
    launches=launches,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    tunables=TUNABLES,
    schedules={
        "gpu": {"TM": 4, "TN": 4, "LX": 16, "LY": 16, "TK": 16, "USE_LOCAL": 1, "VEC": 1,
                "PACK_B": 0},
        # CPU: 6x64 per item in 24 zmm accumulators; 4 items (24 rows) per work-group, so
        # PoCL's per-group cost is paid once per ~31 us of FMAs at N=1024, not per ~8 us
        "cpu": {"TM": 6, "TN": 4, "LX": 1, "LY": 4, "TK": 16, "USE_LOCAL": 0, "VEC": 16,
                "PACK_B": 1},
    },
    config_check=config_check,
    workspace=workspace,
    cases=matmul_case,
    example=example,
    examples=examples,
    doc="Batched matrix product with float32 (float64 for float64) accumulation.",
)
