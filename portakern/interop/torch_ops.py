"""portakern's ops as ``torch.library`` custom ops: ``torch.ops.portakern.<op>`` (docs/torch.md).

Every registered op (the built-ins at import, a user op on ``register(name)`` or its first call
on torch tensors) becomes one custom op in the namespace ``portakern`` whose schema is read
from the spec: the operands (``Tensor``, ``Tensor?`` when optional), the parameters typed by
their defaults (bool, int, float; ``None`` reads as ``float?``), then ``str? backend`` and
``str? config`` ("TM=4,TN=2"). A boolean parameter that adds outputs (attention's
``return_lse``) is not in the schema: the custom op always returns every output, and
``pk.attention`` picks what the call asked for.

* **Real implementation**: CPU tensors go to ``dispatch`` as numpy views (``Tensor.numpy()``,
  bfloat16 through an int16 view: no copy), so selection treats them as host arrays (the
  automatic choice, ``pk.use``, ``backend=``), and the numpy results come back with
  ``torch.from_numpy`` (no copy). CUDA tensors go as CuPy arrays through DLPack and run on
  the cuda backend, enqueued on torch's current stream (CuPy's ``ExternalStream``).
* **Fake implementation**: ``spec.problem`` on ``ArrayMeta``; the outputs' shapes and
  dtypes, so ``torch.compile(fullgraph=True)`` traces the op without running it.
* **Autograd** (built-ins): attention saves ``out`` and ``lse`` and runs the fused
  ``attention_backward``; matmul's backward is two portakern matmuls; softmax and rmsnorm
  have analytic formulas in torch ops, computed in the compute type. A user op gets autograd
  with ``register(name, backward=..., setup_context=...)``; without it, torch raises on
  backward, never detaches silently.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..backend.base import Backend
from ..core import dtypes
from ..core.errors import (
    BackendUnavailable,
    InvalidArgumentError,
    NotAnArrayError,
    PortakernError,
    UnsupportedDTypeError,
)
from ..core.spec import ArrayMeta, KernelSpec
from ..ops import OPS, get_op
from ..runtime import selection
from ..runtime.plan import dispatch
from . import note_torch_loaded, refuse_mixed

NAMESPACE = "portakern"

_NP_OF: dict[torch.dtype, Any] = {
    torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
    torch.float64: np.dtype(np.float64), torch.bfloat16: dtypes.bfloat16,
    torch.bool: np.dtype(np.bool_), torch.int32: np.dtype(np.int32)}
_TORCH_OF: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "bool": torch.bool}
_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


def _np_dtype(dt: torch.dtype) -> Any:
    """The numpy dtype a tensor's data is viewed as, or the dtype's name for the spec to
    refuse (``int64``)."""
    got = _NP_OF.get(dt)
    return got if got is not None else str(dt).removeprefix("torch.")


@dataclass
class _Entry:
    """One op's custom op: its schema's order and what ``call`` needs to fill it."""

    spec: KernelSpec
    operands: tuple[str, ...]
    optional: frozenset[str]
    params: tuple[tuple[str, Any, str], ...]  # (name, default, schema type) in schema order
    selectors: tuple[str, ...]  # bool params that add outputs: always True in the custom op
    n_default: int  # outputs with the selectors at their defaults (False)
    n_out: int  # outputs of the custom op (selectors True)
    schema: str
    op: Any = None  # torch.ops.portakern.<name>
    custom: Any = None  # the CustomOpDef
    has_autograd: bool = False
    # (the spec it was written for, setup_context, backward): the gradient formula
    autograd: tuple[KernelSpec, Callable[..., Any] | None, Callable[..., Any]] | None = None
    names: tuple[str, ...] = field(default=())

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """The custom op's arguments (as torch passes them to an implementation: trailing
        defaults may be left out, some may come by keyword) in schema order, defaults in."""
        vals = list(args)
        defaults = ([None] * len(self.operands) + [d for _, d, _ in self.params]
                    + [None, None])
        for i in range(len(vals), len(self.names)):
            vals.append(kwargs.get(self.names[i], defaults[i]))
        return vals


_ENTRIES: dict[str, _Entry] = {}
_LOCK = threading.RLock()


def _param_type(spec: KernelSpec, name: str, default: Any,
                param_types: Mapping[str, str] | None) -> str:
    if param_types and name in param_types:
        return param_types[name]
    if default is None:
        return "float?"
    got = _SCHEMA_TYPES.get(type(default))
    if got is None:
        raise InvalidArgumentError(
            f"{spec.name}: parameter {name!r} has a default of type {type(default).__name__}, "
            f"which has no torch schema type; pass portakern.torch.register({spec.name!r}, "
            f"param_types={{{name!r}: 'int'}}) (a torch schema type: bool, int, float, str, "
            "float?, int?, str?).")
    return got


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def _output_count(spec: KernelSpec, params: Mapping[str, Any]) -> int | None:
    """Outputs of the spec's example under ``params`` (None: no example, or it fails)."""
    if spec.example is None:
        return None
    try:
        arrays, p = spec.example("float32")
        prob = spec.problem(arrays, {**spec.params, **p, **params})
    except Exception:
        return None
    return len(prob.output_specs)


def register(op: str | KernelSpec, *, backward: Callable[..., Any] | None = None,
             setup_context: Callable[..., Any] | None = None,
             param_types: Mapping[str, str] | None = None, outputs: int | None = None) -> Any:
    """Register ``op`` (a name in portakern's op registry, or a KernelSpec) as the custom op
    ``torch.ops.portakern.<name>`` (once; later calls return it), with its fake
    implementation. ``backward``/``setup_context`` are given to
    ``torch.library.register_autograd`` (inputs and gradients in schema order: operands,
    parameters, ``backend``, ``config``). ``param_types`` overrides the schema type read from
    a parameter's default (``{"n": "int?"}``); ``outputs`` is the number of outputs of a spec
    without an ``example`` (default 1)."""
    spec = op if isinstance(op, KernelSpec) else get_op(op)
    with _LOCK:
        entry = _ENTRIES.get(spec.name)
        if entry is None:
            entry = _define(spec, param_types, outputs)
            _ENTRIES[spec.name] = entry
        _switch_spec(entry, spec)
        if backward is not None:
            _register_autograd(entry, setup_context, backward)
        return entry.op


def registered() -> list[str]:
    """The ops registered as torch custom ops so far."""
    return sorted(_ENTRIES)


def _define(spec: KernelSpec, param_types: Mapping[str, str] | None,
            outputs: int | None) -> _Entry:
    if not spec.name.isidentifier():
        raise InvalidArgumentError(f"{spec.name!r} is no identifier: torch names custom ops "
                                   "by identifiers; register the spec under another name.")
    n_default = _output_count(spec, {}) or outputs or 1
    selectors = tuple(
        k for k, d in spec.params.items() if d is False
        and (_output_count(spec, {k: True}) or n_default) > n_default)
    n_out = _output_count(spec, dict.fromkeys(selectors, True)) or n_default
    params = tuple((k, d, _param_type(spec, k, d, param_types))
                   for k, d in spec.params.items() if k not in selectors)
    args = [f"Tensor? {o.name}=None" if o.optional else f"Tensor {o.name}"
            for o in spec.operands]
    args += [f"{t} {k}={_literal(d)}" for k, d, t in params]
    args += ["str? backend=None", "str? config=None"]
    ret = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    schema = f"({', '.join(args)}) -> {ret}"
    entry = _Entry(spec, tuple(o.name for o in spec.operands),
                   frozenset(o.name for o in spec.operands if o.optional), params, selectors,
                   n_default, n_out, schema,
                   names=(*(o.name for o in spec.operands), *(k for k, _, _ in params),
                          "backend", "config"))

    def impl(*args: Any, **kwargs: Any) -> Any:
        return _run(entry, entry.bind(args, kwargs))

    def fake(*args: Any, **kwargs: Any) -> Any:
        return _fake(entry, entry.bind(args, kwargs))

    custom = torch.library.custom_op(f"{NAMESPACE}::{spec.name}", impl, mutates_args=(),
                                     schema=schema)
    custom.register_fake(fake)
    entry.custom = custom
    entry.op = getattr(getattr(torch.ops, NAMESPACE), spec.name)
    auto = _AUTOGRAD.get(spec.name)
    if auto is not None and OPS.get(spec.name) is spec:  # the built-in op, not a namesake
        _register_autograd(entry, auto[0], auto[1])
    return entry


