"""`pk.verify`: hold any result (a backend's, cuBLAS', a Triton kernel's, your own) to the
float64 oracle under the op's two checks — the same code path as the test suite and
`portakern check`.

Two checks per result:

* **worst-case** (the guarantee): every element within the op's derived bound
  (``spec.tolerance``): ``|got - ref| <= bound``, elementwise. NaN and +-inf must sit exactly
  where the oracle has them (NaN for NaN, the same infinity for an infinity); a non-finite
  value anywhere else fails. A bound of +inf marks an element the op leaves unspecified
  (judged by neither check) where the oracle is finite, and also where it is not when the
  spec sets ``unspecified_nonfinite`` (attention's range rule).
* **statistical** (tracks the real error): the op's probabilistic rounding-error model
  (Higham & Mary 2019) splits each element's error into a deterministic part bounded by
  ``slack`` and a random part that is sub-Gaussian with variance proxy ``sigma**2`` (a sum of
  independent, mean-zero rounding errors, each bounded by h(s) for the value s it rounds;
  Hoeffding's lemma). With ``z = max(|got - ref| - slack, 0) / sigma`` and elements grouped
  where the model lets their errors be correlated (a softmax row shares its sum), the
  statistic is

      T = mean over groups g of (mean over g of z^2),

  and the check passes while ``T <= tau(G)``: for G independent groups a Chernoff bound
  gives P(T >= tau) <= exp(-(G/2) (tau - 1 - ln tau)), and tau(G) is set so that this
  false-alarm probability is ``ALPHA`` = 1e-9 per check (tau = 46.3 for one group, 7.1 for
  10, 2.2 for 100, 1.3 for 1000). Its ratio is ``T / tau``. Averaging over the whole output
  is what makes it sharp: one element's error can be a few sigma, the mean of thousands
  cannot.

Which model (``compare_arrays(..., ordered=)``, ``statistical_model``): ``spec.statistical``
is order-free -- it bounds the error of every summation order -- and judges ``pk.verify``'s
results (anything's: cuBLAS, numpy, your kernel) and the array backends' (numpy, jax).
``spec.statistical_ordered`` (matmul's; other ops have none and keep ``statistical``) is
built from the node values of the op's own C kernel's summation tree and judges results the
caller marks as that kernel's: the suite (tests/_oracle.py) and `portakern check` pass
``ordered=own_kernel(backend)``, True for a C-kernel backend (OpenCL, CUDA, the simulator).
A correct result of another order can fail the ordered model, so never mark a foreign one.
On a device with matrix units (``matrix_unit=native_matrix_unit(backend)``) the ordered
model is called with ``truncation=True`` (matmul: a slack per truncating instruction; a model
without that keyword gives way to the order-free one).

What each catches in matmul (float32, 96 outputs, tau 2.24, K = 4096 and 16384, 30 seeds;
tables and the other ops: docs/guarantees.md, "Correctness checks"):

* ordered: random errors of ~2.3x the kernel's rms error (median; at most 3.5x), TF32- and
  bf16-rounded inputs, a dropped K term and fp16 accumulation, on normal, all-positive and
  +-1e4-offset data alike; no false alarm on the kernel's own results in 1000 seeds x 5
  data families x both K on PoCL (largest T/tau 0.24). It cannot see a compiler's
  reassociation of the source's order, nor judge float64 (the oracle's own error follows
  OpenBLAS' order: float64 keeps the order-free model).
* order-free: bf16-rounded inputs, a dropped K term and fp16 accumulation everywhere, and
  TF32-rounded inputs only on data with cancellation (normal, one operand offset); it
  cannot tell TF32 inputs from a correct sequential fp32 sum on all-positive or same-sign-
  offset data (caught in 5 of 30 seeds at K = 4096, none at 16384), and passes random errors
  up to ~20x (normal, K = 4096) to ~150x (all-positive, K = 16384) the kernel's rms error.

Elements whose oracle value or statistical scale is not finite are judged by the worst-case
check alone. An op without a statistical model (``spec.statistical`` None, as in most user
ops) gets the worst-case check only (``stat_ratio`` None).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.errors import DTypeError, InvalidArgumentError, NotAnArrayError, ShapeError
from ..core.spec import KernelSpec, Problem
from ..core.spec_checks import output_bounds, spec_error
from ..core.statmodel import StatModel

ALPHA = 1e-9  # false-alarm probability of the statistical check, per verdict


@dataclass(frozen=True)
class Check:
    """One check's outcome: ratio <= 1 passes; index is the worst element (None if empty)."""

    name: str
    ok: bool
    ratio: float
    index: tuple[int, ...] | None = None
    detail: str = ""


