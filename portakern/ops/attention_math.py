"""Attention's shared arithmetic, in any array namespace ``xp`` (numpy, jax.numpy): which keys
a row attends, the probabilities recomputed from a log-sum-exp, and the analytic backward.

One module that imports no other attention module, so the forward spec (attention.py), the
backward spec (attention_backward.py) and the jax backend's differentiable XLA function
(attention_xla.py) share one formula without importing each other in a cycle.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def keep_matrix(xp: Any, sq: int, sk: int, causal: bool, mask: Any,
                window: tuple[int, int | None] | None = None, q_offset: Any = 0) -> Any:
    """Which keys each query attends (None: all), broadcastable to (..., Sq, Sk).

    Positions: key j sits at j, query i at ``q_offset + i`` (0: top-left aligned, as causal
    and window are in ``attention``; paged decode passes seq_len - Sq per sequence, an array
    broadcastable to (B, 1, 1, 1), for bottom-right alignment). ``causal``: key position <=
    query position. ``window`` (left, right): query position - left <= key position and,
    when right is not None, key position <= query position + right."""
    keep = None
    if causal or window is not None:
        qpos = xp.arange(sq)[:, None] + q_offset
        kpos = xp.arange(sk)[None, :]
        if causal:
            keep = qpos >= kpos
        if window is not None:  # an int is a left edge alone, as pk.attention takes it
            left, right = (window, None) if isinstance(window, (int, np.integer)) else window
            # No two positions lie further apart than sq + sk (a paged offset is at most the
            # capacity, sk), so a wider edge means the same, and clamping it keeps i + right
            # in int32 under jax: window=(1, 2**31 - 1) as "no right edge" overflowed to a
            # negative edge there and dropped every key.
            near = kpos >= qpos - min(int(left), sq + sk)
            if right is not None:
                near = xp.logical_and(near, kpos <= qpos + min(int(right), sq + sk))
            keep = near if keep is None else xp.logical_and(keep, near)
    if mask is not None:
        keep = mask if keep is None else xp.logical_and(keep, mask)
    return keep


def alibi_distance(xp: Any, sq: int, sk: int, q_offset: Any = 0) -> Any:
    """|query position - key position|, (Sq, Sk) (or broadcast with an array ``q_offset``),
    in the positions of ``keep_matrix``: ALiBi adds -slope * this to each score."""
    qpos = xp.arange(sq)[:, None] + q_offset
    return xp.abs(qpos - xp.arange(sk)[None, :])


def modify_scores(xp: Any, s: Any, bias: Any = None, alibi_slopes: Any = None,
                  softcap: float | None = None, q_offset: Any = 0) -> Any:
    """The score modifiers, in the order every implementation applies them to the scaled
    score s = (scale q) . k, (B, Hq, Sq, Sk), before any masking:

    1. ``bias`` (broadcastable to (B, Hq, Sq, Sk)): s + bias;
    2. ``alibi_slopes`` (Hq,): s - slope_h * |i - j| (positions as ``keep_matrix``);
    3. ``softcap`` c: c * tanh(s / c), which maps every score, -inf and +inf included,
       into [-c, c] (NaN stays NaN): a -inf bias is not a mask under a softcap.

    Both additive terms come before the cap (FlashAttention-2 caps before adding ALiBi; here
    one rule holds for both kinds of bias, as jax.nn.dot_product_attention's bias)."""
    if bias is not None:
        s = s + bias
    if alibi_slopes is not None:
        dist = alibi_distance(xp, s.shape[-2], s.shape[-1], q_offset).astype(s.dtype)
        s = s - xp.reshape(alibi_slopes, (1, -1, 1, 1)).astype(s.dtype) * dist
    if softcap is not None:
        s = capped(xp, s, softcap)
    return s


def capped(xp: Any, s: Any, c: float) -> Any:
    """c tanh(s / c), and s itself where s / c is 0 while s is not: there c tanh(s / c) is s
    to well under an ulp, but XLA on a CPU flushes the subnormal s / c of a cap near the
    type's max (c = 3e38, s ~ 1) to 0, which made every such score 0."""
    u = s / c
    return xp.where(u == 0, s, c * xp.tanh(u))


def probabilities(xp: Any, q: Any, k: Any, lse: Any, mask: Any, causal: bool, scale: float,
                  window: tuple[int, int | None] | None = None) -> tuple[Any, Any]:
    """(P, s) with k repeated to the query heads: P = exp(s - lse) where attended, else 0."""
    s = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    keep = keep_matrix(xp, q.shape[2], k.shape[2], causal, mask, window)
    alive = lse != -xp.inf
    lse_safe = xp.where(alive, lse, xp.zeros_like(lse))[..., None]
    ok = alive[..., None] if keep is None else xp.logical_and(keep, alive[..., None])
    p = xp.where(ok, xp.exp(xp.where(ok, s, lse_safe) - lse_safe), xp.zeros_like(s))
    return p, s


def analytic(xp: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, mask: Any = None,
             causal: bool = False, scale: float | None = None, dlse: Any = None,
             window: tuple[int, int | None] | None = None) -> tuple[Any, Any, Any]:
    """The analytic backward (module docstring), the one formula behind the float64 oracle,
    the jax backend's XLA gradient (ops/attention_xla.py) and, through them, every test.

    ``dlse``: the cotangent of the forward's lse (B, Hq, Sq) when the caller differentiates
    it too (d lse_i / d s_ij = P_ij, so dS = P * (dP - delta + dlse))."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[-1])) if q.shape[-1] else 1.0
    kr = xp.repeat(k, g, axis=1) if g > 1 else k
    vr = xp.repeat(v, g, axis=1) if g > 1 else v
    p, s = probabilities(xp, q, kr, lse, mask, causal, scale, window)
    delta = xp.sum(do * o, axis=-1)[..., None]
    if dlse is not None:
        delta = delta - dlse[..., None]
    dv = xp.matmul(xp.swapaxes(p, -1, -2), do)
    dp = xp.matmul(do, xp.swapaxes(vr, -1, -2))
    ds = p * (dp - delta)
    dq = xp.matmul(ds, kr) * scale
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), q) * scale
    if g > 1:  # the group's sum: (B, Hkv, g, Sk, D) summed over g
        b, sk = k.shape[0], k.shape[2]
        dk = xp.sum(xp.reshape(dk, (b, hkv, g, sk, k.shape[3])), axis=2)
        dv = xp.sum(xp.reshape(dv, (b, hkv, g, sk, v.shape[3])), axis=2)
    return dq, dk, dv