def _register_autograd(entry: _Entry, setup: Callable[..., Any] | None,
                       backward: Callable[..., Any]) -> None:
    """Give the custom op a gradient formula, for the spec it runs now only. torch keeps a
    custom op's autograd for good, while ``pk.register_op(..., replace=True)`` swaps the spec
    under the same name: a call of the new spec must not take the old one's gradient
    silently (half the true gradient, for a softmax of 2x), so its backward says so, until a
    formula is registered for it (a later call here replaces the formula)."""
    entry.autograd = (entry.spec, setup, backward)
    if entry.has_autograd:
        return  # the wrappers below read entry.autograd on each call

    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        formula = entry.autograd
        ctx.pk_formula = formula if formula is not None and formula[0] is entry.spec else None
        if ctx.pk_formula is not None and ctx.pk_formula[1] is not None:
            ctx.pk_formula[1](ctx, inputs, output)

    def guarded_backward(ctx: Any, *grads: Any) -> Any:
        if ctx.pk_formula is None:
            name = entry.spec.name
            raise InvalidArgumentError(
                f"{name}: no gradient for this spec of {name!r}: the torch gradient formula "
                "was written for the spec it replaced (pk.register_op(..., replace=True)); "
                "give the new spec its own: portakern.torch.register(spec, backward=..., "
                "setup_context=...).")
        return ctx.pk_formula[2](ctx, *grads)

    entry.custom.register_autograd(guarded_backward, setup_context=setup_context)
    entry.has_autograd = True


# --- the implementations ------------------------------------------------------------------
def _split(entry: _Entry, vals: Sequence[Any]
           ) -> tuple[list[Any], dict[str, Any], Any, dict[str, int] | None]:
    """(operands, parameters to pass: those not at the spec's default, plus the selectors,
    backend, config) of the custom op's arguments."""
    n = len(entry.operands)
    params = {}
    for (k, d, _), v in zip(entry.params, vals[n:n + len(entry.params)]):
        if not (v.__class__ is d.__class__ and v == d):  # default objects are left out
            params[k] = v
    for s in entry.selectors:
        params[s] = True
    return list(vals[:n]), params, vals[-2], _parse_config(vals[-1])


def _parse_config(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    return out


def _host(t: torch.Tensor) -> Any:
    """A numpy view of a CPU tensor's data (no copy)."""
    t = t.detach()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtypes.bfloat16)
    return t.resolve_conj().resolve_neg().numpy()


