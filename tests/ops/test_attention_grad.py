"""jax.grad through pk.attention(backend="jax") runs the analytic backward (ops/attention_xla.py:
a custom_vjp over the forward with its log-sum-exp), not the autodiff of the unfused chain;
and pk.attention_backward on every C-kernel target equals float64 autodiff of the forward's
semantics (an oracle independent of attention_backward.semantics)."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.ops import attention as A

jax = pytest.importorskip("jax", reason="the jax backend's gradient")
jnp = jax.numpy


def _inputs(seed: int = 0, B: int = 2, Hq: int = 4, Hkv: int = 2, Sq: int = 9, Sk: int = 7,
            D: int = 16, Dv: int = 8) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, Dv)).astype(np.float32)
    w = rng.standard_normal((B, Hq, Sq, Dv)).astype(np.float32)
    mask = rng.random((Sq, Sk)) < 0.7
    mask[1] = False  # a dead row: gradient 0
    return q, k, v, w, mask


def _f64_grads(q, k, v, w, mask, causal, scale, lse_weight=0.0):  # noqa: ANN001, ANN202
    """float64 jax autodiff of the forward semantics (the unfused chain)."""
    with jax.enable_x64(True):
        def loss(q, k, v):  # noqa: ANN001, ANN202
            m = None if mask is None else jnp.asarray(mask)
            o, lse = A.semantics(jnp, q, k, v, mask=m, causal=causal, scale=scale,
                                 return_lse=True)
            return jnp.sum(o * w) + lse_weight * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(
            *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))]


def _close(got, ref, what):  # noqa: ANN001, ANN202
    # float32 against float64: every entry is a sum of O(Sq) products of O(1) terms, computed
    # with a few roundings each; 1e-5 of the largest entry is ~100 u, far above that and far
    # below any formula error (a missing delta or scale moves entries by O(1))
    for g, r, n in zip(got, ref, "qkv", strict=True):
        err = float(np.max(np.abs(np.asarray(g, np.float64) - r)))
        assert err <= 1e-5 * max(1.0, float(np.max(np.abs(r)))), f"{what} d{n}: {err}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_jax_grad_is_the_analytic_backward(causal: bool, scale: float | None) -> None:
    q, k, v, w, mask = _inputs()

    def loss(q, k, v):  # noqa: ANN001, ANN202
        return jnp.sum(pk.attention(q, k, v, mask=mask, causal=causal, scale=scale,
                                    backend="jax") * w)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    _close(g, _f64_grads(q, k, v, w, mask, causal, scale), f"jax causal={causal}")
    assert np.all(np.asarray(g[0])[:, :, 1] == 0)  # the dead row
    text = str(jax.make_jaxpr(loss)(q, k, v))
    assert "custom_vjp_call" in text  # the analytic rule, not autodiff of the chain


def test_jax_grad_through_lse_and_under_vmap() -> None:
    q, k, v, w, mask = _inputs(1)

    def loss(q, k, v):  # noqa: ANN001, ANN202
        o, lse = pk.attention(q, k, v, mask=mask, causal=True, return_lse=True, backend="jax")
        return jnp.sum(o * w) + 0.5 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    _close(g, _f64_grads(q, k, v, w, mask, True, None, lse_weight=0.5), "lse")
    per = jax.vmap(lambda q, k, v: jax.grad(lambda q: jnp.sum(pk.attention(
        q[None], k[None], v[None], causal=True, backend="jax") * w[:1]))(q))(q, k, v)
    for b in range(q.shape[0]):
        ref = _f64_grads(q[b:b + 1], k[b:b + 1], v[b:b + 1], w[:1], None, True, None)[0]
        assert np.max(np.abs(np.asarray(per[b]) - ref[0])) <= 1e-5 * max(1, np.abs(ref).max())


def test_attention_backward_on_every_kernel_target_equals_autodiff() -> None:
    from conftest import KERNEL_TARGETS

    if not KERNEL_TARGETS:
        pytest.skip("no C-kernel backend here")
    q, k, v, w, mask = _inputs(2)
    ref = _f64_grads(q, k, v, w, mask, True, None)
    out, lse = pk.attention(q, k, v, mask=mask, causal=True, return_lse=True, backend="numpy")
    for target in KERNEL_TARGETS:
        got = pk.attention_backward(w, q, k, v, out, lse, mask=mask, causal=True,
                                    backend=target)
        _close(got, ref, target)


def test_bad_lse_and_do_are_refused_before_any_work() -> None:
    q, k, v, w, _ = _inputs(3)
    out, lse = pk.attention(q, k, v, return_lse=True, backend="numpy")
    with pytest.raises(pk.DTypeError, match="float32"):
        pk.attention_backward(w, q, k, v, out, lse.astype(np.float64), backend="numpy")
    with pytest.raises(pk.ShapeError, match=r"\(B, Hq, Sq\)"):
        pk.attention_backward(w, q, k, v, out, lse[..., :-1], backend="numpy")
    with pytest.raises(pk.ShapeError, match="do"):
        pk.attention_backward(w[..., :-1], q, k, v, out, lse, backend="numpy")
    with pytest.raises(pk.DTypeError):
        pk.attention_backward(w.astype(np.float16), q, k, v, out, lse, backend="numpy")


def test_attention_backward_head_dims_up_to_256() -> None:
    """Issue 28: D and Dv up to 256 (the kernels' register arrays and packed rows are sized
    by them at compile time), on every C-kernel target, against float64 autodiff."""
    from conftest import KERNEL_TARGETS

    if not KERNEL_TARGETS:
        pytest.skip("no C-kernel backend here")
    for d, dv in ((256, 256), (128, 40)):
        q, k, v, w, mask = _inputs(4, B=1, Hq=2, Hkv=1, Sq=11, Sk=13, D=d, Dv=dv)
        ref = _f64_grads(q, k, v, w, mask, False, None)
        out, lse = pk.attention(q, k, v, mask=mask, return_lse=True, backend="numpy")
        for target in KERNEL_TARGETS:
            got = pk.attention_backward(w, q, k, v, out, lse, mask=mask, backend=target)
            _close(got, ref, f"{target} D={d} Dv={dv}")
