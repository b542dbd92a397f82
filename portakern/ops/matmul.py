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


MMA_DTYPES = ("float16", "bfloat16")  # what the fragment schedule takes (TF32 never)


def uses_mma(p: Problem, cfg: Mapping[str, int]) -> bool:
    """Whether the call runs the fragment schedule (``matmul_mma``, matrix units or their
    emulation): MMA=1 and fp16/bf16 operands. float32/float64 stay SIMT whatever MMA says."""
    return bool(cfg.get("MMA")) and p.dtype in MMA_DTYPES


def packs_b(p: Problem, cfg: Mapping[str, int]) -> bool:
    """Whether B is copied into column panels first (PACK_B, see matmul.c): asked for, on the
    direct (USE_LOCAL=0) path, and the packed copy indexable with 32-bit ints."""
    if not cfg.get("PACK_B") or cfg["USE_LOCAL"] or uses_mma(p, cfg):
        return False
    return _packed_elements(p, cfg) <= MAX_INDEX


# PACK_B = 2 packs a B of more than this many bytes. Side by side on a 2-core AMD EPYC (Zen,
# AVX2; PoCL / Intel, fp32 square, the packed path indexing A by row pointers, matmul.c):
# reading B in place with 2 items (12 rows) per group is 1.1 / 1.0x faster at N=256 and
# 1.07 / 1.01x at N=384 (B 576 KiB); at N=512 (1 MiB) packing is 1.15 / 1.13x faster, at
# N=1024 and 2048 1.5x and more. (On a 2-core Xeon, before that indexing fix, reading in place
# was still 1.2x faster at N=512.) The threshold sits between the sizes measured.
PACK_MIN_BYTES = 3 << 18  # 768 KiB


def fit_pack(p: Problem, cfg: dict[str, int], compute_units: int) -> dict[str, int]:
    """The spec's ``fit_device``: PACK_B = 2 becomes 1 when one B (K x N) is larger than
    PACK_MIN_BYTES; else 0, with LY at most 2. A raw config keeps 2, which reads as 1."""
    if cfg.get("PACK_B") != 2:
        return cfg
    big = p.derived["K"] * p.derived["N"] * p.info.storage.itemsize > PACK_MIN_BYTES
    cfg["PACK_B"] = int(big)
    if not big:
        cfg["LY"] = min(cfg["LY"], 2)
    return cfg


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
    return {**cfg, "PACK_B": int(packs_b(p, cfg)), "MMA": int(uses_mma(p, cfg))}