def _from_host(r: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(r, np.ndarray):  # a device array (jax, cupy): DLPack
        t = torch.from_dlpack(r)
        return t if t.device == device else t.to(device)
    bf16 = r.dtype == dtypes.bfloat16
    if bf16:
        r = r.view(np.int16)
    if not (r.flags.c_contiguous and r.flags.writeable):
        r = np.array(r, order="C")  # negative strides or read-only: torch takes neither
    t = torch.from_numpy(r)
    if bf16:
        t = t.view(torch.bfloat16)
    return t if t.device == device else t.to(device)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(
            f"CUDA tensors run on portakern's cuda backend through CuPy, which cannot be "
            f"imported ({exc}). Fix: pip install 'portakern[cuda]', or move the tensors to the "
            "CPU (t.cpu()).") from None
    return cupy


def _host_scope(device: torch.device) -> Any:
    return contextlib.nullcontext()  # host backends run synchronously: nothing to order


def _cuda_scope(device: torch.device) -> Any:
    """That device current in CuPy and torch's current stream as CuPy's: portakern's launches
    and CuPy's allocations are ordered after the torch work that made the inputs and before
    the torch work that reads the outputs, with no synchronisation. Not run in CI (no GPU)."""
    cp = _cupy()
    stream = torch.cuda.current_stream(device)
    scope = contextlib.ExitStack()
    scope.enter_context(cp.cuda.Device(device.index))
    scope.enter_context(cp.cuda.ExternalStream(stream.cuda_stream, device.index))
    return scope


def _cuda_view(entry: _Entry, t: torch.Tensor) -> Any:
    """A CuPy view of a CUDA tensor (DLPack; a copy only for a non-contiguous one)."""
    if t.dtype is torch.bfloat16:
        raise UnsupportedDTypeError(
            f"{entry.spec.name}: bfloat16 CUDA tensors cannot pass to CuPy (it has no bfloat16 "
            "dtype); cast to float16 or float32, or use CPU tensors.")
    return _cupy().from_dlpack(t.detach().contiguous())


# torch device type -> (the scope a call runs in, the array a tensor is passed on as): CPU
# tensors as numpy views (selection treats them as host arrays), CUDA tensors as CuPy arrays
# (selection follows them to the cuda backend, on their device)
_DEVICES: dict[str, tuple[Callable[[torch.device], Any], Callable[[_Entry, torch.Tensor], Any]]] = {
    "cpu": (_host_scope, lambda entry, t: _host(t)),
    "cuda": (_cuda_scope, _cuda_view),
}


def _run(entry: _Entry, vals: Sequence[Any]) -> Any:
    tensors, params, backend, config = _split(entry, vals)
    device = next(t for t in tensors if t is not None).device
    kind = _DEVICES.get(device.type)
    if kind is None:
        raise BackendUnavailable(
            f"{entry.spec.name}: tensors on {device} have no portakern backend; CPU tensors "
            "run on the host backends, CUDA tensors on cuda. Move them: t.cpu() or t.cuda().")
    scope, native = kind
    with scope(device):
        args: list[Any] = []  # the leading operands given by position, the rest by name
        for i, (name, t) in enumerate(zip(entry.operands, tensors)):
            if t is None:
                continue
            if len(args) == i:
                args.append(native(entry, t))
            else:
                params[name] = native(entry, t)
        res = dispatch(entry.spec, args, params, backend, config, None)
        outs = res if entry.n_out > 1 else (res,)
        if len(outs) != entry.n_out:
            raise InvalidArgumentError(
                f"{entry.spec.name}: the op returned {len(outs)} outputs, its torch custom op "
                f"declares {entry.n_out}; register it with outputs={len(outs)}.")
        got = tuple(_from_host(r, device) for r in outs)
    return got if entry.n_out > 1 else got[0]


def _fake(entry: _Entry, vals: Sequence[Any]) -> Any:
    tensors, params, _, _ = _split(entry, vals)
    metas = {name: None if t is None else
             ArrayMeta(tuple(int(s) for s in t.shape), _np_dtype(t.dtype))
             for name, t in zip(entry.operands, tensors)}
    spec = entry.spec
    prob = spec.problem(metas, {**spec.params, **params})
    device = next(t for t in tensors if t is not None).device
    outs = tuple(torch.empty(shape, dtype=_TORCH_OF[dt], device=device)
                 for shape, dt in prob.output_specs.values())
    return outs if entry.n_out > 1 else outs[0]


# --- the public functions' path for torch tensors --------------------------------------------
def _entry_for(op: str | KernelSpec) -> _Entry:
    """The custom op that runs ``op``, running the spec the call means: the one given, or
    the registry's under that name *now* (a spec replaced since its torch op was defined
    runs as replaced, as it does on arrays)."""
    spec = op if isinstance(op, KernelSpec) else get_op(op)
    entry = _ENTRIES.get(spec.name)
    if entry is None:
        register(spec)
        entry = _ENTRIES[spec.name]
    _switch_spec(entry, spec)
    return entry


def _switch_spec(entry: _Entry, spec: KernelSpec) -> None:
    """The custom op runs ``spec`` from now on: a namesake with the same operands and
    parameters (the schema torch fixed when the op was defined); any other is refused."""
    if spec is entry.spec:
        return
    if spec.operands != entry.spec.operands or dict(spec.params) != dict(entry.spec.params):
        raise InvalidArgumentError(
            f"{spec.name}: a different spec of this name is already torch.ops.portakern."
            f"{spec.name}, with other operands or parameters; torch cannot redefine a "
            "custom op: register the new spec under another name.")
    entry.spec = spec


def _selector_text(backend: Any) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    if isinstance(backend, Backend):
        return backend.label
    raise InvalidArgumentError(f"backend must be a string like 'numpy' or 'opencl:0' or a "
                               f"backend; got {type(backend).__name__}.")


def _config_text(config: Mapping[str, int] | None) -> str | None:
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise InvalidArgumentError(
            f"config must be a mapping of tunable names to ints, e.g. {{'TM': 4}}; got "
            f"{type(config).__name__}. Pass a dict.")
    for k, v in config.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"tunable {k}={v!r} is outside its domain; pass an int.")
    return ",".join(f"{k}={int(v)}" for k, v in config.items())


