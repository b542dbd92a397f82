"""The Pallas attention's fused backward and its log-sum-exp output (issue #28).

Gradients of ``jax:pallas`` (interpret mode on this CPU) are compared with ``jax.grad`` of the
same loss through ``attention.semantics`` in float64 (under ``jax.enable_x64``). The loss
weighs both outputs, out and lse, so the lse cotangent's path (dS = P (dP - delta + g_lse))
is covered too.

Tolerances are derived, not hand-picked (``grad_bounds``). With u the compute type's unit
roundoff (float32 for float32/bfloat16), u_s the storage type's (q's dtype: O is stored in it
and the gradients are rounded to it), every score s = (scale q).k errs by
E_s <= (D + 2) u |scale q|.|k| + u |s|, so P = exp(s - lse) has relative error
eps_i = 2 max_j E_s + u (max |s| + 2 |lse| + Sk + 8) in row i. |dP_ij| and |delta'_i| are
bounded by M_ij = |dO_i|.|v_j| + sum_d |dO_id| (|O_id| + (P|v|)_id) + |g_lse_i|, and dS_ij
errs by P_ij M_ij c_i with c_i = eps_i + u_s + (Dv + 4) u (dP's dot, delta's sum over the
stored O and its forward error). The three products then add their own sums' rounding:
  dQ_i  <= scale sum_j P_ij M_ij (c_i + (Sk + 2) u) |k_j|
  dK_j  <= sum_{h in group, i} P_ij M_ij (c_i + (G Sq + 2) u) |scale q_i|
  dV_j  <= sum_{h in group, i} P_ij (eps_i + (G Sq + 2) u) |dO_i|
each plus u_s |reference| (the final rounding), times c = 2 for the dropped second-order
terms. The mutants this catches (see the report of issue #28): delta dropped from dS, the
scale dropped from dQ.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'portakern[jax]'")
jnp = pytest.importorskip("jax.numpy", reason="jax.numpy ships with jax")

import portakern as pk  # noqa: E402
from portakern.ops import attention_pallas, get_op  # noqa: E402
from portakern.ops.attention import keep_matrix  # noqa: E402

SPEC = get_op("attention")
NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64}
SAFETY = 2.0  # the bounds above are first order; c = 2 covers the products of two errors


# --- helpers ---------------------------------------------------------------------------------
def _inputs(case: tuple, dtype: str) -> dict[str, Any]:
    B, Hq, Hkv, Sq, Sk, D, Dv, causal, mshape = case[:9]
    rng = np.random.default_rng(zlib.crc32(repr((case, dtype)).encode()))
    x = {"q": rng.standard_normal((B, Hq, Sq, D)) * 2.0,  # peaky rows: lse far from log Sk
         "k": rng.standard_normal((B, Hkv, Sk, D)),
         "v": rng.standard_normal((B, Hkv, Sk, Dv))}
    x = {n: a.astype(NP[dtype]) for n, a in x.items()}
    mask = None
    if mshape is not None:
        mask = rng.random(mshape) > 0.3
        mask[..., 2, :] = False  # a fully masked row: out 0, lse -inf, gradient 0
    # the cotangents, exactly representable in the storage type (so dO is what we weigh)
    w = rng.standard_normal((B, Hq, Sq, Dv)).astype(NP[dtype]).astype(np.float32)
    wl = rng.standard_normal((B, Hq, Sq)).astype(NP[dtype]).astype(np.float32)
    return {**x, "mask": mask, "causal": causal, "w": w, "wl": wl}


def _build(x: dict[str, Any], return_lse: bool = True, **blocks: int) -> Any:
    prob = SPEC.problem({n: x[n] for n in ("q", "k", "v", "mask")},
                        {"causal": x["causal"], "scale": None, "return_lse": return_lse})
    return prob.params["scale"], attention_pallas.build(prob, True, **blocks)


def _loss(out: Any, lse: Any, w: Any, wl: Any) -> Any:
    """Weighs both outputs; a dead row's lse (-inf) gets no weight (and no cotangent)."""
    total = jnp.sum(out.astype(w.dtype) * w)
    if lse is not None:
        total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0).astype(wl.dtype) * wl)
    return total


