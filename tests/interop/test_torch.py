"""portakern.torch (docs/torch.md): torch tensors in and out of every public op, the
``torch.ops.portakern.*`` custom ops (fake implementations, autograd), torch.compile with
fullgraph=True, and a small module trained with portakern's ops against torch's own.

Skipped only where torch cannot be imported (CI installs it: there a missing torch fails)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.runtime import selection

try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # pragma: no cover - CI has torch
    if os.environ.get("CI"):
        raise
    pytest.skip(f"torch is not importable ({exc}). Fix: pip install -e '.[torch]'.",
                allow_module_level=True)

import portakern.torch as pkt
from portakern.interop import torch_ops

from conftest import TARGETS

U32 = 2.0 ** -24  # float32's unit roundoff


def _t(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0,
       grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919 * len(shape) + sum(shape))
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(grad)


def _calls(dtype: torch.dtype) -> list[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...]]]:
    """(label, the public function, tensors) of every op, small shapes."""
    q, k, v = _t(1, 4, 5, 8, dtype=dtype, seed=1), _t(1, 2, 7, 8, dtype=dtype, seed=2), \
        _t(1, 2, 7, 6, dtype=dtype, seed=3)
    mask = torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    return [
        ("matmul", pk.matmul, (_t(2, 3, 9, dtype=dtype), _t(9, 4, dtype=dtype, seed=5))),
        ("softmax", lambda x: pk.softmax(x, axis=0), (_t(6, 5, dtype=dtype),)),
        ("rmsnorm", lambda x, w: pk.rmsnorm(x, w, eps=1e-5),
         (_t(3, 16, dtype=dtype), _t(16, dtype=dtype, seed=6))),
        ("attention", lambda q, k, v, m: pk.attention(q, k, v, causal=True, mask=m),
         (q, k, v, mask)),
        ("attention_lse", lambda q, k, v: pk.attention(q, k, v, return_lse=True), (q, k, v)),
    ]


def _numpy_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(pk.core.dtypes.bfloat16)
    return t.numpy()


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


# --- tensors in, tensors out ------------------------------------------------------------
def test_tensors_in_and_out_equal_the_arrays_path(target: str) -> None:
    """On every target, a call on CPU tensors returns CPU tensors of the dtype and shape
    the same call on the tensors' numpy views returns, with the same values bit for bit (the
    same backend runs the same data), and the same host<->device copies counted."""
    with pk.use(target):
        for label, fn, tensors in _calls(torch.float32):
            got = _as_tuple(fn(*tensors))
            want = _as_tuple(fn(*[_numpy_of(t) for t in tensors]))
            assert len(got) == len(want), label
            for g, w in zip(got, want):
                assert isinstance(g, torch.Tensor) and g.device.type == "cpu", label
                assert tuple(g.shape) == w.shape and _numpy_of(g).dtype == w.dtype, label
                np.testing.assert_array_equal(_numpy_of(g), w, err_msg=f"{label} on {target}")


def test_cpu_tensors_pass_as_views_and_results_come_back_without_copies() -> None:
    x = _t(4, 8)
    view = torch_ops._host(x)
    assert view.ctypes.data == x.data_ptr()  # the tensor's own memory, no copy
    xb = x.to(torch.bfloat16)
    assert torch_ops._host(xb).ctypes.data == xb.data_ptr()
    r = np.ones((3, 2), np.float32)
    assert torch_ops._from_host(r, torch.device("cpu")).data_ptr() == r.ctypes.data


def test_host_copies_are_counted_as_for_numpy() -> None:
    """On opencl the upload of each operand and the download of the result are counted in
    backend.transfers exactly as for numpy arrays."""
    target = next((t for t in TARGETS if t.startswith("opencl")), None)
    if target is None:
        pytest.skip("no OpenCL target here")
    be = selection.get(target)
    a, b = _t(5, 7), _t(7, 3, seed=1)
    pk.matmul(a, b, backend=target)  # compiled and planned

    def counted(x: Any, y: Any) -> dict[str, int]:
        before = be.transfers.snapshot()
        pk.matmul(x, y, backend=target)
        return {k: v - before[k] for k, v in be.transfers.snapshot().items()}

    got = counted(a, b)
    assert got == counted(a.numpy(), b.numpy())
    assert (got["h2d"], got["d2h"]) == (2, 1) and got["h2d_bytes"] == (35 + 21) * 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_and_shapes_are_kept(dtype: torch.dtype) -> None:
    """The output has the inputs' dtype (attention's lse: the compute type, as for arrays)."""
    with pk.use("numpy"):
        for label, fn, tensors in _calls(dtype):
            got = _as_tuple(fn(*tensors))
            want = _as_tuple(fn(*[_numpy_of(t) for t in tensors]))
            assert got[0].dtype is dtype, label
            for g, w in zip(got, want):
                assert _numpy_of(g).dtype == w.dtype and tuple(g.shape) == w.shape, label
                np.testing.assert_array_equal(_numpy_of(g), w, err_msg=label)


def test_non_contiguous_tensors_and_parameters() -> None:
    a = _t(9, 6).T  # a transposed view
    b = torch.nn.Parameter(_t(9, 4, seed=1))
    got = pk.matmul(a, b, backend="numpy")
    np.testing.assert_array_equal(got.detach().numpy(),
                                  pk.matmul(np.ascontiguousarray(a.numpy()),
                                            b.detach().numpy(), backend="numpy"))


# --- refusals -------------------------------------------------------------------------------
def test_mixed_torch_and_other_arrays_are_refused_by_name() -> None:
    a, b = _t(2, 3), _t(3, 4)
    cases: list[Callable[[], Any]] = [
        lambda: pk.matmul(a.numpy(), b),
        lambda: pk.matmul(a, b.numpy()),
        lambda: pk.call("matmul", a, b.numpy()),
        lambda: pk.call("matmul", a.numpy(), b=b),
        lambda: pk.rmsnorm(_t(2, 3), np.ones(3, np.float32)),
    ]
    for case in cases:
        with pytest.raises(pk.InvalidArgumentError) as err:
            case()
        msg = str(err.value)
        assert "torch.Tensor" in msg and "numpy.ndarray" in msg and "torch.from_numpy" in msg
    with pytest.raises(pk.InvalidArgumentError, match=r"a: numpy\.ndarray, b: torch\.Tensor"):
        pk.matmul(a.numpy(), b)
    q = _t(1, 1, 3, 4)
    with pytest.raises(pk.InvalidArgumentError, match=r"mask: numpy\.ndarray"):
        pk.attention(q, q, q, mask=np.ones((3, 3), bool))


def test_the_specs_validation_speaks_for_tensors_too() -> None:
    x = _t(3, 4)
    with pytest.raises(pk.InvalidArgumentError, match="axis"):
        pk.softmax(x, axis=2)
    with pytest.raises(pk.InvalidArgumentError, match="causal"):
        pk.attention(_t(1, 1, 2, 4), _t(1, 1, 2, 4), _t(1, 1, 2, 4), causal=1)
    with pytest.raises(pk.ShapeError):
        pk.matmul(x, _t(5, 2))
    with pytest.raises(pk.DTypeError):
        pk.matmul(x, _t(4, 2, dtype=torch.float64))
    with pytest.raises(pk.InvalidArgumentError, match="unexpected argument"):
        pk.softmax(x, bogus=1)
    with pytest.raises(pk.InvalidArgumentError, match="out="):
        pk.softmax(x, out=torch.empty(3, 4))


def test_gradients_are_never_dropped_silently() -> None:
    """An op without a backward (attention_backward; a user op registered without one)
    refuses to be differentiated instead of detaching its inputs."""
    q, k, v = _t(1, 2, 3, 4, grad=True), _t(1, 2, 3, 4, seed=1), _t(1, 2, 3, 4, seed=2)
    with pk.use("numpy"):
        o, lse = pk.attention(q, k, v, return_lse=True)
        assert o.requires_grad and not lse.requires_grad  # lse: what the backward reads
        dq, _, _ = pk.attention_backward(torch.ones_like(o), q, k, v, o.detach(), lse)
        with pytest.raises(RuntimeError, match="(?i)autograd"):
            dq.sum().backward()


# --- custom ops, user ops ------------------------------------------------------------------
def test_every_op_is_a_custom_op_in_the_portakern_namespace() -> None:
    assert torch_ops.torch is torch  # torch_ops' `import torch` is torch, not portakern.torch
    for name in ("matmul", "softmax", "attention", "rmsnorm", "attention_backward"):
        assert name in pkt.registered()
        assert isinstance(getattr(torch.ops.portakern, name), torch._ops.OpOverloadPacket)
    x = _t(3, 5)
    got = torch.ops.portakern.softmax(x, 0, "numpy")
    np.testing.assert_array_equal(got.numpy(), pk.softmax(x.numpy(), axis=0, backend="numpy"))
    q = _t(1, 2, 4, 8)
    out, lse = torch.ops.portakern.attention(q, q, q, causal=True, backend="numpy")
    assert out.shape == (1, 2, 4, 8) and lse.shape == (1, 2, 4) and lse.dtype is torch.float32
    # the fake implementation: shapes and dtypes with no data
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fq = torch.empty(2, 8, 16, 32, dtype=torch.float16)
        fk = torch.empty(2, 2, 24, 32, dtype=torch.float16)
        fo, flse = torch.ops.portakern.attention(fq, fk, fk)
        assert fo.shape == (2, 8, 16, 32) and fo.dtype is torch.float16
        assert flse.shape == (2, 8, 16) and flse.dtype is torch.float32
        with pytest.raises(pk.ShapeError):
            torch.ops.portakern.matmul(fq, fq)


@pytest.fixture
def user_op() -> Iterator[pk.KernelSpec]:
    from test_user_ops import SPEC  # alpha * x + y: a C kernel and no example

    spec = pk.register_op(SPEC.replace(name="torch_scaled_sum"))
    try:
        yield spec
    finally:
        pk.unregister_op(spec.name)


def test_a_user_op_becomes_a_custom_op_with_the_autograd_it_is_given(
        user_op: pk.KernelSpec) -> None:
    x, y = _t(3, 4, dtype=torch.float64, grad=True), _t(3, 4, dtype=torch.float64, seed=1)
    with pk.use("numpy"):
        got = pk.call(user_op.name, x, y, alpha=2.0)  # registered on its first tensor call
        np.testing.assert_allclose(got.detach().numpy(), 2 * x.detach().numpy() + y.numpy())
        with pytest.raises(RuntimeError, match="(?i)autograd"):
            got.sum().backward()

        def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.alpha = inputs[2] if len(inputs) > 2 else 1.0

        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
            return ctx.alpha * g, g, None, None, None

        op = pkt.register(user_op.name, backward=backward, setup_context=setup)
        assert op is torch.ops.portakern.torch_scaled_sum
        y.requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda a, b: torch.ops.portakern.torch_scaled_sum(a, b, 3.0), (x, y))


def test_a_replaced_op_runs_as_replaced_and_never_takes_the_old_gradient() -> None:
    """pk.register_op(..., replace=True) under a name torch already has: tensors run the new
    spec, by name or by spec, as arrays do (they ran the old one); its backward refuses
    (torch keeps the built-in's formula, which gave half the true gradient of a softmax of
    2x) until a formula is registered for it; restored, the built-in's gradient is back."""
    from portakern.ops import get_op

    original = get_op("softmax")
    doubled = original.replace(
        semantics=lambda xp, x, axis=-1: original.semantics(xp, 2 * x, axis=axis))
    x = _t(2, 5, dtype=torch.float64)
    weights = torch.arange(5.0, dtype=torch.float64)
    pk.register_op(doubled, replace=True)
    try:
        with pk.use("numpy"):
            expected = torch.softmax(2 * x, -1)
            torch.testing.assert_close(pk.softmax(x), expected)
            torch.testing.assert_close(pk.call("softmax", x), expected)
            xr = x.clone().requires_grad_(True)
            y = pk.call(doubled, xr)
            torch.testing.assert_close(y.detach(), expected)
            with pytest.raises(pk.InvalidArgumentError, match="no gradient for this spec"):
                (y * weights).sum().backward()

            def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
                (out,) = ctx.saved_tensors
                return 2 * out * (g - (g * out).sum(-1, keepdim=True)), None, None, None

            pkt.register(doubled, backward=backward,
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))
            xr = x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad((pk.softmax(xr) * weights).sum(), xr)
            xt = x.clone().requires_grad_(True)
            (want,) = torch.autograd.grad((torch.softmax(2 * xt, -1) * weights).sum(), xt)
            torch.testing.assert_close(g, want)
    finally:
        pk.register_op(original, replace=True)
        pkt.register(original, backward=torch_ops._softmax_backward,
                     setup_context=torch_ops._softmax_setup)
    with pk.use("numpy"):
        xr = x.clone().requires_grad_(True)
        torch.testing.assert_close(pk.softmax(xr).detach(), torch.softmax(x, -1))
        assert torch.autograd.gradcheck(lambda a: pk.softmax(a), (xr,))