@dataclass
class Verdict:
    """What ``pk.verify`` returns. ``ok`` is True when every check passes.

    worst_ratio: the worst-case check's max |got - ref| / bound (<= 1 passes);
    stat_ratio: the statistical check's T / tau (<= 1 passes; None without a model);
    index: where the worst-case ratio is largest; where: that element in words;
    checks: each check's outcome."""

    ok: bool
    worst_ratio: float
    where: str = ""
    stat_ratio: float | None = None
    index: tuple[int, ...] | None = None
    checks: tuple[Check, ...] = field(default_factory=tuple)

    def __str__(self) -> str:
        lines = [f"verdict: {'ok' if self.ok else 'FAILED'}"]
        for c in self.checks:
            lines.append(f"  {c.name:11s} {'ok' if c.ok else 'FAIL':4s} ratio {c.ratio:.3g}"
                         f"{' at ' + str(c.index) if c.index is not None else ''}"
                         f"{': ' + c.detail if c.detail else ''}")
        return "\n".join(lines)


def tau(groups: int, alpha: float = ALPHA) -> float:
    """The statistic's threshold for `groups` independent groups: the smallest tau > 1 with
    exp(-(groups/2)(tau - 1 - ln tau)) <= alpha."""
    if groups <= 0:
        return math.inf
    c = 2.0 * math.log(1.0 / alpha) / groups
    lo, hi = 1.0, 2.0
    while hi - 1.0 - math.log(hi) < c:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if mid - 1.0 - math.log(mid) < c:
            lo = mid
        else:
            hi = mid
    return hi


def statistical_model(spec: KernelSpec, ordered: bool = False, matrix_unit: bool = False
                      ) -> Callable[..., StatModel] | None:
    """The op's statistical error model: ``spec.statistical`` (order-free), or with
    ``ordered`` (the result came from the spec's own C kernel) ``spec.statistical_ordered``
    where the spec has one. The built-in ops' and a user op's alike; None for an op without
    one (``spec.replace(semantics=...)`` drops both, ``replace(source=...)`` the ordered).

    ``matrix_unit`` (the kernel ran where matrix units may have computed it: a device with a
    native fragment lowering, ``native_matrix_unit``): their truncating adds are outside
    the ordered model's round-to-nearest, so it is called with ``truncation=True`` when it
    takes that keyword (matmul's adds a slack per matrix-unit step); one that does not take
    it gives way to the order-free model."""
    if ordered and spec.statistical_ordered is not None:
        if not matrix_unit:
            return spec.statistical_ordered
        model: Callable[..., StatModel] = spec.statistical_ordered
        if "truncation" in inspect.signature(model).parameters:
            return functools.partial(model, truncation=True)
    return spec.statistical


def native_matrix_unit(backend: Any) -> bool:
    """Whether ``backend``'s device has a native fragment lowering (CUDA sm_80+, HIP
    CDNA/RDNA3, OpenCL with Intel's matrix extension), so a C kernel's fp16/bf16 products
    may have run on matrix units; the CPU devices run the emulation, which rounds to
    nearest. Pass it as ``compare_arrays(..., matrix_unit=)``."""
    return getattr(backend, "matrix_unit", None) is not None


