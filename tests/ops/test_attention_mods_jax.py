"""Issue 29 items 1-2 on jax and jax:pallas: window, softcap, bias and ALiBi slopes.

Forward: each modifier and their combinations against the float64 oracle under the op's
derived bound (``_oracle.compare_case``, the path of pk.verify), on the XLA path and the
Pallas kernel with small blocks, so the window's block skipping and multi-block walks run.

Gradients: dq, dk, dv, dbias and dslopes of pk.attention (out and lse both weighed) against
float64 jax autodiff of ``attention.semantics`` (an oracle independent of both analytic
backwards). Tolerance: every gradient entry is a sum of at most a few hundred products of
O(1) terms computed with a few roundings each in float32, so 1e-5 of the largest entry
(~100 u) is far above rounding and far below a formula error (a missing cap derivative, a
bias cotangent not summed over its broadcast dims, a slope's sign: all move entries by
O(1) of the largest). The same argument as tests/ops/test_attention_grad.py.

Mutants (the Pallas kernel, patched in place): the soft cap applied after masking, the
window's left edge off by one, and the window's block skipping off by one block.

The sharded Pallas path (explicit shardings, psum of the bias's and slopes' partial
cotangents) runs in a subprocess with 4 simulated CPU devices.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'portakern[jax]'")
jnp = jax.numpy

import portakern as pk  # noqa: E402
from portakern.core.sampling import Case  # noqa: E402
from portakern.ops import attention_pallas, get_op  # noqa: E402

from _oracle import compare_case  # noqa: E402

SPEC = get_op("attention")
TARGETS = ["jax", "jax:pallas"]
SMALL = {"block_q": 8, "block_k": 8}  # several blocks per row and column: skipping runs
B, HQ, HKV, SQ, SK, D = 2, 4, 2, 19, 27, 16
SLOPES = (2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ)).astype(np.float32)  # ALiBi's series


def _qkv(seed: int, dtype: Any = np.float32, sq: int = SQ, sk: int = SK) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"q": (rng.standard_normal((B, HQ, sq, D)) * 2).astype(dtype),
            "k": rng.standard_normal((B, HKV, sk, D)).astype(dtype),
            "v": rng.standard_normal((B, HKV, sk, D)).astype(dtype)}


def _bias(seed: int, shape: tuple[int, ...], dtype: Any = np.float32, inf: bool = False
          ) -> np.ndarray:
    rng = np.random.default_rng(seed + 100)
    b = rng.standard_normal(shape) * 2
    if inf:  # -inf entries drop keys (without a cap); a whole row of them kills the row
        b[rng.random(shape) < 0.2] = -np.inf
        if len(shape) >= 2 and shape[-2] == SQ:
            b[..., 3, :] = -np.inf
    return b.astype(dtype)


FORWARD = [  # (id, params, bias shape or None, bias with -inf, slopes, mask)
    ("window-left-softcap-50", {"window": 3, "softcap": 50.0}, None, False, False, False),
    ("window-both-causal", {"window": (5, 2), "causal": True}, None, False, False, False),
    ("window-0-0-bias-key", {"window": (0, 0)}, (SK,), False, False, False),
    ("window-wide-alibi", {"window": (200, 4)}, None, False, True, False),
    ("softcap-bends", {"softcap": 0.5, "scale": 1.0}, None, False, False, False),
    ("bias-full", {}, (B, HQ, SQ, SK), False, False, False),
    ("bias-2d-inf-dead-row", {}, (SQ, SK), True, False, False),
    ("bias-head-key-alibi-causal-window", {"causal": True, "window": 6}, (1, HQ, 1, SK), False,
     True, False),
    ("all-mask-lse", {"causal": True, "window": (7, 3), "softcap": 2.0, "return_lse": True},
     (B, 1, SQ, SK), True, True, True),
]


def _case(fid: str, params: dict[str, Any], bshape: Any, inf: bool, slopes: bool,
          mask: bool, dtype: Any = np.float32) -> Case:
    arrays: dict[str, Any] = _qkv(len(fid), dtype)
    arrays["mask"] = None
    if mask:
        arrays["mask"] = np.random.default_rng(7).random((SQ, SK)) < 0.8
    if bshape is not None:
        arrays["bias"] = _bias(len(fid), bshape, dtype, inf)
    if slopes:
        arrays["alibi_slopes"] = SLOPES
    return Case(arrays, {"causal": False, "scale": None, **params}, fid)


@pytest.mark.parametrize("path", TARGETS)
@pytest.mark.parametrize("fcase", FORWARD, ids=[f[0] for f in FORWARD])
def test_forward_matches_oracle(path: str, fcase: tuple) -> None:
    case = _case(*fcase)
    config = SMALL if path == "jax:pallas" else None
    got = pk.call(SPEC, backend=path, config=config, **case.arrays, **case.params)
    verdict = compare_case(SPEC, case, got, path)
    assert verdict.ok, f"{path} {case.describe()}\n{verdict}"


@pytest.mark.parametrize("path", TARGETS)
def test_forward_bfloat16_all_modifiers(path: str) -> None:
    case = _case("bf16-all", {"causal": True, "window": (6, 1), "softcap": 3.0},
                 (1, HQ, SQ, SK), False, True, False, dtype=jnp.bfloat16)
    got = pk.call(SPEC, backend=path, **case.arrays, **case.params)
    verdict = compare_case(SPEC, case, got, path)
    assert verdict.ok, f"{path} {case.describe()}\n{verdict}"


def test_one_built_function_never_ignores_a_bias() -> None:
    """The backend caches the jitted function by parameters, not shapes: a call with a bias
    after one without (same parameters) must still add it (it once did not on jax)."""
    x = _qkv(3)
    bias = _bias(3, (SQ, SK)) * 5
    ref = pk.attention(x["q"], x["k"], x["v"], bias=bias, backend="numpy")
    for path in TARGETS:
        pk.attention(x["q"], x["k"], x["v"], backend=path)
        got = pk.attention(x["q"], x["k"], x["v"], bias=bias, backend=path)
        assert np.max(np.abs(np.asarray(got) - ref)) < 1e-5, path


# --- gradients -------------------------------------------------------------------------------
GRADS = [  # (id, params, bias shape or None, slopes): each modifier in two of them
    ("bias-full-window", {"window": (4, 2)}, (B, HQ, SQ, SK), False),
    ("bias-2d-softcap", {"softcap": 1.0}, (SQ, SK), False),
    ("alibi-window-causal", {"window": 5, "causal": True}, None, True),
    ("all", {"causal": True, "window": (9, 3), "softcap": 2.0}, (1, HQ, 1, SK), True),
]


def _loss(out_lse: tuple[Any, Any], w: Any, wl: Any) -> Any:
    out, lse = out_lse
    return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * wl)


def _grad_inputs(gid: str) -> tuple[dict[str, Any], dict[str, Any], np.ndarray, np.ndarray]:
    """The case's arrays, parameters and the loss's weights (of out and lse)."""
    params, bshape, slopes = next(g[1:] for g in GRADS if g[0] == gid)
    x = _qkv(len(gid))
    x["bias"] = None if bshape is None else _bias(len(gid), bshape)
    x["alibi_slopes"] = SLOPES if slopes else None
    rng = np.random.default_rng(len(gid) + 1)
    w = rng.standard_normal((B, HQ, SQ, D)).astype(np.float32)
    wl = rng.standard_normal((B, HQ, SQ)).astype(np.float32)
    return x, params, w, wl


@functools.cache
def _f64_grads(gid: str) -> list[np.ndarray | None]:
    """float64 jax autodiff of the semantics: (dq, dk, dv, dbias, dslopes); one per case,
    shared by both paths."""
    x, params, w, wl = _grad_inputs(gid)
    scale = 1.0 / np.sqrt(D)
    window = params.get("window")
    if isinstance(window, int):  # what validate() makes of an int
        params = {**params, "window": (window, None)}
    with jax.enable_x64(True):
        def loss(q: Any, k: Any, v: Any, b: Any, s: Any) -> Any:
            return _loss(SPEC.semantics(jnp, q, k, v, None, b, s, return_lse=True,
                                        scale=scale, **params), jnp.asarray(w, jnp.float64),
                         jnp.asarray(wl, jnp.float64))

        args = [None if x[n] is None else jnp.asarray(x[n], jnp.float64)
                for n in ("q", "k", "v", "bias", "alibi_slopes")]
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
        return [None if g is None else np.asarray(g) for g in got]


@pytest.mark.parametrize("path", TARGETS)
@pytest.mark.parametrize("gcase", GRADS, ids=[g[0] for g in GRADS])
def test_gradients_match_float64(path: str, gcase: tuple) -> None:
    gid, _, bshape, slopes = gcase
    x, params, w, wl = _grad_inputs(gid)
    config = SMALL if path == "jax:pallas" else None

    def loss(q: Any, k: Any, v: Any, b: Any, s: Any) -> Any:
        return _loss(pk.attention(q, k, v, bias=b, alibi_slopes=s, return_lse=True,
                                  backend=path, config=config, **params), w, wl)

    names = ("q", "k", "v", "bias", "alibi_slopes")
    args = [None if x[n] is None else jnp.asarray(x[n]) for n in names]
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    if path == "jax:pallas" and (bshape is not None or slopes):  # asked for: computed
        assert "portakern_attention_bwd_dmods" in compiled.as_text()
    got = compiled(*args)
    ref = _f64_grads(gid)
    for n, g, r in zip(names, got, ref, strict=True):
        if r is None:
            assert g is None, n
            continue
        assert g.shape == r.shape and g.dtype == x[n].dtype, (n, g.shape, g.dtype)
        err = float(np.max(np.abs(np.asarray(g, np.float64) - r)))
        assert err <= 1e-5 * max(1.0, float(np.max(np.abs(r)))), f"{path} {gid} d{n}: {err}"


@pytest.mark.parametrize("path", TARGETS)
def test_dead_row_from_bias_gives_zero_gradients(path: str) -> None:
    """A bias row of -inf (no cap) is a row with no key: out 0, lse -inf, and every gradient
    through it 0, never NaN (the bias's too)."""
    x = _qkv(5)
    bias = _bias(5, (SQ, SK), inf=True)  # row 3 all -inf

    def loss(q: Any, b: Any) -> Any:
        return jnp.sum(pk.attention(q, x["k"], x["v"], bias=b, backend=path) ** 2)

    dq, db = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x["q"]), jnp.asarray(bias))
    assert np.all(np.asarray(dq)[:, :, 3] == 0)
    assert np.all(np.isfinite(np.asarray(db))) and np.all(np.asarray(db)[3] == 0)