def test_rmsnorm_gradient_of_huge_rows_and_of_empty_ones() -> None:
    """The backward's mean of squares overflowed float32 for |x| ~ 1e19 (r = 0: dx and dw
    silently 0, the forward right); an empty last dimension crashed in a reshape."""
    import torch.nn.functional as F

    base = _t(2, 8, dtype=torch.float64)
    for scale in (1e-30, 1.0, 1e20, 1e30):
        x = (base * scale).float().requires_grad_(True)
        w = torch.linspace(0.5, 2.0, 8).requires_grad_(True)
        xd = x.detach().double().requires_grad_(True)
        wd = w.detach().double().requires_grad_(True)
        g = torch.arange(16.0).reshape(2, 8)
        with pk.use("numpy"):
            (pk.rmsnorm(x, w) * g).sum().backward()
        (F.rms_norm(xd, (8,), wd, eps=1e-6) * g.double()).sum().backward()
        assert x.grad is not None and w.grad is not None and xd.grad is not None
        torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4,
                                   atol=1e-5 * float(xd.grad.abs().max()))
    x0, w0 = torch.zeros(3, 0, requires_grad=True), torch.zeros(0, requires_grad=True)
    with pk.use("numpy"):
        pk.rmsnorm(x0, w0).sum().backward()
    assert x0.grad is not None and x0.grad.shape == (3, 0)
    assert w0.grad is not None and w0.grad.shape == (0,)


