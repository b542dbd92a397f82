"""Pallas fused attention: the JAX backend's "jax:pallas" path for ``attention``.

One kernel instance per (batch*head, query block). It keeps its query tile, the running row
max ``m``, the running denominator ``l`` and the output accumulator in fast memory and walks the
key/value blocks of its kv head with an online softmax, so the Sq x Sk score matrix is never
written to main memory (the point of fusion). Causal key blocks above the diagonal are not
visited. The scale is folded into q before the dot, and non-finite inputs follow
``attention.semantics`` (NaN in q, k or an attended v row, or a +inf score, make a row NaN;
a -inf score drops a key; a row with no key to attend is 0 whatever v holds). Boolean masks
(broadcastable to (B, Hq, Sq, Sk)) are read tile by tile; grouped-query
attention maps query head h to kv head h // (Hq // Hkv) in the index map, so K and V are never
repeated in memory.

Score modifiers (issue 29; ``attention_math.modify_scores``): a ``bias`` broadcastable to
(B, Hq, Sq, Sk) is read tile by tile like the mask (its (Sq, Sk) plane materialised and
zero-padded, broadcast batch/head dims not), ``alibi_slopes`` (Hq,) as one small row, and
``softcap``; each tile's score becomes c tanh((s + bias - slope |i - j|) / c) before the
mask (``_masked_scores``). A ``window`` (left, right) is a mask on positions, and it also
bounds the key blocks a query block walks (``_key_blocks``) and the query blocks a key block
walks in the backward (``_query_blocks``), so a sliding window costs O(Sq (left + right))
rather than O(Sq Sk). The backward multiplies dS by the cap's derivative 1 - (s'/c)^2. The
bias's cotangent is dS itself (with respect to the pre-cap score), summed over the dims the
bias broadcasts over, and the slopes' is -sum dS |i - j| over batch and positions: a fourth
Pallas call ("portakern_attention_bwd_dmods") writes the (B, Hq, Sq, Sk) dS tiles and each
row's slope sum, then XLA sums them down. That is the one Sq x Sk array of the backward, as
in FlashAttention's Triton bias gradient; it is a call of its own so that under ``jit`` XLA
drops it when neither cotangent is used (a bias that is not differentiated).

Arbitrary shapes: Sq and Sk are padded to block multiples (padded keys are masked out, padded
query rows are sliced away) and the head dims D and Dv are zero-padded to the platform's
alignment (zeros change no dot product), so D = 40, 59, 80, 111 work everywhere.

Numerics: every tile is widened to the compute dtype (float32 for float16/bfloat16/float32,
float64 for float64) before any arithmetic, dots use precision=HIGHEST with
preferred_element_type = compute dtype, and masked scores are -inf with a guarded max, so a
row with no key to attend gives 0, never NaN. That is what lets the kernel meet
``attention.SPEC.tolerance`` just like the C kernels.

Log-sum-exp: the forward also writes each row's lse = m + log l (natural log, scale included:
log sum_j exp(s_ij) over the keys the row attends), float32 (float64 for float64 inputs), -inf
for a dead row, NaN where the output row is NaN. ``build`` returns ``(out, lse)`` when the
problem's ``return_lse`` parameter is set (missing: False).

Gradients: the kernel is wrapped in ``jax.custom_vjp`` with residuals (q, k, v, mask, bias,
slopes, out, lse) (lse is computed even when not returned) and a fused FlashAttention-2
backward in three Pallas kernels: ``delta_i = dO_i . O_i - g_lse_i`` (one instance per
(batch*head, query block)); dK and dV (one per (batch*kv head, key block), looping over the
query blocks and over the Hq/Hkv query heads of its group, so GQA's sum happens in the
kernel and K/V are never repeated); dQ (one per (batch*head, query block), looping over the
key blocks). Each recomputes P = exp(s' - lse) on the attended keys (0 elsewhere and on a
dead row), then dV = P^T dO, dP = dO V^T, dS = P (dP - delta) (times the cap's derivative),
dQ = scale dS K, dK = dS^T (scale q); blocks wholly masked by causal or the window are
skipped. No atomics: every output block has one writer, so the result is deterministic.
Accumulation is in the compute dtype; gradients come back in the inputs' dtypes, the
boolean mask gets no cotangent, and fully masked rows give zero gradients. Without a bias
cotangent the Sq x Sk matrices are never written to memory. Inputs with explicit shardings
run the backward per shard too (the bias's partial cotangents psum-ed over the split mesh
axes it broadcasts over, the slopes' over the batch axis). Only finite inputs are held to
the float64 gradient (rows that are NaN in the forward may give NaN gradients).
tests/ops/test_attention_pallas_grad.py derives the error bounds;
tests/ops/test_attention_mods_jax.py checks the modifiers.

Nothing here imports jax at module import time: ``import portakern`` must stay jax-free, and
``attention.SPEC.pallas`` points at :func:`build`, which imports jax when first called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ..core.errors import InvalidArgumentError
from ..core.spec import Problem, Tunable
from . import attention_math

# Block sizes are tunables with platform defaults. Interpret mode on a CPU pays per grid step,
# so larger blocks are faster there; GPUs (Triton) want powers of two; TPUs want multiples of
# (8, 128) in the last two block dims.
TUNABLES = (
    Tunable("block_q", (8, 16, 32, 64, 128, 256, 512), "query rows per kernel instance"),
    Tunable("block_k", (8, 16, 32, 64, 128, 256, 512), "keys per online-softmax step"),
)
DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"block_q": 64, "block_k": 64},
    "gpu": {"block_q": 64, "block_k": 64},
    "tpu": {"block_q": 128, "block_k": 128},
}
# zero-padding of the head dims D and Dv per platform (lane alignment / power-of-two blocks)
_HEAD_ALIGN = {"cpu": 8, "gpu": 16, "tpu": 128}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit_block(block: int, n: int, platform: str) -> int:
    """Shrink a block to the problem so short sequences are not padded to a full block."""
    if platform == "gpu":  # Triton block shapes are powers of two, dots need >= 16
        return max(16, min(block, _next_pow2(n)))
    return max(8, min(block, _round_up(n, 8)))


def _pad_head(d: int, platform: str) -> int:
    align = _HEAD_ALIGN.get(platform, 8)
    if platform == "gpu":
        return max(align, _next_pow2(max(d, 1)))
    return max(align, _round_up(d, align))


def block_config(platform: str, overrides: dict[str, int] | None = None) -> dict[str, int]:
    """The platform's default block sizes with validated overrides (InvalidArgumentError)."""
    cfg = dict(DEFAULTS.get(platform, DEFAULTS["gpu"]))
    known = {t.name: t for t in TUNABLES}
    for name, value in (overrides or {}).items():
        if name not in known:
            raise InvalidArgumentError(
                f"attention (Pallas): unknown tunable {name!r}; the Pallas kernel declares "
                f"{sorted(known)} (BQ/BK of the C kernel map to block_q/block_k).")
        cfg[name] = known[name].check(value, "attention (Pallas)")
    return cfg