def _ref_lse(q: Any, k: Any, mask: Any, causal: bool, scale: float) -> Any:
    """log sum_j exp(s_ij) over the attended keys, s = (scale q).k; -inf for a dead row."""
    g = q.shape[1] // k.shape[1]
    s = (q * scale) @ jnp.swapaxes(jnp.repeat(k, g, axis=1), -1, -2)
    keep = keep_matrix(jnp, q.shape[2], k.shape[2], causal, mask)
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    dead = m == -jnp.inf
    m = jnp.where(dead, 0.0, m)
    den = jnp.sum(jnp.exp(s - m), axis=-1, keepdims=True)
    return jnp.where(dead, -jnp.inf, m + jnp.log(jnp.where(dead, 1.0, den)))[..., 0]


def _reference(x: dict[str, Any], scale: float) -> tuple[list[np.ndarray], np.ndarray]:
    """float64 gradients of the same loss through attention.semantics, and the float64 lse."""
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x[n].astype(np.float64)) for n in "qkv")
        mask = None if x["mask"] is None else jnp.asarray(x["mask"])
        w, wl = jnp.asarray(x["w"], jnp.float64), jnp.asarray(x["wl"], jnp.float64)

        def loss(a: Any, b: Any, c: Any) -> Any:
            out = SPEC.semantics(jnp, a, b, c, mask, causal=x["causal"], scale=scale)
            return _loss(out, _ref_lse(a, b, mask, x["causal"], scale), w, wl)

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        lse = _ref_lse(q, k, mask, x["causal"], scale)
        return [np.asarray(g) for g in grads], np.asarray(lse)


def grad_bounds(x: dict[str, Any], scale: float, grads: list[np.ndarray], dtype: str
                ) -> list[np.ndarray]:
    """The derived bounds on |dq|, |dk|, |dv| errors (module docstring), float64 numpy."""
    compute = np.float64 if dtype == "float64" else np.float32
    u = float(np.finfo(compute).eps) / 2
    us = float(ml_dtypes.finfo(NP[dtype]).eps) / 2  # (np.finfo knows bf16 from ml_dtypes 0.7)
    q, k, v = (x[n].astype(np.float64) for n in "qkv")
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    g = Hq // Hkv
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    qs = q * scale
    s = qs @ np.swapaxes(kr, -1, -2)
    keep = keep_matrix(np, Sq, Sk, x["causal"], x["mask"])
    keep = np.broadcast_to(True if keep is None else keep, s.shape)
    es = (D + 2) * u * (np.abs(qs) @ np.swapaxes(np.abs(kr), -1, -2)) + u * np.abs(s)
    s = np.where(keep, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    dead = mx == -np.inf
    e = np.where(keep, np.exp(s - np.where(dead, 0, mx)), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    p = e / np.where(dead, 1.0, den)
    lse = np.where(dead, 0.0, np.where(dead, 0, mx) + np.log(np.where(dead, 1.0, den)))
    sabs = np.where(keep, np.abs(np.where(keep, s, 0)), 0).max(axis=-1, keepdims=True)
    eps = (2 * np.where(keep, es, 0).max(axis=-1, keepdims=True)
           + u * (sabs + 2 * np.abs(lse) + Sk + 8))                      # (B, H, Sq, 1)
    do = np.abs(x["w"].astype(np.float64))
    o = np.abs(p @ vr)
    pv = p @ np.abs(vr)
    wl = np.abs(x["wl"].astype(np.float64))[..., None]
    m = do @ np.swapaxes(np.abs(vr), -1, -2) + np.sum(do * (o + pv), -1, keepdims=True) + wl
    a = p * m
    c = eps + us + (Dv + 4) * u
    bq = scale * ((a * (c + (Sk + 2) * u)) @ np.abs(kr))
    bk = np.swapaxes(a * (c + (g * Sq + 2) * u), -1, -2) @ np.abs(qs)
    bv = np.swapaxes(p * (eps + (g * Sq + 2) * u), -1, -2) @ do

    def fold(b: np.ndarray) -> np.ndarray:  # sum the group's query heads onto their kv head
        return b.reshape(B, Hkv, g, *b.shape[2:]).sum(axis=2)

    floor = 64 * float(np.finfo(compute).tiny)
    return [SAFETY * (b + us * np.abs(r)) + floor
            for b, r in zip((bq, fold(bk), fold(bv)), grads, strict=True)]


def _check(got: list[Any], ref: list[np.ndarray], bounds: list[np.ndarray], what: str) -> None:
    for name, a, r, b in zip("qkv", got, ref, bounds, strict=True):
        a = np.asarray(a).astype(np.float64)
        assert a.shape == r.shape, (what, name, a.shape, r.shape)
        err = np.abs(a - r)
        bad = ~(err <= b)
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, err / b, 0)), err.shape)
            pytest.fail(f"{what}: d{name} error {err[i]:.3g} > bound {b[i]:.3g} at {i} "
                        f"(got {a[i]!r}, expected {r[i]!r}); {int(bad.sum())} elements out")


