"""The jax backend's XLA attention (``backend="jax"``): the semantics, differentiated by the
analytic backward rather than by autodiff of the unfused chain.

``jax.grad`` through the plain lowered semantics would differentiate every step of the
unfused forward (the max, the exp, the division, the where's) and keep their Sq x Sk
intermediates as residuals. Here the forward is the same semantics, asked for its log-sum-
exp too, under a ``jax.custom_vjp`` whose residuals are (q, k, v, mask, bias, alibi_slopes,
out, lse) and whose backward is ``attention_math.analytic`` (attention_backward's semantics):
P recomputed from lse, dS = P (dP - delta), the formula the float64 oracle and the C kernels
use. The boolean mask gets no cotangent, and ``scale`` a zero one: it is a traced argument
only so that one compiled function serves every scale (``pk.attention`` takes it as a
concrete number and refuses a tracer, so no caller can differentiate it; a zero also stays
unvarying under ``shard_map``, where a sum over the shard's rows would not). ``softcap`` is
traced and refused as a tracer the same way, and gets a zero cotangent too.

Score modifiers (:func:`analytic_modified`) stay in the same rule, so ``jax.grad`` keeps no
Sq x Sk residual with them either: P is recomputed from the *modified* score s' (bias, then
ALiBi, then the soft cap, as ``attention_math.modify_scores``), dS = P (dP - delta) is the
cotangent of s', the cap's derivative turns it into the pre-cap one
(d c tanh(x / c) / dx = 1 - (s'/c)^2), and that dS_pre is the true cotangent of the bias
(summed over the dims it broadcasts over) and, times -|i - j| summed over batch and
positions, of the ALiBi slopes. A window is a mask. Which of these a call has is read from
its arguments at trace time, never from the problem it was first built for: the backend
caches this function by parameters (not shapes), so a function built without a bias may
serve a call with one.

Nothing here imports jax at module import time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import dtypes
from ..core.spec import Problem
from . import attention_math


def analytic_modified(xp: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any,
                      mask: Any = None, bias: Any = None, slopes: Any = None,
                      causal: bool = False, scale: float | None = None, dlse: Any = None,
                      window: tuple[int, int | None] | None = None, softcap: Any = None
                      ) -> tuple[Any, Any, Any, Any, Any]:
    """``attention_math.analytic`` with the score modifiers: (dq, dk, dv, dbias, dslopes) in
    the compute type; dbias has the bias's shape, dslopes (Hq,); None where the operand is.

    Why here and not in attention_math: the float64 oracle of ``attention_backward`` knows no
    modifiers yet, and this rule is checked against float64 autodiff of the semantics
    (tests/ops/test_attention_mods_jax.py), an oracle independent of it."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[-1])) if q.shape[-1] else 1.0
    kr = xp.repeat(k, g, axis=1) if g > 1 else k
    vr = xp.repeat(v, g, axis=1) if g > 1 else v
    s = xp.matmul(q * scale, xp.swapaxes(kr, -1, -2))
    s = attention_math.modify_scores(xp, s, bias, slopes, softcap)
    keep = attention_math.keep_matrix(xp, q.shape[2], k.shape[2], causal, mask, window)
    alive = lse != -xp.inf
    lse_safe = xp.where(alive, lse, xp.zeros_like(lse))[..., None]
    ok = alive[..., None] if keep is None else xp.logical_and(keep, alive[..., None])
    ok = xp.broadcast_to(ok, s.shape)
    p = xp.where(ok, xp.exp(xp.where(ok, s, lse_safe) - lse_safe), xp.zeros_like(s))
    delta = xp.sum(do * o, axis=-1)[..., None]
    if dlse is not None:
        delta = delta - dlse[..., None]
    dv = xp.matmul(xp.swapaxes(p, -1, -2), do)
    ds = p * (xp.matmul(do, xp.swapaxes(vr, -1, -2)) - delta)
    if softcap is not None:  # only where attended: elsewhere s' may be NaN (q or k NaN)
        t = xp.where(ok, s, xp.zeros_like(s)) / softcap
        ds = ds * (1 - t * t)
    dq = xp.matmul(ds, kr) * scale
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), q) * scale
    if g > 1:  # the group's sum: (B, Hkv, g, Sk, D) summed over g
        b, sk = k.shape[0], k.shape[2]
        dk = xp.sum(xp.reshape(dk, (b, hkv, g, sk, k.shape[3])), axis=2)
        dv = xp.sum(xp.reshape(dv, (b, hkv, g, sk, v.shape[3])), axis=2)
    dbias = dslopes = None
    if bias is not None:  # the sum over the dims bias broadcasts over (leading ones too)
        shape4 = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        axes = tuple(a for a in range(4) if shape4[a] == 1 and ds.shape[a] != 1)
        dbias = xp.reshape(xp.sum(ds, axis=axes, keepdims=True) if axes else ds, bias.shape)
    if slopes is not None:
        dist = attention_math.alibi_distance(xp, q.shape[2], k.shape[2]).astype(ds.dtype)
        dslopes = -xp.sum(ds * dist, axis=(0, 2, 3))
    return dq, dk, dv, dbias, dslopes