class _Mods(NamedTuple):
    """The score modifiers of one call, static in every kernel (module docstring).

    ``window`` (left, right) is clamped at trace time to the padded extents, so the int32
    positions never overflow; ``bias`` and ``slopes`` say whether those operands are read,
    ``bias_heads`` whether the bias has its own head dim (else one tile serves every head),
    ``hq`` picks a head's slope."""

    window: tuple[int, int | None] | None = None
    softcap: float | None = None
    bias: bool = False
    bias_heads: bool = False
    slopes: bool = False
    hq: int = 1


_PLAIN = _Mods()


def _unpack(refs: tuple[Any, ...], fixed: int, *flags: bool) -> tuple[Any, ...]:
    """(the ``fixed`` leading refs..., one ref or None per optional input flag..., the
    remaining (output) refs as a tuple)."""
    it = iter(refs)
    head = [next(it) for _ in range(fixed)]
    opt = [next(it) if f else None for f in flags]
    return (*head, *opt, tuple(it))


def _slope(sl_ref: Any, h: Any, acc_dtype: Any) -> Any:
    """Head h's ALiBi slope, (1, 1), from the whole (1, Hp) slopes row: a one-hot sum, so
    no dynamic lane index (which the TPU and GPU lowerings take less kindly)."""
    import jax.numpy as jnp
    from jax import lax

    row = sl_ref[...].astype(acc_dtype)
    hit = lax.broadcasted_iota(jnp.int32, row.shape, 1) == h
    return jnp.sum(jnp.where(hit, row, jnp.zeros_like(row)), axis=1, keepdims=True)


def _modify(s: Any, qidx: Any, kidx: Any, bias: Any, slope: Any, softcap: float | None
            ) -> Any:
    """attention_math.modify_scores on one tile: + bias, - slope |i - j|, c tanh(s / c)."""
    import jax.numpy as jnp

    if bias is not None:
        s = s + bias
    if slope is not None:
        s = s - slope * jnp.abs(qidx - kidx).astype(s.dtype)
    if softcap is not None:
        s = attention_math.capped(jnp, s, softcap)
    return s


def _masked_scores(s: Any, keep: Any, qidx: Any, kidx: Any, bias: Any, slope: Any,
                   softcap: float | None) -> Any:
    """The modifiers, then the mask (-inf), in the order of attention.semantics: a cap
    applied after masking would map a masked key's -inf to -c, a weight."""
    import jax.numpy as jnp

    s = _modify(s, qidx, kidx, bias, slope, softcap)
    return jnp.where(keep, s, jnp.full_like(s, -jnp.inf))


def _keep_positions(keep: Any, qidx: Any, kidx: Any, causal: bool,
                    window: tuple[int, int | None] | None) -> Any:
    """keep, narrowed by causal (j <= i) and the window (i - left <= j <= i + right)."""
    import jax.numpy as jnp

    if causal:
        keep = jnp.logical_and(keep, kidx <= qidx)
    if window is not None:
        left, right = window
        keep = jnp.logical_and(keep, kidx >= qidx - left)
        if right is not None:
            keep = jnp.logical_and(keep, kidx <= qidx + right)
    return keep


def _cap_grad(ds: Any, s: Any, softcap: float | None) -> Any:
    """dS with respect to the uncapped score: d(c tanh(x / c))/dx = 1 - (s'/c)^2, s' the
    capped score the probabilities were recomputed from."""
    if softcap is None:
        return ds
    t = s / softcap
    return ds * (1 - t * t)