# --- gradients against float64 ---------------------------------------------------------------
GRAD_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, Dv, causal, mask shape, dtype, blocks (block_q, block_k)
    (1, 2, 2, 16, 16, 16, 16, False, None, "float32", None),            # plain
    (1, 4, 2, 20, 28, 40, 24, False, None, "float32", (8, 8)),          # GQA, D=40/Dv=24
    (2, 4, 2, 24, 17, 16, 8, True, None, "float32", (8, 16)),           # causal, Sq > Sk
    (1, 4, 2, 13, 30, 40, 24, True, (1, 1, 13, 30), "float32", (8, 8)),  # mask + dead row
    (1, 4, 2, 19, 26, 40, 24, True, (19, 26), "bfloat16", (8, 16)),     # bf16 everything
    (1, 4, 2, 11, 9, 24, 16, True, (1, 4, 11, 9), "float64", (8, 8)),   # float64 (x64 on)
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: "x".join(map(str, c[:7]))
                         + ("-causal" if c[7] else "") + ("-mask" if c[8] else "") + "-" + c[9])
def test_grad_matches_float64(case: tuple) -> None:
    x64 = jax.enable_x64(True) if case[9] == "float64" else contextlib.nullcontext()
    with x64:
        _grad_case(case)


def _grad_case(case: tuple) -> None:
    dtype, blocks = case[9], case[10]
    x = _inputs(case, dtype)
    kw = {} if blocks is None else {"block_q": blocks[0], "block_k": blocks[1]}
    scale, fn = _build(x, **kw)
    mask = None if x["mask"] is None else jnp.asarray(x["mask"])
    w, wl = jnp.asarray(x["w"]), jnp.asarray(x["wl"])

    def loss(a: Any, b: Any, c: Any) -> Any:
        out, lse = fn(a, b, c, mask)
        return _loss(out, lse, w, wl)

    got = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x[n]) for n in "qkv"))
    for gr, n in zip(got, "qkv", strict=True):
        assert gr.dtype == x[n].dtype, (n, gr.dtype)
    ref, _ = _reference(x, scale)
    _check(got, ref, grad_bounds(x, scale, ref, dtype), f"{case}")
    if x["mask"] is not None:  # the fully masked row: exactly zero gradient
        assert np.all(np.asarray(got[0])[..., 2, :] == 0)


def test_grad_through_pk_attention_jit_vmap() -> None:
    """The user path: jit(vmap(grad)) of pk.attention(backend="jax:pallas") (bf16 here runs
    the kernels on float32 copies, the backend's interpret-mode rule), each vmapped slice
    against its own float64 reference."""
    case = (1, 4, 2, 12, 20, 40, 24, True, (1, 1, 12, 20))
    xs = [_inputs(case + (i,), "bfloat16") for i in range(2)]
    st = {n: np.stack([x[n] for x in xs]) for n in ("q", "k", "v", "mask", "w")}

    def loss(a: Any, b: Any, c: Any, m: Any, w: Any) -> Any:
        out = pk.attention(a, b, c, mask=m, causal=True, backend="jax:pallas")
        return _loss(out, None, w, None)

    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(
        *(jnp.asarray(st[n]) for n in ("q", "k", "v", "mask", "w")))
    scale = 1 / np.sqrt(40)
    for i, x in enumerate(xs):
        x = {**x, "wl": np.zeros_like(x["wl"])}  # no lse in this loss
        ref, _ = _reference(x, scale)
        _check([gr[i] for gr in got], ref, grad_bounds(x, scale, ref, "bfloat16"),
               f"jit(vmap(grad))[{i}]")
        assert np.all(np.asarray(got[0][i])[..., 2, :].astype(np.float32) == 0)