def call(op: str | KernelSpec, args: Sequence[Any], kwargs: Mapping[str, Any], backend: Any,
         config: Mapping[str, int] | None, out: Any = None) -> Any:
    """``pk.<op>(...)`` / ``pk.call(op, ...)`` on torch tensors: the arguments bound as the
    spec binds them, every array checked to be a tensor on one device, then the custom op;
    the outputs the call asked for. Plain Python on constants and the op call only, so dynamo
    traces it into one graph node."""
    entry = _entry_for(op)
    spec = entry.spec
    kw = dict(kwargs)
    if out is None:
        out = kw.pop("out", None)
    if out is not None:
        raise InvalidArgumentError(
            f"{spec.name}: out= is not supported for torch tensors (a custom op returns new "
            f"tensors); write `out.copy_(pk.{spec.name}(...))` instead.")
    if len(args) > len(entry.operands):
        spec.bind(args, kw)  # raises the spec's own error
    vals: list[Any] = []
    for i, name in enumerate(entry.operands):
        if i < len(args):
            if name in kw:
                spec.bind(args, kw)
            vals.append(args[i])
        else:
            vals.append(kw.pop(name, None))
    for name, a in zip(entry.operands, vals):
        if a is None:
            if name not in entry.optional:
                spec.bind(args, kwargs)
        elif not isinstance(a, torch.Tensor):
            refuse_mixed(spec, args, kwargs, out)  # raises when another array is among them
            raise NotAnArrayError(f"{spec.name}: argument {name!r} must be a torch tensor like "
                                  f"the others; got {type(a).__name__}.")
    for k, d, t in entry.params:
        v = kw.pop(k, d)
        if t == "int[]?" and isinstance(v, (list, tuple)) and len(v) == 2 and v[1] is None:
            v = [v[0]]  # (left, None): a window with no right edge, as the list [left]
        v = _plain(v)
        if not _fits(v, t):  # the spec's validation names what is wrong
            _validate(entry, vals, {k: v})
            raise InvalidArgumentError(f"{spec.name}: {k}={v!r} does not fit the custom op's "
                                       f"schema type {t}.")
        if t == "int[]?" and v is not None:
            v = [v] if isinstance(v, int) else list(v)
        vals.append(v)
    chosen = [kw.pop(s, False) for s in entry.selectors]
    if kw:
        spec.bind(args, kwargs)  # an unexpected keyword: the spec's own error
    present = [a for a in vals[:len(entry.operands)] if a is not None]
    for a in present[1:]:
        if a.device != present[0].device:
            raise InvalidArgumentError(
                f"{spec.name}: tensors on {present[0].device} and {a.device} in one call; "
                f"move them to one device.")
    for s, v in zip(entry.selectors, chosen):
        if v is not True and v is not False:
            _validate(entry, vals, {s: v})
            raise InvalidArgumentError(f"{spec.name}: {s} must be True or False; got {v!r}.")
    vals += [_selector_text(backend), _config_text(config)]
    res = entry.op(*vals)
    if not entry.selectors or all(chosen):
        return res
    if any(chosen):
        raise InvalidArgumentError(
            f"{spec.name}: only all of {entry.selectors} or none may be set on torch tensors; "
            f"call torch.ops.{NAMESPACE}.{spec.name} (it returns every output) and pick.")
    return res[0] if entry.n_default == 1 else tuple(res[:entry.n_default])