def test_numpy_scalars_pass_as_parameters_as_on_arrays() -> None:
    x = _t(3, 4)
    with pk.use("numpy"):
        torch.testing.assert_close(pk.softmax(x, axis=np.int64(0)), pk.softmax(x, axis=0))
        torch.testing.assert_close(pk.rmsnorm(x, torch.ones(4), eps=np.float32(1e-5)),
                                   pk.rmsnorm(x, torch.ones(4), eps=1e-5))
        q = _t(1, 2, 4, 8)
        torch.testing.assert_close(pk.attention(q, q, q, causal=np.bool_(True),
                                                window=np.int64(1)),
                                   pk.attention(q, q, q, causal=True, window=1))


# --- autograd ------------------------------------------------------------------------------
def test_gradcheck_float64_on_numpy() -> None:
    """Every built-in's backward against finite differences, float64 on the numpy backend."""
    f64 = torch.float64
    a, b = _t(2, 1, 3, 5, dtype=f64, grad=True), _t(4, 5, 2, dtype=f64, seed=1, grad=True)
    x, w = _t(2, 3, 6, dtype=f64, grad=True), _t(6, dtype=f64, seed=2, grad=True)
    q = _t(2, 4, 5, 6, dtype=f64, grad=True, seed=3)
    k = _t(2, 2, 7, 6, dtype=f64, grad=True, seed=4)
    v = _t(2, 2, 7, 3, dtype=f64, grad=True, seed=5)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(6)) > 0.4
    mask[..., 0] = True
    checks: list[tuple[Callable[..., Any], tuple[torch.Tensor, ...]]] = [
        (pk.matmul, (a, b)),  # batch dims broadcast: (2,1) with (4,)
        (lambda x: pk.softmax(x, axis=1), (x,)),
        (lambda x, w: pk.rmsnorm(x, w, eps=1e-3), (x, w)),
        (lambda q, k, v: pk.attention(q, k, v, causal=True), (q, k, v)),  # GQA, Sq != Sk
        (lambda q, k, v: pk.attention(q, k, v, mask=mask, scale=0.3), (q, k, v)),
    ]
    with pk.use("numpy"):
        for fn, inputs in checks:
            assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def _float32_gradients_agree(fn_pk: Callable[..., Any], fn_torch: Callable[..., Any],
                             inputs: tuple[torch.Tensor, ...], n: int, label: str) -> None:
    """float32 gradients of portakern's op and of torch's, both against torch's in float64.

    The bound: each gradient entry is a sum of at most ``n`` rounded products, so its
    float32 error is at most gamma_n = n*u/(1 - n*u) times the sum of the terms' magnitudes
    (Higham, Thm 3.5 for one dot product; a forward and a backward stage at most double
    it); the magnitudes are bounded by the gradient's own scale, max|g64|, times the
    largest input's magnitude. portakern must meet that bound, and be no more than 8x
    torch's own error from the float64 answer."""
    seed = torch.ones(())
    grads = []
    for fn, dt in ((fn_pk, torch.float32), (fn_torch, torch.float32), (fn_torch, torch.float64)):
        xs = [t.detach().to(dt).requires_grad_(t.dtype.is_floating_point) for t in inputs]
        out = fn(*xs)
        cot = torch.linspace(-1, 1, out.numel(), dtype=dt).reshape(out.shape)
        out.backward(cot * seed.to(dt))
        grads.append([x.grad.double() for x in xs])
    gamma = 2 * n * U32 / (1 - n * U32)
    for g_pk, g_t, g64 in zip(*grads):
        scale = float(g64.abs().max()) * max(1.0, max(float(t.abs().max()) for t in inputs))
        err_pk, err_t = float((g_pk - g64).abs().max()), float((g_t - g64).abs().max())
        assert err_pk <= gamma * scale, f"{label}: {err_pk:.3g} > gamma_n {gamma * scale:.3g}"
        assert err_pk <= max(8 * err_t, 64 * U32 * scale), f"{label}: {err_pk} vs {err_t}"