# --- the backward is the fused one -----------------------------------------------------------
def _walk(jaxpr: Any, found: list[Any]) -> None:
    """Every equation, into sub-jaxprs but not into pallas_call kernels."""
    for eqn in jaxpr.eqns:
        found.append(eqn)
        if eqn.primitive.name == "pallas_call":
            continue
        for val in eqn.params.values():
            for sub in (val if isinstance(val, (tuple, list)) else (val,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _walk(inner, found)


def test_backward_runs_the_pallas_kernels() -> None:
    """The grad's program holds the forward and the backward kernels (delta, dK/dV, dQ) and
    no float (Sq, Sk) intermediate, which the unfused VJP's probabilities would be."""
    Sq, Sk = 24, 17
    x = _inputs((1, 4, 2, Sq, Sk, 16, 8, True, (Sq, Sk)), "float32")
    _, fn = _build(x, return_lse=False)
    mask = jnp.asarray(x["mask"])
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c, mask) ** 2),
                                    argnums=(0, 1, 2)))(*(jnp.asarray(x[n]) for n in "qkv"))
    eqns: list[Any] = []
    _walk(jaxpr.jaxpr, eqns)
    names = [str(getattr(e.params["name"], "name", e.params["name"]))
             for e in eqns if e.primitive.name == "pallas_call"]
    assert len(names) >= 3, names
    assert {"portakern_attention", "portakern_attention_bwd_delta",
            "portakern_attention_bwd_dkdv", "portakern_attention_bwd_dq"} <= set(names), names
    big = [(e.primitive.name, v.aval) for e in eqns for v in e.outvars
           if getattr(v.aval, "shape", ())[-2:] == (Sq, Sk)
           and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert not big, f"an unfused (Sq, Sk) intermediate in the backward: {big[:3]}"


# --- lse -------------------------------------------------------------------------------------
def test_lse_values_shape_dtype_and_dead_rows() -> None:
    case = (2, 4, 2, 13, 30, 40, 24, True, (2, 1, 13, 30))
    x = _inputs(case, "float32")
    x["q"][0, 1, 5] = np.nan  # a NaN row: NaN output, NaN lse
    scale, fn = _build(x, block_q=8, block_k=16)
    out, lse = fn(*(jnp.asarray(x[n]) for n in "qkv"), jnp.asarray(x["mask"]))
    assert lse.shape == (2, 4, 13) and lse.dtype == jnp.float32
    assert out.shape == (2, 4, 13, 24) and out.dtype == jnp.float32
    lse = np.asarray(lse, np.float64)
    with jax.enable_x64(True):
        ref = np.asarray(_ref_lse(jnp.asarray(x["q"].astype(np.float64)),
                                  jnp.asarray(x["k"].astype(np.float64)),
                                  jnp.asarray(x["mask"]), True, scale))
    assert np.all(lse[..., 2] == -np.inf) and np.all(ref[..., 2] == -np.inf)
    assert np.isnan(lse[0, 1, 5]) and np.all(np.isnan(np.asarray(out)[0, 1, 5]))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref))
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(lse))
    # lse = m + log l: the scores err by E_s (module docstring), the sum by Sk u relative
    u = float(np.finfo(np.float32).eps) / 2
    q, k = x["q"].astype(np.float64) * scale, np.repeat(x["k"].astype(np.float64), 2, axis=1)
    q = np.where(np.isfinite(q), q, 0.0)  # the NaN row is judged by NaN-ness above
    mag = (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)).max(axis=-1)
    bound = SAFETY * ((40 + 2) * u * mag + u * (2 * np.abs(np.where(fin, ref, 0)) + 30 + 8))
    assert np.all(np.abs(lse[fin] - ref[fin]) <= bound[fin])
    # no key at all (Sk = 0): every row is dead
    x0 = {**x, "k": x["k"][:, :, :0], "v": x["v"][:, :, :0], "mask": None}
    _, fn0 = _build(x0)
    out0, lse0 = fn0(*(jnp.asarray(x0[n]) for n in "qkv"), None)
    assert lse0.shape == (2, 4, 13) and np.all(np.asarray(lse0) == -np.inf)
    assert np.all(np.asarray(out0) == 0)


def test_return_lse_false_returns_only_out() -> None:
    x = _inputs((1, 2, 2, 5, 7, 8, 8, False, None), "float32")
    _, fn = _build(x, return_lse=False)
    out = fn(*(jnp.asarray(x[n]) for n in "qkv"), None)
    assert isinstance(out, jax.Array) and out.shape == (1, 2, 5, 8)
