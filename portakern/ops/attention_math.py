"""Attention's shared arithmetic, in any array namespace ``xp`` (numpy, jax.numpy): which keys
a row attends, the probabilities recomputed from a log-sum-exp, and the analytic backward.

One module that imports no other attention module, so the forward spec (attention.py), the
backward spec (attention_backward.py) and the jax backend's differentiable XLA function
(attention_xla.py) share one formula without importing each other in a cycle.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def keep_matrix(xp: Any, sq: int, sk: int, causal: bool, mask: Any) -> Any:
    keep = None
    if causal:
        keep = xp.arange(sq)[:, None] >= xp.arange(sk)[None, :]
    if mask is not None:
        keep = mask if keep is None else xp.logical_and(keep, mask)
    return keep


def probabilities(xp: Any, q: Any, k: Any, lse: Any, mask: Any, causal: bool, scale: float
                   ) -> tuple[Any, Any]:
    """(P, s) with k repeated to the query heads: P = exp(s - lse) where attended, else 0."""
    s = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    keep = keep_matrix(xp, q.shape[2], k.shape[2], causal, mask)
    alive = lse != -xp.inf
    lse_safe = xp.where(alive, lse, xp.zeros_like(lse))[..., None]
    ok = alive[..., None] if keep is None else xp.logical_and(keep, alive[..., None])
    p = xp.where(ok, xp.exp(xp.where(ok, s, lse_safe) - lse_safe), xp.zeros_like(s))
    return p, s


def analytic(xp: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, mask: Any = None,
             causal: bool = False, scale: float | None = None, dlse: Any = None
             ) -> tuple[Any, Any, Any]:
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
    p, s = probabilities(xp, q, kr, lse, mask, causal, scale)
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