def test_float32_gradients_agree_with_torchs_own_ops(kernel_target: str) -> None:
    target = kernel_target
    q, k, v = _t(2, 4, 9, 16, seed=1), _t(2, 2, 11, 16, seed=2), _t(2, 2, 11, 8, seed=3)
    a, b = _t(3, 7, 20, seed=4), _t(20, 5, seed=5)
    x, w = _t(4, 6, 24, seed=6), _t(24, seed=7)

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with pk.use(target):
        _float32_gradients_agree(lambda q, k, v: pk.attention(q, k, v, causal=True), sdpa,
                                 (q, k, v), n=16 + 11, label=f"attention on {target}")
        _float32_gradients_agree(pk.matmul, torch.matmul, (a, b), n=20 + 3 * 7,
                                 label=f"matmul on {target}")
        _float32_gradients_agree(lambda x: pk.softmax(x, axis=1),
                                 lambda x: torch.softmax(x, dim=1), (x,), n=6,
                                 label=f"softmax on {target}")
        _float32_gradients_agree(lambda x, w: pk.rmsnorm(x, w, eps=1e-5),
                                 lambda x, w: F.rms_norm(x, (24,), w, eps=1e-5), (x, w),
                                 n=24 * 4, label=f"rmsnorm on {target}")


# --- a small model: rmsnorm -> attention (GQA, causal) -> matmul ---------------------------
B, S, D, HQ, HKV, DH = 2, 12, 32, 4, 2, 8


