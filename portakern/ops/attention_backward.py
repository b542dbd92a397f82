"""attention_backward(do, q, k, v, o, lse, mask=None, causal=False, scale=None) -> (dq, dk, dv).

The fused backward of ``attention`` (FlashAttention-2): the probabilities are recomputed from
q, k and the forward's log-sum-exp (``pk.attention(..., return_lse=True)``), never stored:

    P = exp(s - lse) on attended keys (0 elsewhere and on dead rows, lse = -inf),
    s = (scale q) . k as the forward scores; delta = rowsum(dO * out);
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - delta);  dQ = scale dS K;  dK = scale dS^T Q,

dK and dV summed over the query heads of each kv head's group (grouped-query attention).
Operand ``o`` is the forward's output (``pk.attention_backward``'s ``out``). Shapes: do and o
(B, Hq, Sq, Dv), lse (B, Hq, Sq) in the compute type (float32; float64 for
float64), the rest as ``attention``. Outputs in the inputs' dtype, accumulated in the compute
type. Three kernels (attention_backward.c): delta, dK/dV over query rows, dQ over keys; extra
device memory is delta alone, B*Hq*Sq words: O(S), never Sq x Sk.

Error analysis (``tolerance``; u the compute type's unit roundoff, all magnitudes from the
float64 oracle's intermediates). A score errs by E_s = 2 D u scale |q|.|k| + 2 u |s| (as the
forward); P_ij = exp(s_ij - lse_i) then by dP_ij = P_ij (E_s + u (|s - lse| + 4)). dV_j sums
Sq g terms P_ij dO_i: sum_i dP_ij |dO_i| + (Sq g + 2) u sum_i P_ij |dO_i|. dP_ij and delta_i are
Dv-term dots: Dv u |dO|.|V| and Dv u |dO|.|O|; so dS_ij errs by
E_dS = dP_ij |dP_ij - delta_i| + P_ij Dv u (|dO_i|.|V_j| + |dO_i|.|O_i|) + 2 u |dS_ij|, and
dQ_i = scale sum_j dS_ij K_j by scale (sum_j E_dS |K_j| + (Sk + 2) u sum_j |dS_ij| |K_j|) (dK the
same over i and the group). Plus the output's rounding (u_out |ref|) and a subnormal floor.
Non-finite inputs are outside this op's contract: every gradient element an inf or NaN
input reaches is unspecified (+inf bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.errors import ShapeError
from ..core.sampling import Case, Chooser, normal
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
from . import attention, attention_math
from ._common import cdiv, kernel_source, need_rank


def semantics(xp: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, mask: Any = None,
              causal: bool = False, scale: float | None = None,
              window: tuple[int, int | None] | None = None) -> tuple[Any, Any, Any]:
    """The analytic backward, written once (``attention_math.analytic``): the float64 oracle,
    and the jax backend's XLA formulation (no autodiff of the unfused chain). ``window`` is
    the forward's sliding window (a mask: keys outside it have P = 0); the score modifiers
    (bias, ALiBi, softcap) have no fused backward here."""
    return attention_math.analytic(xp, do, q, k, v, o, lse, mask, causal, scale, window=window)


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    do, out, lse = m["do"], m["o"], m["lse"]
    assert do is not None and out is not None and lse is not None
    fwd = attention.validate({"q": m["q"], "k": m["k"], "v": m["v"], "mask": m["mask"]},
                             {**params, "return_lse": False})
    d = fwd.derived
    B, Hq, Sq, Dv = d["B"], d["Hq"], d["Sq"], d["Dv"]
    for name, meta in (("do", do), ("o (the forward's out)", out)):
        need_rank("attention_backward", name, meta.shape, rank=4, layout="(B, Hq, Sq, Dv)")
        if tuple(meta.shape) != (B, Hq, Sq, Dv):
            raise ShapeError(f"attention_backward: {name} has shape {tuple(meta.shape)}; "
                             f"expected (B, Hq, Sq, Dv) = {(B, Hq, Sq, Dv)}, the forward "
                             "output's shape.")
    if tuple(lse.shape) != (B, Hq, Sq):
        raise ShapeError(f"attention_backward: lse has shape {tuple(lse.shape)}; expected "
                         f"(B, Hq, Sq) = {(B, Hq, Sq)}, as pk.attention(..., return_lse=True) "
                         "returns it.")
    dt = fwd.dtype
    assert m["q"] is not None and m["k"] is not None and m["v"] is not None
    return Problem("attention_backward", dt,
                   {n: (None if m[n] is None else tuple(m[n].shape))  # type: ignore[union-attr]  # checked above
                    for n in ("do", "q", "k", "v", "o", "lse", "mask")},
                   {k: fwd.params[k] for k in ("causal", "scale", "window")},
                   tuple(m["q"].shape),
                   derived=dict(d),
                   empty_result=False,
                   outputs={"dq": (tuple(m["q"].shape), dt), "dk": (tuple(m["k"].shape), dt),
                            "dv": (tuple(m["v"].shape), dt)})


def ab_vec(p: Problem, cfg: Mapping[str, int]) -> int:
    """The vector path's lanes (1: the scalar path). The CPU schedule's VEC, halved until it
    divides D and Dv (so K, Q and dO rows are whole vectors); vectors only where the storage
    type is the compute type (plain loads), with keys and queries to pack, and the packed
    copies indexable with 32-bit ints. A dialect without vectors (CUDA) runs the same launches
    on the scalar code (attention_backward.c)."""
    d = p.derived
    vec = int(cfg.get("VEC", 1))
    if vec <= 1 or p.info.storage != p.info.compute or not d["Sq"] or not d["Sk"]:
        return 1
    if not d["D"] or not d["Dv"]:
        return 1
    while vec > 1 and (d["D"] % vec or d["Dv"] % vec):
        vec //= 2
    if vec <= 1:
        return 1
    blk = vec * cfg["NV"]
    sqp, skp = cdiv(d["Sq"], blk) * blk, cdiv(d["Sk"], blk) * blk
    width = max(d["D"], d["Dv"])
    if max(d["B"] * d["Hq"] * width * sqp, d["B"] * d["Hkv"] * width * skp) > MAX_INDEX:
        return 1
    return vec


def _padded(p: Problem, cfg: Mapping[str, int], vec: int) -> tuple[int, int]:
    blk = vec * cfg["NV"]
    return cdiv(p.derived["Sq"], blk) * blk, cdiv(p.derived["Sk"], blk) * blk


def workspace(p: Problem, cfg: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    d = p.derived
    lt = attention.lse_dtype(p.dtype)
    ws = {"delta": (max(1, d["B"] * d["Hq"] * d["Sq"]), lt)}
    vec = ab_vec(p, cfg)
    if vec > 1:  # the packed copies (attention_backward.c): O(S D), never Sq x Sk
        sqp, skp = _padded(p, cfg, vec)
        bh, bkv = d["B"] * d["Hq"], d["B"] * d["Hkv"]
        ws.update({"kt": (bkv * d["D"] * skp, lt), "vt": (bkv * d["Dv"] * skp, lt),
                   "qt": (bh * d["D"] * sqp, lt), "dot": (bh * d["Dv"] * sqp, lt),
                   "lsep": (bh * sqp, lt), "deltap": (bh * sqp, lt)})
    return ws


def defines(p: Problem, cfg: Mapping[str, int]) -> dict[str, Any]:
    return {"WG": cfg["WG"], "DQ": p.derived["D"], "DV": p.derived["Dv"],
            "VEC": ab_vec(p, cfg), "TQ": cfg["TQ"], "TK": cfg["TK"], "NV": cfg["NV"],
            "AB_WIN": int(p.params.get("window") is not None)}


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    d, wg = p.derived, cfg["WG"]
    has_mask = p.shapes["mask"] is not None
    ms = d["mask_strides"]
    mask = "mask" if has_mask else "lse"  # unread without a mask
    rows_q = d["B"] * d["Hq"] * d["Sq"]
    rows_k = d["B"] * d["Hkv"] * d["Sk"]
    common = (Scalar(d["Sq"]), Scalar(d["Sk"]), Scalar(d["Hq"]), Scalar(d["Hq"] // d["Hkv"]))
    flags = (Scalar(p.params["scale"], "acc"), Scalar(int(p.params["causal"])),
             Scalar(int(has_mask)), Scalar(ms[0]), Scalar(ms[1]), Scalar(ms[2]), Scalar(ms[3]))
    win = attention.score_mod_args(p)[:2]  # wl, wr (attention_mods.c), as the forward's
    out: list[Launch] = []
    if rows_q:
        out.append(Launch("attention_bwd_delta", (cdiv(rows_q, wg), 1, 1), (wg, 1, 1),
                          (Buf("do"), Buf("o"), Buf("delta"), Scalar(rows_q))))
    base = (Buf("do"), Buf("q"), Buf("k"), Buf("v"), Buf("lse"), Buf("delta"), Buf(mask))
    vec = ab_vec(p, cfg)
    if vec > 1:  # the CPU vector path: packs, then one item per TK keys / TQ queries
        sqp, skp = _padded(p, cfg, vec)
        bh, bkv = d["B"] * d["Hq"], d["B"] * d["Hkv"]
        out.append(Launch("attention_bwd_pack_kv", (cdiv(bkv * skp, wg), 1, 1), (wg, 1, 1),
                          (Buf("k"), Buf("v"), Buf("kt"), Buf("vt"), Scalar(d["Sk"]),
                           Scalar(skp), Scalar(bkv * skp))))
        out.append(Launch("attention_bwd_pack_q", (cdiv(bh * sqp, wg), 1, 1), (wg, 1, 1),
                          (Buf("q"), Buf("do"), Buf("lse"), Buf("delta"), Buf("qt"),
                           Buf("dot"), Buf("lsep"), Buf("deltap"), Scalar(d["Sq"]),
                           Scalar(sqp), Scalar(bh * sqp), Scalar(p.params["scale"], "acc"))))
        nkb = cdiv(d["Sk"], cfg["TK"])
        out.append(Launch("attention_bwd_dkdv_vec", (bkv * nkb, 1, 1), (1, 1, 1),
                          (*base, Buf("dk"), Buf("dv"), Buf("qt"), Buf("dot"), Buf("lsep"),
                           Buf("deltap"), *common, Scalar(nkb), Scalar(bkv * nkb), *flags,
                           Scalar(sqp), *win)))
        nqb = cdiv(d["Sq"], cfg["TQ"])
        out.append(Launch("attention_bwd_dq_vec", (bh * nqb, 1, 1), (1, 1, 1),
                          (*base, Buf("dq"), Buf("kt"), Buf("vt"), *common, Scalar(nqb),
                           Scalar(bh * nqb), *flags, Scalar(skp), *win)))
        return out
    if rows_k:
        out.append(Launch("attention_bwd_dkdv", (cdiv(rows_k, wg), 1, 1), (wg, 1, 1),
                          (*base, Buf("dk"), Buf("dv"), *common, Scalar(rows_k), *flags, *win)))
    if rows_q:
        out.append(Launch("attention_bwd_dq", (cdiv(rows_q, wg), 1, 1), (wg, 1, 1),
                          (*base, Buf("dq"), *common, Scalar(rows_q), *flags, *win)))
    return out


def cost(p: Problem) -> Cost:
    d = p.derived
    pairs = attention.attended_pairs(d["Sq"], d["Sk"], p.params["causal"],
                                     p.params.get("window"))
    bh = d["B"] * d["Hq"]
    isz = p.info.storage.itemsize
    width = d["D"] + d["Dv"]
    # the algorithm's five products per (query, key) pair, as FlashAttention-2 counts them
    # (2.5x the forward's at D = Dv): s = q.k and dQ, dK (D each), dP = dO.v and dV (Dv each).
    # The kernels compute s and dP twice (in dK/dV and in dQ); that is our overhead, not work
    # the roofline should credit.
    flops = 2.0 * bh * pairs * (3 * d["D"] + 2 * d["Dv"])
    acc = p.info.compute.itemsize  # lse, in the compute type
    # read do, q, o, lse once and the k, v rows some query attends; write dq, dk, dv once
    # (dk, dv for every key: 0 where none attends)
    keys = attention.attended_keys(d["Sq"], d["Sk"], p.params["causal"], p.params.get("window"))
    nbytes = (isz * (bh * d["Sq"] * (2 * d["D"] + 2 * d["Dv"])
                     + d["B"] * d["Hkv"] * (keys + d["Sk"]) * width) + acc * bh * d["Sq"])
    return Cost(flops=float(flops), bytes=float(nbytes))


def tolerance(p: Problem, x: dict[str, np.ndarray], refs: Any) -> tuple[np.ndarray, ...]:
    """One worst-case bound per output (module docstring, "Error analysis")."""
    d = p.derived
    u = float(np.finfo(p.info.compute).eps) / 2
    scale = p.params["scale"]
    g = d["Hq"] // d["Hkv"]
    do, q, out, lse = x["do"], x["q"], x["o"], x["lse"]
    k, v = np.repeat(x["k"], g, axis=1), np.repeat(x["v"], g, axis=1)
    with np.errstate(all="ignore"):
        pr, s = attention_math.probabilities(np, q, k, lse, x.get("mask"), p.params["causal"],
                                             scale, p.params.get("window"))
        qs = np.abs(q * scale)
        es = 2.0 * d["D"] * u * np.matmul(qs, np.swapaxes(np.abs(k), -1, -2)) + 2.0 * u * np.abs(s)
        dlse = np.where(np.isfinite(lse), lse, 0.0)[..., None]
        e_p = pr * (es + u * (np.abs(s - dlse) + 4.0))
        e_p = np.where(pr > 0, e_p, 0.0)
        ado, av, ao = np.abs(do), np.abs(v), np.abs(out)
        dp = np.matmul(do, np.swapaxes(v, -1, -2))
        delta = np.sum(do * out, axis=-1)[..., None]
        ds = pr * (dp - delta)
        e_dot = d["Dv"] * u * (np.matmul(ado, np.swapaxes(av, -1, -2))
                               + np.sum(ado * ao, axis=-1)[..., None])
        e_ds = e_p * np.abs(dp - delta) + pr * e_dot + 2.0 * u * np.abs(ds)
        ak, aq = np.abs(k), np.abs(q)
        b_dq = scale * (np.matmul(e_ds, ak) + (d["Sk"] + 2) * u * np.matmul(np.abs(ds), ak))
        b_dk = scale * (np.matmul(np.swapaxes(e_ds, -1, -2), aq)
                        + (d["Sq"] * g + 2) * u * np.matmul(np.swapaxes(np.abs(ds), -1, -2), aq))
        b_dv = (np.matmul(np.swapaxes(e_p, -1, -2), ado)
                + (d["Sq"] * g + 2) * u * np.matmul(np.swapaxes(pr, -1, -2), ado))
        # Underflow: a P or dS below the smallest normal may flush to zero (XLA:CPU and
        # GPUs flush subnormals), an absolute loss of `tiny` in P (times |dP - delta| in dS)
        # plus `tiny` in dS itself. dQ and dK carry it times scale and |k| or |q|, so with a
        # large scale it is far above the floor below (found: scale 30, dK -8.5e-37 vs 0).
        tiny = float(np.finfo(p.info.compute).tiny)
        t_ds = tiny * (1.0 + np.abs(dp - delta))
        b_dq = b_dq + scale * np.matmul(t_ds, ak)
        b_dk = b_dk + scale * np.matmul(np.swapaxes(t_ds, -1, -2), aq)
        b_dv = b_dv + tiny * np.sum(ado, axis=-2, keepdims=True)
    if g > 1:
        b, hkv, sk = d["B"], d["Hkv"], d["Sk"]
        b_dk = b_dk.reshape(b, hkv, g, sk, -1).sum(axis=2)
        b_dv = b_dv.reshape(b, hkv, g, sk, -1).sum(axis=2)
    floor = p.info.subnormal + 4.0 * max(d["Sq"] * g, d["Sk"]) * float(
        np.finfo(p.info.compute).tiny)
    bounds = []
    for bound, ref in zip((b_dq, b_dk, b_dv), refs, strict=True):
        bound = bound + p.info.unit_roundoff * np.abs(ref) + floor
        bounds.append(np.where(np.isfinite(bound) & np.isfinite(ref), bound, np.inf))
    return tuple(bounds)


def backward_case(ch: Chooser, dtype: str) -> Case:
    """A forward case's shapes (GQA, causal, masks with dead rows, Sq != Sk, D != Dv), finite
    values; out and lse from the float64 forward, stored as the forward returns them."""
    rng = np.random.default_rng(ch.seed())
    b = ch.choice((1, 2))
    hkv = ch.choice((1, 2))
    hq = hkv * ch.choice((1, 2, 3))
    # lengths of 1 and 2, tile edges, and a long one: dK/dV sum over Sq * group rows and dQ
    # over Sk keys, each with its own rounding budget in the tolerance
    sq = ch.choice((1, 2, 7, 16, 17, 33, 257))
    sk = sq if ch.boolean(0.3) else ch.choice((1, 2, 16, 17, 33, 300))
    dh = ch.choice((8, 16, 40, 64))
    dv = dh if ch.boolean(0.7) else ch.choice((16, 24))
    causal = ch.boolean(0.4)
    # tiny (every P nearly uniform) and huge (one key takes each row) scales as well
    scale = None if ch.boolean(0.6) else ch.choice((1e-6, 0.05, 0.5, 2.0, 30.0))
    mag = ch.choice((1.0, 1.0, 4.0))
    q = normal(rng, (b, hq, sq, dh), dtype, mag)
    k = normal(rng, (b, hkv, sk, dh), dtype, mag)
    v = normal(rng, (b, hkv, sk, dv), dtype)
    do = normal(rng, (b, hq, sq, dv), dtype)
    note = f"mag {mag}" + (" causal" if causal else "")
    mask = None
    if ch.boolean(0.4):
        mshape = ch.choice(((sq, sk), (b, 1, sq, sk), (1, hq, 1, sk)))
        mask = rng.random(mshape) < 0.7
        if ch.boolean(0.5) and mshape[-2] == sq:
            mask[..., 0, :] = False  # a dead row: gradient 0
        note += " mask" + str(mshape)
    window = None
    if ch.boolean(0.2):  # drawn last: the cases without a window keep their values
        window = (ch.choice((0, 3, 20)) if ch.boolean(0.5)
                  else (ch.choice((0, 5)), ch.choice((0, 7))))
        note += f" window{window}"
    f64 = [np.asarray(a, np.float64) for a in (q, k, v)]
    o, lse = attention.semantics(np, *f64, mask=mask, causal=causal, scale=scale,
                                 return_lse=True, window=window)
    out = dtypes.cast_to(o, dtype)
    lse = np.asarray(lse, attention.lse_dtype(dtype))
    return Case({"do": do, "q": q, "k": k, "v": v, "o": out, "lse": lse, "mask": mask},
                {"causal": causal, "scale": scale, "window": window}, note)


def example(dtype: str, *, B: int = 1, H: int = 8, Hkv: int = 8, Sq: int = 128, Sk: int = 128,
            D: int = 64, Dv: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    dv = Dv or D
    lt = attention.lse_dtype(dtype)
    return ({"do": ArrayMeta((B, H, Sq, dv), dtype), "q": ArrayMeta((B, H, Sq, D), dtype),
             "k": ArrayMeta((B, Hkv, Sk, D), dtype), "v": ArrayMeta((B, Hkv, Sk, dv), dtype),
             "o": ArrayMeta((B, H, Sq, dv), dtype), "lse": ArrayMeta((B, H, Sq), lt),
             "mask": None}, {"causal": False, "scale": None})


def examples(dtype: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The compile checks' calls: GQA d64, d128, and a masked causal call."""
    out = []
    for name, d, hkv in (("gqa d64", 64, 2), ("d128", 128, 4)):
        metas, params = example(dtype, H=4, Hkv=hkv, D=d)
        out.append((name, metas, params))
    metas, _ = example(dtype, H=4, Hkv=4)
    metas["mask"] = ArrayMeta((1, 1, 128, 128), "bool")
    out.append(("d64 mask causal", metas, {"causal": True}))
    return out


SPEC = KernelSpec(
    name="attention_backward",
    operands=(Operand("do"), Operand("q"), Operand("k"), Operand("v"), Operand("o"),
              Operand("lse", kind="acc"), Operand("mask", kind="bool", optional=True)),
    params={"causal": False, "scale": None, "window": None},
    validate=validate,
    semantics=semantics,
    source=kernel_source("vexp.c", "attention_mods.c", "attention_backward.c"),
    slots=lambda p: {"T": p.dtype},
    defines=defines,
    launches=launches,
    workspace=workspace,
    cost=cost,
    tolerance=tolerance,
    tunables=(Tunable("WG", (1, 8, 16, 32, 64, 128, 256), "rows per work-group"),
              Tunable("VEC", (1, 2, 4, 8, 16), "vector lanes (CPU schedule, OpenCL; 1: the "
                      "scalar path)"),
              Tunable("TQ", (1, 2, 4, 8), "query rows per dQ work-item (vector path)"),
              Tunable("TK", (1, 2, 4), "key rows per dK/dV work-item (vector path)"),
              Tunable("NV", (1, 2, 4), "vectors per key/query block (vector path)")),
    schedules={"gpu": {"WG": 128, "VEC": 1, "TQ": 1, "TK": 1, "NV": 1},
               "cpu": {"WG": 8, "VEC": 16, "TQ": 4, "TK": 4, "NV": 2}},
    unspecified_nonfinite=True,
    cases=backward_case,
    example=example,
    examples=examples,
    doc="Fused attention backward from the forward's log-sum-exp: dq, dk, dv; GQA, causal, "
        "masks; no Sq x Sk buffer.",
)