@pytest.mark.parametrize("path", TARGETS)
def test_grad_keeps_no_autodiff_residuals(path: str) -> None:
    """With every modifier, the forward is the custom_vjp (the analytic rule on jax, the
    fused kernels on jax:pallas), not autodiff of the unfused chain: jax.vjp keeps no float
    (Sq, Sk) residual."""
    x = _qkv(6)
    kw = {"causal": True, "window": (5, 2), "softcap": 2.0}

    def f(q: Any, k: Any, v: Any, s: Any) -> Any:
        return pk.attention(q, k, v, alibi_slopes=s, backend=path, **kw)

    args = [jnp.asarray(x[n]) for n in "qkv"] + [jnp.asarray(SLOPES)]
    assert "custom_vjp_call" in str(jax.make_jaxpr(f)(*args))
    _, pullback = jax.vjp(f, *args)
    big = [r.shape for r in jax.tree_util.tree_leaves(pullback)
           if hasattr(r, "shape") and tuple(r.shape[-2:]) == (SQ, SK)]
    assert not big, f"(Sq, Sk) residuals: {big}"


def test_pallas_bias_cotangent_kernel_dropped_when_unused() -> None:
    """The (B, Hq, Sq, Sk) dS tiles of the bias's cotangent are a Pallas call of their own:
    under jit XLA drops it when only q is differentiated (test_gradients_match_float64
    finds it when the bias is)."""
    x = _qkv(8, sq=16, sk=16)
    args = [jnp.asarray(x[n]) for n in "qkv"] + [jnp.asarray(_bias(8, (16, 16)))]

    def loss(q: Any, k: Any, v: Any, b: Any) -> Any:
        return jnp.sum(pk.attention(q, k, v, bias=b, backend="jax:pallas"))

    hlo = jax.jit(jax.grad(loss)).lower(*args).compile().as_text()
    assert "portakern_attention_bwd_dq" in hlo
    assert "portakern_attention_bwd_dmods" not in hlo