class Block(torch.nn.Module):
    """x -> rmsnorm -> q, k, v projections -> causal GQA attention -> output projection,
    with either portakern's ops or torch's own."""

    def __init__(self, ops: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ops = ops
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.wq = torch.nn.Parameter(torch.randn(D, HQ * DH, generator=g) / math.sqrt(D))
        self.wk = torch.nn.Parameter(torch.randn(D, HKV * DH, generator=g) / math.sqrt(D))
        self.wv = torch.nn.Parameter(torch.randn(D, HKV * DH, generator=g) / math.sqrt(D))
        self.wo = torch.nn.Parameter(torch.randn(HQ * DH, D, generator=g) / math.sqrt(HQ * DH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mm = pk.matmul if self.ops == "portakern" else torch.matmul
        if self.ops == "portakern":
            h = pk.rmsnorm(x, self.norm, eps=1e-5)
        else:
            h = F.rms_norm(x, (D,), self.norm, eps=1e-5)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.reshape(B, S, n, DH).transpose(1, 2)

        q, k, v = heads(mm(h, self.wq), HQ), heads(mm(h, self.wk), HKV), heads(mm(h, self.wv), HKV)
        if self.ops == "portakern":
            o = pk.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return mm(o.transpose(1, 2).reshape(B, S, HQ * DH), self.wo)


def _train(ops: str, dtype: torch.dtype, steps: int = 3) -> list[float]:
    model = Block(ops).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dtype)
    target = torch.randn(B, S, D, generator=g).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# the longest chain of float32 sums one loss value passes through, forward and backward:
# rmsnorm's row (D), a projection (D), a score (DH), a softmax row and P.V (S, S), the output
# projection (HQ*DH), and the loss's mean (B*S*D, summed pairwise by both: log2 of it)
N_CHAIN = D + D + DH + 2 * S + HQ * DH + math.ceil(math.log2(B * S * D))


def test_training_steps_match_torch_within_the_derived_bound(kernel_target: str) -> None:
    """Three SGD steps of the block with portakern's ops and with torch's, in float32, from
    the same initial weights, against the same training in float64 with torch's ops.

    The bound: a float32 loss of step t carries rounding of at most gamma = N*u relative
    (N the chain of sums above, u = 2^-24: each sum's relative error is at most its length
    times u, first order, and the errors along a chain add); every earlier step adds its own
    through the weights it updated, scaled by how much the loss responds to them, which
    with lr=0.5 on this well-conditioned block is at most 1 per step, so step t (from 1) is
    within t*gamma of the float64 loss, relative. Both float32 runs must be within it, so
    they are within 2*t*gamma of each other."""
    with pk.use(kernel_target):
        pk_losses = _train("portakern", torch.float32)
    torch_losses = _train("torch", torch.float32)
    exact = _train("torch", torch.float64)
    gamma = N_CHAIN * U32
    assert pk_losses[-1] < pk_losses[0]  # it trains
    for t, (lp, lt, l64) in enumerate(zip(pk_losses, torch_losses, exact), start=1):
        assert abs(lp - l64) <= t * gamma * l64, (t, lp, l64, t * gamma * l64)
        assert abs(lt - l64) <= t * gamma * l64, (t, lt, l64)
        assert abs(lp - lt) <= 2 * t * gamma * l64, (t, lp, lt)


def test_torch_compile_fullgraph_traces_the_public_functions_into_custom_ops() -> None:
    """The block's forward (pk.rmsnorm, pk.matmul, pk.attention called on tensors) compiles
    with fullgraph=True (no graph break), the graph holds portakern's custom ops, and the
    compiled forward and backward (aot_eager: torch's autograd traced, no C++ compiler)
    give eager's values."""
    model = Block("portakern")
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with pk.use("numpy"):
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=record, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
        assert {"portakern.rmsnorm", "portakern.attention", "portakern.matmul"} <= set(seen)
        eager.square().mean().backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch._dynamo.reset()
        trained = torch.compile(model, backend="aot_eager", fullgraph=True)
        trained(x).square().mean().backward()
        for p, g in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
        torch._dynamo.reset()

        def raw(q: torch.Tensor) -> torch.Tensor:  # the custom op named directly
            out, _ = torch.ops.portakern.attention(q, q, q, causal=True)
            return torch.ops.portakern.softmax(out * 2, -1)

        q = _t(1, 2, 4, 8)
        torch.testing.assert_close(torch.compile(raw, backend="aot_eager", fullgraph=True)(q),
                                   raw(q), rtol=0, atol=0)


# --- CUDA: tensors on torch's current stream (a GPU machine only) -------------------------
@pytest.mark.gpu
def test_cuda_tensors_run_on_torchs_current_stream() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch (this torch build or machine has none)")
    pytest.importorskip("cupy", reason="the cuda backend needs CuPy: pip install '.[cuda]'")
    side = torch.cuda.Stream()
    x = torch.randn(64, 128, device="cuda")
    with torch.cuda.stream(side):  # made and used on a side stream, no synchronisation
        y = x * 2
        got = pk.softmax(y, axis=-1)
        back = got.sum(-1)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, torch.softmax(x * 2, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(back, torch.ones(64, device="cuda"), rtol=1e-5, atol=1e-5)
    assert got.device == x.device


# --- import order and cost ----------------------------------------------------------------
def _run_python(code: str) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True).stdout


def test_arrays_alone_load_neither_torch_nor_the_custom_ops() -> None:
    out = _run_python("import sys, numpy as np, portakern as pk\n"
                      "pk.softmax(np.ones((2, 3), np.float32), backend='numpy')\n"
                      "print('torch' in sys.modules, 'portakern.interop.torch_ops' in sys.modules)")
    assert out.split() == ["False", "False"]


COMPILED_FIRST_CALL = """
import torch._dynamo.testing
counter = torch._dynamo.testing.CompileCounter()
f = torch.compile(lambda q: pk.attention(q, q, q, causal=True, backend="numpy") * 2,
                  backend=counter, fullgraph=True)
q = torch.ones(1, 2, 3, 4)
print(float(f(q).sum()), counter.frame_count)
"""


@pytest.mark.parametrize("order", [
    "import torch\nimport portakern as pk\n",
    "import portakern as pk\nimport torch\nimport portakern.torch\n"],
    ids=["torch-imported-first", "portakern.torch-imported"])
def test_a_first_call_inside_torch_compile(order: str) -> None:
    """The first call on tensors may be inside a compiled function when torch was imported
    before portakern, or portakern.torch before compiling (docs/torch.md)."""
    assert _run_python(order + COMPILED_FIRST_CALL).split() == ["48.0", "1"]


@pytest.mark.parametrize("kw", [
    {"window": 3}, {"window": (2, 1)}, {"window": (4, None), "softcap": 2.0},
    {"bias": "bias", "alibi_slopes": "slopes", "softcap": 30.0}])
def test_score_modifiers_pass_through_the_custom_op(kw: dict[str, Any]) -> None:
    """window (int, pair, pair with None: torch's int[] schema), softcap, bias and ALiBi
    slopes reach the spec unchanged: the tensors' result equals the arrays' result."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
               ((1, 2, 9, 8), (1, 2, 11, 8), (1, 2, 11, 8)))
    extra = {"bias": rng.standard_normal((9, 11)).astype(np.float32),
             "slopes": np.array([0.5, 0.25], np.float32)}
    arrays = {n: extra[x] if isinstance(x, str) else x for n, x in kw.items()}
    tensors = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x
               for n, x in arrays.items()}
    got = pk.attention(*map(torch.from_numpy, (q, k, v)), backend="numpy", **tensors)
    want = pk.attention(q, k, v, backend="numpy", **arrays)
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_windowed_attention_trains_through_the_fused_backward() -> None:
    """window is a mask: torch autograd runs the fused attention_backward with it, and the
    gradients equal the float64 analytic backward's."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal(s) for s in
                  ((1, 2, 9, 8), (1, 1, 11, 8), (1, 1, 11, 8), (1, 2, 9, 8)))
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = pk.attention(qt, kt, vt, window=(2, 1), causal=True, backend="numpy")
    out.backward(torch.from_numpy(g))
    o, lse = pk.attention(q, k, v, window=(2, 1), causal=True, return_lse=True,
                          backend="numpy")
    want = pk.attention_backward(g, q, k, v, o, lse, causal=True, window=(2, 1),
                                 backend="numpy")
    for t, w in zip((qt, kt, vt), want, strict=True):
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-12, atol=1e-12)


