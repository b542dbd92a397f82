"""The public ops: validate -> select backend -> dispatch. Nothing here knows a backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .backend.base import Backend
from .core.errors import PortakernError
from .core.spec import KernelSpec
from .interop import TORCH_CLASSES, refuse_mixed
from .ops import get_op
from .runtime.plan import dispatch

# torch tensors go to their torch custom op (portakern/interop, docs/torch.md) before any
# other work; every other call pays one set lookup of its first array's class (~20 ns). A
# call that fails with a tensor anywhere is refused as mixed, or (a Tensor subclass not met
# before, operands by keyword) sent on to the custom op.
_TORCH = TORCH_CLASSES


def _torch(op: str | KernelSpec, args: Any, kwargs: Any, backend: Any, config: Any,
           out: Any = None) -> Any:
    from .interop import torch_ops  # loads torch's custom ops at the first tensor

    return torch_ops.call(op, args, kwargs, backend, config, out)


def call(op: str | KernelSpec, *args: Any, backend: str | Backend | None = None,
         config: Mapping[str, int] | None = None, out: Any = None, **kwargs: Any) -> Any:
    """Run any registered op (or a KernelSpec) on the selected backend.

    ``config`` overrides tunables (validated against each tunable's domain). ``out`` is a
    device array of the result's shape and dtype to write into (C-kernel backends). The one
    path of every entry point is portakern.runtime.plan.dispatch."""
    if args and args[0].__class__ in _TORCH:
        return _torch(op, args, kwargs, backend, config, out)
    try:
        return dispatch(op if op.__class__ is KernelSpec else _spec(op), args, kwargs, backend,
                        config, out)
    except PortakernError:  # torch tensors by keyword go on; mixed with other arrays: refused
        if not refuse_mixed(op, args, kwargs, out):
            raise
    return _torch(op, args, kwargs, backend, config, out)


def _spec(op: str | KernelSpec) -> KernelSpec:
    return op if isinstance(op, KernelSpec) else get_op(op)


# The named wrappers take the same keywords as ``call`` (out= included) and refuse unknown
# ones the same way: with InvalidArgumentError from the spec's binding, not a plain TypeError.
# A parameter that *is* the wrapper's own default object (``is``, never ``==``: True == 1,
# yet axis=True must be refused) is not passed on, and the spec's binding fills in its own
# default, the same value (tests/test_api_defaults.py): the plan key is shorter, and the
# runner has no keyword operand to look at. Anything else is passed and validated.
def matmul(a: Any, b: Any, *, backend: str | Backend | None = None,
           config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """(..., M, K) @ (..., K, N) -> (..., M, N); batch dims broadcast; fp32 accumulation."""
    if a.__class__ in _TORCH:
        return _torch("matmul", (a, b), kwargs, backend, config)
    out = kwargs.pop("out", None)
    try:
        return dispatch(get_op("matmul"), (a, b), kwargs, backend, config, out)
    except PortakernError:
        if not refuse_mixed("matmul", (a, b), kwargs, out):
            raise
    return _torch("matmul", (a, b), kwargs, backend, config, out)


_AXIS = -1  # softmax's default; equal to the spec's (tests/test_api_defaults.py)


def softmax(x: Any, axis: int = _AXIS, *, backend: str | Backend | None = None,
            config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Stable softmax along ``axis``; a row of only -inf gives zeros."""
    if x.__class__ in _TORCH:
        return _torch("softmax", (x,), {**kwargs, "axis": axis}, backend, config)
    out = kwargs.pop("out", None)
    if axis is not _AXIS:  # the default object is left out: see the note above matmul
        kwargs["axis"] = axis
    try:
        return dispatch(get_op("softmax"), (x,), kwargs, backend, config, out)
    except PortakernError:
        if not refuse_mixed("softmax", (x,), kwargs, out):
            raise
    return _torch("softmax", (x,), kwargs, backend, config, out)


def attention(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None,
              scale: float | None = None, return_lse: bool = False,
              window: int | tuple[int, int | None] | None = None, softcap: float | None = None,
              bias: Any = None, alibi_slopes: Any = None,
              backend: str | Backend | None = None,
              config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Fused softmax(mods(scale q k^T) [causal, window, mask]) v; rows with no key to attend
    give 0.

    Score modifiers, in this order, before masking: ``bias`` (float, broadcastable to
    (B, Hq, Sq, Sk)) is added; ``alibi_slopes`` (Hq,) float32 adds -slope * |i - j|;
    ``softcap`` c maps s to c * tanh(s / c). ``window``: an int ``left`` or a pair
    (left, right): query i attends key j only when i - left <= j (and j <= i + right).

    ``return_lse=True``: ``(out, lse)``, lse (B, Hq, Sq) the log-sum-exp of each row's scaled
    scores (float32; float64 for float64 inputs), -inf for a row with no key to attend: what
    ``attention_backward`` recomputes the probabilities from."""
    if q.__class__ in _TORCH:
        return _torch("attention", (q, k, v), {**kwargs, "mask": mask, "causal": causal,
                                               "scale": scale, "return_lse": return_lse,
                                               "window": window, "softcap": softcap,
                                               "bias": bias, "alibi_slopes": alibi_slopes},
                      backend, config)
    out = kwargs.pop("out", None)
    if mask is not None:  # the spec's defaults are left out: a shorter plan key, and no
        kwargs["mask"] = mask  # keyword operand for the runner to look at
    if causal is not False:
        kwargs["causal"] = causal
    if scale is not None:
        kwargs["scale"] = scale
    if return_lse is not False:
        kwargs["return_lse"] = return_lse
    if window is not None:
        kwargs["window"] = window
    if softcap is not None:
        kwargs["softcap"] = softcap
    if bias is not None:
        kwargs["bias"] = bias
    if alibi_slopes is not None:
        kwargs["alibi_slopes"] = alibi_slopes
    try:
        return dispatch(get_op("attention"), (q, k, v), kwargs, backend, config, out)
    except PortakernError:
        if not refuse_mixed("attention", (q, k, v), kwargs, out):
            raise
    return _torch("attention", (q, k, v), kwargs, backend, config, out)


def attention_backward(do: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any = None,
                       causal: bool = False, scale: float | None = None,
                       window: int | tuple[int, int | None] | None = None, *,
                       backend: str | Backend | None = None,
                       config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """(dq, dk, dv) of ``attention`` given the output's cotangent ``do``, the forward's inputs
    and its ``out, lse = pk.attention(q, k, v, ..., return_lse=True)``; the same mask, causal
    and scale as the forward. Fused (no Sq x Sk buffer), deterministic. ``out`` is the
    forward's output (the spec's operand ``o``); to write the gradients into arrays of your
    own, ``pk.call("attention_backward", do, q, k, v, out, lse, out=(dq, dk, dv))``.
    ``window``: the forward's sliding window (the score modifiers have no fused backward)."""
    kwargs["mask"], kwargs["causal"], kwargs["scale"] = mask, causal, scale
    if window is not None:
        kwargs["window"] = window
    if do.__class__ in _TORCH:
        return _torch("attention_backward", (do, q, k, v, out, lse), kwargs, backend, config)
    try:
        return dispatch(get_op("attention_backward"), (do, q, k, v, out, lse), kwargs, backend,
                        config, None)
    except PortakernError:
        if not refuse_mixed("attention_backward", (do, q, k, v, out, lse), kwargs):
            raise
    return _torch("attention_backward", (do, q, k, v, out, lse), kwargs, backend, config)


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any, *,
                    scale: float | None = None, softcap: float | None = None,
                    window: int | tuple[int, int | None] | None = None, bias: Any = None,
                    alibi_slopes: Any = None, backend: str | Backend | None = None,
                    config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """Decode attention over a paged KV cache (docs/decode.md): q (B, Hq, Sq, D), caches
    (num_blocks, Hkv, block_size, D / Dv), block_table (B, max_blocks) int32, seq_lens (B,)
    int32 (tokens in the cache, the Sq new ones included) -> (B, Hq, Sq, Dv).

    Query i of sequence b sits at position seq_lens[b] - Sq + i and attends cache positions
    <= its own (causal, bottom-right aligned); ``window``, ``softcap`` and ``alibi_slopes``
    as in ``attention``, in those positions; ``bias`` broadcasts to (B, Hq, Sq, max_blocks *
    block_size), indexed by cache position. The tables' values are checked on the host first
    (a device array's are copied down: a few hundred bytes), naming a bad entry; long
    contexts are split across work-groups (``config={"SPLIT": n}`` forces n, 1 = unsplit)."""
    tables = (q, k_cache, v_cache, block_table, seq_lens)
    if q.__class__ in _TORCH:
        return _torch("paged_attention", tables,
                      {**kwargs, "scale": scale, "softcap": softcap, "window": window,
                       "bias": bias, "alibi_slopes": alibi_slopes}, backend, config)
    out = kwargs.pop("out", None)
    if scale is not None:  # the spec's defaults are left out: a shorter plan key
        kwargs["scale"] = scale
    if softcap is not None:
        kwargs["softcap"] = softcap
    if window is not None:
        kwargs["window"] = window
    if bias is not None:
        kwargs["bias"] = bias
    if alibi_slopes is not None:
        kwargs["alibi_slopes"] = alibi_slopes
    # the spec's check_values refuses bad tables before any device work (runtime.plan)
    try:
        return dispatch(get_op("paged_attention"), tables, kwargs, backend, config, out)
    except PortakernError:
        if not refuse_mixed("paged_attention", tables, kwargs, out):
            raise
    return _torch("paged_attention", tables, kwargs, backend, config, out)


_EPS = 1e-6  # rmsnorm's default; equal to the spec's (tests/test_api_defaults.py)


def rmsnorm(x: Any, weight: Any, eps: float = _EPS, *, backend: str | Backend | None = None,
            config: Mapping[str, int] | None = None, **kwargs: Any) -> Any:
    """x / sqrt(mean(x**2, axis=-1) + eps) * weight, fused; weight has shape (x.shape[-1],)."""
    if x.__class__ in _TORCH:
        return _torch("rmsnorm", (x, weight), {**kwargs, "eps": eps}, backend, config)
    out = kwargs.pop("out", None)
    if eps is not _EPS:
        kwargs["eps"] = eps
    try:
        return dispatch(get_op("rmsnorm"), (x, weight), kwargs, backend, config, out)
    except PortakernError:
        if not refuse_mixed("rmsnorm", (x, weight), kwargs, out):
            raise
    return _torch("rmsnorm", (x, weight), kwargs, backend, config, out)