def _key_blocks(qi: Any, block_q: int, block_k: int, nk: int, causal: bool,
                window: tuple[int, int | None] | None, dynamic_loop: bool
                ) -> tuple[Any, Any]:
    """[lo, hi): the key blocks query block qi can attend. Causal and a window's right edge
    bound hi by the block's last query; a window's left edge bounds lo by its first query.
    Blocks outside hold only masked keys, so skipping them changes no sum."""
    import jax.numpy as jnp

    hi = _causal_upper(qi, block_q, block_k, nk) if causal else _trip(qi, nk, dynamic_loop)
    lo: Any = 0
    if window is not None:
        left, right = window
        lo = jnp.maximum((qi * block_q - left) // block_k, 0)
        if right is not None:
            hi = jnp.minimum(hi, (qi * block_q + block_q - 1 + right) // block_k + 1)
    return lo, hi


def _query_blocks(kj: Any, block_q: int, block_k: int, nq: int, causal: bool,
                  window: tuple[int, int | None] | None, dynamic_loop: bool
                  ) -> tuple[Any, Any]:
    """[lo, hi): the query blocks that can attend key block kj (the transpose of
    ``_key_blocks``): causal and a window's right edge bound lo, its left edge bounds hi."""
    import jax.numpy as jnp

    kstart = kj * block_k
    lo: Any = jnp.minimum(kstart // block_q, nq) if causal else 0
    hi = _trip(kj, nq, dynamic_loop)
    if window is not None:
        left, right = window
        hi = jnp.minimum(hi, (kstart + block_k - 1 + left) // block_q + 1)
        if right is not None:
            lo = jnp.maximum(lo, jnp.maximum((kstart - right) // block_q, 0))
    return lo, hi


def _causal_upper(qi: Any, block_q: int, block_k: int, nk: int) -> Any:
    """Key blocks a causal query block visits: the last query of block qi sees keys
    < (qi + 1) * block_q (top-left aligned)."""
    import jax.numpy as jnp

    return jnp.minimum(nk, ((qi + 1) * block_q + block_k - 1) // block_k)


def _trip(pid: Any, n: int, dynamic_loop: bool) -> Any:
    """A loop bound ``n``; traced when ``dynamic_loop``: the interpreter then keeps a while
    loop, as its scan form (static bounds) mis-types shard_map's varying axes in the carry
    (jax 0.10)."""
    import jax.numpy as jnp

    return jnp.maximum(pid * 0 + n, 0) if dynamic_loop else n


def _kernel(*refs: Any, has_mask: bool, mods: _Mods, causal: bool, scale: float,
            block_q: int, block_k: int, sk: int, nk: int, acc_dtype: Any,
            dynamic_loop: bool) -> None:
    """One (batch*head, query block) instance: online softmax over the key blocks; writes the
    output tile and the rows' log-sum-exp."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    q_ref, k_ref, v_ref, m_ref, b_ref, sl_ref, (o_ref, lse_ref) = _unpack(
        refs, 3, has_mask, mods.bias, mods.slopes)
    qi = pl.program_id(1)
    head = pl.program_id(0) % mods.hq  # at the top: no program_id inside a loop body
    hi = lax.Precision.HIGHEST
    # the scale folded into q, as every implementation does (attention.semantics); inside the
    # loop body: at the kernel's top level, jax 0.10's interpreter under shard_map refuses a
    # product of the varying q block with the constant scale ("varying manual axes")
    dvp = o_ref.shape[-1]
    neg_inf = jnp.array(-jnp.inf, acc_dtype)

    def step(j: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        m_prev, l_prev, acc_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :].astype(acc_dtype)
        vb = v_ref[pl.ds(start, block_k), :].astype(acc_dtype)
        q = q_ref[...].astype(acc_dtype) * scale  # (block_q, Dp)
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=hi,
                            preferred_element_type=acc_dtype)
        # a key whose v row holds NaN/inf scores NaN (rows that attend it are NaN); its v
        # enters p.v zeroed, so rows that do not attend it (weight 0) stay clean
        finite_v = jnp.isfinite(vb)
        s = jnp.where(jnp.all(finite_v, axis=1)[None, :], s, jnp.nan)
        vb = jnp.where(finite_v, vb, jnp.zeros_like(vb))
        kidx = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        qidx = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        keep = _keep_positions(kidx < sk, qidx, kidx, causal, mods.window)  # padded keys out
        if m_ref is not None:
            keep = jnp.logical_and(keep, m_ref[:, pl.ds(start, block_k)] != 0)
        bias = None if b_ref is None else b_ref[:, pl.ds(start, block_k)].astype(acc_dtype)
        slope = None if sl_ref is None else _slope(sl_ref, head, acc_dtype)
        s = _masked_scores(s, keep, qidx, kidx, bias, slope, mods.softcap)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # a row with nothing kept so far has m = -inf: shift by 0 instead (exp(-inf) = 0)
        m_safe = jnp.where(m_new == neg_inf, jnp.zeros_like(m_new), m_new)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p, vb, (((1,), (0,)), ((), ())), precision=hi,
                             preferred_element_type=acc_dtype)
        return m_new, l_new, alpha * acc_prev + pv

    init = (jnp.full((block_q, 1), -jnp.inf, acc_dtype), jnp.zeros((block_q, 1), acc_dtype),
            jnp.zeros((block_q, dvp), acc_dtype))
    lo, upper = _key_blocks(qi, block_q, block_k, nk, causal, mods.window, dynamic_loop)
    m_fin, l_fin, acc = lax.fori_loop(lo, upper, step, init)
    # Dead (no key attended, every score -inf): l is exactly 0 and acc is 0. A NaN score makes
    # l NaN, even where the max reduction skips NaN (XLA:CPU's does), and NaN is alive: the
    # test is l == 0, never "l > 0" (which took NaN rows for empty ones and wrote zeros).
    dead = l_fin == 0
    out = acc / jnp.where(dead, jnp.ones_like(l_fin), l_fin)
    o_ref[...] = out.astype(o_ref.dtype)
    # l is relative to the last shift (m, or 0 for a row that kept nothing): lse = m + log l,
    # -inf for a dead row (log 0), NaN wherever l is NaN (the row's output is NaN too)
    shift = jnp.where(m_fin == -jnp.inf, jnp.zeros_like(m_fin), m_fin)
    lse = jnp.where(dead, jnp.full_like(l_fin, -jnp.inf),
                    shift + jnp.log(jnp.where(dead, jnp.ones_like(l_fin), l_fin)))
    lse_ref[...] = lse[:, 0].astype(lse_ref.dtype)


def _delta_kernel(*refs: Any, has_glse: bool, acc_dtype: Any, dynamic_loop: bool) -> None:
    """Backward preprocess, one (batch*head, query block) instance: delta_i = dO_i . O_i, less
    the log-sum-exp's cotangent (dS = P (dP - delta + g_lse) = P (dP - delta'))."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    if has_glse:
        o_ref, do_ref, g_ref, d_ref = refs
    else:
        o_ref, do_ref, d_ref = refs
        g_ref = None

    def once(_: Any, d: Any) -> Any:
        d = d + jnp.sum(o_ref[...].astype(acc_dtype) * do_ref[...].astype(acc_dtype), axis=1)
        if g_ref is not None:
            d = d - g_ref[...].astype(acc_dtype)
        return d

    # a one-trip loop, traced under interpret: the interpreter's grid loop wants the output
    # typed as its (unvarying) initial value under shard_map, and a while loop's result is
    # typed by its carry; straight-line code would carry the inputs' varying axes (jax 0.10)
    d = lax.fori_loop(0, _trip(pl.program_id(1), 1, dynamic_loop), once,
                      jnp.zeros(d_ref.shape, acc_dtype))
    d_ref[...] = d.astype(d_ref.dtype)


def _probs(qs: Any, kb: Any, lse: Any, keep: Any, acc_dtype: Any,
           modify: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
    """(P, s'): P = exp(s' - lse) on the kept keys, 0 elsewhere and on a dead row (lse =
    -inf); s' the score after ``modify`` (the forward's modifiers), which the soft cap's
    derivative needs."""
    import jax.numpy as jnp
    from jax import lax

    s = lax.dot_general(qs, kb, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=acc_dtype)
    if modify is not None:
        s = modify(s)
    # a dead row's lse is -inf: shift by +inf instead, so every exp is exactly 0 (never the
    # NaN of -inf - -inf)
    lse = jnp.where(lse == -jnp.inf, jnp.full_like(lse, jnp.inf), lse)
    return jnp.where(keep, jnp.exp(s - lse[:, None]), jnp.zeros_like(s)), s


def _finite_v(vb: Any) -> Any:
    """v with its non-finite entries zeroed, as it enters p.v (attention.semantics)."""
    import jax.numpy as jnp

    return jnp.where(jnp.isfinite(vb), vb, jnp.zeros_like(vb))


def _dkdv_kernel(*refs: Any, has_mask: bool, mask_heads: bool, mods: _Mods, causal: bool,
                 scale: float, block_q: int, block_k: int, sq: int, sk: int, nq: int,
                 group: int, hkv: int, acc_dtype: Any, dynamic_loop: bool) -> None:
    """One (batch*kv head, key block) instance: dK and dV of its keys, summed over the query
    blocks and over the group's Hq/Hkv query heads (GQA's sum stays in the kernel)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    (q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, m_ref, b_ref, sl_ref,
     (dk_ref, dv_ref)) = _unpack(refs, 6, has_mask, mods.bias, mods.slopes)
    kj = pl.program_id(1)
    kv_head = pl.program_id(0) % hkv  # at the top: no program_id inside a loop body
    hi = lax.Precision.HIGHEST
    dims_tn = (((0,), (0,)), ((), ()))  # A^T . B over the query rows
    dims_nt = (((1,), (1,)), ((), ()))  # A . B^T over the head dim
    dp, dvp = dk_ref.shape[-1], dv_ref.shape[-1]
    kstart = kj * block_k
    # query blocks that attend none of this block's keys (causal, window) are skipped;
    # padded keys and padded query rows never count
    lo, upper = _query_blocks(kj, block_q, block_k, nq, causal, mods.window, dynamic_loop)

    def head(g: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        def step(i: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            dk, dv = carry
            start = pl.multiple_of(i * block_q, block_q)
            kb = k_ref[...].astype(acc_dtype)
            vb = _finite_v(v_ref[...].astype(acc_dtype))
            qs = q_ref[g, pl.ds(start, block_q), :].astype(acc_dtype) * scale
            do = do_ref[g, pl.ds(start, block_q), :].astype(acc_dtype)
            qidx = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
            kidx = kstart + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            keep = _keep_positions(jnp.logical_and(kidx < sk, qidx < sq), qidx, kidx,
                                   causal, mods.window)
            if m_ref is not None:
                keep = jnp.logical_and(keep, m_ref[g if mask_heads else 0,
                                                   pl.ds(start, block_q), :] != 0)
            bias = None if b_ref is None else b_ref[g if mods.bias_heads else 0,
                                                    pl.ds(start, block_q), :].astype(acc_dtype)
            slope = None if sl_ref is None else _slope(
                sl_ref, kv_head * group + g, acc_dtype)
            p, s = _probs(qs, kb, lse_ref[g, pl.ds(start, block_q)].astype(acc_dtype), keep,
                          acc_dtype, lambda s: _modify(s, qidx, kidx, bias, slope, mods.softcap))
            dv = dv + lax.dot_general(p, do, dims_tn, precision=hi,
                                      preferred_element_type=acc_dtype)
            dpv = lax.dot_general(do, vb, dims_nt, precision=hi,
                                  preferred_element_type=acc_dtype)
            delta = d_ref[g, pl.ds(start, block_q)].astype(acc_dtype)
            ds = _cap_grad(p * (dpv - delta[:, None]), s, mods.softcap)
            dk = dk + lax.dot_general(ds, qs, dims_tn, precision=hi,
                                      preferred_element_type=acc_dtype)
            return dk, dv

        return lax.fori_loop(lo, upper, step, carry)

    init = (jnp.zeros((block_k, dp), acc_dtype), jnp.zeros((block_k, dvp), acc_dtype))
    dk, dv = lax.fori_loop(0, _trip(kj, group, dynamic_loop), head, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs: Any, has_mask: bool, mods: _Mods, causal: bool, scale: float,
               block_q: int, block_k: int, sk: int, nk: int, acc_dtype: Any,
               dynamic_loop: bool, grads: tuple[str, ...] = ("dq",)) -> None:
    """One (batch*head, query block) instance: dQ = scale dS . K over its kv head's keys.

    With ``grads`` ("dbias", "dslope") instead, the same walk writes the modifiers'
    cotangents (a separate pallas_call, so XLA drops it when nobody asks for them): the tile
    dS (with respect to the score before the cap: the bias's cotangent, summed over its
    broadcast dims by the caller) and each row's sum_j dS_ij |i - j| (ALiBi's, negated and
    summed over rows by the caller)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, m_ref, b_ref, sl_ref, outs = _unpack(
        refs, 6, has_mask, mods.bias, mods.slopes)
    out_refs = dict(zip(grads, outs, strict=True))
    qi = pl.program_id(1)
    hi = lax.Precision.HIGHEST
    slope = None if sl_ref is None else _slope(sl_ref, pl.program_id(0) % mods.hq, acc_dtype)
    db_ref = out_refs.get("dbias")
    if db_ref is not None:  # key blocks the walk skips hold no attended key: dS = 0 there
        db_ref[...] = jnp.zeros(db_ref.shape, db_ref.dtype)

    def step(j: Any, acc: tuple[Any, Any]) -> tuple[Any, Any]:
        dq, rows = acc
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :].astype(acc_dtype)
        vb = _finite_v(v_ref[pl.ds(start, block_k), :].astype(acc_dtype))
        qs = q_ref[...].astype(acc_dtype) * scale
        do = do_ref[...].astype(acc_dtype)
        kidx = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        qidx = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        keep = _keep_positions(kidx < sk, qidx, kidx, causal, mods.window)
        if m_ref is not None:
            keep = jnp.logical_and(keep, m_ref[:, pl.ds(start, block_k)] != 0)
        bias = None if b_ref is None else b_ref[:, pl.ds(start, block_k)].astype(acc_dtype)
        p, s = _probs(qs, kb, lse_ref[...].astype(acc_dtype), keep, acc_dtype,
                      lambda s: _modify(s, qidx, kidx, bias, slope, mods.softcap))
        dpv = lax.dot_general(do, vb, (((1,), (1,)), ((), ())), precision=hi,
                              preferred_element_type=acc_dtype)
        ds = _cap_grad(p * (dpv - d_ref[...].astype(acc_dtype)[:, None]), s, mods.softcap)
        if "dq" in out_refs:
            dq = dq + lax.dot_general(ds * scale, kb, (((1,), (0,)), ((), ())), precision=hi,
                                      preferred_element_type=acc_dtype)
        if db_ref is not None:
            db_ref[:, pl.ds(start, block_k)] = ds.astype(db_ref.dtype)
        if "dslope" in out_refs:
            rows = rows + jnp.sum(ds * jnp.abs(qidx - kidx).astype(acc_dtype), axis=1)
        return dq, rows

    lo, upper = _key_blocks(qi, block_q, block_k, nk, causal, mods.window, dynamic_loop)
    dq_shape = out_refs["dq"].shape if "dq" in out_refs else (1, 1)
    dq, rows = lax.fori_loop(lo, upper, step, (jnp.zeros(dq_shape, acc_dtype),
                                               jnp.zeros((block_q,), acc_dtype)))
    if "dq" in out_refs:
        out_refs["dq"][...] = dq.astype(out_refs["dq"].dtype)
    if "dslope" in out_refs:
        out_refs["dslope"][...] = rows.astype(out_refs["dslope"].dtype)


class _Layout:
    """Block sizes, padded extents and the padded mask, bias and slopes of one call (forward
    and backward)."""

    def __init__(self, q: Any, k: Any, v: Any, mask: Any, platform: str,
                 blocks: dict[str, int], bias: Any = None, slopes: Any = None) -> None:
        import jax.numpy as jnp

        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.group = self.Hq // self.Hkv
        self.acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        self.bq = _fit_block(blocks["block_q"], self.Sq, platform)
        self.bk = _fit_block(blocks["block_k"], max(self.Sk, 1), platform)
        self.sqp, self.skp = _round_up(self.Sq, self.bq), _round_up(self.Sk, self.bk)
        self.dp, self.dvp = _pad_head(self.D, platform), _pad_head(self.Dv, platform)
        self.nq, self.nk = self.sqp // self.bq, self.skp // self.bk
        self.m4, self.mb, self.mh = self._tiles(mask, jnp.int8)
        # the bias as the mask: broadcast batch/head dims stay unmaterialised, the (Sq, Sk)
        # plane is materialised and zero-padded (padded keys are masked anyway)
        self.b4, self.bb, self.bh = self._tiles(bias, None)
        self.bias_shape4 = None if bias is None else (
            (1,) * (4 - bias.ndim) + tuple(bias.shape))
        self.sl = None
        if slopes is not None:  # one (1, Hp) row, read whole (_slope)
            hp = max(8, _next_pow2(self.Hq))
            self.sl = jnp.pad(jnp.reshape(slopes, (1, self.Hq)), ((0, 0), (0, hp - self.Hq)))

    def _tiles(self, x: Any, dtype: Any) -> tuple[Any, int, int]:
        """x broadcast to (xb, xh, Sqp, Skp), xb in {1, B}, xh in {1, Hq}, zero-padded."""
        import jax.numpy as jnp

        if x is None:
            return None, 1, 1
        x4 = jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))
        xb = self.B if x4.shape[0] != 1 else 1
        xh = self.Hq if x4.shape[1] != 1 else 1
        x4 = jnp.broadcast_to(x4, (xb, xh, self.Sq, self.Sk))
        x4 = jnp.pad(x4, ((0, 0), (0, 0), (0, self.sqp - self.Sq), (0, self.skp - self.Sk)))
        return (x4 if dtype is None else x4.astype(dtype)), xb, xh

    def mods(self, window: tuple[int, int | None] | None, softcap: float | None) -> _Mods:
        """The static modifiers, the window clamped so that i - left and i + right stay in
        int32 (a window wider than the padded sequences masks nothing more)."""
        if window is not None:
            span = self.sqp + self.skp
            left, right = window
            window = (min(left, span), None if right is None else min(right, span))
        return _Mods(window, softcap, self.b4 is not None, self.bh > 1, self.sl is not None,
                     self.Hq)

    def pad(self, x: Any, s: int, d: int) -> Any:
        import jax.numpy as jnp

        return jnp.pad(x, ((0, 0), (0, 0), (0, s - x.shape[2]), (0, d - x.shape[3])))

    def pad_rows(self, x: Any) -> Any:
        """(B, Hq, Sq) row statistics -> (B, Hq, Sqp)."""
        import jax.numpy as jnp

        return jnp.pad(x, ((0, 0), (0, 0), (0, self.sqp - self.Sq)))


def _forward(q: Any, k: Any, v: Any, mask: Any, bias: Any = None, slopes: Any = None, *,
             causal: bool, scale: float | None, interpret: bool, platform: str,
             blocks: dict[str, int], window: tuple[int, int | None] | None = None,
             softcap: float | None = None) -> tuple[Any, Any]:
    """The fused forward pass on concrete or traced arrays of any (validated) shape:
    (out, lse), lse (B, Hq, Sq) in the compute dtype."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    B, Hq, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    out_dtype = q.dtype
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    acc_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    if 0 in (B, Hq, Sq) or Sk == 0:  # nothing to attend: rows of zeros (never NaN)
        return (jnp.zeros((B, Hq, Sq, Dv), out_dtype),
                jnp.full((B, Hq, Sq), -jnp.inf, acc_dtype))
    lay = _Layout(q, k, v, mask, platform, blocks, bias, slopes)
    mods = lay.mods(window, softcap)
    bq, dp, dvp, group = lay.bq, lay.dp, lay.dvp, lay.group
    q = lay.pad(q, lay.sqp, dp)
    k = lay.pad(k, lay.skp, dp)
    v = lay.pad(v, lay.skp, dvp)
    sq_dim = getattr(pl, "squeezed", None)  # None on older jax means the same thing

    def q_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, bh % Hq, i, 0)

    def row_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, bh % Hq, i)

    def kv_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, (bh % Hq) // group, 0, 0)

    in_specs = [pl.BlockSpec((sq_dim, sq_dim, bq, dp), q_map),
                pl.BlockSpec((sq_dim, sq_dim, lay.skp, dp), kv_map),
                pl.BlockSpec((sq_dim, sq_dim, lay.skp, dvp), kv_map)]
    args = [q, k, v]
    _add_row_tiles(in_specs, args, lay, Hq, pl, sq_dim)
    kernel = _bind(_kernel, has_mask=lay.m4 is not None, mods=mods, causal=causal,
                   scale=float(scale), block_q=bq, block_k=lay.bk, sk=Sk, nk=lay.nk,
                   acc_dtype=acc_dtype, dynamic_loop=interpret)
    args, out_shape = _outs_like(args, [((B, Hq, lay.sqp, dvp), out_dtype),
                                        ((B, Hq, lay.sqp), acc_dtype)])
    out, lse = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(B * Hq, lay.nq),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((sq_dim, sq_dim, bq, dvp), q_map),
                   pl.BlockSpec((sq_dim, sq_dim, bq), row_map)),
        interpret=interpret,
        name="portakern_attention",
    )(*args)
    return out[:, :, :Sq, :Dv], lse[:, :, :Sq]


def _add_row_tiles(in_specs: list[Any], args: list[Any], lay: _Layout, Hq: int, pl: Any,
                   sq_dim: Any) -> None:
    """The mask, bias and slopes inputs of a (batch*q head, query block) grid: a (block_q,
    Skp) tile of the mask and bias (broadcast batch/head dims read tile 0), the slopes row
    whole."""
    for x, xb, xh in ((lay.m4, lay.mb, lay.mh), (lay.b4, lay.bb, lay.bh)):
        if x is None:
            continue

        def x_map(bh: Any, i: Any, xb: int = xb, xh: int = xh) -> tuple[Any, ...]:
            return (bh // Hq if xb > 1 else 0, bh % Hq if xh > 1 else 0, i, 0)

        in_specs.append(pl.BlockSpec((sq_dim, sq_dim, lay.bq, lay.skp), x_map))
        args.append(x)
    if lay.sl is not None:
        in_specs.append(pl.BlockSpec(lay.sl.shape, lambda bh, i: (0, 0)))
        args.append(lay.sl)


def _backward(q: Any, k: Any, v: Any, mask: Any, out: Any, lse: Any, g: Any, g_lse: Any,
              bias: Any = None, slopes: Any = None, *, causal: bool, scale: float | None,
              interpret: bool, platform: str, blocks: dict[str, int],
              window: tuple[int, int | None] | None = None, softcap: float | None = None
              ) -> tuple[Any, ...]:
    """The fused backward pass (FlashAttention-2): (dq, dk, dv, dbias, dslopes) in the inputs'
    dtypes from the forward's out and lse and the cotangents g (of out) and g_lse (of lse,
    or None). dbias is summed to the bias's shape, dslopes (Hq,); None where the operand is.
    """
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    if 0 in (B, Hq, Sq) or Sk == 0:  # no key attended anywhere: every gradient is 0
        return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
                None if bias is None else jnp.zeros_like(bias),
                None if slopes is None else jnp.zeros_like(slopes))
    lay = _Layout(q, k, v, mask, platform, blocks, bias, slopes)
    mods = lay.mods(window, softcap)
    bq, bk, dp, dvp, group = lay.bq, lay.bk, lay.dp, lay.dvp, lay.group
    sqp, skp, acc = lay.sqp, lay.skp, lay.acc
    sq_dim = getattr(pl, "squeezed", None)
    qp, kp, vp = lay.pad(q, sqp, dp), lay.pad(k, skp, dp), lay.pad(v, skp, dvp)
    op, gp = lay.pad(out, sqp, dvp), lay.pad(g, sqp, dvp)
    lsep = lay.pad_rows(lse)
    has_mask = lay.m4 is not None

    def q_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, bh % Hq, i, 0)

    def row_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, bh % Hq, i)

    # 1. delta = rowsum(dO * O) - g_lse
    args = [op, gp]
    in_specs = [pl.BlockSpec((sq_dim, sq_dim, bq, dvp), q_map)] * 2
    if g_lse is not None:
        args.append(lay.pad_rows(g_lse))
        in_specs.append(pl.BlockSpec((sq_dim, sq_dim, bq), row_map))
    args, (d_shape,) = _outs_like(args, [((B, Hq, sqp), acc)])
    delta = pl.pallas_call(
        _bind(_delta_kernel, has_glse=g_lse is not None, acc_dtype=acc,
              dynamic_loop=interpret),
        out_shape=d_shape, grid=(B * Hq, lay.nq), in_specs=in_specs,
        out_specs=pl.BlockSpec((sq_dim, sq_dim, bq), row_map),
        interpret=interpret, name="portakern_attention_bwd_delta",
    )(*args)

    # 2. dK, dV: one instance per (batch*kv head, key block); the group's query heads are one
    # block (heads h*group .. h*group + group - 1 of q, dO, lse, delta)
    def grp_map(bh: Any, j: Any) -> tuple[Any, ...]:
        return (bh // Hkv, bh % Hkv, 0, 0)

    def grp_rows(bh: Any, j: Any) -> tuple[Any, ...]:
        return (bh // Hkv, bh % Hkv, 0)

    def kblk_map(bh: Any, j: Any) -> tuple[Any, ...]:
        return (bh // Hkv, bh % Hkv, j, 0)

    args = [qp, kp, vp, gp, lsep, delta]
    in_specs = [pl.BlockSpec((sq_dim, group, sqp, dp), grp_map),
                pl.BlockSpec((sq_dim, sq_dim, bk, dp), kblk_map),
                pl.BlockSpec((sq_dim, sq_dim, bk, dvp), kblk_map),
                pl.BlockSpec((sq_dim, group, sqp, dvp), grp_map),
                pl.BlockSpec((sq_dim, group, sqp), grp_rows),
                pl.BlockSpec((sq_dim, group, sqp), grp_rows)]
    for x, xb, xh in ((lay.m4, lay.mb, lay.mh), (lay.b4, lay.bb, lay.bh)):
        if x is None:
            continue

        def x_kmap(bh: Any, j: Any, xb: int = xb, xh: int = xh) -> tuple[Any, ...]:
            return (bh // Hkv if xb > 1 else 0, bh % Hkv if xh > 1 else 0, 0, j)

        in_specs.append(pl.BlockSpec((sq_dim, group if xh > 1 else 1, sqp, bk), x_kmap))
        args.append(x)
    if lay.sl is not None:
        in_specs.append(pl.BlockSpec(lay.sl.shape, lambda bh, j: (0, 0)))
        args.append(lay.sl)
    kernel = _bind(_dkdv_kernel, has_mask=has_mask, mask_heads=lay.mh > 1, mods=mods,
                   causal=causal, scale=float(scale), block_q=bq, block_k=bk, sq=Sq, sk=Sk,
                   nq=lay.nq, group=group, hkv=Hkv, acc_dtype=acc, dynamic_loop=interpret)
    args, shapes = _outs_like(args, [((B, Hkv, skp, dp), k.dtype),
                                     ((B, Hkv, skp, dvp), v.dtype)])
    dk, dv = pl.pallas_call(
        kernel, out_shape=tuple(shapes), grid=(B * Hkv, lay.nk), in_specs=in_specs,
        out_specs=(pl.BlockSpec((sq_dim, sq_dim, bk, dp), kblk_map),
                   pl.BlockSpec((sq_dim, sq_dim, bk, dvp), kblk_map)),
        interpret=interpret, name="portakern_attention_bwd_dkdv",
    )(*args)

    # 3. dQ: one instance per (batch*q head, query block), as the forward; 4. the modifiers'
    # cotangents the same way, in a call of their own
    def kv_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, (bh % Hq) // group, 0, 0)

    def q_walk(grads: tuple[str, ...], outs: list[tuple[tuple[int, ...], Any, Any]],
               name: str) -> list[Any]:
        args = [qp, kp, vp, gp, lsep, delta]
        in_specs = [pl.BlockSpec((sq_dim, sq_dim, bq, dp), q_map),
                    pl.BlockSpec((sq_dim, sq_dim, skp, dp), kv_map),
                    pl.BlockSpec((sq_dim, sq_dim, skp, dvp), kv_map),
                    pl.BlockSpec((sq_dim, sq_dim, bq, dvp), q_map),
                    pl.BlockSpec((sq_dim, sq_dim, bq), row_map),
                    pl.BlockSpec((sq_dim, sq_dim, bq), row_map)]
        _add_row_tiles(in_specs, args, lay, Hq, pl, sq_dim)
        kernel = _bind(_dq_kernel, has_mask=has_mask, mods=mods, causal=causal,
                       scale=float(scale), block_q=bq, block_k=bk, sk=Sk, nk=lay.nk,
                       acc_dtype=acc, dynamic_loop=interpret, grads=grads)
        args, shapes = _outs_like(args, [(s, d) for s, d, _ in outs])
        got = pl.pallas_call(
            kernel, out_shape=tuple(shapes), grid=(B * Hq, lay.nq), in_specs=in_specs,
            out_specs=tuple(spec for _, _, spec in outs), interpret=interpret, name=name,
        )(*args)
        return list(got)

    (dq,) = q_walk(("dq",), [((B, Hq, sqp, dp), q.dtype,
                              pl.BlockSpec((sq_dim, sq_dim, bq, dp), q_map))],
                   "portakern_attention_bwd_dq")
    dbias = dslopes = None
    grads: tuple[str, ...] = ()
    outs: list[tuple[tuple[int, ...], Any, Any]] = []
    if bias is not None:
        grads += ("dbias",)
        outs.append(((B, Hq, sqp, skp), acc, pl.BlockSpec((sq_dim, sq_dim, bq, skp), q_map)))
    if slopes is not None:
        grads += ("dslope",)
        outs.append(((B, Hq, sqp), acc, pl.BlockSpec((sq_dim, sq_dim, bq), row_map)))
    if grads:
        got = dict(zip(grads, q_walk(grads, outs, "portakern_attention_bwd_dmods"),
                       strict=True))
        if bias is not None:
            full = got["dbias"][:, :, :Sq, :Sk]
            shape4 = lay.bias_shape4
            axes = tuple(a for a in range(4) if shape4[a] == 1 and full.shape[a] != 1)
            dbias = jnp.reshape(jnp.sum(full, axis=axes, keepdims=True) if axes else full,
                                bias.shape).astype(bias.dtype)
        if slopes is not None:
            dslopes = (-jnp.sum(got["dslope"][:, :, :Sq], axis=(0, 2))).astype(slopes.dtype)
    return dq[:, :, :Sq, :D], dk[:, :, :Sk, :D], dv[:, :, :Sk, :lay.Dv], dbias, dslopes


def _outs_like(args: list[Any], outs: list[tuple[tuple[int, ...], Any]]
               ) -> tuple[list[Any], list[Any]]:
    """Output structs that vary over the mesh axes the inputs vary over (shard_map).

    Under ``shard_map(check_vma=True)`` a pallas_call must state how its outputs vary
    across manual mesh axes. The output of a per-shard kernel varies wherever any input does,
    so inputs are first cast to vary over the union (a no-op outside shard_map). Covers the
    ``manual_axis_type`` (newer) and ``vma`` (older) spellings; jax without either needs none.
    """
    import jax
    from jax import lax

    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return args, [jax.ShapeDtypeStruct(s, d) for s, d in outs]

    def varying(x: Any) -> frozenset:
        aval = typeof(x)
        mat = getattr(aval, "mat", None)
        return frozenset(mat.varying if mat is not None else getattr(aval, "vma", frozenset()))

    union = frozenset().union(*(varying(a) for a in args))
    if union:
        cast = getattr(lax, "pcast", None)
        cast_args = []
        for a in args:
            rest = tuple(sorted(union - varying(a), key=str))
            if rest:
                a = cast(a, rest, to="varying") if cast is not None else lax.pvary(a, rest)
            cast_args.append(a)
        args = cast_args
    aval = typeof(args[0])
    if hasattr(aval, "mat"):
        return args, [jax.ShapeDtypeStruct(s, d, manual_axis_type=aval.mat) for s, d in outs]
    if hasattr(aval, "vma"):
        return args, [jax.ShapeDtypeStruct(s, d, vma=aval.vma) for s, d in outs]
    return args, [jax.ShapeDtypeStruct(s, d) for s, d in outs]


def _shard_plan(q: Any, k: Any, v: Any, mask: Any, *extra: Any) -> dict[str, Any] | None:
    """How to run per shard when the inputs carry explicit shardings, or None.

    With explicit sharding in types (``AxisType.Explicit`` meshes) a kernel's refs would be
    sharded, which Pallas does not slice. Attention is independent per (batch, head), so the
    kernels run per shard under ``shard_map``: batch and head dims keep q's sharding,
    sequence and head dims are gathered. K/V heads follow q's head sharding (so query head h
    and its kv head h // group land on the same shard); when Hkv does not split that way,
    heads are gathered and only the batch stays sharded. Inputs without explicit shardings
    (plain arrays, GSPMD auto axes, already inside shard_map) give None: call directly.
    ``extra`` (bias, slopes; None allowed) only count when looking for a sharded input.
    The plan's specs: "q" (B, Hq, ...), "kv" (B, Hkv, ...), "row" (B, Hq, Sq), "slopes"
    (Hq,), and "b", "h" for the mask's and bias's non-broadcast dims.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    typeof = getattr(jax, "typeof", None)
    if typeof is None or not hasattr(jax.sharding, "reshard"):
        return None
    operands = [x for x in (q, k, v, mask, *extra) if x is not None]
    specs = [getattr(getattr(typeof(x), "sharding", None), "spec", None) for x in operands]
    if not any(sp is not None and any(e is not None for e in sp) for sp in specs):
        return None
    mesh = typeof(q).sharding.mesh
    for x, sp in zip(operands, specs, strict=True):
        if sp is not None and any(e is not None for e in sp):
            mesh = typeof(x).sharding.mesh
            break

    def size(entry: Any) -> int:
        names = entry if isinstance(entry, tuple) else (entry,)
        n = 1
        for a in names:
            if a is not None:
                n *= int(mesh.shape[a])
        return n

    qspec = tuple(typeof(q).sharding.spec) + (None,) * 4
    b_ax, h_ax = qspec[0], qspec[1]
    B, Hq, Hkv = q.shape[0], q.shape[1], k.shape[1]
    if b_ax is not None and B % size(b_ax):
        b_ax = None
    if h_ax is not None and (Hq % size(h_ax) or (Hkv != 1 and Hkv % size(h_ax))):
        h_ax = None  # the GQA grouping would not stay on one shard: gather heads
    kv_h = h_ax if Hkv != 1 else None
    return {"mesh": mesh, "b": b_ax, "h": h_ax, "q": P(b_ax, h_ax, None, None),
            "kv": P(b_ax, kv_h, None, None), "row": P(b_ax, h_ax, None), "slopes": P(h_ax)}


def _bcast_spec(plan: dict[str, Any], shape4: tuple[int, ...]) -> Any:
    """The spec of a 4-d mask or bias: batch/head split like q where not broadcast."""
    from jax.sharding import PartitionSpec as P

    return P(plan["b"] if shape4[0] != 1 else None, plan["h"] if shape4[1] != 1 else None,
             None, None)


def _sharded(local: Callable[..., Any], plan: dict[str, Any],
             operands: list[tuple[Any, str]], out_kinds: tuple[Any, ...]) -> Any:
    """``local(*operands)`` per shard under shard_map; operands are (array or None, kind),
    kind a plan spec name, or "mask"/"bias" (reshaped to 4-d, split where not broadcast);
    None operands stay None inside. ``out_kinds``: plan spec names or PartitionSpecs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh = plan["mesh"]
    args, specs, present = [], [], []
    for x, kind in operands:
        present.append(x is not None)
        if x is None:
            continue
        if kind in ("mask", "bias"):
            x = jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))
            spec = _bcast_spec(plan, x.shape)
        else:
            spec = plan[kind]
        args.append(jax.sharding.reshard(x, NamedSharding(mesh, spec)))
        specs.append(spec)

    def run(*xs: Any) -> Any:
        it = iter(xs)
        return local(*[next(it) if p else None for p in present])

    return jax.shard_map(run, mesh=mesh, in_specs=tuple(specs),
                         out_specs=tuple(plan[k] if isinstance(k, str) else k
                                         for k in out_kinds))(*args)


def _bind(fn: Callable[..., Any], **static: Any) -> Callable[..., Any]:
    def bound(*refs: Any) -> None:
        fn(*refs, **static)

    return bound


def build(problem: Problem, interpret: bool, *, block_q: int | None = None,
          block_k: int | None = None, platform: str | None = None,
          reference: Callable[..., Any] | None = None,
          semantics: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Build ``fn(q, k, v, mask, bias=None, alibi_slopes=None)``: the fused kernel with the
    fused backward (custom_vjp).

    ``fn`` returns ``out`` (B, Hq, Sq, Dv) in q's dtype, or ``(out, lse)`` when
    ``problem.params["return_lse"]`` is true (missing: False); lse is (B, Hq, Sq), float32
    (float64 for float64 inputs): log sum_j exp(s'_ij) over the keys row i attends (s' the
    modified score), -inf for a row with none, NaN where the output row is NaN. Both outputs
    are differentiable, with respect to q, k, v, bias and alibi_slopes.

    Only the problem's static parameters (causal, scale, return_lse, window, softcap) are
    read; shapes, and whether a bias or slopes are given, come from the arrays at trace time,
    so one built function serves every shape (and vmap/shard_map) and never ignores an
    operand it was not built for (the backend caches it by parameters alone).
    ``interpret=True`` runs the kernels through Pallas' interpreter (CPU, tests).
    ``platform`` ('cpu' | 'gpu' | 'tpu') picks block/padding rules; default: interpret ->
    'cpu', else jax.default_backend(). ``reference`` and ``semantics`` (the unfused function
    the backward once differentiated) are accepted and unused: the backward is fused too.
    """
    import jax
    from jax import lax

    del reference, semantics  # the backward no longer differentiates an unfused forward
    causal = bool(problem.params.get("causal", False))
    scale = problem.params.get("scale")
    return_lse = bool(problem.params.get("return_lse", False))
    window = problem.params.get("window")
    if window is not None and not isinstance(window, tuple):  # validate() normalises it
        window = (int(window), None)
    softcap = problem.params.get("softcap")
    if platform is None:
        platform = "cpu" if interpret else jax.default_backend()
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    overrides = {n: v for n, v in (("block_q", block_q), ("block_k", block_k)) if v is not None}
    blocks = block_config(platform, overrides)
    static = {"causal": causal, "scale": scale, "interpret": interpret, "platform": platform,
              "blocks": blocks, "window": window,
              "softcap": None if softcap is None else float(softcap)}

    def local_fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any
                  ) -> tuple[Any, Any]:
        return _forward(q, k, v, mask, bias, slopes, **static)

    def forward(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any) -> tuple[Any, Any]:
        plan = _shard_plan(q, k, v, mask, bias, slopes)
        if plan is None:
            return local_fwd(q, k, v, mask, bias, slopes)
        return _sharded(local_fwd, plan, [(q, "q"), (k, "kv"), (v, "kv"), (mask, "mask"),
                                          (bias, "bias"), (slopes, "slopes")], ("q", "row"))

    def backward(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, out: Any,
                 lse: Any, g: Any, g_lse: Any) -> tuple[Any, ...]:
        plan = _shard_plan(q, k, v, mask, bias, slopes)
        if plan is None:
            return _backward(q, k, v, mask, out, lse, g, g_lse, bias, slopes, **static)
        shape4 = None if bias is None else (1,) * (4 - bias.ndim) + tuple(bias.shape)
        # a bias broadcast over a split batch/head dim, and the slopes (summed over the
        # batch), get partial sums per shard: psum them over those mesh axes
        b_sum = () if shape4 is None else tuple(
            ax for ax, n in ((plan["b"], shape4[0]), (plan["h"], shape4[1]))
            if ax is not None and n == 1)
        s_sum = () if plan["b"] is None else (plan["b"],)

        def names(axes: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(n for a in axes for n in (a if isinstance(a, tuple) else (a,)))

        def local(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any, out: Any,
                  lse: Any, g: Any, g_lse: Any) -> tuple[Any, ...]:
            dq, dk, dv, dbias, dslopes = _backward(q, k, v, mask, out, lse, g, g_lse, bias,
                                                   slopes, **static)
            rest = []
            if dbias is not None:
                rest.append(lax.psum(dbias, names(b_sum)) if b_sum else dbias)
            if dslopes is not None:
                rest.append(lax.psum(dslopes, names(s_sum)) if s_sum else dslopes)
            return (dq, dk, dv, *rest)

        kinds: tuple[Any, ...] = ("q", "kv", "kv")
        if bias is not None:
            kinds += (_bcast_spec(plan, shape4),)  # psum-ed dims are replicated
        if slopes is not None:
            kinds += ("slopes",)
        got = list(_sharded(local, plan, [
            (q, "q"), (k, "kv"), (v, "kv"), (mask, "mask"), (bias, "bias"),
            (slopes, "slopes"), (out, "q"), (lse, "row"), (g, "q"), (g_lse, "row")], kinds))
        dq, dk, dv = got[:3]
        dbias = None if bias is None else got[3].reshape(bias.shape)
        dslopes = None if slopes is None else got[-1]
        # cotangents carry their primal's sharding
        grads = [dq, dk, dv, dbias, dslopes]
        return tuple(None if d is None else jax.sharding.reshard(d, jax.typeof(x).sharding)
                     for d, x in zip(grads, (q, k, v, bias, slopes), strict=True))

    @jax.custom_vjp
    def fused(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any) -> Any:
        out, lse = forward(q, k, v, mask, bias, slopes)
        return (out, lse) if return_lse else out

    def fused_fwd(q: Any, k: Any, v: Any, mask: Any, bias: Any, slopes: Any
                  ) -> tuple[Any, tuple[Any, ...]]:
        out, lse = forward(q, k, v, mask, bias, slopes)  # lse: a residual even if not returned
        return ((out, lse) if return_lse else out), (q, k, v, mask, bias, slopes, out, lse)

    def fused_bwd(res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        q, k, v, mask, bias, slopes, out, lse = res
        g_out, g_lse = g if return_lse else (g, None)
        g_lse = None if g_lse is None else g_lse.astype(lse.dtype)
        dq, dk, dv, dbias, dslopes = backward(q, k, v, mask, bias, slopes, out, lse,
                                              g_out.astype(out.dtype), g_lse)
        return dq, dk, dv, None, dbias, dslopes  # the boolean mask has no cotangent

    fused.defvjp(fused_fwd, fused_bwd)

    def entry(q: Any, k: Any, v: Any, mask: Any = None, bias: Any = None,
              alibi_slopes: Any = None) -> Any:
        return fused(q, k, v, mask, bias, alibi_slopes)

    return entry