def test_a_modifier_without_a_torch_backward_refuses_to_differentiate() -> None:
    """The fused backward knows causal and mask only: with a modifier the backward raises,
    never a gradient that ignores the window or the cap."""
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 6, 8, dtype=torch.float64)
    out = pk.attention(q, k, v, softcap=5.0, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError, match="no torch backward for softcap"):
        out.sum().backward()


def test_paged_attention_takes_tensors_and_refuses_a_bad_table() -> None:
    """pk.paged_attention on CPU tensors equals the arrays' call (window as int[]), and a
    block id outside the cache is refused by name before any work, as for arrays."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((4, 2, 4, 8)).astype(np.float32) for _ in range(2))
    bt, sl = np.array([[0, 1], [3, 2]], np.int32), np.array([7, 5], np.int32)
    want = pk.paged_attention(q, kc, vc, bt, sl, window=3, softcap=2.0, backend="numpy")
    got = pk.paged_attention(*map(torch.from_numpy, (q, kc, vc, bt, sl)), window=3,
                             softcap=2.0, backend="numpy")
    np.testing.assert_array_equal(got.numpy(), want)
    bad = torch.from_numpy(np.array([[0, 1], [3, 9]], np.int32))
    with pytest.raises(pk.InvalidArgumentError, match=r"block_table\[1, 1\] = 9"):
        pk.paged_attention(*map(torch.from_numpy, (q, kc, vc)), bad, torch.from_numpy(sl))
