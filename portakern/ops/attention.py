"""attention(q, k, v, causal=False, mask=None, scale=None): fused scaled-dot-product attention.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) -> (B, Hq, Sq, Dv). Hkv must
divide Hq (grouped-query attention; Hkv == Hq is multi-head, Hkv == 1 multi-query). mask is
boolean, broadcastable to (B, Hq, Sq, Sk), True = attend. causal: query i attends keys j <= i
(top-left aligned, as jax.nn.dot_product_attention and torch SDPA). scale defaults to
1/sqrt(D). A query row with no key to attend (fully masked, causal with Sk = 0) returns 0.

Error analysis. Scores s = scale q.k carry E_s = gamma_D scale |q|.|k| + u|s| absolute error;
a softmax weight p_j = exp(s_j - m)/l then carries relative error 2 max_j E_s + u|s_j - m| +
O(Sk u) (exp, sum, online rescales); o = sum_j p_j v_j adds Sk u sum_j p_j |v_j|. Every term
scales with W = sum_j p_j |v_j|, so the bound is W * rel + u_out |o| + floor.

GPU schedule and its static resources (`portakern resources attention`, held in CI by
tests/tools/test_resources.py): one query per work-item, BQ = 128 items per group sharing BK = 16
key/value rows in local memory; the item keeps its Dv output accumulators and 8 scores in
registers (fully unrolled, so nothing goes to the stack) and re-reads q from the cache. For
D = Dv = 64 that is 128 registers on sm_80/sm_90 (25% occupancy, 16 of 64 warps) and ~170
VGPRs on gfx90a (25%), with no spills. Occupancy floor: 12.5% for float64. Justification:
64 fp64 accumulators alone are 128 32-bit registers, so with the scores and addresses a
work-item needs ~250 registers: 8 of 64 warps on sm_80/sm_90 (gfx90a: 6 of 32 waves, LDS);
capping it at 128 registers would only trade occupancy for spills. Head dims above 64 hold
more accumulators (fp32 d128: ~250 registers, 12.5%; fp64 d >= 80 spills on NVIDIA) and are
reported, not held to the floor.

Fragment schedule (tunable MMA, docs/fragments.md): fp16/bf16 on a device with matrix units
(the "mma" schedule; ``config={"MMA": 1}`` anywhere, emulated where there are none) run
``attention_mma`` (attention_mma.c): 64 items take 16 queries, S = Q K^T and O += P V are
16x16x16 tile products with fp32 accumulation, the per-key rules and the online softmax
stay SIMT. Two differences from the steps above, both in the bounds: the scale multiplies
the fp32 dot after it (fp16: q enters the matrix unit as it is, its dot cannot overflow;
bf16: q * 2^e enters, 2^e the largest power of two <= scale, exact, and the dot is
multiplied by scale / 2^e in [1, 2), so the dot overflows only where the scaled scores do;
the range rule widens by that factor of 2 at bf16's edges), and the weights P are
rounded to the input type before P.V (u_storage relative on each weight; fp16's subnormal
weights add half its smallest subnormal per key). Split-K works as on the SIMT path (ranges
of whole 16-key tiles). float32/float64 ignore MMA (no TF32).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.dtypes import dtype_name
from ..core.errors import InvalidArgumentError, ShapeError
from ..core.sampling import HEAD_DIMS, Case, Chooser, normal
from ..core.spec import (
    MAX_INDEX,
    ArrayMeta,
    Buf,
    Cost,
    KernelSpec,
    Launch,
    Operand,
    PallasKernel,
    Problem,
    Scalar,
    Tunable,
)
from . import attention_pallas, attention_xla  # import jax only when called
from ._common import broadcast_strides, cdiv, kernel_source, need_rank
from .attention_math import alibi_distance, keep_matrix, modify_scores

LOCAL_BUDGET_BYTES = 32 * 1024  # K/V tiles must fit this; BK is capped to honour it
MMA_DTYPES = ("float16", "bfloat16")  # what the fragment schedule takes (TF32 never)
MMA_BK = 16  # keys per tile of the fragment schedule (attention_mma.c: AM_BK)
MMA_QUERIES = 16  # queries per work-group of the fragment schedule (one tile's rows)
MMA_ITEMS = 64  # work-items per group of the fragment schedule (whole waves on every target)
MMA_LOCAL_LIMIT = 48 * 1024  # CUDA's static shared memory: larger head dims stay SIMT


def mma_local_bytes(d: int, dv: int) -> int:
    """attention_mma's local memory for head dims d, dv (the worst emulation's scratch, 8
    waves of 1 KiB, included): K and V tiles, S, P, three row vectors, the V row flags."""
    dqp, dvp = cdiv(max(d, 1), 16) * 16, cdiv(max(dv, 1), 16) * 16
    return (2 * MMA_BK * (dqp + dvp) + (4 + 2) * 16 * MMA_BK + 3 * 4 * 16 + 4 * MMA_BK
            + 8 * 1024)


def uses_mma(p: Problem, cfg: Mapping[str, int]) -> bool:
    """Whether the call runs the fragment schedule (``attention_mma``, matrix units or their
    emulation): MMA=1, fp16/bf16 inputs, and its tiles fit MMA_LOCAL_LIMIT (head dims up to
    ~700). float32/float64 stay SIMT whatever MMA says (no TF32)."""
    return (bool(cfg.get("MMA")) and p.dtype in MMA_DTYPES
            and mma_local_bytes(p.derived["D"], p.derived["Dv"]) <= MMA_LOCAL_LIMIT)


def queries_per_group(p: Problem, cfg: Mapping[str, int]) -> int:
    return MMA_QUERIES if uses_mma(p, cfg) else cfg["BQ"] * cfg["RQ"] * cfg["TQ"]


def tile_keys(p: Problem, cfg: Mapping[str, int]) -> int:
    """Keys per tile of the schedule the call runs (a split-K range is a multiple of it)."""
    return MMA_BK if uses_mma(p, cfg) else effective_bk(p, cfg)


def semantics(xp: Any, q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
              alibi_slopes: Any = None, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, window: tuple[int, int | None] | None = None,
              softcap: float | None = None) -> Any:
    """The op in the arrays' dtype (float64 on the oracle, the compute dtype under jax).

    Every implementation follows these steps (README, "Semantics and dtypes"): the scale is
    folded into q before the dot, s = (scale * q) . k, so the scores are finite whenever the
    scaled scores fit the compute type (no dot * scale - max for a compiler to fuse into one
    FMA); a key whose v row holds a NaN or an inf scores NaN; keys the mask or causal exclude
    score -inf; a row is dead (output 0) when every score is -inf, alive otherwise, also when a
    score is NaN or +inf (exp(s - m) then makes the row NaN); and v enters p.v with its
    non-finite entries zeroed, so a key a row does not attend (weight 0) never poisons it.

    The NaN of a bad v row comes from v itself (0 * v is NaN exactly where v is NaN or +-inf,
    else +-0, and s + 0 == s), never from a NaN constant: XLA:CPU (jaxlib 0.10.2) miscompiles
    exp(where(b, nan, x)) when b is invariant along the fused loop (Sk = 1, Sq >= 2), giving
    garbage (docs/guarantees.md, "XLA:CPU and a constant NaN under exp").

    Score modifiers (``attention_math.modify_scores``): ``bias``, then ALiBi's
    -slope * |i - j|, then the soft cap c tanh(s / c), all before masking; ``window`` (left,
    right) is a mask like ``causal`` (``attention_math.keep_matrix``).

    ``return_lse``: also the log-sum-exp of each row's scores, (out, lse): lse = m + log(den),
    -inf for a dead row, NaN exactly where den is (the row's output is then NaN), in the
    arrays' dtype here (the backends return it in the compute type: float32, or float64).
    """
    hq, hkv = q.shape[1], k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if hq != hkv:
        k = xp.repeat(k, hq // hkv, axis=1)
        v = xp.repeat(v, hq // hkv, axis=1)
    s = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    finite_v = xp.isfinite(v)
    s = s + xp.sum(v * 0, axis=-1)[..., None, :]  # NaN for a bad v row, (B, H, 1, Sk)
    s = modify_scores(xp, s, bias, alibi_slopes, softcap)
    keep = keep_matrix(xp, q.shape[2], k.shape[2], causal, mask, window)
    if keep is not None:
        s = xp.where(keep, s, -xp.inf)
    m = xp.max(s, axis=-1, keepdims=True) if s.shape[-1] else xp.zeros(s.shape[:-1] + (1,), s.dtype)
    m = xp.where(m == -xp.inf, xp.zeros_like(m), m)  # shift a row with no finite max by 0
    e = xp.exp(s - m)
    den = xp.sum(e, axis=-1, keepdims=True)
    # Dead: every score -inf, so every e is 0. A live row has den >= 1 (its max gives exp(0))
    # or NaN, also where a max reduction skips NaN (XLA:CPU's does): never "den > 0".
    dead = den == 0
    p = e / xp.where(dead, xp.ones_like(den), den)
    out = xp.matmul(p, xp.where(finite_v, v, xp.zeros_like(v)))
    if not return_lse:
        return out
    lse = m + xp.log(xp.where(dead, xp.ones_like(den), den))
    lse = xp.where(dead, -xp.inf * xp.ones_like(lse), lse)
    return out, lse[..., 0]


def checked_scale(value: object, d: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"attention: scale must be a positive finite real number or "
                                   f"None; got {type(value).__name__} {value!r}.")
    f = float(value)
    if not math.isfinite(f) or f <= 0.0:
        raise InvalidArgumentError(f"attention: scale must be positive and finite; got {f!r}. "
                                   "Pass None for the default 1/sqrt(D).")
    return f


def checked_window(value: object) -> tuple[int, int | None] | None:
    """None, an int ``left`` or a pair (left, right) (right may be None) -> (left, right)."""
    if value is None:
        return None
    pair = value if isinstance(value, (tuple, list)) else (value, None)
    if isinstance(pair, (tuple, list)) and len(pair) == 1:  # [left] (torch's int[] schema)
        pair = (pair[0], None)
    ok = len(pair) == 2 and all(
        (x is None and i == 1) or (isinstance(x, (int, np.integer)) and not isinstance(x, bool))
        for i, x in enumerate(pair))
    if not ok:
        raise InvalidArgumentError(f"attention: window must be None, an int left, or a pair "
                                   f"(left, right) of ints (right may be None); got {value!r}.")
    left, right = int(pair[0]), None if pair[1] is None else int(pair[1])
    if left < 0 or (right is not None and right < 0):
        raise InvalidArgumentError(f"attention: window sizes must be >= 0; got {value!r}. Query "
                                   "i attends key j when i - left <= j (<= i + right).")
    return left, right


# The largest soft cap: 2**126, whose reciprocal is float32's smallest normal. XLA on a CPU
# divides by a scalar as a product with its reciprocal, which a larger cap makes subnormal and
# flushes to 0: s / 3e38 came out 0 for every finite s, and NaN for s = +-inf.
MAX_SOFTCAP = 2.0 ** 126


def checked_softcap(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(float(value)) or float(value) <= 0.0:
        raise InvalidArgumentError(f"attention: softcap must be a positive finite number or "
                                   f"None; got {value!r}. Gemma 2 uses 50.0 (s -> c tanh(s/c)).")
    if float(value) > MAX_SOFTCAP:
        raise InvalidArgumentError(
            f"attention: softcap must be at most 2**126 (about 8.5e37); got {value!r}. 1 / c "
            "must be a normal float32: XLA divides by c as a product with 1 / c, which it would "
            "flush to 0. Any cap that large leaves scores below 1e34 within an ulp: pass None.")
    return float(value)


def _broadcast_strides(what: str, shape: tuple[int, ...], target: tuple[int, ...],
                       note: str) -> list[int]:
    if len(shape) > 4:
        raise ShapeError(f"attention: {what} has rank {len(shape)}; expected at most 4, "
                         f"broadcastable to (B, Hq, Sq, Sk) = {target}.")
    try:
        if tuple(np.broadcast_shapes(shape, target)) != target:
            raise ValueError
    except ValueError:
        raise ShapeError(f"attention: {what} of shape {shape} does not broadcast to "
                         f"(B, Hq, Sq, Sk) = {target}{note}.") from None
    return broadcast_strides(shape, target, 1)


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    q, k, v, mask = m["q"], m["k"], m["v"], m["mask"]
    bias, slopes = m.get("bias"), m.get("alibi_slopes")
    assert q is not None and k is not None and v is not None
    lay = {"q": "(B, Hq, Sq, D)", "k": "(B, Hkv, Sk, D)", "v": "(B, Hkv, Sk, Dv)"}
    for name, meta in (("q", q), ("k", k), ("v", v)):
        need_rank("attention", name, meta.shape, rank=4, layout=lay[name])
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    Bv, Hv, Skv, Dv = v.shape
    if Bk != B or Bv != B:
        raise ShapeError(f"attention: batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}; "
                         "expected the same B in all three.")
    if Dk != D:
        raise ShapeError(f"attention: head dim of k ({Dk}) differs from q ({D}); expected "
                         f"q (B, Hq, Sq, D) and k (B, Hkv, Sk, D) with equal D.")
    if (Hv, Skv) != (Hkv, Sk):
        raise ShapeError(f"attention: v {v.shape} must match k {k.shape} in heads and length; "
                         "expected v (B, Hkv, Sk, Dv).")
    if Hkv == 0 or Hq % Hkv:
        raise ShapeError(f"attention: query heads Hq={Hq} must be a multiple of key/value heads "
                         f"Hkv={Hkv} (grouped-query attention); got q {q.shape}, k {k.shape}.")
    causal = params["causal"]
    if not isinstance(causal, (bool, np.bool_)):
        raise InvalidArgumentError(f"attention: causal must be True or False; got {causal!r}.")
    params["causal"] = bool(causal)
    params["scale"] = checked_scale(params["scale"], D)
    ret = params.get("return_lse", False)
    if not isinstance(ret, (bool, np.bool_)):
        raise InvalidArgumentError(f"attention: return_lse must be True or False; got {ret!r}.")
    params["return_lse"] = ret = bool(ret)
    params["window"] = checked_window(params.get("window"))
    params["softcap"] = checked_softcap(params.get("softcap"))
    target = (B, Hq, Sq, Sk)
    mstr = [0, 0, 0, 0]
    if mask is not None:
        mstr = _broadcast_strides("mask", mask.shape, target, "; True = attend")
    bstr = [0, 0, 0, 0]
    if bias is not None:
        bstr = _broadcast_strides("bias", bias.shape, target, ", added to the scaled scores")
    if slopes is not None and tuple(slopes.shape) != (Hq,):
        raise ShapeError(f"attention: alibi_slopes has shape {tuple(slopes.shape)}; expected "
                         f"(Hq,) = ({Hq},), one float32 slope per query head.")
    out = (B, Hq, Sq, Dv)
    dt = dtype_name(q.dtype)
    outputs = None
    empty = (0 in out) or Sk == 0
    if ret:  # the lse of a row with no key is -inf, not the 0 an empty result is filled with
        outputs = {"out": (out, dt), "lse": ((B, Hq, Sq), lse_dtype(dt))}
        empty = B * Hq * Sq == 0
    return Problem("attention", dt,
                   {"q": q.shape, "k": k.shape, "v": v.shape,
                    "mask": None if mask is None else mask.shape,
                    "bias": None if bias is None else bias.shape,
                    "alibi_slopes": None if slopes is None else slopes.shape}, params, out,
                   derived={"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "Sk": Sk, "D": D, "Dv": Dv,
                            "mask_strides": mstr, "bias_strides": bstr},
                   empty_result=empty, outputs=outputs)


def lse_dtype(dtype: str) -> str:
    """The log-sum-exp's dtype: the compute type (float64 for float64, else float32)."""
    return dtypes.compute_dtype_name(dtype)


def effective_bk(p: Problem, cfg: Mapping[str, int]) -> int:
    """BK capped so that K and V tiles fit LOCAL_BUDGET_BYTES (documented, deterministic)."""
    vec = max(1, cfg.get("VEC", 1))
    width = max(1, p.derived["D"]) + -(-max(1, p.derived["Dv"]) // vec) * vec
    esz = p.info.compute.itemsize
    cap = max(1, LOCAL_BUDGET_BYTES // (width * esz))
    bk = cfg["BK"]
    while bk > cap and bk > 1:
        bk //= 2
    return bk


def packs_kv(p: Problem, cfg: Mapping[str, int]) -> bool:
    """Whether K and V are first copied into the KT/VP workspaces (PACK_KV, see attention.c):
    asked for, on the vector path (VEC > 1 dividing BK, storage type = compute type), and the
    copies indexable with 32-bit ints. A dialect without vector types (CUDA) compiles the
    scalar path, which ignores the copies: the GPU schedule has PACK_KV=0."""
    if not cfg.get("PACK_KV") or cfg["VEC"] <= 1 or p.info.storage != p.info.compute:
        return False
    if uses_mma(p, cfg):
        return False
    if p.derived["Sk"] == 0:  # nothing to pack (a call that runs with Sk = 0 returns lse)
        return False
    if effective_bk(p, cfg) % cfg["VEC"]:
        return False
    kt, vp = _packed_elements(p, cfg)
    return max(kt, vp) <= MAX_INDEX


def _packed_elements(p: Problem, cfg: Mapping[str, int]) -> tuple[int, int]:
    d, bk, vec = p.derived, effective_bk(p, cfg), cfg["VEC"]
    heads, skp = d["B"] * d["Hkv"], cdiv(d["Sk"], bk) * bk
    dvp = cdiv(max(1, d["Dv"]), vec) * vec
    return heads * max(1, d["D"]) * skp, heads * skp * dvp


SPLIT_MIN_TILES = 4  # key tiles per range at least: fewer and the combine outweighs the gain
SPLIT_GROUPS_PER_UNIT = 2  # split until the groups fill each compute unit this many times


def split_plan(p: Problem, cfg: Mapping[str, int]) -> tuple[int, int]:
    """(nsplit, chunk): how many key ranges the forward launches per query block, and the
    keys per range (a multiple of BK). SPLIT = 1: none; SPLIT = n > 1: n ranges (fewer when
    there are fewer tiles). SPLIT = 0 (automatic) is resolved for the device by
    ``fit_splits`` before a call runs; a raw config (tools without a device) reads it as 1."""
    d = p.derived
    bk = tile_keys(p, cfg)
    tiles = cdiv(max(d["Sk"], 1), bk)
    want = max(1, min(cfg.get("SPLIT", 1), tiles))
    # the partials (rows x ranges x (Dv + 2)) are indexed with 32-bit ints: fewer ranges
    # until they fit (a forced SPLIT on a long prefill would wrap and write out of bounds)
    rows = d["B"] * d["Hq"] * d["Sq"]
    while want > 1 and rows * want * (max(d["Dv"], 1) + 2) > MAX_INDEX:
        want //= 2
    per = cdiv(tiles, want)
    return cdiv(tiles, per), per * bk


def fit_splits(p: Problem, cfg: dict[str, int], compute_units: int) -> dict[str, int]:
    """The spec's ``fit_device``: SPLIT = 0 becomes enough key ranges that the work-groups
    fill the device's compute units SPLIT_GROUPS_PER_UNIT times over, each range at least
    SPLIT_MIN_TILES tiles, rounded down to a power of two in the tunable's domain. That
    splits decode (Sq = 1) at small batch, where B * Hq groups would leave most of a GPU's
    units idle, and leaves prefill and large batches unsplit."""
    if cfg.get("SPLIT") != 0:
        return cfg
    d = p.derived
    tiles = cdiv(max(d["Sk"], 1), tile_keys(p, cfg))
    groups = d["B"] * d["Hq"] * cdiv(d["Sq"], queries_per_group(p, cfg))
    want = min(cdiv(SPLIT_GROUPS_PER_UNIT * compute_units, max(groups, 1)),
               tiles // SPLIT_MIN_TILES, 128)
    cfg["SPLIT"] = 1 << (max(want, 1).bit_length() - 1)
    return cfg


def workspace(p: Problem, cfg: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    nsplit, _ = split_plan(p, cfg)
    if nsplit > 1:
        d = p.derived
        rows = d["B"] * d["Hq"] * d["Sq"]
        out["part"] = (rows * nsplit * (max(d["Dv"], 1) + 2), lse_dtype(p.dtype))
    if packs_kv(p, cfg):
        kt, vp = _packed_elements(p, cfg)
        out.update({"kt": (kt, p.dtype), "vp": (vp, p.dtype)})
    return out


def defines(p: Problem, cfg: Mapping[str, int]) -> dict[str, Any]:
    return {"BQ": cfg["BQ"], "BK": effective_bk(p, cfg), "TQ": cfg["TQ"], "RQ": cfg["RQ"],
            "VEC": cfg["VEC"],
            "DQ": p.derived["D"], "DV": p.derived["Dv"], "PACK_KV": int(packs_kv(p, cfg)),
            "AT_MODS": int(score_mods(p) != 0),
            "AT_MMA": int(uses_mma(p, cfg)), "AM_BK": MMA_BK,
            "AM_BF16": int(p.dtype == "bfloat16")}


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    d = p.derived
    mma = uses_mma(p, cfg)
    nqb = cdiv(d["Sq"], queries_per_group(p, cfg))
    ms = d["mask_strides"]
    has_mask = p.shapes["mask"] is not None
    packed = packs_kv(p, cfg)
    bk = effective_bk(p, cfg)
    skp = cdiv(d["Sk"], bk) * bk
    pre: list[Launch] = []
    if packed:
        pre.append(Launch("attention_pack_kv", (d["B"] * d["Hkv"] * (skp // bk), 1, 1),
                          (bk, 1, 1), (Buf("k"), Buf("v"), Buf("kt"), Buf("vp"),
                                       Scalar(d["Sk"]), Scalar(skp))))
    kt, vp = ("kt", "vp") if packed else ("q", "q")  # unread without PACK_KV
    lse_on = int(bool(p.params.get("return_lse")))
    lse = "lse" if lse_on else "out"  # unwritten without lse_on
    args = (Buf("q"), Buf("k"), Buf("v"), Buf("mask" if has_mask else "q"), Buf("out"),
            Buf(lse), Buf(kt), Buf(vp), *score_mod_buffers(p),
            Scalar(d["Sq"]), Scalar(d["Sk"]), Scalar(d["Hq"]), Scalar(d["Hq"] // d["Hkv"]),
            Scalar(nqb), Scalar(p.params["scale"], "acc"), Scalar(int(p.params["causal"])),
            Scalar(int(has_mask)), Scalar(ms[0]), Scalar(ms[1]), Scalar(ms[2]), Scalar(ms[3]),
            Scalar(skp), *score_mod_args(p))
    nsplit, chunk = split_plan(p, cfg)
    part = "part" if nsplit > 1 else "out"  # unwritten without a split
    args += (Buf(part), Scalar(nsplit), Scalar(chunk), Scalar(lse_on))
    if mma:  # the fragment schedule (attention_mma.c): 16 queries per group of 64 items
        main = Launch("attention_mma", (d["B"] * d["Hq"] * nqb * nsplit, 1, 1),
                      (MMA_ITEMS, 1, 1), args)
    else:
        main = Launch("attention", (d["B"] * d["Hq"] * nqb * nsplit, 1, 1), (cfg["BQ"], 1, 1),
                      args)
    if nsplit == 1:
        return pre + [main]
    rows = d["B"] * d["Hq"] * d["Sq"]
    wg = 64
    combine = Launch("attention_combine", (cdiv(rows, wg), 1, 1), (wg, 1, 1),
                     (Buf("part"), Buf("out"), Buf(lse), Scalar(rows), Scalar(nsplit),
                      Scalar(lse_on)))
    return pre + [main, combine]


def score_mod_buffers(p: Problem) -> tuple[Buf, Buf]:
    """BIAS and SLOPES (attention_mods.c); an absent one is bound to q and never read."""
    return (Buf("bias" if p.shapes.get("bias") is not None else "q"),
            Buf("alibi_slopes" if p.shapes.get("alibi_slopes") is not None else "q"))


# attention_mods.c's bits of the kernels' `mods` argument
MOD_BITS = {"bias": 1, "alibi_slopes": 2, "softcap": 4, "window": 8}


def score_mods(p: Problem) -> int:
    """The call's modifiers as attention_mods.c's `mods` bits. Run-time data, not compile-time
    switches: every combination shares the one kernel compiled with AT_MODS (a compile costs
    far more than three tests per score, and up to 16 variants per shape filled the cache)."""
    on = {"bias": p.shapes.get("bias") is not None,
          "alibi_slopes": p.shapes.get("alibi_slopes") is not None,
          "softcap": p.params.get("softcap") is not None,
          "window": p.params.get("window") is not None}
    return sum(bit for name, bit in MOD_BITS.items() if on[name])


def score_mod_args(p: Problem) -> tuple[Scalar, ...]:
    """wl, wr, cap, mods, bs0..bs3 (attention_mods.c): a window without a right edge has
    wr = Sk (no key lies further right than that); absent modifiers pass values never read."""
    window = p.params.get("window")
    left, right = window if window is not None else (0, None)
    right = p.derived["Sk"] if right is None else min(right, p.derived["Sk"])
    left = min(left, max(p.derived["Sq"], 1))  # a query never looks further left than Sq
    cap = p.params.get("softcap") or 1.0
    bs = p.derived.get("bias_strides", [0, 0, 0, 0])
    return (Scalar(left), Scalar(right), Scalar(cap, "acc"), Scalar(score_mods(p)),
            Scalar(bs[0]), Scalar(bs[1]), Scalar(bs[2]), Scalar(bs[3]))


def _attended_ranges(sq: int, sk: int, causal: bool, window: tuple[int, int | None] | None,
                     q_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): the first and last key each query row may attend under causal and the
    window (hi < lo: none); both rise with the row."""
    i = np.arange(sq, dtype=np.int64) + q_offset
    lo = np.zeros(sq, np.int64)
    hi = np.full(sq, sk - 1, np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window is not None:
        lo = np.maximum(lo, i - window[0])
        if window[1] is not None:
            hi = np.minimum(hi, i + window[1])
    return lo, hi


def attended_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int | None] | None,
                   q_offset: int = 0) -> float:
    """(query, key) pairs that causal and the window keep, the work the kernels do (a mask
    is data, not counted: the flops are those of the unmasked call). Exact, per row."""
    if sq == 0 or sk == 0:
        return 0.0
    lo, hi = _attended_ranges(sq, sk, causal, window, q_offset)
    return float(np.maximum(hi - lo + 1, 0).sum())


def attended_keys(sq: int, sk: int, causal: bool, window: tuple[int, int | None] | None,
                  q_offset: int = 0) -> int:
    """Keys some query attends (causal and the window; a mask is data): the K/V rows a call
    must read, which the kernels' tile skipping keeps to (a decode step's 128-key window of a
    32768-key cache reads 128 keys, not 32768). Counting every key instead made the byte
    count, a lower bound on what moved, up to Sk / window times too high, and a run's
    bandwidth roof with it (a case's rate lifts the roof)."""
    if sq == 0 or sk == 0:
        return 0
    lo, hi = _attended_ranges(sq, sk, causal, window, q_offset)
    live = hi >= lo
    lo, hi = lo[live], hi[live]
    if not lo.size:
        return 0
    # both ends rise with the row: a row adds the keys past the highest key before it
    before = np.concatenate(([-1], np.maximum.accumulate(hi)[:-1]))
    return int(np.maximum(hi - np.maximum(lo, before + 1) + 1, 0).sum())


def cost(p: Problem) -> Cost:
    d = p.derived
    pairs = attended_pairs(d["Sq"], d["Sk"], p.params["causal"], p.params.get("window"))
    keys = attended_keys(d["Sq"], d["Sk"], p.params["causal"], p.params.get("window"))
    bh = d["B"] * d["Hq"]
    isz = p.info.storage.itemsize
    width = d["D"] + d["Dv"]
    nbytes = isz * (bh * d["Sq"] * width + d["B"] * d["Hkv"] * keys * width)
    return Cost(flops=2.0 * bh * pairs * (d["D"] + d["Dv"]), bytes=float(nbytes))


def tolerance(p: Problem, x: dict[str, np.ndarray], ref: Any) -> Any:
    """The worst-case bound (module docstring) on the rows the semantics specify; 0 where the
    oracle is NaN (compared by NaN-ness: a NaN is expected exactly there); +inf (not judged)
    where the range rule leaves a row to IEEE arithmetic in the compute type (unspecified).
    With ``return_lse`` (``ref`` = (out, lse)) one bound per output."""
    if not p.params.get("return_lse"):
        return worst_case_bounds(p, x, ref, None)[0]
    return worst_case_bounds(p, x, ref[0], ref[1])


def worst_case_bounds(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray, lse: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray | None]:
    """(the output's bound, the lse's bound or None). The lse = m + log(l) errs by at most
    the largest attended score's error (a shift of every score by at most e_max moves the
    log-sum-exp by at most e_max), the rounding of s - m (u dist) and of exp (4 u), the Sk - 1
    additions of l (Sk u, relative, so absolute in the log) and log's and the final
    addition's roundings (u |lse| each, plus 8 u slack)."""
    d = p.derived
    u = float(np.finfo(p.info.compute).eps) / 2
    scale = p.params["scale"]
    g = d["Hq"] // d["Hkv"]
    q, k, v = x["q"], np.repeat(x["k"], g, axis=1), np.repeat(x["v"], g, axis=1)
    keep = keep_matrix(np, d["Sq"], d["Sk"], p.params["causal"], x.get("mask"),
                       p.params.get("window"))
    keep = np.broadcast_to(True if keep is None else keep, q.shape[:-1] + (d["Sk"],))
    qs = q * scale
    qf = np.where(np.isfinite(qs), qs, 0.0)  # the finite terms of every score
    kf = np.where(np.isfinite(k), k, 0.0)
    vf = np.where(np.isfinite(v), v, 0.0)
    s_all = np.matmul(qs, np.swapaxes(k, -1, -2))  # with the non-finite terms: NaN, +-inf
    s = np.matmul(qf, np.swapaxes(kf, -1, -2))
    mag = np.matmul(np.abs(qf), np.swapaxes(np.abs(kf), -1, -2))
    es = (_dot_gamma(p) * u) * mag + 2.0 * u * np.abs(s)
    s, es, s_mod = _modified(p, x, s, es, s_all, u)
    keep_f = keep & np.isfinite(s_mod)  # the keys a finite row weighs (a -inf score drops one)
    s = np.where(keep_f, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True) if d["Sk"] else np.zeros(s.shape[:-1] + (1,))
    dead = mx == -np.inf
    e = np.where(keep_f, np.exp(s - np.where(dead, 0, mx)), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    pr = e / np.where(dead, 1.0, den)
    e_max = np.where(keep_f, es, 0.0).max(axis=-1, keepdims=True) if d["Sk"] else 0.0
    dist = (np.where(keep_f, np.abs(s - np.where(dead, 0, mx)), 0.0).max(axis=-1, keepdims=True)
            if d["Sk"] else 0.0)
    rel = 2.0 * e_max + u * (2.0 * dist + 3.0 * d["Sk"] + 2.0 * d["Dv"] + 16.0)
    w = np.matmul(pr, np.abs(vf))
    floor = p.info.subnormal + 4.0 * d["Sk"] * float(np.finfo(p.info.compute).tiny)
    if p.dtype in MMA_DTYPES:  # the fragment schedule may run (_mma_terms)
        pv_rel, eta = _mma_terms(p)
        rel = rel + pv_rel
        floor = floor + eta * np.matmul(keep_f, np.abs(vf)) / np.where(dead, 1.0, den)
    bound = w * rel + p.info.unit_roundoff * np.abs(ref) + floor
    bound = np.where(np.isnan(ref), 0.0, bound)
    loose = unspecified(p, q, k, vf, keep, mag, s_all) | _mods_overflow(p, x, keep, mag)
    if lse is None:
        return np.where(loose, np.inf, bound), None
    with np.errstate(invalid="ignore"):
        lb = e_max[..., 0] + u * (dist[..., 0] + d["Sk"] + 12.0 + 2.0 * np.abs(lse)) \
            if d["Sk"] else np.zeros(lse.shape)
    lb = np.where(np.isfinite(lse), lb, 0.0)  # NaN and -inf: exactly those
    return np.where(loose, np.inf, bound), np.where(loose.any(axis=-1), np.inf, lb)


def _dot_gamma(p: Problem) -> float:
    """A score's dot-product error in units of u x |scale q|.|k|: 2D (any order, FMA or not;
    factor 2: the scale's rounding into q, and slack) on the SIMT paths. fp16/bf16 may run the
    fragment schedule (attention_mma.c), whose D/16 tile products each err by at most 36u of
    their terms' magnitude on any matrix unit (matmul's _mma_gamma: aligned, truncated
    internal sums), the scale applied after in fp32 (its rounding: the 2u|s| term)."""
    d = max(p.derived["D"], 1)
    if p.dtype in MMA_DTYPES:
        return max(2.0 * d, 36.0 * cdiv(d, 16))
    return 2.0 * d


def _mma_terms(p: Problem) -> tuple[float, float]:
    """The fragment schedule's extra output error, fp16/bf16 (attention_mma.c):

    * P.V on matrix units: O accumulates ceil(Sk/16) + 1 tile products at most (keys in
      tiles of 16, one partial tile), each within 36u of its terms' magnitude (<= l W, the
      unnormalised weighted sum), rescales counted in the SIMT terms: 36u (ceil(Sk/16) + 1)
      relative to W.
    * P is rounded to the input type before P.V (l sums the unrounded fp32 p): each weight
      errs by u_storage of itself, so u_storage W, plus, where fp16 rounds a small weight
      into its subnormals, half its smallest subnormal (eta) per attended key, divided by l
      (>= 1, the oracle's den): eta sum_attended |v| / den (eta is 2^-25 for fp16,
      ~2^-134 for bf16).
    Returns (relative term on W, eta)."""
    u = u_of(p)
    sk = p.derived["Sk"]
    rel = 36.0 * u * (cdiv(sk, 16) + 1) + p.info.unit_roundoff
    # (p.info, not np.finfo(storage): numpy's finfo knows bfloat16 only from ml_dtypes 0.7)
    eta = p.info.subnormal / 2.0
    return rel, eta


def _modified(p: Problem, x: dict[str, np.ndarray], s: np.ndarray, es: np.ndarray,
              s_all: np.ndarray, u: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The score modifiers applied to the float64 scores, with their error bound.

    ``s`` holds the finite terms of each score, ``es`` its error bound, ``s_all`` the exact
    score (NaN, +-inf where a term is). A score that is exactly +-inf (no rounding) takes
    that value. Bias and ALiBi add one rounding each (u |s + b|, and u |slope d| for the
    product); the cap passes an error on scaled by tanh's slope (<= 1) and adds the rounding
    of s / c (at most u min(|s|, c) once through tanh), tanh's own (8 ulp, as OpenCL's
    full-profile tanh allows, 5) and the product's: 10 u |c tanh(s / c)| in all.
    Returns (s, es, s_all) after the modifiers."""
    bias, slopes, cap = x.get("bias"), x.get("alibi_slopes"), p.params.get("softcap")
    if bias is None and slopes is None and cap is None:
        return s, es, s_all
    with np.errstate(invalid="ignore", over="ignore"):
        exact = np.where(np.isfinite(s_all), s, s_all)
        es = np.where(np.isfinite(s_all), es, 0.0)
        t = modify_scores(np, exact, bias, slopes, None)
        if slopes is not None:
            sq, sk = s.shape[-2], s.shape[-1]
            es = es + u * np.abs(slopes.reshape(1, -1, 1, 1) * alibi_distance(np, sq, sk))
        if bias is not None or slopes is not None:
            es = es + u * np.abs(t)
        if cap is not None:
            capped = cap * np.tanh(t / cap)
            es = es + u * np.minimum(np.abs(t), cap) + 10.0 * u * np.abs(capped)
            t = capped
        es = np.where(np.isfinite(es), es, 0.0)
    return np.where(np.isfinite(t), t, 0.0), es, t


def _mods_overflow(p: Problem, x: dict[str, np.ndarray], keep: np.ndarray,
                   mag: np.ndarray) -> np.ndarray:
    """The range rule for the modifiers: a row whose attended score plus bias and ALiBi terms
    could overflow the compute type is left to IEEE arithmetic (unspecified), as an
    overflowing dot is."""
    bias, slopes = x.get("bias"), x.get("alibi_slopes")
    if bias is None and slopes is None:
        return np.zeros(mag.shape[:-1] + (1,), bool)
    big = float(np.finfo(p.info.compute).max)
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.array(mag, dtype=np.float64)
        if bias is not None:
            total = total + np.where(np.isfinite(bias), np.abs(bias), 0.0)
        if slopes is not None:
            total = total + np.abs(slopes.reshape(1, -1, 1, 1)) * alibi_distance(
                np, mag.shape[-2], mag.shape[-1])
        over = np.any(keep & (total * (1.0 + 4.0 * u_of(p)) >= big / 2), axis=-1)
    return over[..., None]


def u_of(p: Problem) -> float:
    return float(np.finfo(p.info.compute).eps) / 2


def unspecified(p: Problem, q: np.ndarray, k: np.ndarray, vf: np.ndarray, keep: np.ndarray,
                mag: np.ndarray, s_all: np.ndarray) -> np.ndarray:
    """The range rule (README): where IEEE arithmetic in the compute type, not the float64
    oracle, decides an output element, so backends may differ (order of the sums, FMA, flushing
    of subnormals). Inputs are float64, k and v repeated to Hq heads, vf with non-finite
    entries zeroed; mag = |scale q| . |k| over the finite terms. An element is unspecified when
    its row attends a key (mask/causal allow it) whose score's finite terms could overflow
    (positive or negative part, (mag + |s|)/2, within the dot's rounding of the largest
    finite value), when scale * q overflows in the compute type, when it underflows (to a
    subnormal or 0) in a row that attends a key with an infinite k (0 * inf), or when the
    attended keys' sum of |v| could overflow the unnormalised accumulator of a fused kernel.
    bf16 (attention_mma.c's q * 2^e): also where |scale q| reaches bf16's max, and the
    underflow threshold doubles."""
    ct = p.info.compute
    big = float(np.finfo(ct).max)
    u = float(np.finfo(ct).eps) / 2
    d, sk = p.derived["D"], p.derived["Sk"]
    with np.errstate(all="ignore"):
        s_fin = np.where(np.isfinite(s_all), s_all, 0.0)
        part = 0.5 * (mag + np.abs(np.where(np.isfinite(mag), s_fin, 0.0)))
        over_s = np.any(keep & (part * (1.0 + 2.0 * (d + 1) * u) >= big), axis=-1)
        qc = q.astype(ct) * ct.type(p.params["scale"])  # one rounding, as the kernels do
        fin = np.isfinite(q)
        over_q = np.any(fin & ~np.isfinite(qc), axis=-1)
        tiny = float(np.finfo(ct).tiny)
        if p.dtype == "bfloat16":
            # the fragment schedule (attention_mma.c) feeds bf16(q * s2), s2 <= scale a
            # power of two (> scale / 2): it may round to inf where |scale q| nears bf16's
            # max, and leaves the normal range below 2 x fp32's tiny
            over_q |= np.any(fin & (np.abs(q * p.params["scale"])
                                    >= _STORAGE_MAX["bfloat16"]), axis=-1)
            tiny *= 2.0
        under_q = np.any(fin & (q != 0) & (np.abs(qc) < tiny), axis=-1)
        inf_k = np.any(np.isinf(k), axis=-1)[..., None, :]  # (B, H, 1, Sk)
        under_q &= np.any(keep & inf_k, axis=-1)
        acc = np.matmul(keep.astype(np.float64), np.abs(vf)) * (1.0 + (sk + 2) * u) >= big
    return (over_s | over_q | under_q)[..., None] | acc


STAT_EXP_ERR = 8.0  # exp's error in units of u (4 ulp), as in softmax.statistical


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    """Probabilistic model (the statistical check, portakern.verify). Per query row, with
    weights p_j, W_d = sum_j p_j |v_jd|, o the oracle's output, E = STAT_EXP_ERR:

    * random (sub-Gaussian proxy sigma^2; independent mean-zero rounding errors, Higham &
      Mary 2019): each score's D-term dot (and the scale) errs with proxy
      u^2 (D + 1) (scale |q|.|k|_j)^2 (every contiguous partial sum is <= scale |q|.|k|),
      moving o_d by sum_j p_j ds_j (v_jd - o_d); the denominator and the P.V sums add Sk - 1
      partial sums each (<= l and <= l W_d) and rescale them at most once per key (exp error
      E u): proxy u^2 (Sk (1 + E^2) + 1)(W_d^2 + o_d^2); output rounding u_out |o_d|.
    * deterministic (slack): s_j - m rounding and exp (u (|s_j - m| + E) per weight), the
      scale product (u |s_j|), the final division: u (2 max|s| + dist + E + 4)(W_d + |o_d|).
    * fp16/bf16 (the fragment schedule, attention_mma.c, may run): P rounded to the input
      type, proxy u_s^2 sum_j p_j^2 v_jd^2; fp16's subnormal weights in the slack
      (_mma_terms). The matrix units' internal sums are modelled as fp32 roundings (what
      the emulation does); their truncation is in the worst-case bound only.

    One group per query row (its elements share the row's weights)."""
    from ..core.statmodel import StatModel

    d = p.derived
    u = float(np.finfo(p.info.compute).eps) / 2
    scale = p.params["scale"]
    g = d["Hq"] // d["Hkv"]
    q, k, v = x["q"], np.repeat(x["k"], g, axis=1), np.repeat(x["v"], g, axis=1)
    with np.errstate(all="ignore"):
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        mag = scale * np.matmul(np.abs(q), np.swapaxes(np.abs(k), -1, -2))
        # the modifiers' roundings (_modified's bound, less the dot's) enter the slack
        _, es_mod, s = _modified(p, x, s, np.zeros_like(s), s, u)
        keep = keep_matrix(np, d["Sq"], d["Sk"], p.params["causal"], x.get("mask"),
                           p.params.get("window"))
        keep = np.broadcast_to(True if keep is None else keep, s.shape)
        s = np.where(keep, s, -np.inf)
        mx = s.max(axis=-1, keepdims=True) if d["Sk"] else np.zeros(s.shape[:-1] + (1,))
        dead = ~np.isfinite(mx)
        e = np.where(keep, np.exp(s - np.where(dead, 0, mx)), 0.0)
        pr = e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True))
        o = np.abs(np.nan_to_num(ref, nan=0.0))
        w = np.matmul(pr, np.abs(v))
        c = pr * pr * (u * u * (d["D"] + 1)) * mag * mag
        score_var = 2.0 * (np.matmul(c, v * v) + o * o * c.sum(axis=-1, keepdims=True))
        sk_term = d["Sk"] * (1.0 + STAT_EXP_ERR ** 2) + 1.0
        sigma2 = u * u * sk_term * (w * w + o * o) + score_var + (p.info.unit_roundoff * o) ** 2
        if p.dtype in MMA_DTYPES:
            # the fragment schedule rounds each weight to the input type before P.V
            # (independent, mean zero, <= u_storage p_j): proxy u_s^2 sum_j p_j^2 v_jd^2
            us = p.info.unit_roundoff
            vf = np.where(np.isfinite(v), v, 0.0)
            sigma2 = sigma2 + us * us * np.matmul(pr * pr, vf * vf)
        sabs = np.where(keep, np.abs(s), 0.0).max(axis=-1, keepdims=True) if d["Sk"] else 0.0
        dist = (np.where(keep, np.abs(s - np.where(dead, 0, mx)), 0.0).max(axis=-1, keepdims=True)
                if d["Sk"] else 0.0)
        e_mod = (np.where(keep, es_mod, 0.0).max(axis=-1, keepdims=True) if d["Sk"] else 0.0)
        slack = (u * (2.0 * sabs + dist + STAT_EXP_ERR + 4.0) + 2.0 * e_mod) * (w + o)
        if p.dtype in MMA_DTYPES:  # fp16's subnormal weights (_mma_terms' eta)
            eta = _mma_terms(p)[1]
            den = np.where(dead, 1.0, e.sum(axis=-1, keepdims=True))
            vf = np.where(np.isfinite(v), v, 0.0)
            slack = slack + eta * np.matmul(keep.astype(np.float64), np.abs(vf)) / den
    floor = p.info.subnormal + 4.0 * d["Sk"] * float(np.finfo(p.info.compute).tiny)
    return StatModel(np.sqrt(sigma2), slack + floor, (-1,))



# --- test cases: shapes and values that break kernels and numerics (suite, `check`) ---
def attention_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    b = ch.choice((1, 2))
    hkv = ch.choice((1, 2))
    hq = hkv * ch.choice((1, 2, 3))
    sq = ch.choice((1, 2, 15, 16, 17, 31, 33, 64, 65, 100))
    # (1024 keys: with few queries the automatic split-K path runs, whose combine the
    # default configs never reached below 4 key tiles; a review's mutant there survived)
    sk = sq if ch.boolean(0.3) else ch.choice((1, 2, 16, 17, 32, 33, 65, 100, 1024))
    d = ch.choice(HEAD_DIMS)
    dv = d if ch.boolean(0.7) else ch.choice((16, 40))
    causal = ch.boolean(0.4)
    scale = None if ch.boolean(0.6) else ch.choice((0.05, 0.5, 2.0))
    # numerics: plain N(0, 1) values in a third of the cases; else NaN/+-inf entries, scales
    # log-uniform over [1e-30, 1e30] or at the overflow edge, magnitudes up to 1e4, or values
    # near the storage type's range (attention.py: the semantics and the range rule)
    kind = ch.choice(ATTENTION_VALUES)
    if kind == "nonfinite" and ch.boolean(0.25):
        # one or two keys: every row's softmax then has one or two terms, so the reductions
        # over Sk fold into the elementwise code (XLA:CPU: a NaN constant under exp once
        # came out as garbage there, docs/guarantees.md)
        sk = ch.choice((1, 2))
    mag = ch.choice((1e2, 1e4)) if kind == "magnitude" else 1.0
    shapes = {"q": (b, hq, sq, d), "k": (b, hkv, sk, d), "v": (b, hkv, sk, dv)}
    x = {n: normal(rng, shp, dtype, mag) for n, shp in shapes.items()}
    if kind == "range":
        x = _attention_range_values(ch, rng, shapes, dtype)
        if dtype != "float16":  # q or k near the limit: q . k overflows unless scaled first
            scale = ch.choice((1e-3, 1e-6, 1e-12))
    note = kind
    if kind == "scale":
        edge = ch.choice((None, None, 0.5, 0.9, 4.0))
        if edge is None:
            scale = float(10.0 ** rng.uniform(-30.0, 30.0))
        else:  # the largest sum of |scale q_d k_d| at edge x the compute type's max
            big = float(np.finfo(np.float64 if dtype == "float64" else np.float32).max)
            kk = np.repeat(np.abs(x["k"].astype(np.float64)), hq // hkv, axis=1)
            qk = np.matmul(np.abs(x["q"].astype(np.float64)), np.swapaxes(kk, -1, -2))
            top = float(qk.max()) if qk.size else 0.0
            scale = min(edge * big / top, 1e300) if top > 0 else 1.0
            note += f" edge {edge}"
    if kind == "nonfinite":
        note += nonfinite_entries(ch, rng, x)
    mask = None
    if causal:
        note += " causal"
    if ch.boolean(0.4):
        mshape = ch.choice(((sq, sk), (b, 1, sq, sk), (1, hq, 1, sk), (b, hq, sq, sk)))
        mask = rng.random(mshape) < 0.7
        if ch.boolean(0.5) and len(mshape) >= 2 and mshape[-2] == sq:
            mask[..., 0, :] = False  # a fully masked row must give 0, whatever v holds
        if ch.boolean(0.5) and len(mshape) >= 2 and mshape[-2] == sq and sq > 1:
            mask[..., 1, :] = False  # a row that attends exactly one key
            mask[..., 1, int(rng.integers(sk))] = True
        note += " mask" + str(mshape)
    ret = ch.boolean(0.25)  # drawn last: the draws above keep their seeds
    if ret:
        note += " lse"
    extra, mods, mod_note = score_mod_case(ch, rng, dtype, b, hq, sq, sk)
    return Case({"q": x["q"], "k": x["k"], "v": x["v"], "mask": mask, **extra},
                {"causal": causal, "scale": scale, "return_lse": ret, **mods},
                (note + mod_note).strip())


def score_mod_case(ch: Chooser, rng: np.random.Generator, dtype: str, b: int, hq: int,
                    sq: int, sk: int) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Windows (left only, both sides, 0, past the ends, 2**31 - 1), soft caps (small enough
    to bend the scores, 50 as Gemma 2, or near the type's max), biases (broadcast shapes,
    N(0, 1) to N(0, 30), -inf entries that drop keys) and ALiBi slopes (the geometric series
    of the paper, or random), each in about a fifth of the cases. Drawn from the case's own
    generator, not the chooser, so the chooser's stream, and with it every case of a
    sequence, is what it was before the modifiers existed (the mutant checks draw 40 cases
    in a row)."""
    def boolean(p: float) -> bool:
        return bool(rng.random() < p)

    def choice(options: tuple[Any, ...]) -> Any:
        return options[int(rng.integers(len(options)))]

    arrays: dict[str, Any] = {}
    params: dict[str, Any] = {}
    note = ""
    if boolean(0.2):
        # 2**31 - 1: "no edge" as users write it, which overflowed int32 positions once
        left = choice((0, 1, 3, 16, 200, 2**31 - 1))
        params["window"] = left if boolean(0.5) else (left, choice((0, 2, 17, 300, 2**31 - 1)))
        note += f" window{params['window']}"
    if boolean(0.2):
        # the largest cap: s / c is subnormal for |s| < 1, which XLA on a CPU once flushed
        params["softcap"] = choice((0.5, 2.0, 50.0, MAX_SOFTCAP))
        note += f" softcap{params['softcap']}"
    if boolean(0.2):
        bshape = choice(((sq, sk), (b, hq, sq, sk), (1, hq, 1, sk), (sk,)))
        bias = rng.standard_normal(bshape) * choice((1.0, 30.0))
        if boolean(0.3):
            bias[rng.random(bshape) < 0.2] = -np.inf
        arrays["bias"] = dtypes.cast_to(bias, dtype)
        note += f" bias{bshape}"
    if boolean(0.15):
        slopes = (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq) if boolean(0.5)
                  else rng.random(hq) * 2.0)
        arrays["alibi_slopes"] = slopes.astype(np.float32)
        note += " alibi"
    return arrays, params, note


ATTENTION_VALUES = ("plain", "plain", "nonfinite", "nonfinite", "scale", "magnitude", "range")
_STORAGE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
                "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


def _attention_range_values(ch: Chooser, rng: np.random.Generator,
                            shapes: dict[str, tuple[int, ...]], dtype: str
                            ) -> dict[str, np.ndarray]:
    """Values near the storage type's range. float16: q, k and v up to +-65504 (the scores,
    computed in float32, stay in range). Wider types: q or k (the other N(0, 1)) up to the
    type's max, so q . k overflows float32 unless the scale is folded into q first; v up to
    1e35, so the fused kernels' unnormalised sums over 100 keys stay inside float32."""
    top = _STORAGE_MAX[dtype]
    if dtype == "float16":
        spread = dict.fromkeys(shapes, top / 3)
    else:
        big = ch.choice(("q", "k"))
        spread = {"q": 1.0, "k": 1.0, "v": 1e35 / 3}
        spread[big] = min(top, 3e38) / 3
    out = {}
    for n, shp in shapes.items():
        y = np.clip(rng.standard_normal(shp) * spread[n], -top, top)
        y[rng.random(shp) < 0.05] = top  # some entries exactly at the limit
        out[n] = dtypes.cast_to(y, dtype)
    return out


def nonfinite_entries(ch: Chooser, rng: np.random.Generator, x: dict[str, np.ndarray]) -> str:
    """NaN and +-inf entries in q, k and v (in place), and sometimes a q row whose every score
    is -inf (+inf at q[..., i, d], k[..., :, d] negative): a row with nothing to attend."""
    notes = []
    for _ in range(ch.choice((1, 2, 3))):
        name = ch.choice(("q", "k", "v"))
        value = ch.choice((np.nan, np.inf, -np.inf))
        a = x[name]
        if a.size:
            a[tuple(int(rng.integers(n)) for n in a.shape)] = value
            notes.append(f"{name}={value}")
    q, k = x["q"], x["k"]
    if ch.boolean(0.3) and q.size and k.size:
        i, dd = int(rng.integers(q.shape[2])), int(rng.integers(q.shape[3]))
        q[:, :, i, dd] = np.inf
        k[:, :, :, dd] = -np.abs(np.where(k[:, :, :, dd] == 0, 1, k[:, :, :, dd]))
        notes.append(f"row {i} scores -inf")
    return " " + " ".join(notes)



def pallas_build(problem: Problem, interpret: bool, **kw: Any) -> Any:
    """The spec's ``pallas`` field: attention_pallas.build (the fused forward, with its
    log-sum-exp when ``return_lse``, and the fused Pallas backward under ``custom_vjp``)."""
    kw.setdefault("semantics", semantics)
    return attention_pallas.build(problem, interpret, **kw)

def xla_build(problem: Problem, traced: tuple[str, ...]) -> Any:
    """The spec's ``xla`` field: attention_xla.build with this op's semantics as the forward
    (passed, not imported there: no import cycle between the attention modules)."""
    return attention_xla.build(problem, traced, semantics=semantics)


# --- representative calls: what `portakern show`/`tune` render and the compile checks compile
Example = tuple[str, dict[str, Any], dict[str, Any]]


def example(dtype: str, *, B: int = 1, H: int = 8, Hkv: int = 8, Sq: int = 128, Sk: int = 128,
            D: int = 64, Dv: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A typical call; ``--shape D=80,Dv=64`` sets the sizes (head dims are compile-time
    constants of the kernel). Dv=0: Dv = D."""
    dv = Dv or D
    return ({"q": ArrayMeta((B, H, Sq, D), dtype), "k": ArrayMeta((B, Hkv, Sk, D), dtype),
             "v": ArrayMeta((B, Hkv, Sk, dv), dtype), "mask": None},
            {"causal": False, "scale": None})


def examples(dtype: str) -> list[Example]:
    """The compile checks' calls: every head dim that changes the source (64 with GQA, then
    40, 80, 111, 128), and a masked causal call (the same source: run-time flags)."""
    def qkv(d: int) -> dict[str, Any]:
        return {"q": ArrayMeta((1, 4, 128, d), dtype), "k": ArrayMeta((1, 2, 128, d), dtype),
                "v": ArrayMeta((1, 2, 128, d), dtype)}

    out: list[Example] = [("gqa d64", qkv(64), {})]
    out += [(f"d{d}", qkv(d), {}) for d in (40, 80, 111, 128)]
    out.append(("d64 mask causal", {**qkv(64), "mask": ArrayMeta((1, 1, 128, 128), "bool")},
                {"causal": True}))
    return out


SPEC = KernelSpec(
    name="attention",
    operands=(Operand("q"), Operand("k"), Operand("v"),
              Operand("mask", kind="bool", optional=True), Operand("bias", optional=True),
              Operand("alibi_slopes", kind="float32", optional=True)),
    params={"causal": False, "scale": None, "return_lse": False, "window": None,
            "softcap": None},
    validate=validate,
    semantics=semantics,
    source=kernel_source("mma.c", "vexp.c", "attention_mods.c", "attention.c",
                         "attention_mma.c"),
    slots=lambda p: {"T": p.dtype},
    defines=defines,
    launches=launches,
    workspace=workspace,
    fit_device=fit_splits,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    tunables=(Tunable("BQ", (1, 2, 4, 8, 16, 32, 64, 128, 256), "queries per work-group"),
              Tunable("BK", (1, 2, 4, 8, 16, 32, 64, 128), "keys per local-memory tile"),
              Tunable("TQ", (1, 2, 4, 6, 8), "queries per register block of a work-item"),
              Tunable("RQ", (1, 2, 4, 8, 16), "register blocks per work-item, taking each "
                      "K/V tile in turn while it is cached"),
              Tunable("VEC", (1, 2, 4, 8, 16), "vector lanes (CPU schedule, OpenCL)"),
              Tunable("PACK_KV", (0, 1), "copy K transposed and V into padded workspaces "
                      "first; tiles read in place, no barriers (vector path)"),
              Tunable("SPLIT", (0, 1, 2, 4, 8, 16, 32, 64, 128), "key ranges per query block "
                      "(split-K decode, merged by attention_combine); 0: from the device's "
                      "compute units, 1: none"),
              Tunable("MMA", (0, 1), "fp16/bf16: the fragment schedule (attention_mma.c: "
                      "matrix units, or their emulation where the device has none); "
                      "float32/float64 ignore it (no TF32)")),
    schedules={"gpu": {"BQ": 128, "BK": 16, "TQ": 1, "RQ": 1, "VEC": 1, "PACK_KV": 0,
                       "SPLIT": 0, "MMA": 0},
               # CPU: RQ=4 (16 queries per item): their scaled rows (4 KiB) and a 16 KiB K
               # tile and V tile stay nearer L1 than with RQ=8 (8 KiB of rows)
               "cpu": {"BQ": 1, "BK": 64, "TQ": 4, "RQ": 4, "VEC": 16, "PACK_KV": 1,
                       "SPLIT": 0, "MMA": 0},
               # AVX2 (16 ymm registers): 2 query rows per block and 32-key tiles, so a
               # block's scores and accumulators fit; side by side on a 2-core AMD EPYC
               # (Zen), PoCL / Intel, S=512 1.28 / 1.29x, S=1024 1.29 / 1.30x, S=2048 causal
               # 1.31 / 1.33x faster than the cpu one (VEC 8 was slower on PoCL)
               "cpu256": {"BQ": 1, "BK": 32, "TQ": 2, "RQ": 4, "VEC": 16, "PACK_KV": 1,
                          "SPLIT": 0, "MMA": 0},
               # a device with matrix units (CUDA sm_80+, HIP CDNA/RDNA3, Intel's extension):
               # the gpu schedule, and fp16/bf16 through the fragment API (attention_mma.c)
               "mma": {"BQ": 128, "BK": 16, "TQ": 1, "RQ": 1, "VEC": 1, "PACK_KV": 0,
                       "SPLIT": 0, "MMA": 1}},
    xla=xla_build,
    pallas=PallasKernel(pallas_build, tunables=attention_pallas.TUNABLES,
                        aliases={"BQ": "block_q", "BK": "block_k"},
                        check=attention_pallas.block_config),
    # the range rule's rows are unspecified whatever the oracle gives, NaN included: FMA or
    # summation order decide whether a score with +inf and -inf terms is NaN or +-inf
    unspecified_nonfinite=True,
    cases=attention_case,
    example=example,
    examples=examples,
    doc="Fused attention with online softmax; GQA, causal and boolean masks.",
)
