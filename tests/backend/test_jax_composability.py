"""The JAX backend: numerics against the float64 oracle, and composition with jit/vmap/grad.

Both paths are covered: "jax:cpu" (the semantics lowered by XLA) and "jax:pallas" (the fused
Pallas attention kernel, interpret mode on this CPU; other ops fall back to XLA). Errors are
judged by each op's derived bound (spec.tolerance), never by a hand-picked atol. Gradients
are checked against central finite differences of the float64 semantics in numpy (directional
derivatives along random directions), and the Pallas backward against the XLA backward.
Multi-device sharding lives in test_jax_sharding.py (it needs a fresh process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend needs jax: pip install 'portakern[jax]'")
jnp = pytest.importorskip("jax.numpy", reason="jax.numpy ships with jax")

import portakern as pk  # noqa: E402
from portakern.core.errors import (  # noqa: E402
    BackendUnavailable,
    InvalidArgumentError,
    UnknownBackendError,
    UnsupportedDTypeError,
)
from portakern.ops import get_op  # noqa: E402
from portakern.runtime import selection  # noqa: E402

TARGETS = ["jax:cpu", "jax:pallas"]
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "float64": np.float64}


# --- helpers ---------------------------------------------------------------------------------
def oracle(op: str, arrays: dict[str, Any], params: dict[str, Any]) -> tuple[Any, np.ndarray,
                                                                           np.ndarray]:
    """(problem, float64 reference, bound) for numpy operands in their storage dtype."""
    spec = get_op(op)
    prob = spec.problem(arrays, params)
    x64 = {k: (v if v.dtype == bool else np.asarray(v).astype(np.float64))
           for k, v in arrays.items() if v is not None}
    with np.errstate(all="ignore"):
        ref = np.asarray(spec.semantics(np, *[x64.get(o.name) for o in spec.operands],
                                        **prob.params), dtype=np.float64)
        tol = spec.tolerance(prob, x64, ref)
    return prob, ref, tol


def assert_within_bound(op: str, arrays: dict[str, Any], params: dict[str, Any], got: Any,
                        what: str = "") -> None:
    _, ref, tol = oracle(op, arrays, params)
    out = np.asarray(got).astype(np.float64)
    assert out.shape == ref.shape, f"{op} {what}: shape {out.shape}, expected {ref.shape}"
    assert not np.isnan(out).any() or np.isnan(ref).any(), f"{op} {what}: NaN in the result"
    err = np.abs(out - ref)
    bad = ~(err <= tol)
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(tol, 1e-300), 0)),
                               err.shape)
        pytest.fail(f"{op} {what}: error {err[idx]:.3g} > bound {tol[idx]:.3g} at {idx} "
                    f"(got {out[idx]!r}, expected {ref[idx]!r}); {int(bad.sum())} elements out")


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    return rng.standard_normal(shape).astype(NP_DTYPES[dtype])


def attn_inputs(rng: np.random.Generator, B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int,
                Dv: int, dtype: str = "float32") -> dict[str, np.ndarray]:
    return {"q": rand(rng, (B, Hq, Sq, D), dtype), "k": rand(rng, (B, Hkv, Sk, D), dtype),
            "v": rand(rng, (B, Hkv, Sk, Dv), dtype)}


# --- numerics: differential against the float64 oracle ---------------------------------------
ATTN_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, Dv, causal, mask shape (None = no mask)
    (1, 2, 2, 5, 7, 40, 59, False, None),
    (2, 4, 2, 33, 17, 59, 40, True, None),          # GQA, Sq > Sk, causal
    (2, 4, 1, 20, 31, 80, 111, False, (2, 1, 20, 31)),  # MQA, mask broadcast over heads
    (1, 2, 2, 19, 30, 111, 80, True, (19, 30)),     # causal + 2-D mask
    (1, 3, 3, 1, 1, 1, 1, False, None),              # tiny
    (1, 2, 1, 65, 130, 64, 32, True, (1, 1, 1, 130)),  # key-padding mask, > one block
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("jtarget", TARGETS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "x".join(map(str, c[:7])))
def test_attention_matches_oracle(case: tuple, jtarget: str, dtype: str) -> None:
    B, Hq, Hkv, Sq, Sk, D, Dv, causal, mshape = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    arrays = attn_inputs(rng, B, Hq, Hkv, Sq, Sk, D, Dv, dtype)
    arrays["mask"] = None if mshape is None else rng.random(mshape) > 0.3
    if mshape is not None and mshape[-2] > 1:
        arrays["mask"][..., 0, :] = False  # a fully masked query row must give 0, not NaN
    got = pk.attention(**{k: arrays[k] for k in "qkv"}, mask=arrays["mask"], causal=causal,
                       backend=jtarget)
    assert isinstance(got, np.ndarray) and got.dtype == arrays["q"].dtype
    assert_within_bound("attention", arrays, {"causal": causal, "scale": None}, got, jtarget)
    if mshape is not None and mshape[-2] > 1:
        assert np.all(got[..., 0, :].astype(np.float64) == 0.0)


@pytest.mark.parametrize("blocks", [(8, 8), (8, 16), (16, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_pallas_small_blocks(blocks: tuple[int, int], causal: bool) -> None:
    """Many query and key blocks: online rescaling, causal block skipping, padded tails."""
    rng = np.random.default_rng(7)
    arrays = attn_inputs(rng, 1, 4, 2, 37, 29, 40, 24)
    arrays["mask"] = rng.random((37, 29)) > 0.2
    arrays["q"] *= 4.0  # peaky scores: the running max changes between blocks
    got = pk.attention(arrays["q"], arrays["k"], arrays["v"], mask=arrays["mask"],
                       causal=causal, scale=0.3, backend="jax:pallas",
                       config={"block_q": blocks[0], "block_k": blocks[1]})
    assert_within_bound("attention", arrays, {"causal": causal, "scale": 0.3}, got,
                        f"blocks {blocks}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("jtarget", TARGETS)
def test_matmul_softmax_match_oracle(jtarget: str, dtype: str) -> None:
    rng = np.random.default_rng(3)
    for sa, sb in [((3, 17, 33), (33, 5)), ((2, 1, 4, 7), (3, 7, 9)), ((1, 1), (1, 1))]:
        arrays = {"a": rand(rng, sa, dtype), "b": rand(rng, sb, dtype)}
        got = pk.matmul(arrays["a"], arrays["b"], backend=jtarget)
        assert_within_bound("matmul", arrays, {}, got, f"{jtarget} {sa}@{sb}")
    x = rand(rng, (4, 37, 5), dtype) * 30 + 100  # large offsets: max-subtraction matters
    x[0, :, 0] = -np.inf  # a row of only -inf gives zeros
    for axis in (-1, 1, 0):
        got = pk.softmax(x, axis=axis, backend=jtarget)
        assert_within_bound("softmax", {"x": x}, {"axis": axis % 3}, got, f"axis {axis}")


def test_float64_refused_without_x64() -> None:
    if jax.config.read("jax_enable_x64"):
        pytest.skip("jax_enable_x64 is on in this process")
    a = np.ones((2, 2))
    for target in TARGETS:
        assert "float64" not in selection.get(target).supported_dtypes()
        with pytest.raises(UnsupportedDTypeError, match="jax_enable_x64"):
            pk.matmul(a, a, backend=target)


def test_float64_with_x64_subprocess() -> None:
    """With JAX_ENABLE_X64=1 float64 runs (XLA and Pallas) and meets the float64 bound."""
    script = textwrap.dedent("""
        import numpy as np, portakern as pk
        from portakern.runtime import selection
        from portakern.ops import get_op
        rng = np.random.default_rng(0)
        q, k, v = rng.standard_normal((1, 4, 13, 40)), rng.standard_normal((1, 2, 9, 40)), \\
            rng.standard_normal((1, 2, 9, 24))
        spec = get_op("attention")
        prob = spec.problem({"q": q, "k": k, "v": v, "mask": None},
                            {"causal": True, "scale": None})
        ref = spec.semantics(np, q, k, v, None, **prob.params)
        tol = spec.tolerance(prob, {"q": q, "k": k, "v": v}, ref)
        for t in ("jax:cpu", "jax:pallas"):
            assert "float64" in selection.get(t).supported_dtypes(), t
            got = pk.attention(q, k, v, causal=True, backend=t)
            assert got.dtype == np.float64, got.dtype
            assert np.all(np.abs(got - ref) <= tol), (t, np.abs(got - ref).max())
        a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
        assert np.abs(pk.matmul(a, b, backend="jax") - a @ b).max() < 1e-13
        # x64 switched off after the call was planned: refused, not computed in float32
        import jax
        jax.config.update("jax_enable_x64", False)
        try:
            pk.matmul(a, b, backend="jax")
        except pk.UnsupportedDTypeError as exc:
            assert "jax_enable_x64" in str(exc)
        else:
            raise AssertionError("a planned float64 call ran with x64 off")
        print("OK")
    """)
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


# --- composability: jit, vmap, grad ----------------------------------------------------------
def test_inside_jit() -> None:
    rng = np.random.default_rng(1)
    a, b = jnp.asarray(rand(rng, (4, 9, 6))), jnp.asarray(rand(rng, (6, 5)))
    eager = pk.matmul(a, b, backend="jax")
    f = jax.jit(lambda x, y: pk.matmul(x, y, backend="jax"))
    assert isinstance(f(a, b), jax.Array)
    np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(eager))
    g = jax.jit(lambda x, y: pk.softmax(pk.matmul(x, y), axis=1))  # automatic: jax inputs
    assert_within_bound("softmax", {"x": np.asarray(eager)}, {"axis": 1}, g(a, b))
    q = jnp.asarray(rand(rng, (2, 4, 11, 40)))
    k, v = jnp.asarray(rand(rng, (2, 2, 13, 40))), jnp.asarray(rand(rng, (2, 2, 13, 24)))
    for target in TARGETS:
        h = jax.jit(lambda q, k, v, t=target: pk.attention(q, k, v, causal=True, backend=t))
        assert_within_bound("attention", {"q": np.asarray(q), "k": np.asarray(k),
                                          "v": np.asarray(v)},
                            {"causal": True, "scale": None}, h(q, k, v), f"jit {target}")
    # numpy operands inside a trace give traced results (like jnp), not a host round trip
    bn = np.asarray(b)
    out = jax.jit(lambda x: pk.matmul(x, bn, backend="jax"))(a)
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), rtol=1e-6, atol=1e-6)


def test_jit_cache_reused_across_calls() -> None:
    be = selection.get("jax:cpu")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rand(rng, (3, 8)))
    pk.softmax(x, backend=be)
    before = be.cache_info()["functions"]["inserts"]
    pk.softmax(x * 2, backend=be)
    pk.softmax(jnp.asarray(rand(rng, (5, 8))), backend=be)  # new shape: jit retraces, same fn
    # no new function made (the executable bound may evict old ones, so not "same count")
    assert be.cache_info()["functions"]["inserts"] == before


@pytest.mark.parametrize("jtarget", TARGETS)
def test_vmap(jtarget: str) -> None:
    rng = np.random.default_rng(4)
    q, k = rand(rng, (3, 2, 4, 9, 40)), rand(rng, (3, 2, 2, 11, 40))
    v = rand(rng, (3, 2, 2, 11, 24))
    mask = rng.random((3, 9, 11)) > 0.4
    out = jax.vmap(lambda a, b, c, m: pk.attention(a, b, c, mask=m, backend=jtarget))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    for i in range(3):
        assert_within_bound("attention", {"q": q[i], "k": k[i], "v": v[i], "mask": mask[i]},
                            {"causal": False, "scale": None}, out[i], f"vmap {jtarget}[{i}]")
    a, b = rand(rng, (3, 7, 5)), rand(rng, (3, 5, 4))
    mm = jax.vmap(lambda x, y: pk.matmul(x, y, backend=jtarget))(jnp.asarray(a), jnp.asarray(b))
    sm = jax.vmap(lambda x: pk.softmax(x, axis=0, backend=jtarget), in_axes=1, out_axes=1)(
        jnp.asarray(a))
    for i in range(3):
        assert_within_bound("matmul", {"a": a[i], "b": b[i]}, {}, mm[i])
        assert_within_bound("softmax", {"x": a[:, :, i]}, {"axis": 0}, sm[:, :, i])


def _fd_check(op: str, jax_loss: Any, np_loss: Any, args: list[np.ndarray],
              rng: np.random.Generator) -> list[np.ndarray]:
    """jax.grad (float32) vs central differences of the float64 numpy loss, 3 directions."""
    grads = jax.grad(jax_loss, argnums=tuple(range(len(args))))(*[jnp.asarray(a) for a in args])
    grads = [np.asarray(g, dtype=np.float64) for g in grads]
    x64 = [a.astype(np.float64) for a in args]
    h = 1e-5
    for _ in range(3):
        dirs = [rng.standard_normal(a.shape) for a in args]
        fd = (np_loss(*[x + h * d for x, d in zip(x64, dirs, strict=True)])
              - np_loss(*[x - h * d for x, d in zip(x64, dirs, strict=True)])) / (2 * h)
        ad = sum(float(np.sum(g * d)) for g, d in zip(grads, dirs, strict=True))
        scale = sum(float(np.sum(np.abs(g * d))) for g, d in zip(grads, dirs, strict=True))
        assert abs(ad - fd) <= 1e-4 * scale + 1e-6, f"{op}: grad.d = {ad}, finite diff {fd}"
        assert all(np.isfinite(g).all() for g in grads), f"{op}: non-finite gradient"
    return grads


@pytest.mark.parametrize("jtarget", TARGETS)
def test_grad_matmul_softmax(jtarget: str) -> None:
    rng = np.random.default_rng(5)
    a, b = rand(rng, (2, 6, 5)), rand(rng, (5, 4))
    w = rng.standard_normal((2, 6, 4))
    _fd_check("matmul", lambda x, y: jnp.sum(w * pk.matmul(x, y, backend=jtarget)),
              lambda x, y: float(np.sum(w * (x @ y))), [a, b], rng)
    x = rand(rng, (3, 7)) * 3
    ws = rng.standard_normal((3, 7))
    sm = get_op("softmax").semantics
    _fd_check("softmax", lambda t: jnp.sum(ws * pk.softmax(t, backend=jtarget)),
              lambda t: float(np.sum(ws * sm(np, t, axis=-1))), [x], rng)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_grad_attention_xla_and_pallas(causal: bool, masked: bool) -> None:
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (1, 4, 9, 40)), rand(rng, (1, 2, 11, 40)), rand(rng, (1, 2, 11, 24))
    mask = None
    if masked:
        mask = rng.random((1, 1, 9, 11)) > 0.3
        mask[..., 2, :] = False  # fully masked row: zero output, zero (not NaN) gradient
    w = rng.standard_normal((1, 4, 9, 24))
    sem = get_op("attention").semantics
    mj = None if mask is None else jnp.asarray(mask)

    def np_loss(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> float:
        with np.errstate(all="ignore"):
            return float(np.sum(w * sem(np, a, b, c, mask, causal=causal, scale=None)))

    grads = {}
    for target in TARGETS:
        def loss(a: Any, b: Any, c: Any, t: str = target) -> Any:
            return jnp.sum(w * pk.attention(a, b, c, mask=mj, causal=causal, backend=t))

        grads[target] = _fd_check(f"attention {target}", loss, np_loss, [q, k, v], rng)
    for gx, gp in zip(grads["jax:cpu"], grads["jax:pallas"], strict=True):
        np.testing.assert_allclose(gp, gx, rtol=1e-4, atol=1e-5)
    if masked:
        assert np.all(grads["jax:pallas"][0][..., 2, :] == 0.0)


def test_grad_under_jit_and_vmap_pallas() -> None:
    rng = np.random.default_rng(8)
    q, k, v = (jnp.asarray(rand(rng, s)) for s in ((2, 1, 2, 6, 16), (2, 1, 1, 6, 16),
                                                    (2, 1, 1, 6, 8)))

    def loss(a: Any, b: Any, c: Any, t: str) -> Any:
        return jnp.sum(pk.attention(a, b, c, causal=True, backend=t) ** 2)

    gp = jax.jit(jax.vmap(jax.grad(lambda a, b, c: loss(a, b, c, "jax:pallas"))))(q, k, v)
    gx = jax.vmap(jax.grad(lambda a, b, c: loss(a, b, c, "jax:cpu")))(q, k, v)
    np.testing.assert_allclose(np.asarray(gp), np.asarray(gx), rtol=1e-4, atol=1e-5)


# --- arrays, transfers, selection ------------------------------------------------------------
def test_jax_in_jax_out_zero_transfers() -> None:
    rng = np.random.default_rng(9)
    a, b = jnp.asarray(rand(rng, (4, 5))), jnp.asarray(rand(rng, (5, 3)))
    assert selection.owner_of([a, b]) == "jax"
    be = selection.get("jax")
    be.transfers.reset()
    out = pk.matmul(a, b)  # automatic selection follows the jax inputs
    assert isinstance(out, jax.Array)
    q = jnp.asarray(rand(rng, (1, 2, 3, 8)))
    assert isinstance(pk.attention(q, q, q), jax.Array)
    assert isinstance(pk.softmax(a), jax.Array)
    assert be.transfers.snapshot() == {"h2d": 0, "d2h": 0, "h2d_bytes": 0, "d2h_bytes": 0}


def test_numpy_in_numpy_out_counted() -> None:
    be = selection.get("jax:cpu")
    be.transfers.reset()
    a, b = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    out = pk.matmul(a, b, backend=be)
    assert isinstance(out, np.ndarray) and np.all(out == 5)
    assert be.transfers.snapshot() == {"h2d": 2, "d2h": 1, "h2d_bytes": a.nbytes + b.nbytes,
                                       "d2h_bytes": out.nbytes}


def test_to_backend_dlpack_counted() -> None:
    be = selection.get("jax")
    be.transfers.reset()
    before = be.dlpack_imports
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = pk.to_backend(x, "jax")
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(np.asarray(y), x)
    assert be.dlpack_imports == before + 1
    assert be.transfers.h2d == 1 and be.transfers.h2d_bytes == x.nbytes
    z = pk.to_backend(np.ones((2, 2), ml_dtypes.bfloat16), "jax")  # no DLPack: host copy
    assert isinstance(z, jax.Array) and be.transfers.h2d == 2
    assert pk.to_backend(y, "jax") is y  # already native: untouched, not counted
    assert be.transfers.h2d == 2


def test_selectors_and_probe() -> None:
    av = pk.backends()["jax"]
    assert av["available"] and av["versions"]["jax"] == jax.__version__
    assert av["devices"][0]["kind"] in ("cpu", "gpu", "tpu")
    cls = type(selection.get("jax"))
    assert cls.test_targets()[1] == "jax:pallas"
    assert selection.get("jax:pallas").pallas and not selection.get("jax:0").pallas
    assert selection.get("jax:pallas_cpu").device.kind == "cpu"
    assert selection.get("jax:cpu").device.kind == "cpu"
    kinds = {d["kind"] for d in av["devices"]}
    for kind in ("gpu", "tpu"):
        if kind not in kinds:
            with pytest.raises(BackendUnavailable, match="Fix"):
                selection.get(f"jax:{kind}")
    with pytest.raises(BackendUnavailable, match="does not exist"):
        selection.get(f"jax:{len(av['devices']) + 3}")
    with pytest.raises(UnknownBackendError, match="jax:pallas"):
        selection.get("jax:nonsense")


def test_tunable_validation() -> None:
    q = np.ones((1, 1, 4, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match="block_q"):
        pk.attention(q, q, q, backend="jax:pallas", config={"block_q": 7})
    with pytest.raises(InvalidArgumentError, match="unknown tunable"):
        pk.attention(q, q, q, backend="jax:pallas", config={"TM": 4})
    with pytest.raises(InvalidArgumentError):
        pk.attention(q, q, q, backend="jax:cpu", config={"BQ": 3})
    got = pk.attention(q, q, q, backend="jax:pallas", config={"BQ": 8, "BK": 16})
    assert_within_bound("attention", {"q": q, "k": q, "v": q}, {"causal": False, "scale": None},
                        got)


def test_import_portakern_does_not_import_jax() -> None:
    code = "import sys, portakern; assert 'jax' not in sys.modules, 'jax imported'; print('OK')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr
