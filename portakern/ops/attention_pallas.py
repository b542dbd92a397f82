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

Arbitrary shapes: Sq and Sk are padded to block multiples (padded keys are masked out, padded
query rows are sliced away) and the head dims D and Dv are zero-padded to the platform's
alignment (zeros change no dot product), so D = 40, 59, 80, 111 work everywhere.

Numerics: every tile is widened to the compute dtype (float32 for float16/bfloat16/float32,
float64 for float64) before any arithmetic, dots use precision=HIGHEST with
preferred_element_type = compute dtype, and masked scores are -inf with a guarded max, so a
row with no key to attend gives 0, never NaN. That is what lets the kernel meet
``attention.SPEC.tolerance`` just like the C kernels.

Gradients: the kernel is wrapped in ``jax.custom_vjp``. The forward pass is the fused kernel;
the backward pass is the VJP of the *unfused* semantics (``attention.semantics`` lowered with
jax.numpy at HIGHEST precision), recomputed from the saved q, k, v, mask. It is exact up to
rounding but materialises the Sq x Sk probabilities in the backward pass (a fused backward
kernel is future work; see docs/jax.md).

Nothing here imports jax at module import time: ``import portakern`` must stay jax-free, and
``attention.SPEC.pallas`` points at :func:`build`, which imports jax when first called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..core.errors import InvalidArgumentError
from ..core.spec import Problem, Tunable

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