def own_kernel(backend: Any) -> bool:
    """Whether ``backend``'s results come from the spec's own C kernel (a KernelBackend
    compiles ``spec.source``: OpenCL, CUDA, the simulator), so ``compare_arrays(...,
    ordered=True)`` may judge them by the model of its summation order. Array backends
    (numpy, jax) evaluate the semantics in their library's own order: False."""
    from ..backend.base import KernelBackend

    return isinstance(backend, KernelBackend)


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def compare_arrays(spec: KernelSpec, arrays: Mapping[str, Any], params: Mapping[str, Any],
                   got: Any, prob: Problem | None = None, *, ordered: bool = False,
                   matrix_unit: bool = False) -> Verdict:
    """Both checks of ``got`` against the float64 oracle on host (numpy) operands. Several
    outputs (``prob.outputs``): ``got`` is a tuple, each entry checked (``_compare_outputs``).

    ``ordered``: ``got`` was computed by this spec's own C kernel (``own_kernel(backend)``),
    so the statistical check uses ``spec.statistical_ordered`` where the spec has one (the
    model of the kernel's summation order, sharper); otherwise ``spec.statistical``, which
    admits every order. Say it only of results of ``spec.source``: another implementation's
    correct result may fail the ordered model (numpy/OpenBLAS' fp32 matmul does, at K =
    4096 on all-positive data). ``matrix_unit``: the kernel ran on a device whose matrix
    units may have computed it (``native_matrix_unit(backend)``; ``statistical_model``)."""
    if prob is None:
        prob = spec.problem(arrays, dict(params))
    if prob.outputs is not None:
        return _compare_outputs(spec, arrays, prob, got)
    x64 = {k: (v if v is None or v.dtype.kind in "bi" else np.asarray(v).astype(np.float64))
           for k, v in arrays.items()}
    args = [x64[o.name] for o in spec.operands]
    with np.errstate(all="ignore"):
        ref = np.asarray(spec.semantics(np, *args, **prob.params), dtype=np.float64)
        got64 = np.asarray(got).astype(np.float64)
        if got64.shape != ref.shape:
            msg = f"shape {got64.shape} != expected {ref.shape}"
            return Verdict(False, math.inf, msg, None, None,
                           (Check("worst-case", False, math.inf, None, msg),))
        if ref.size == 0:  # nothing to judge; the checks the op has, each passed
            if statistical_model(spec) is None:
                return Verdict(True, 0.0, "", None, None, (Check("worst-case", True, 0.0),))
            return Verdict(True, 0.0, "", 0.0, None,
                           (Check("worst-case", True, 0.0), Check("statistical", True, 0.0)))
        inputs = {k: v for k, v in x64.items() if v is not None}
        bound = np.broadcast_to(np.asarray(spec.tolerance(prob, inputs, ref), np.float64),
                                ref.shape)
        diff = got64 - ref
        err = np.abs(diff)
        both_nan = np.isnan(got64) & np.isnan(ref)
        same_inf = np.isinf(ref) & (got64 == ref)
        err = np.where(both_nan | same_inf, 0.0, err)
        err = np.where(np.isnan(err), np.inf, err)
        # a bound of +inf where the oracle is finite: an element the op leaves unspecified
        # (attention's range rule: IEEE in the compute type decides), judged by neither check.
        # Where the oracle is NaN or infinite, got must match it exactly whatever the bound,
        # unless the spec says its +inf bounds come only from such a rule (unspecified_nonfinite).
        unspecified = np.isposinf(bound) & (np.isfinite(ref) | spec.unspecified_nonfinite)
        err = np.where(unspecified, 0.0, err)
        # a bound that is NaN (an operand's inf times 0) claims nothing: only exact matches pass
        bound = np.nan_to_num(bound, nan=0.0, posinf=np.inf)
        ratio = np.where(err == 0, 0.0, err / np.maximum(bound, 1e-300))
        ratio = np.where(np.isnan(ratio), np.inf, ratio)
        flat = int(ratio.argmax())
        worst = float(ratio.flat[flat])
        idx = _index(flat, ref.shape)
        where = (f"at {idx}: got {got64[idx]!r}, expected {ref[idx]!r}, "
                 f"bound {float(bound[idx])!r}")
        checks = [Check("worst-case", worst <= 1.0, worst, idx, where)]
        stat_ratio = None
        model = statistical_model(spec, ordered, matrix_unit)
        if model is not None:
            st = model(prob, inputs, ref)
            stat_ratio, sidx, sdetail = _statistic(st, prob, err, ref, got64, ~unspecified)
            if ordered and model is not spec.statistical:
                sdetail = f"kernel-order model: {sdetail}"
            checks.append(Check("statistical", stat_ratio <= 1.0, stat_ratio, sidx, sdetail))
    ok = all(c.ok for c in checks)
    return Verdict(ok, worst, where, stat_ratio, idx, tuple(checks))