def _plain(v: Any) -> Any:
    """numpy scalars (an ``np.int64`` axis, an ``np.float32`` eps, an ``np.bool_``) as the
    Python scalars a custom op's schema takes, as the array path accepts them; lists and
    tuples item by item (a window)."""
    if isinstance(v, np.generic) and v.shape == ():
        if isinstance(v, (np.bool_, np.integer, np.floating)):
            return v.item()
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _fits(v: Any, t: str) -> bool:
    if t.endswith("?") and v is None:
        return True
    base = t.rstrip("?")
    if base == "bool":
        return v is True or v is False
    if base == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if base == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if base == "str":
        return isinstance(v, str)
    if base == "int[]":  # attention's window: an int left, or [left] / [left, right]
        items = v if isinstance(v, (list, tuple)) else [v]
        return all(isinstance(x, int) and not isinstance(x, bool) for x in items)
    return True


def _validate(entry: _Entry, tensors: Sequence[Any], params: Mapping[str, Any]) -> None:
    """The spec's validation on the tensors' metadata (raises its precise error)."""
    metas = {n: None if t is None else ArrayMeta(tuple(t.shape), _np_dtype(t.dtype))
             for n, t in zip(entry.operands, tensors)}
    entry.spec.problem(metas, {**entry.spec.params, **params})


# --- autograd of the built-in ops ----------------------------------------------------------
def _use_label() -> str | None:
    """The ``pk.use`` choice in force (for the backward to run where the forward ran)."""
    cur = selection.current_choice()
    return cur.label if isinstance(cur, Backend) else cur