def _kernel(*refs: Any, has_mask: bool, causal: bool, scale: float, block_q: int,
            block_k: int, sk: int, nk: int, acc_dtype: Any, dynamic_loop: bool) -> None:
    """One (batch*head, query block) instance: online softmax over the key blocks."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    if has_mask:
        q_ref, k_ref, v_ref, m_ref, o_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref = refs
        m_ref = None
    qi = pl.program_id(1)
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
        keep = kidx < sk  # padded keys never count
        if causal:
            qidx = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
            keep = jnp.logical_and(keep, kidx <= qidx)
        if m_ref is not None:
            keep = jnp.logical_and(keep, m_ref[:, pl.ds(start, block_k)] != 0)
        s = jnp.where(keep, s, neg_inf)
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
    if causal:  # top-left aligned: the last query of this block sees keys < (qi + 1) * block_q
        upper = jnp.minimum(nk, ((qi + 1) * block_q + block_k - 1) // block_k)
    elif dynamic_loop:
        # a traced trip count keeps the interpreter on a while loop: its scan form (static
        # bounds) mis-types shard_map's varying axes in the carry (jax 0.10)
        upper = jnp.maximum(qi * 0 + nk, 0)
    else:
        upper = nk
    _, l_fin, acc = lax.fori_loop(0, upper, step, init)
    # Dead (no key attended, every score -inf): l is exactly 0 and acc is 0. A NaN score makes
    # l NaN, even where the max reduction skips NaN (XLA:CPU's does), and NaN is alive: the
    # test is l == 0, never "l > 0" (which took NaN rows for empty ones and wrote zeros).
    out = acc / jnp.where(l_fin == 0, jnp.ones_like(l_fin), l_fin)
    o_ref[...] = out.astype(o_ref.dtype)


def _forward(q: Any, k: Any, v: Any, mask: Any, *, causal: bool, scale: float | None,
             interpret: bool, platform: str, blocks: dict[str, int]) -> Any:
    """The fused forward pass on concrete or traced arrays of any (validated) shape."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out_dtype = q.dtype
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    if 0 in (B, Hq, Sq, Dv) or Sk == 0:  # nothing to attend: rows of zeros (never NaN)
        return jnp.zeros((B, Hq, Sq, Dv), out_dtype)
    acc_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    group = Hq // Hkv
    bq = _fit_block(blocks["block_q"], Sq, platform)
    bk = _fit_block(blocks["block_k"], Sk, platform)
    sqp, skp = _round_up(Sq, bq), _round_up(Sk, bk)
    dp, dvp = _pad_head(D, platform), _pad_head(Dv, platform)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, sqp - Sq), (0, dp - D)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, skp - Sk), (0, dp - D)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, skp - Sk), (0, dvp - Dv)))
    nq, nk = sqp // bq, skp // bk
    sq_dim = getattr(pl, "squeezed", None)  # None on older jax means the same thing

    def q_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, bh % Hq, i, 0)

    def kv_map(bh: Any, i: Any) -> tuple[Any, ...]:
        return (bh // Hq, (bh % Hq) // group, 0, 0)

    in_specs = [pl.BlockSpec((sq_dim, sq_dim, bq, dp), q_map),
                pl.BlockSpec((sq_dim, sq_dim, skp, dp), kv_map),
                pl.BlockSpec((sq_dim, sq_dim, skp, dvp), kv_map)]
    args = [q, k, v]
    if mask is not None:
        m4 = jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
        mb = B if m4.shape[0] != 1 else 1  # keep broadcast batch/head dims unmaterialised
        mh = Hq if m4.shape[1] != 1 else 1
        m4 = jnp.broadcast_to(m4, (mb, mh, Sq, Sk))
        m4 = jnp.pad(m4, ((0, 0), (0, 0), (0, sqp - Sq), (0, skp - Sk))).astype(jnp.int8)

        def m_map(bh: Any, i: Any) -> tuple[Any, ...]:
            b = bh // Hq if mb > 1 else 0
            h = bh % Hq if mh > 1 else 0
            return (b, h, i, 0)

        in_specs.append(pl.BlockSpec((sq_dim, sq_dim, bq, skp), m_map))
        args.append(m4)
    kernel = _bind(_kernel, has_mask=mask is not None, causal=causal, scale=float(scale),
                   block_q=bq, block_k=bk, sk=Sk, nk=nk, acc_dtype=acc_dtype,
                   dynamic_loop=interpret)
    args, out_shape = _out_like(args, (B, Hq, sqp, dvp), out_dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B * Hq, nq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((sq_dim, sq_dim, bq, dvp), q_map),
        interpret=interpret,
        name="portakern_attention",
    )(*args)
    return out[:, :, :Sq, :Dv]


def _out_like(args: list[Any], shape: tuple[int, ...], dtype: Any) -> tuple[list[Any], Any]:
    """Output struct that varies over the mesh axes the inputs vary over (shard_map).

    Under ``shard_map(check_vma=True)`` a pallas_call must state how its output varies
    across manual mesh axes. The output of a per-shard kernel varies wherever any input does,
    so inputs are first cast to vary over the union (a no-op outside shard_map). Covers the
    ``manual_axis_type`` (newer) and ``vma`` (older) spellings; jax without either needs none.
    """
    import jax
    from jax import lax

    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return args, jax.ShapeDtypeStruct(shape, dtype)

    def varying(x: Any) -> frozenset:
        aval = typeof(x)
        mat = getattr(aval, "mat", None)
        return frozenset(mat.varying if mat is not None else getattr(aval, "vma", frozenset()))

    union = frozenset().union(*(varying(a) for a in args))
    if union:
        cast = getattr(lax, "pcast", None)
        out = []
        for a in args:
            rest = tuple(sorted(union - varying(a), key=str))
            if rest:
                a = cast(a, rest, to="varying") if cast is not None else lax.pvary(a, rest)
            out.append(a)
        args = out
    aval = typeof(args[0])
    if hasattr(aval, "mat"):
        return args, jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
    if hasattr(aval, "vma"):
        return args, jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return args, jax.ShapeDtypeStruct(shape, dtype)


def _per_shard(local: Callable[..., Any], q: Any, k: Any, v: Any, mask: Any) -> Any:
    """Run ``local`` once per shard when the inputs carry explicit shardings.

    With explicit sharding in types (``AxisType.Explicit`` meshes) a kernel's refs would be
    sharded, which Pallas does not slice. Attention is independent per (batch, head), so we
    run the kernel per shard under ``shard_map``: batch and head dims keep q's sharding,
    sequence and head dims are gathered. K/V heads follow q's head sharding (so query head h
    and its kv head h // group land on the same shard); when Hkv does not split that way,
    heads are gathered and only the batch stays sharded. Inputs without explicit shardings
    (plain arrays, GSPMD auto axes, already inside shard_map) call ``local`` directly.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    typeof = getattr(jax, "typeof", None)
    if typeof is None or not hasattr(jax.sharding, "reshard"):
        return local(q, k, v, mask)
    operands = [x for x in (q, k, v, mask) if x is not None]
    specs = [getattr(getattr(typeof(x), "sharding", None), "spec", None) for x in operands]
    if not any(sp is not None and any(e is not None for e in sp) for sp in specs):
        return local(q, k, v, mask)
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
    q_spec, kv_spec = P(b_ax, h_ax, None, None), P(b_ax, kv_h, None, None)

    def reshard(x: Any, spec: Any) -> Any:
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))

    q, k, v = reshard(q, q_spec), reshard(k, kv_spec), reshard(v, kv_spec)
    if mask is None:
        return jax.shard_map(lambda a, b, c: local(a, b, c, None), mesh=mesh,
                             in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)(q, k, v)
    import jax.numpy as jnp

    m4 = jnp.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
    m_spec = P(b_ax if m4.shape[0] != 1 else None, h_ax if m4.shape[1] != 1 else None,
               None, None)
    m4 = reshard(m4, m_spec)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, m_spec),
                         out_specs=q_spec)(q, k, v, m4)


def _bind(fn: Callable[..., Any], **static: Any) -> Callable[..., Any]:
    def bound(*refs: Any) -> None:
        fn(*refs, **static)

    return bound


def _default_reference(semantics: Callable[..., Any], causal: bool, scale: float | None
                       ) -> Callable[..., Any]:
    """Unfused semantics in the compute dtype at HIGHEST precision (the backward's forward)."""
    import jax
    import jax.numpy as jnp

    def ref(q: Any, k: Any, v: Any, mask: Any) -> Any:
        acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        with jax.default_matmul_precision("highest"):
            out = semantics(jnp, q.astype(acc), k.astype(acc), v.astype(acc), mask,
                            causal=causal, scale=scale)
        return out.astype(q.dtype)

    return ref


def build(problem: Problem, interpret: bool, *, block_q: int | None = None,
          block_k: int | None = None, platform: str | None = None,
          reference: Callable[..., Any] | None = None,
          semantics: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Build ``fn(q, k, v, mask) -> out``: the fused kernel with the unfused VJP.

    Only the problem's static parameters (causal, scale) are read; shapes come from the
    arrays at trace time, so one built function serves every shape (and vmap/shard_map).
    ``interpret=True`` runs the kernel through Pallas' interpreter (CPU, tests).
    ``platform`` ('cpu' | 'gpu' | 'tpu') picks block/padding rules; default: interpret ->
    'cpu', else jax.default_backend(). ``reference(q, k, v, mask)`` is the unfused function
    whose VJP is the backward pass; the JAX backend passes its own XLA lowering.
    """
    import jax

    causal = bool(problem.params.get("causal", False))
    scale = problem.params.get("scale")
    if platform is None:
        platform = "cpu" if interpret else jax.default_backend()
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    overrides = {n: v for n, v in (("block_q", block_q), ("block_k", block_k)) if v is not None}
    blocks = block_config(platform, overrides)
    if reference is None and semantics is None:
        raise InvalidArgumentError("attention_pallas.build needs reference= or semantics= "
                                   "(the op's semantics, for the backward's forward)")
    ref = reference if reference is not None else _default_reference(semantics, causal, scale)

    def local(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return _forward(q, k, v, mask, causal=causal, scale=scale, interpret=interpret,
                        platform=platform, blocks=blocks)

    def forward(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return _per_shard(local, q, k, v, mask)

    @jax.custom_vjp
    def fused(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return forward(q, k, v, mask)

    def fused_fwd(q: Any, k: Any, v: Any, mask: Any) -> tuple[Any, tuple[Any, ...]]:
        return forward(q, k, v, mask), (q, k, v, mask)

    def fused_bwd(res: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        q, k, v, mask = res
        out, vjp = jax.vjp(lambda a, b, c: ref(a, b, c, mask), q, k, v)
        dq, dk, dv = vjp(g.astype(out.dtype))  # the reference rounds to the problem dtype
        return dq, dk, dv, None  # the boolean mask has no cotangent

    fused.defvjp(fused_fwd, fused_bwd)
    return fused