def _compare_outputs(spec: KernelSpec, arrays: Mapping[str, Any], prob: Problem,
                     got: Any) -> Verdict:
    """Each output of a several-output op checked as a one-output op would be: the oracle's
    tuple once, ``spec.tolerance(prob, inputs, refs)`` one bound per output
    (portakern.core.spec_checks.output_bounds: a tuple, a dict by name, or one for all; None, and
    every int32 output, exact), each check named after its output. An output of the wrong
    dtype fails its check (portakern never casts silently). The statistical check is for
    one-output ops: each output here gets the worst-case check."""
    outs = prob.output_specs
    names = tuple(outs)
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        what = f"{len(got)} arrays" if isinstance(got, (tuple, list)) else type(got).__name__
        msg = (f"expected a tuple of {len(names)} arrays ({', '.join(names)}), one per output "
               f"of {spec.name}; got {what}")
        return Verdict(False, math.inf, msg, None, None,
                       (Check("worst-case", False, math.inf, None, msg),))
    x64 = {k: (v if v is None or v.dtype.kind in "bi" else np.asarray(v).astype(np.float64))
           for k, v in arrays.items()}
    with np.errstate(all="ignore"):
        res = spec.semantics(np, *[x64[o.name] for o in spec.operands], **prob.params)
        if not isinstance(res, (tuple, list)) or len(res) != len(names):
            n = len(res) if isinstance(res, (tuple, list)) else 1
            raise spec_error(spec.name, "semantics", f"returns {n} array(s) while validate "
                             f"declares {len(names)} outputs {list(names)}",
                             "return a tuple with one array per output, in the order of "
                             "Problem.outputs")
        refs = tuple(np.asarray(r, dtype=np.float64) for r in res)
        inputs = {k: v for k, v in x64.items() if v is not None}
        bounds = output_bounds(spec.name, outs, spec.tolerance(prob, inputs, refs))
    worst: Verdict | None = None
    checks: list[Check] = []
    for (name, (_, dt)), ref, bound, g in zip(outs.items(), refs, bounds, got):
        gdt = getattr(g, "dtype", None)
        if gdt is not None and dtypes.dtype_name(gdt) != dt:
            msg = (f"has dtype {dtypes.dtype_name(gdt)}; {spec.name} returns {dt} there "
                   "(portakern never casts silently)")
            v = Verdict(False, math.inf, msg, None, None,
                        (Check("worst-case", False, math.inf, None, msg),))
        else:
            exact = 0.0 if bound is None else bound  # int32 outputs and None: no error allowed
            one = spec.replace(semantics=lambda xp, *a, _r=ref, **k: _r,
                               tolerance=lambda p, x, r, _b=exact: _b, statistical=None,
                               statistical_ordered=None)
            v = compare_arrays(one, arrays, prob.params, g,
                               dataclasses.replace(prob, outputs=None, out_shape=ref.shape))
        checks += [dataclasses.replace(c, name=f"{name}: {c.name}") for c in v.checks]
        if worst is None or v.worst_ratio > worst.worst_ratio:
            worst = dataclasses.replace(v, where=f"output {name!r} {v.where}")
    assert worst is not None
    return dataclasses.replace(worst, ok=all(c.ok for c in checks), checks=tuple(checks))


def _statistic(st: StatModel, prob: Problem, err: np.ndarray, ref: np.ndarray,
               got64: np.ndarray, judged: np.ndarray
               ) -> tuple[float, tuple[int, ...] | None, str]:
    sigma = np.broadcast_to(np.asarray(st.sigma, np.float64), ref.shape)
    slack = np.broadcast_to(np.asarray(st.slack, np.float64), ref.shape)
    if prob.info.compute == np.float64:
        # the float64 oracle commits rounding errors of the same kind as the result it judges
        sigma, slack = sigma * math.sqrt(2.0), slack * 2.0
    use = (judged & np.isfinite(ref) & np.isfinite(got64) & np.isfinite(sigma)
           & np.isfinite(slack))
    excess = np.maximum(err - slack, 0.0)
    z2 = np.where(use, np.where(excess > 0, excess / np.where(sigma > 0, sigma, 0.0), 0.0), 0.0)
    z2 = np.where(np.isnan(z2), np.inf, z2) ** 2
    axes = tuple(a % ref.ndim for a in st.group_axes)
    n_in = np.sum(use, axis=axes, keepdims=True) if axes else use.astype(np.float64)
    z_group = np.sum(z2, axis=axes, keepdims=True) / np.maximum(n_in, 1) if axes else z2
    live = n_in > 0
    groups = int(np.count_nonzero(live))
    if groups == 0:
        return 0.0, None, "no finite element to judge"
    t_stat = float(np.sum(np.where(live, z_group, 0.0)) / groups)
    threshold = tau(groups)
    flat = int(z2.argmax())
    idx = _index(flat, ref.shape)
    detail = (f"T = mean z^2 = {t_stat:.3g} over {groups} group(s), tau = {threshold:.3g}; "
              f"largest z = {math.sqrt(float(z2.flat[flat])):.3g} at {idx} (got "
              f"{got64[idx]!r}, expected {ref[idx]!r}, sigma {float(sigma[idx]):.3g}, "
              f"slack {float(slack[idx]):.3g})")
    return t_stat / threshold, idx, detail