def _compute(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype is torch.float64 else torch.float32


def _matmul_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    vals = _ENTRIES["matmul"].bind(inputs, {})
    ctx.save_for_backward(vals[0], vals[1])
    ctx.backend = vals[-2] or _use_label()


def _matmul_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    a, b = ctx.saved_tensors
    mm = torch.ops.portakern.matmul
    da = db = None
    if ctx.needs_input_grad[0]:  # dA = dC @ B^T, summed over A's broadcast batch dims
        da = mm(g, b.mT, ctx.backend).sum_to_size(a.shape)
    if ctx.needs_input_grad[1]:  # dB = A^T @ dC, likewise
        if b.dim() == 2 and a.dim() > 2:  # one (K, M') @ (M', N) over every batch row
            db = mm(a.reshape(-1, a.shape[-1]).mT, g.reshape(-1, g.shape[-1]), ctx.backend)
        else:
            db = mm(a.mT, g, ctx.backend).sum_to_size(b.shape)
    return da, db, None, None


def _softmax_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    vals = _ENTRIES["softmax"].bind(inputs, {})
    ctx.axis = vals[1]
    ctx.save_for_backward(output)


def _softmax_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    (y,) = ctx.saved_tensors  # dx = y * (g - sum(g * y)) along the axis
    ct = _compute(y)
    yc, gc = y.to(ct), g.to(ct)
    dx = yc * (gc - (gc * yc).sum(ctx.axis, keepdim=True))
    return dx.to(y.dtype), None, None, None


def _rmsnorm_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    vals = _ENTRIES["rmsnorm"].bind(inputs, {})
    ctx.eps = vals[2]
    ctx.save_for_backward(vals[0], vals[1])


def _rms_inverse(x: torch.Tensor, eps: float) -> torch.Tensor:
    """r = (mean(x^2) + eps)^(-1/2) per row, with no overflow or underflow in x^2: the row
    scaled by its largest |x| first (x ~ 1e20 squared overflows float32; the forward splits
    such rows the same way). s > 1: r = (mean((x/s)^2) + eps/s^2)^(-1/2) / s; else the
    square of the scaled mean times s^2, which cannot overflow."""
    s = x.abs().amax(-1, keepdim=True) if x.shape[-1] else x.new_zeros((*x.shape[:-1], 1))
    s = torch.where(s == 0, torch.ones_like(s), s)
    ms = (x / s).square().mean(-1, keepdim=True)
    return torch.where(s > 1, torch.rsqrt(ms + eps / s.square()) / s,
                       torch.rsqrt(ms * s.square() + eps))


def _rmsnorm_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    # y = w * x * r, r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / n; with xn = x r:
    # dx = r * (g w - xn * mean(g w xn)) (r^3 alone underflows for large x); dw = sum g xn
    x, w = ctx.saved_tensors
    ct = _compute(x)
    xc, wc, gc = x.to(ct), w.to(ct), g.to(ct)
    r = _rms_inverse(xc, ctx.eps)
    xn = xc * r
    gw = gc * wc
    dx = r * (gw - xn * (gw * xn).mean(-1, keepdim=True))
    n = x.shape[-1]
    dw = (gc * xn).reshape(-1, n).sum(0) if x.numel() else wc.new_zeros(wc.shape)
    return dx.to(x.dtype), dw.to(w.dtype), None, None, None


def _attention_setup(ctx: Any, inputs: Sequence[Any], output: Any) -> None:
    entry = _ENTRIES["attention"]
    named = dict(zip(entry.names, entry.bind(inputs, {}), strict=True))
    out, lse = output
    ctx.causal, ctx.scale = named["causal"], named["scale"]
    ctx.modifiers = [n for n in ("softcap", "bias", "alibi_slopes") if named[n] is not None]
    ctx.window = named["window"]
    ctx.n_inputs = len(entry.names)
    ctx.backend = named["backend"] or _use_label()
    ctx.save_for_backward(named["q"], named["k"], named["v"], named["mask"], out, lse)
    ctx.mark_non_differentiable(lse)  # lse is what the backward reads, not a loss term


def _attention_backward(ctx: Any, g: torch.Tensor, _g_lse: Any) -> tuple[Any, ...]:
    if ctx.modifiers:  # never a gradient that ignores them
        raise InvalidArgumentError(
            f"attention: no torch backward for {', '.join(ctx.modifiers)} yet (the fused "
            "attention_backward takes causal, window and mask only). Detach the inputs, drop "
            "the modifier, or train through backend='jax' (jax.grad supports them).")
    q, k, v, mask, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.portakern.attention_backward(
        g.contiguous(), q, k, v, out, lse, mask, ctx.causal, ctx.scale, ctx.window, ctx.backend,
        None)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


_AUTOGRAD: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "matmul": (_matmul_setup, _matmul_backward),
    "softmax": (_softmax_setup, _softmax_backward),
    "rmsnorm": (_rmsnorm_setup, _rmsnorm_backward),
    "attention": (_attention_setup, _attention_backward),
}

note_torch_loaded()  # torch came after portakern: tensors are known from now on
# built-in parameters whose default (None) does not say their schema type
_BUILTIN_PARAM_TYPES = {"attention": {"window": "int[]?"},
                        "attention_backward": {"window": "int[]?"},
                        "paged_attention": {"window": "int[]?"}}
for _name in ("matmul", "softmax", "attention", "rmsnorm", "attention_backward",
              "paged_attention"):
    register(_name, param_types=_BUILTIN_PARAM_TYPES.get(_name))
for _name in list(OPS):  # user ops registered so far; one torch cannot take is refused
    with contextlib.suppress(PortakernError):  # on its first call, with the reason
        register(_name)

__all__ = ["NAMESPACE", "call", "register", "registered"]