# --- mutants of the Pallas kernel ------------------------------------------------------------
def _pallas_verdict(case: Case) -> Any:
    prob = SPEC.problem({n: case.arrays.get(n) for n in
                         ("q", "k", "v", "mask", "bias", "alibi_slopes")}, dict(case.params))
    fn = attention_pallas.build(prob, True, **SMALL)  # fresh: sees the patched helpers
    arrays = [None if case.arrays.get(n) is None else jnp.asarray(case.arrays[n])
              for n in ("q", "k", "v", "mask", "bias", "alibi_slopes")]
    got = fn(*arrays)
    got = tuple(np.asarray(g) for g in got) if isinstance(got, tuple) else np.asarray(got)
    return compare_case(SPEC, case, got, "jax:pallas")


def _cap_after_mask(s: Any, keep: Any, qidx: Any, kidx: Any, bias: Any, slope: Any,
                    softcap: float | None) -> Any:
    s = jnp.where(keep, s, -jnp.inf)
    return attention_pallas._modify(s, qidx, kidx, bias, slope, softcap)


def _window_left_off_by_one(keep: Any, qidx: Any, kidx: Any, causal: bool,
                            window: Any) -> Any:
    if window is not None:
        window = (window[0] + 1, window[1])
    return ORIGINAL_KEEP(keep, qidx, kidx, causal, window)


def _skip_one_block_too_many(qi: Any, bq: int, bk: int, nk: int, causal: bool, window: Any,
                             dynamic: bool) -> tuple[Any, Any]:
    lo, hi = ORIGINAL_BLOCKS(qi, bq, bk, nk, causal, window, dynamic)
    return (lo + 1 if window is not None else lo), hi


ORIGINAL_KEEP = attention_pallas._keep_positions
ORIGINAL_BLOCKS = attention_pallas._key_blocks
MUTANTS = [  # (name, attribute, replacement, the FORWARD case that must catch it)
    ("softcap after masking", "_masked_scores", _cap_after_mask, FORWARD[8]),
    ("window left edge off by one", "_keep_positions", _window_left_off_by_one, FORWARD[1]),
    ("window block skipping off by one", "_key_blocks", _skip_one_block_too_many,
     FORWARD[1]),
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_pallas_mutants_are_caught(mutant: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    _, attr, replacement, fcase = mutant
    case = _case(*fcase)  # test_forward_matches_oracle passes it unpatched
    monkeypatch.setattr(attention_pallas, attr, replacement)
    assert not _pallas_verdict(case).ok, f"mutant {mutant[0]!r} not caught"


# --- explicit shardings ----------------------------------------------------------------------
SHARDED = textwrap.dedent('''
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import portakern as pk

    assert len(jax.devices()) == 4, jax.devices()
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((2, 2), ("b", "h"))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 11, 13, 8
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    w = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    sl = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    bias = rng.standard_normal((Sq, Sk)).astype(np.float32)  # broadcast over both split dims
    kw = dict(causal=True, window=(4, 2), softcap=3.0, backend="jax:pallas")

    def f(q, k, v, b, s):
        return pk.attention(q, k, v, bias=b, alibi_slopes=s, **kw)

    sh = (put(q, P("b", "h")), put(k, P("b", "h")), put(v, P("b", "h")), put(bias, P()),
          put(sl, P("h")))
    plain = tuple(jnp.asarray(x) for x in (q, k, v, bias, sl))
    with jax.set_mesh(mesh):
        out, pullback = jax.vjp(f, *sh)
        assert out.sharding.spec[:2] == ("b", "h"), out.sharding
        gs = pullback(put(w, P("b", "h")))
    ref, pullback = jax.vjp(f, *plain)
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    gp = pullback(jnp.asarray(w))
    for a, b_, n in zip(gs, gp, ("q", "k", "v", "bias", "slopes")):
        assert a.shape == b_.shape, (n, a.shape, b_.shape)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6,
                                   err_msg=n)
    print("OK")
''')


def test_pallas_modifiers_under_explicit_sharding() -> None:
    """Per-shard kernels with a bias broadcast over the split batch and head dims and
    head-split slopes: the forward equals the unsharded one bit for bit; the gradients
    (the bias's and slopes' psum-ed over the shards) match it."""
    if not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "reshard"):
        pytest.skip("this jax has no explicit sharding in types")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=4").strip())
    env.pop("PORTAKERN_BACKEND", None)
    res = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-8000:]