def build(problem: Problem, traced: tuple[str, ...], *, semantics: Any) -> Any:
    """``fn(q, k, v, mask, bias, alibi_slopes, *traced values)``: out (or (out, lse) with
    return_lse) in the storage dtype (lse in the compute type), differentiable by the analytic
    backward, modifiers included (module docstring). ``semantics``: attention's
    (attention.xla_build passes it)."""
    import jax
    import jax.numpy as jnp

    info = dtypes.info(problem.dtype)
    compute, storage = np.dtype(info.compute), np.dtype(info.storage)
    params = dict(problem.params)
    want_lse = bool(params.pop("return_lse", False))
    static = {k: v for k, v in params.items() if k not in traced}

    def named(values: tuple[Any, ...]) -> dict[str, Any]:
        kw = dict(static)
        kw.update(zip(traced, values))
        return kw

    def widen(x: Any) -> Any:
        return None if x is None else x.astype(compute)

    def forward(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, *values: Any
                ) -> tuple[Any, Any]:
        out, lse = semantics(jnp, widen(q), widen(k), widen(v),
                             None if mask is None else mask.astype(bool), widen(bias),
                             widen(slopes), return_lse=True, **named(values))
        return out.astype(storage), lse.astype(compute)

    @jax.custom_vjp
    def fused(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, *values: Any
              ) -> tuple[Any, Any]:
        return forward(q, k, v, mask, bias, slopes, *values)

    def fused_fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, *values: Any
                  ) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
        out, lse = forward(q, k, v, mask, bias, slopes, *values)
        return (out, lse), (q, k, v, mask, bias, slopes, out, lse, values)

    def fused_bwd(res: tuple[Any, ...], g: tuple[Any, Any]) -> tuple[Any, ...]:
        q, k, v, mask, bias, slopes, out, lse, values = res
        g_out, g_lse = g
        kw = named(values)
        m = None if mask is None else mask.astype(bool)
        dbias = dslopes = None
        if bias is None and slopes is None and kw.get("softcap") is None:
            dq, dk, dv = attention_math.analytic(
                jnp, widen(g_out), widen(q), widen(k), widen(v), widen(out), lse, m,
                kw["causal"], kw["scale"], dlse=widen(g_lse), window=kw.get("window"))
        else:
            dq, dk, dv, dbias, dslopes = analytic_modified(
                jnp, widen(g_out), widen(q), widen(k), widen(v), widen(out), lse, m,
                widen(bias), widen(slopes), kw["causal"], kw["scale"], dlse=widen(g_lse),
                window=kw.get("window"), softcap=kw.get("softcap"))
            dbias = None if bias is None else dbias.astype(bias.dtype)
            dslopes = None if slopes is None else dslopes.astype(slopes.dtype)
        d_values = tuple(jnp.zeros_like(x) for x in values)  # see the module docstring
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias,
                dslopes, *d_values)

    fused.defvjp(fused_fwd, fused_bwd)

    def fn(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, *values: Any) -> Any:
        out, lse = fused(q, k, v, mask, bias, slopes, *values)
        return (out, lse) if want_lse else out

    return fn