def _host(name: str, x: Any, op: str) -> np.ndarray:
    """A host numpy copy of a numpy, jax, CuPy or PyOpenCL array (or anything with
    __array__); refuse what is none of those."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple, str, bytes)) or x is None or not hasattr(x, "shape"):
        raise NotAnArrayError(
            f"verify({op}): {name} must be an array (numpy, jax, cupy or pyopencl); got "
            f"{type(x).__name__}. Wrap it with np.asarray(...).")
    get = getattr(x, "get", None)
    if callable(get) and not hasattr(x, "__array_namespace_info__"):
        try:
            out = get()  # cupy.ndarray, pyopencl.array.Array: device -> host
            if isinstance(out, np.ndarray):
                return out
        except Exception:  # noqa: BLE001 - fall back to __array__
            pass
    try:
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001
        raise NotAnArrayError(
            f"verify({op}): {name} ({type(x).__name__}) cannot be copied to host: {exc}. "
            "Pass a numpy array, e.g. np.asarray(x) or x.get().") from None


def verify(op: str | KernelSpec, *operands: Any, got: Any = None, **params: Any) -> Verdict:
    """Check ``got`` — a result of ``op`` on ``operands`` computed by anything — against
    portakern's float64 oracle with the same two checks the test suite and `portakern check`
    apply: the op's worst-case bound and its statistical check.

    >>> a = np.random.rand(64, 4096).astype(np.float32)
    >>> b = np.random.rand(4096, 32).astype(np.float32)
    >>> v = pk.verify("matmul", a, b, got=a @ b)      # numpy/OpenBLAS's own matmul
    >>> v.ok, v.worst_ratio, v.stat_ratio, v.index

    Operands and parameters are those of the op (``pk.verify("softmax", x, axis=0, got=y)``);
    they are validated as the op validates them (ShapeError, DTypeError, ...). ``got`` must
    have the op's output shape and dtype (portakern never casts silently).
    """
    from ..ops import get_op

    spec = op if isinstance(op, KernelSpec) else get_op(op)
    if got is None:
        raise InvalidArgumentError(
            f"verify({spec.name}): got= is missing; expected the result to check, e.g. "
            f"pk.verify({spec.name!r}, *operands, got=result).")
    arrays, bound_params = spec.bind(operands, params)
    prob = spec.problem(arrays, bound_params)  # shapes, dtypes, params: as the op refuses them
    host = {k: (None if v is None else _host(f"operand {k!r}", v, spec.name))
            for k, v in arrays.items()}
    if prob.outputs is not None:  # several outputs: got is a tuple, one array per output
        if not isinstance(got, tuple) or len(got) != len(prob.outputs):
            raise InvalidArgumentError(
                f"verify({spec.name}): got must be a tuple of {len(prob.outputs)} arrays, one "
                f"per output ({', '.join(prob.outputs)}); got {type(got).__name__}.")
        got_t = tuple(_host(f"got[{i}]", g, spec.name) for i, g in enumerate(got))
        for (name, (shape, dt)), g in zip(prob.outputs.items(), got_t):
            if tuple(g.shape) != tuple(shape):
                raise ShapeError(
                    f"verify({spec.name}): output {name!r} has shape {tuple(g.shape)}; expected "
                    f"{tuple(shape)}, as {spec.name} of these operands returns. Pass the "
                    "outputs of the same call, in order.")
            if dtypes.dtype_name(g.dtype) != dt:
                raise DTypeError(
                    f"verify({spec.name}): output {name!r} has dtype "
                    f"{dtypes.dtype_name(g.dtype)}; expected {dt}, as {spec.name} of these "
                    f"operands returns. Cast it: got[{list(prob.outputs).index(name)}]"
                    f".astype({dt!r}) is what a {dt} result would hold.")
        return compare_arrays(spec, host, prob.params, got_t, prob)
    got_h = _host("got", got, spec.name)
    if tuple(got_h.shape) != tuple(prob.out_shape):
        raise ShapeError(
            f"verify({spec.name}): got has shape {tuple(got_h.shape)}, but {spec.name} of these "
            f"operands gives {tuple(prob.out_shape)}; pass the result of the same call.")
    want = dtypes.info(prob.dtype).storage
    if got_h.dtype != want:
        raise DTypeError(
            f"verify({spec.name}): got has dtype {dtypes.dtype_name(got_h.dtype)}, but "
            f"{spec.name} of {prob.dtype} operands returns {prob.dtype}; expected got of dtype "
            f"{prob.dtype}. If your implementation returns a wider type, cast it: "
            f"got.astype({prob.dtype!r}) is what a {prob.dtype} result would hold.")
    return compare_arrays(spec, host, prob.params, got_h, prob)
