"""The jax backend's XLA attention (``backend="jax"``): the semantics, differentiated by the
analytic backward rather than by autodiff of the unfused chain.

``jax.grad`` through the plain lowered semantics would differentiate every step of the
unfused forward (the max, the exp, the division, the where's) and keep their Sq x Sk
intermediates as residuals. Here the forward is the same semantics, asked for its log-sum-
exp too, under a ``jax.custom_vjp`` whose residuals are (q, k, v, mask, out, lse) and whose
backward is ``attention_math.analytic`` (attention_backward's semantics): P recomputed from
lse, dS = P (dP - delta), the formula the float64 oracle and the C kernels use. The boolean
mask gets no cotangent, and ``scale`` a zero one: it is a traced argument only so that one
compiled function serves every scale (``pk.attention`` takes it as a concrete number and
refuses a tracer, so no caller can differentiate it; a zero also stays unvarying under
``shard_map``, where a sum over the shard's rows would not).

With a score modifier (bias, ALiBi slopes, softcap) the function is the lowered semantics
itself, differentiated by jax's autodiff: the analytic rule knows causal, window and mask,
not the modifiers' derivatives (the cap's sech^2, the bias's own cotangent). A window alone
keeps the analytic rule (it is a mask).

Nothing here imports jax at module import time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import dtypes
from ..core.spec import Problem


def build(problem: Problem, traced: tuple[str, ...], *, semantics: Any) -> Any:
    """``fn(q, k, v, mask, bias, alibi_slopes, *traced values)``: out (or (out, lse) with
    return_lse) in the storage dtype (lse in the compute type), differentiable by the analytic
    backward (autodiff with a score modifier). ``semantics``: attention's (attention.xla_build
    passes it)."""
    import jax
    import jax.numpy as jnp

    from . import attention_math

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

    def forward(q: Any, k: Any, v: Any, mask: Any, *values: Any, bias: Any = None,
                slopes: Any = None) -> tuple[Any, Any]:
        out, lse = semantics(jnp, widen(q), widen(k), widen(v),
                             None if mask is None else mask.astype(bool), widen(bias),
                             widen(slopes), return_lse=True, **named(values))
        return out.astype(storage), lse.astype(compute)

    if problem.shapes.get("bias") is not None or problem.shapes.get("alibi_slopes") is not None \
            or params.get("softcap") is not None:
        def modified(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any,
                     *values: Any) -> Any:
            out, lse = forward(q, k, v, mask, *values, bias=bias, slopes=slopes)
            return (out, lse) if want_lse else out

        return modified

    @jax.custom_vjp
    def fused(q: Any, k: Any, v: Any, mask: Any, *values: Any) -> tuple[Any, Any]:
        return forward(q, k, v, mask, *values)

    def fused_fwd(q: Any, k: Any, v: Any, mask: Any, *values: Any
                  ) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
        out, lse = forward(q, k, v, mask, *values)
        return (out, lse), (q, k, v, mask, out, lse, values)

    def fused_bwd(res: tuple[Any, ...], g: tuple[Any, Any]) -> tuple[Any, ...]:
        q, k, v, mask, out, lse, values = res
        g_out, g_lse = g
        kw = named(values)
        dq, dk, dv = attention_math.analytic(
            jnp, widen(g_out), widen(q), widen(k), widen(v), widen(out), lse,
            None if mask is None else mask.astype(bool), kw["causal"], kw["scale"],
            dlse=widen(g_lse), window=kw.get("window"))
        d_values = tuple(jnp.zeros_like(x) for x in values)  # see the module docstring
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, *d_values)

    fused.defvjp(fused_fwd, fused_bwd)

    def fn(q: Any, k: Any, v: Any, mask: Any, _bias: Any, _slopes: Any, *values: Any) -> Any:
        out, lse = fused(q, k, v, mask, *values)
        return (out, lse) if want_lse else out

    return fn