def workspace(p: Problem, cfg: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    return {"bp": (_packed_elements(p, cfg), p.dtype)} if packs_b(p, cfg) else {}


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    M, N, K, batch = (p.derived[k] for k in ("M", "N", "K", "batch"))
    mma = uses_mma(p, cfg)
    if mma:
        bm, bn = cfg["MBM"], cfg["MBN"]
    else:
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
        if mma:
            out.append(Launch("matmul_mma", (cdiv(N, bn), gy, n0 * n1),
                              (cfg["MITEMS"], 1, 1), args))
        else:
            out.append(Launch("matmul", (cdiv(N, bn), gy, n0 * n1),
                              (cfg["LX"], cfg["LY"], 1), args))
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
    if p.dtype in MMA_DTYPES:  # the fragment schedule may run on matrix units
        gamma = max(gamma, _mma_gamma(K, u))
    mag = np.matmul(np.abs(x["a"]), np.abs(x["b"]))
    floor = p.info.subnormal + K * float(np.finfo(p.info.compute).tiny)
    return gamma * mag + p.info.unit_roundoff * np.abs(ref) + floor + _read_as_zero(p, x)


def _read_as_zero(p: Problem, x: dict[str, np.ndarray]) -> np.ndarray | float:
    """sum_k |a_ik b_kj| over the products with a factor subnormal in the compute type: XLA
    on CPUs reads such inputs as zero, and beside a large factor the lost product is a normal
    number (1e-40 * 1e20). Only those products are loosened; 0 when no input is subnormal."""
    tiny = float(np.finfo(p.info.compute).tiny)
    a = np.abs(np.asarray(x["a"], dtype=np.float64))
    b = np.abs(np.asarray(x["b"], dtype=np.float64))
    sa, sb = (a > 0) & (a < tiny), (b > 0) & (b < tiny)
    if not (sa.any() or sb.any()):
        return 0.0
    with np.errstate(all="ignore"):
        lost = np.matmul(np.where(sa, a, 0.0), b) + np.matmul(a, np.where(sb, b, 0.0))
    return np.nan_to_num(lost, nan=0.0, posinf=0.0)


def _mma_gamma(K: int, u: float) -> float:
    """The worst-case relative bound (times |A||B|) of matmul_mma on a matrix unit.

    Inside one instruction the arithmetic is not IEEE-sequential (Fasi, Higham, Mikaitis and
    Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): the exact products
    and the incoming c are aligned to the largest exponent and truncated, summed, and the
    result normalised by truncation. Model one 16-deep tile product d = c + sum_i p_i, at
    most 17 terms, each truncated by less than one ulp of the largest (2u M, M = max term
    <= S = |c| + sum |p_i|), and the result by 2u |d|: |err| <= 2u (17 + 1) S = 36u S, for
    any internal blocking and any rounding no worse than truncation. In one KB1 block c
    chains through L/16 products (L = min(K, KB1) = 512 at most) and each S is at most the
    block's sum of |p| (first order in u), so the block errs by <= 36u (L/16) sum|p| =
    2.25 u L sum|p|. The block sums are added outside pk_mma in IEEE fp32 (matmul.c): each
    term passes at most KB2 additions into the second level and K/(KB1 KB2) + 1 into the
    total, u each. So gamma_MMA = u (2.25 min(K, KB1) + KB2 + K/(KB1 KB2) + 1), above the
    SIMT bound 2Ku only for K below ~600 (1.7x at K = 16)."""
    return u * (2.25 * min(K, KB1) + KB2 + K / (KB1 * KB2) + 1.0)


# Probabilistic models (the statistical check, portakern.verify). Two, for two kinds of
# result; both split the error into independent, mean-zero rounding errors (Higham & Mary
# 2019), each bounded by h(s) for the value s it rounds, and take their sum as sub-Gaussian
# with variance proxy sigma^2 = sum h(s)^2 (Hoeffding's lemma), first order in u.
#
# `statistical` (order-free: pk.verify of any result, array backends). For one output element
# let p_k = a_k b_k (exact, float64) and P_j = p_1 + ... + p_j (P_0 = 0) its prefix sums. Any
# summation tree whose every node adds a contiguous run of k -- sequential, blocked, pairwise,
# any mix -- has K - 1 nodes, and each node's value s is a difference of two prefix sums, so
# |s| <= R := max_j P_j - min_j P_j. With h(s) = u|s| for the nodes and the products (0 with
# FMA) and u_out|c| for the store,
#     sigma^2 = u^2 (sum_k p_k^2 + (K - 1) R^2) + u_out^2 c^2
# in every such order. It must admit one running sum over all K (a correct order), so its
# sigma is ~9x / 16x the ordered model's (below) on normal data at K = 4096 / 16384, and
# ~21x / 65x on data without cancellation (all-positive, same-sign offsets: R = |c|). One
# assumption fails for a running sum of near-constant terms: its rounding errors share a
# sign (RUNNING_SUM_SLACK), so the model adds that order's actual error as slack.
# Measured (float32, 96 outputs, 10 seeds, K = 4096 / 16384, with the running-sum slack):
# random errors pass it up to ~21x / 38x the kernel's rms error on normal data, ~54x / 165x
# on all-positive and ~40-50x / ~450x on same-sign offsets (a correct running sum errs ~100x
# the blocked kernel there), and TF32-rounded inputs pass it on all-positive data (caught in
# 4/10 seeds at K = 4096, 0/10 at 16384) and same-sign +-1e4 offsets (0-5/10). Tables:
# docs/guarantees.md ("Correctness checks").
#
# `statistical_ordered` (results of matmul.c itself: the suite and `portakern check` on
# C-kernel backends, compare_arrays(ordered=True)). matmul.c writes one tree for every output
# element on every path and schedule (bit for bit an fp32 emulation on PoCL on all four
# paths, tests/runtime/test_statistical_power.py; Intel's CPU OpenCL compiler reassociates
# the scalar direct path, which the model cannot see): k in blocks of KB1 = 512 terms, each a
# sequential sum s_j = fl(s_{j-1} + p_k) from 0 (an FMA, or a rounded product then an add);
# block sums added one by one into a second-level sum, KB2 = 16 blocks each; those added one
# by one into the total. (Plain additions, no compensation.) Its rounding nodes are the
# products p_k (unless fused), every running value s_j after the first in a block, in a
# second-level sum and in the total; the model sums h(s)^2 over exactly those values (exact
# partial sums, float64), with h(s) half an ulp of s in the compute format (u 2^floor(log2
# |s|), |s| widened by 2^-10 against a computed value across a binade edge), plus the
# store's u_out^2 c^2 where the output dtype is narrower (fp16, bf16). A uniform rounding
# error has variance h^2/3, so the kernel's own results sit near T = 1/3 and a result with
# random errors m times the kernel's rms has T ~ (1 + m^2)/3: caught once m > sqrt(3 tau(G)
# - 1), 2.4 at 96 outputs, 1.7 at 1000, 4x from 15 outputs on. Measured (float32, 96 outputs,
# K = 4096 and 16384, normal, all-positive and +-1e4-offset data): random errors of 2.2-2.4x
# the kernel's rms caught (median over 30 seeds; at most 3.5x), TF32-rounded inputs caught on
# every family (T/tau >= 14), and no false alarm on the kernel's own results in 1000 seeds x
# 5 families x both K on PoCL (largest T/tau 0.24). It knows one order: a correct result of
# another order can fail it (one running sum; numpy/OpenBLAS' sgemm on all-positive data at
# K = 4096, T/tau ~ 5), so it judges only results marked as matmul.c's. float64: the float64
# oracle errs as much as the kernel, in OpenBLAS' unknown order, so `statistical` judges
# float64 results either way.
#
# Underflow: the worst-case floor is the deterministic slack (both models). Errors of
# different output elements are independent (one group each).
STAT_CHUNK = 1 << 20  # float64 products materialised at once (8 MiB)
# The order-free model's deterministic slack, in units of one running sum's actual error on
# the element (its products rounded, then added in order from 0, in the compute format). Its
# errors are not independent where the terms are near-constant relative to the ulp grid
# (same-sign offsets): they add up with one sign, ~K u |c| / 4, not ~sqrt(K) u |c| (jax:cpu's
# XLA dot and numpy's gemv, both a running sum, erred by 6 sigma at K = 16384 on +-1e4
# offsets). Measured on +-1e4 and all-positive data at K = 4096 and 16384: a fused running
# sum errs within 0.2% of it, and a reversed one or 2, 16 or 64 interleaved running sums
# pass with T/tau <= 0.012 (their nodes are no larger). Once, not twice: a dropped ~1e8 term
# of a 1.6e12 sum is still caught (T/tau 1.9-2 at K = 16384), and at 2x it passes.
RUNNING_SUM_SLACK = 1.0
KB1, KB2 = 512, 16  # matmul.c's K blocking (its #defines; a test keeps the two equal)
MMA_K = 16  # k depth of one matrix-unit step (the fragment API's 16x16x16 tile)
# A step's error bound in float32 ulps of its largest magnitude: each of the MMA_K products
# and the accumulator loses less than one ulp of the largest to the alignment, the
# normalisation one more (statistical_ordered's `truncation`)
MMA_STEP_ULPS = MMA_K + 2
BINADE_MARGIN = 1.0 + 2.0**-10  # h(s) from |s| widened by this (see statistical_ordered)


def _operands3(p: Problem, x: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """a as (batch, M, K) and b transposed as (batch, N, K), K contiguous."""
    batch, M, N, K = (p.derived[k] for k in ("batch", "M", "N", "K"))
    a3 = np.broadcast_to(x["a"], batch + x["a"].shape[-2:]).reshape(-1, M, K)
    b3 = np.broadcast_to(x["b"], batch + x["b"].shape[-2:]).reshape(-1, K, N)
    return a3, np.ascontiguousarray(np.swapaxes(b3, -1, -2))


def _floor(p: Problem) -> float:
    return p.info.subnormal + p.derived["K"] * float(np.finfo(p.info.compute).tiny)


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    """The order-free model (the comment above): any contiguous-run summation order."""
    from ..core.statmodel import StatModel

    K = p.derived["K"]
    u = float(np.finfo(p.info.compute).eps) / 2
    a3, bt = _operands3(p, x)
    M, N = a3.shape[1], bt.shape[1]
    rng = np.empty((a3.shape[0], M, N))
    sq = np.empty((a3.shape[0], M, N))
    run = np.zeros((a3.shape[0], M, N))
    exact = p.info.compute.itemsize < 8  # float64 products are not exact in float64
    rows = max(1, STAT_CHUNK // max(1, K * N))
    with np.errstate(all="ignore"):
        for z in range(a3.shape[0]):
            for i0 in range(0, M, rows):
                pre = a3[z, i0:i0 + rows, None, :] * bt[z, None, :, :]  # (r, N, K) products
                sq[z, i0:i0 + rows] = np.einsum("rnk,rnk->rn", pre, pre)  # sum_k p_k^2
                if exact:  # one running sum in the compute format (np.cumsum is sequential)
                    seq = np.cumsum(pre.astype(p.info.compute), axis=2,
                                    dtype=p.info.compute)[..., -1]
                np.cumsum(pre, axis=2, out=pre)  # prefix sums P_1..P_K
                rng[z, i0:i0 + rows] = (np.maximum(pre.max(axis=2), 0.0)
                                        - np.minimum(pre.min(axis=2), 0.0))
                if exact:
                    run[z, i0:i0 + rows] = np.abs(seq - pre[..., -1])
        var = sq.reshape(ref.shape) + (K - 1) * (rng * rng).reshape(ref.shape)
        sigma2 = u * u * var + (p.info.unit_roundoff * ref) ** 2
        slack = np.where(np.isfinite(run), run, 0.0).reshape(ref.shape)
    return StatModel(np.sqrt(sigma2), _floor(p) + _read_as_zero(p, x) + RUNNING_SUM_SLACK * slack)


def _half_ulp2(s: np.ndarray, u: float, valid: np.ndarray | bool = True) -> np.ndarray:
    """h(s)^2 = (u 2^floor(log2 |s| (1 + 2^-10)))^2 where ``valid``, 0 elsewhere and at 0;
    +inf where s is not finite (the element is then judged by the worst-case check alone)."""
    _, e = np.frexp(np.abs(s) * BINADE_MARGIN)
    h = np.ldexp(u, e - 1)
    h2 = np.where(np.isfinite(s), h * h, np.inf)
    return np.where(valid & (s != 0), h2, 0.0)


def _truncation_slack(prod: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per output, the sum over the fragment schedule's matrix-unit steps of MMA_STEP_ULPS
    ulps (float32) of the step's largest magnitude: its accumulator before or after, or one of
    its MMA_K exact products. prod: (rows, N, nb * KB1) products; s: (rows, N, nb, KB1) the
    blocks' running sums (the accumulator after each term)."""
    rows, n, nb, kb1 = s.shape
    steps = kb1 // MMA_K
    after = np.abs(s[..., MMA_K - 1::MMA_K])  # (rows, N, nb, steps)
    before = np.concatenate([np.zeros(after.shape[:-1] + (1,)), after[..., :-1]], axis=-1)
    pmax = np.abs(prod.reshape(rows, n, nb, steps, MMA_K)).max(axis=-1)
    big = np.maximum(np.maximum(before, after), pmax)
    return MMA_STEP_ULPS * 2.0**-23 * big.sum(axis=(2, 3))


def statistical_ordered(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray, *,
                        truncation: bool = False) -> Any:
    """The model of matmul.c's own summation tree (the comment above): sigma^2 is the sum of
    h(s)^2 over the tree's actual node values, not the worst case over all orders.

    ``truncation``: the result may come from a device's matrix units (verify passes it for a
    backend with a native fragment lowering: CUDA sm_80+, HIP CDNA/RDNA3, Intel's extension).
    Their adds are not IEEE: each instruction aligns its MMA_K products and the accumulator
    to the largest and truncates (Fasi, Higham, Mikaitis, Pranesh, PeerJ CS 2021), errors of
    one sign that a variance cannot describe. The model then adds a deterministic slack of
    MMA_STEP_ULPS ulps of each step's largest magnitude, summed over the steps; the block,
    second-level and total sums stay outside the instruction (round to nearest, as modelled).
    The emulation (every CPU device) rounds to nearest like SIMT code and is judged without
    it."""
    from ..core.statmodel import StatModel

    if p.info.compute == np.float64:  # the oracle's own error: order unknown
        return statistical(p, x, ref)
    K = p.derived["K"]
    u = float(np.finfo(p.info.compute).eps) / 2
    a3, bt = _operands3(p, x)
    M, N = a3.shape[1], bt.shape[1]
    nb = -(-K // KB1)  # KB1 blocks, the last one possibly short
    ng = -(-nb // KB2)  # second-level sums
    kpad = nb * KB1
    in_block = (np.arange(kpad) < K).reshape(nb, KB1)
    in_block[:, 0] = False  # the first running value of a block is 0 + p: only p rounds
    in_group = (np.arange(ng * KB2) < nb).reshape(ng, KB2)
    in_group[:, 0] = False
    var = np.empty((a3.shape[0], M, N))
    slack = np.zeros((a3.shape[0], M, N))
    rows = max(1, STAT_CHUNK // max(1, kpad * N))
    with np.errstate(all="ignore"):
        for z in range(a3.shape[0]):
            for i0 in range(0, M, rows):
                prod = np.zeros((min(rows, M - i0), N, kpad))
                np.multiply(a3[z, i0:i0 + rows, None, :], bt[z, None, :, :],
                            out=prod[..., :K])  # exact products p_k; zeros past K
                v = _half_ulp2(prod, u).sum(axis=2)  # the products (unless fused)
                s = np.cumsum(prod.reshape(prod.shape[:2] + (nb, KB1)), axis=3)
                v += _half_ulp2(s, u, in_block).sum(axis=(2, 3))  # in each block
                if truncation:
                    slack[z, i0:i0 + rows] = _truncation_slack(prod, s)
                blocks = np.zeros(s.shape[:2] + (ng * KB2,))
                blocks[..., :nb] = s[..., -1]  # block sums
                g = np.cumsum(blocks.reshape(blocks.shape[:2] + (ng, KB2)), axis=3)
                v += _half_ulp2(g, u, in_group).sum(axis=(2, 3))  # second-level sums
                t = np.cumsum(g[..., -1], axis=2)  # the total, second-level sum by sum
                v += _half_ulp2(t[..., 1:], u).sum(axis=2)
                var[z, i0:i0 + rows] = v
        sigma2 = var.reshape(ref.shape)
        if p.info.storage != p.info.compute:  # the store rounds to fp16/bf16
            sigma2 = sigma2 + (p.info.unit_roundoff * ref) ** 2
    return StatModel(np.sqrt(sigma2), _floor(p) + _read_as_zero(p, x) + slack.reshape(ref.shape))


MMA_WAVES = (8, 16, 32, 64)  # every wave a lowering has (core/codegen.py FRAGMENTS)


def mma_check(cfg: Mapping[str, int]) -> str | None:
    """Why the fragment schedule's MBM, MBN, MITEMS and TK cannot split into whole waves and
    tiles for every wave size (the kernel must not depend on which target it meets), or
    None. Mirrors matmul.c's #error."""
    if cfg["TK"] % 16:
        return f"MMA=1 takes TK a multiple of 16 (a tile's k depth); got TK={cfg['TK']}."
    tm, tn, items = cfg["MBM"] // 16, cfg["MBN"] // 16, cfg["MITEMS"]
    for wave in MMA_WAVES:
        waves = items // wave
        if items % wave or (tm * tn) % waves:
            return (f"MMA=1: {tm * tn} tiles of 16x16 ({cfg['MBM']}x{cfg['MBN']}) do not "
                    f"split evenly over the {waves} waves of {wave} lanes in MITEMS={items}; "
                    "raise MBM/MBN or lower MITEMS.")
        tpw = tm * tn // waves
        wn = min(tpw, tn)
        if tn % wn or tpw % wn or tm % (tpw // wn):
            return (f"MMA=1: {tpw} tiles per wave of {wave} do not tile a "
                    f"{cfg['MBM']}x{cfg['MBN']} block; use square blocks.")
    return None


def config_check(p: Problem | None, cfg: Mapping[str, int]) -> str | None:
    if cfg["MMA"] and (p is None or p.dtype in MMA_DTYPES):
        why = mma_check(cfg)
        if why:
            return why
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
    Tunable("PACK_B", (0, 1, 2), "copy B into column panels first (USE_LOCAL=0; ignored with "
            "1); 2: when one B is larger than PACK_MIN_BYTES, else read in place with at most "
            "2 items per group"),
    Tunable("MMA", (0, 1), "fp16/bf16: the fragment schedule (matrix units, or their "
            "emulation where the device has none); float32/float64 ignore it (no TF32)"),
    Tunable("MBM", (32, 64, 128), "MMA=1: rows of C per work-group (a multiple of 16)"),
    Tunable("MBN", (32, 64, 128), "MMA=1: columns of C per work-group"),
    Tunable("MITEMS", (64, 128, 256), "MMA=1: work-items per group (whole waves of 64)"),
)


# --- test cases: shapes and values that break kernels and numerics (suite, `check`) ---
LONG_K = (4096, 16384)  # long reductions: where TF32/bf16 inputs show (statistical check)
MATMUL_VALUES = ("normal", "normal", "positive", "integer", "offset", "nonfinite", "subnormal")


def matmul_values(rng: np.random.Generator, kind: str, shape_a: tuple[int, ...],
                  shape_b: tuple[int, ...], dtype: str, scale: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Operands of one value family: normal; positive (uniform [0, 1), no cancellation);
    integer-valued (exact in every order while partial sums stay below 2^24); offset (a's
    entries around +-1e4, b's around +-1e4 or 0: a common offset the rounding must not
    bias); nonfinite (normal with a few NaN / +inf / -inf entries, which must land exactly
    where the oracle puts them); subnormal (half of a's entries subnormal, b's large: the
    products are normal numbers). fp16 keeps its results below its range (65504)."""
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
    elif kind == "subnormal":  # a: some entries subnormal in the compute type; b: large
        tiny = float(np.finfo({"float16": np.float16, "float64": np.float64}.get(
            dtype, np.float32)).tiny)
        big = 1.0 if dtype == "float16" else 1e20 if dtype != "float64" else 1e200
        a = rng.standard_normal(shape_a) * np.where(rng.random(shape_a) < 0.5, tiny / 64, scale)
        b = rng.standard_normal(shape_b) * big
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
    # (N of 65 and 129 in the deep shapes: the CPU schedule's vector micro-kernel covers 64
    # columns an item, and a K > 512 drawn only with N <= 33 never reached it: a mutant that
    # dropped its last k past 512 survived the suite's seed)
    elif shape_kind == "deep":
        m, k, n = ch.choice((2, 9)), ch.choice((700, 2049)), ch.choice((2, 33, 65, 129))
    elif shape_kind == "long":
        m, k, n = ch.choice((1, 3, 9)), ch.choice(LONG_K), ch.choice((1, 5, 33, 65, 129))
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


_MMA_OFF = {"MMA": 0, "MBM": 64, "MBN": 64, "MITEMS": 128}

SPEC = KernelSpec(
    name="matmul",
    operands=(Operand("a"), Operand("b")),
    params={},
    validate=validate,
    semantics=semantics,
    source=kernel_source("mma.c", "matmul.c"),
    slots=slots,
    defines=defines,
    launches=launches,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    statistical_ordered=statistical_ordered,
    tunables=TUNABLES,
    schedules={
        "gpu": {"TM": 4, "TN": 4, "LX": 16, "LY": 16, "TK": 16, "USE_LOCAL": 1, "VEC": 1,
                "PACK_B": 0, **_MMA_OFF},
        # CPU: 6x64 per item in 24 zmm accumulators; 4 items (24 rows) per work-group, so
        # PoCL's per-group cost is paid once per ~31 us of FMAs at N=1024, not per ~8 us
        "cpu": {"TM": 6, "TN": 4, "LX": 1, "LY": 4, "TK": 16, "USE_LOCAL": 0, "VEC": 16,
                "PACK_B": 2, **_MMA_OFF},
        # AVX2 (256-bit vectors, 16 ymm registers): 6x16 per item in 12 ymm accumulators,
        # the classic AVX2 micro-kernel; the cpu schedule's 24 16-lane accumulators are 48
        # ymm and spill. Side by side on a 2-core AMD EPYC (Zen), PoCL / Intel: N=256
        # 1.86 / 1.92x, N=512 1.64 / 1.70x, N=1024 1.53 / 1.88x faster than the cpu one
        "cpu256": {"TM": 6, "TN": 2, "LX": 1, "LY": 4, "TK": 16, "USE_LOCAL": 0, "VEC": 8,
                   "PACK_B": 2, **_MMA_OFF},
        # a device with matrix units (CUDA sm_80+, HIP CDNA/RDNA3, Intel's extension): the
        # gpu schedule, and fp16/bf16 through the fragment API
        "mma": {"TM": 4, "TN": 4, "LX": 16, "LY": 16, "TK": 16, "USE_LOCAL": 1, "VEC": 1,
                "PACK_B": 0, "MMA": 1, "MBM": 64, "MBN": 64, "MITEMS": 128},
    },
    config_check=config_check,
    workspace=workspace,
    fit_device=fit_pack,
    cases=matmul_case,
    example=example,
    examples=examples,
    doc="Batched matrix product with float32 (float64 for float64) accumulation.",
)
