"""KernelSpec: the one definition of an op that every backend, test and benchmark reads.

A spec is data plus a few pure functions of the *problem* (shapes, dtype, parameters) — never
of a backend. Backends read ``source``/``slots``/``defines``/``launches`` (C-kernel backends) or
``semantics`` (array-library backends); tests read ``semantics`` and ``tolerance``; the
benchmark reads ``cost``. Validation runs on metadata only (shape, dtype), so it is the same
for numpy arrays, CuPy arrays, PyOpenCL arrays and jax Arrays, and happens before any backend
is touched.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import codegen, dtypes
from .errors import DTypeError, InvalidArgumentError, NotAnArrayError, ShapeError, SpecError

if TYPE_CHECKING:  # sampling imports nothing from here, but keep spec importable on its own
    from .sampling import Case, Chooser
    from .statmodel import StatModel

_SPEC_TOKENS = itertools.count()

# 32-bit index arithmetic is used inside kernels: any operand or output beyond this is refused
# from its shape alone, before anything is allocated.
MAX_INDEX = 2**31 - 1


@dataclass(frozen=True)
class Tunable:
    """A compile-time parameter with a finite domain; becomes ``#define NAME value``."""

    name: str
    domain: tuple[int, ...]
    doc: str = ""

    def check(self, value: object, spec: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or int(value) not in self.domain:
            raise InvalidArgumentError(
                f"{spec}: tunable {self.name}={value!r} is outside its domain {self.domain}; "
                f"pick one of those values.")
        return int(value)


@dataclass(frozen=True)
class Operand:
    """An array operand. kind 'float' shares the op's dtype; 'bool' is a boolean mask;
    'int32' is an index table (dtype int32 only, never converted to float); 'acc' is a float
    array in the op's compute type (float32 for float16/bfloat16/float32 ops, float64 for
    float64 ones), such as the forward's log-sum-exp a backward takes; 'float32' is a float32
    array whatever the op's dtype (attention's ALiBi slopes, as FlashAttention takes them)."""

    name: str
    kind: str = "float"
    optional: bool = False


@dataclass(frozen=True)
class ArrayMeta:
    shape: tuple[int, ...]
    dtype: np.dtype | str


@dataclass(frozen=True)
class Buf:
    """Kernel argument: the device buffer of operand/output ``name``."""

    name: str


@dataclass(frozen=True)
class Scalar:
    """Kernel argument: a scalar. ctype 'int' (32-bit) or 'acc' (the compute float type)."""

    value: float | int
    ctype: str = "int"


@dataclass(frozen=True)
class Launch:
    """One kernel launch: entry point, number of work-groups per dim, work-group size, args."""

    kernel: str
    groups: tuple[int, int, int]
    local: tuple[int, int, int]
    args: tuple[Buf | Scalar, ...]

    @functools.cached_property
    def global_size(self) -> tuple[int, int, int]:
        """Work-items per dimension (groups x local): computed once, not on every enqueue."""
        g, lo = self.groups, self.local
        return (g[0] * lo[0], g[1] * lo[1], g[2] * lo[2])


@dataclass(frozen=True)
class PallasKernel:
    """An op's Pallas kernel (the jax backend's ``jax:pallas`` path) with its block tunables as
    data, so the backend names no op's blocks. Calling it calls ``build``.

    * ``build(problem, interpret, *, platform, reference, **blocks)`` -> a function of the
      operands (jax arrays) giving the result;
    * ``tunables``: the block sizes ``build`` takes as keywords (``config={name: value}`` on
      the Pallas path), each with its domain;
    * ``aliases``: C-kernel tunable -> Pallas tunable it stands for (attention: BQ -> block_q),
      so one ``config=`` works on every backend; the value is checked against both;
    * ``check(platform, blocks)``: optional platform-level validation of the chosen blocks
      (raises InvalidArgumentError), run before tracing.
    """

    build: Callable[..., Any]
    tunables: tuple[Tunable, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[str, Mapping[str, int]], Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.build(*args, **kwargs)


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float  # compulsory main-memory traffic: inputs read once, outputs written once


@dataclass
class Problem:
    """A validated call: everything a backend needs, nothing about which backend runs it."""

    op: str
    dtype: str  # canonical float dtype name of the float operands and output
    shapes: dict[str, tuple[int, ...] | None]
    params: dict[str, Any]
    out_shape: tuple[int, ...]
    derived: dict[str, Any] = field(default_factory=dict)  # op-specific sizes (M, N, K, ...)
    empty_result: bool = False  # True: the answer is all zeros (or empty) with no kernel needed
    # Several outputs: {name: (shape, dtype name)} in the order the op returns them (a tuple);
    # launches name each as Buf(name). None: the one output Buf("out") of out_shape and dtype.
    outputs: dict[str, tuple[tuple[int, ...], str]] | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of operand ``name``, which the call gave (a required operand's always
        is); KeyError for an optional operand the call left out."""
        shape = self.shapes.get(name)
        if shape is None:
            raise KeyError(f"{self.op}: operand {name!r} was not given")
        return shape

    @property
    def info(self) -> dtypes.DTypeInfo:
        return dtypes.info(self.dtype)

    @property
    def output_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every output by its buffer name: {"out": (out_shape, dtype)} for a one-output op."""
        if self.outputs is None:
            return {"out": (tuple(self.out_shape), self.dtype)}
        return self.outputs


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype an output or workspace buffer of dtype ``name`` is stored in: a float
    dtype's storage type, or int32 (index tables, flags)."""
    if name == "int32":
        return np.dtype(np.int32)
    return np.dtype(dtypes.info(name).storage)


def array_meta(name: str, x: object, spec: str) -> ArrayMeta:
    """Shape and dtype of anything array-like that a backend could own; refuse the rest."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None or isinstance(x, (list, tuple)):
        raise NotAnArrayError(
            f"{spec}: argument {name!r} must be an array (numpy, cupy, pyopencl or jax); got "
            f"{type(x).__name__}. Wrap it with np.asarray(...).")
    try:
        shp = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise NotAnArrayError(f"{spec}: argument {name!r} has a non-integer shape {shape!r}; "
                              "expected an array with a concrete shape.") from None
    return ArrayMeta(shp, dtype)


def check_index_range(spec: str, what: str, shape: Sequence[int]) -> None:
    n = 1
    for s in shape:
        n *= int(s)
    if n > MAX_INDEX:
        raise ShapeError(
            f"{spec}: {what} of shape {tuple(shape)} has {n} elements, more than the {MAX_INDEX} "
            "that 32-bit kernel indexing addresses; split the call into smaller pieces.")


def schedule_family(schedule_class: str) -> str:
    """'cpu256' -> 'cpu': a schedule class is its family plus the native vector bits."""
    return schedule_class.rstrip("0123456789") or schedule_class


@dataclass(frozen=True)
class KernelSpec:
    """The single source of truth of an op. docs/add-a-kernel.md explains each field; a user op
    is registered with ``portakern.register_op``, which checks the spec (SpecError otherwise)."""

    name: str
    operands: tuple[Operand, ...]
    params: Mapping[str, Any]  # keyword parameters and their defaults
    validate: Callable[[dict[str, ArrayMeta | None], dict[str, Any]], Problem]
    semantics: Callable[..., Any]  # semantics(xp, *arrays, **params) in the compute dtype
    source: str  # portable C kernel in portakern's macro dialect
    slots: Callable[[Problem], dict[str, Any]]  # dtype slot -> dtype
    defines: Callable[[Problem, Mapping[str, int]], dict[str, Any]]
    launches: Callable[[Problem, Mapping[str, int]], list[Launch]]
    cost: Callable[[Problem], Cost]
    # (problem, float64 inputs, the float64 result: an array, or a tuple of them for several
    # outputs) -> the bound (a tuple of bounds for several outputs)
    tolerance: Callable[[Problem, dict[str, np.ndarray], Any], Any]
    tunables: tuple[Tunable, ...] = ()
    # 'gpu' (required), 'cpu', and optionally 'cpu256' (a CPU whose native float vectors
    # are 256 bits, AVX2: half the lanes and half the registers of AVX-512, so smaller
    # register blocks) and 'mma'; a class the spec lacks falls back to its family
    # ('cpu256' -> 'cpu'), then to 'gpu' (schedule_for)
    schedules: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    config_check: Callable[[Problem | None, Mapping[str, int]], str | None] | None = None
    # optional: the Pallas kernel (jax:pallas path), a PallasKernel (block tunables declared)
    # or a bare callable build(problem, interpret, *, platform, reference) taking no blocks
    pallas: PallasKernel | Callable[..., Any] | None = None
    # optional: the jax backend's XLA function in place of the plain lowered semantics,
    # xla(problem, traced) -> fn(*operands, *traced values) with the lowered semantics'
    # contract (outputs in their dtypes): e.g. attention's, whose custom_vjp gives jax.grad
    # the analytic backward instead of the autodiff of the unfused chain
    xla: Callable[..., Any] | None = None
    # optional: workspace(problem, cfg) -> {buffer name: (elements, dtype name)}: device
    # scratch the launches use (e.g. a packed copy of an operand), named in Launch args as
    # Buf(name). C-kernel backends allocate it per call; array backends never see it.
    workspace: Callable[[Problem, Mapping[str, int]], Mapping[str, tuple[int, str]]] | None = None
    # optional: fit_device(problem, cfg, compute_units) -> cfg: the configuration with its
    # automatic tunables (e.g. attention's SPLIT = 0) resolved for the device that runs it,
    # from its compute units (SMs, CUs, cores). Called by runtime.configs.config_for; a raw
    # config (tools without a device) keeps the automatic value, which the spec must read
    # as its device-independent default.
    fit_device: Callable[[Problem, dict[str, int], int], dict[str, int]] | None = None
    # optional: check_values(operands by name) raises on operand *values* that no shape or
    # dtype check can see (paged_attention's block table ids and lengths), before any
    # device work. Every call of the op runs it (runtime.plan.dispatch), cached plan or not;
    # it may copy small device tables to the host, and skips values it cannot know (tracers).
    check_values: Callable[[Mapping[str, Any]], None] | None = None
    doc: str = ""
    # A +inf tolerance bound marks an element the op leaves unspecified (judged by neither
    # check) where the oracle is finite. True: also where the oracle is NaN or infinite, for an
    # op whose tolerance gives +inf only by a range rule (attention: IEEE arithmetic in the
    # compute type decides, e.g. FMA turning a score's inf - inf (NaN) into -inf). False: a
    # NaN/inf there must match exactly whatever the bound (an inf operand can make it +inf).
    unspecified_nonfinite: bool = False
    # --- optional, for user-defined ops (docs/add-a-kernel.md); checked by register_op ------
    # example(dtype, **sizes) -> ({operand: array or ArrayMeta(shape, dtype)}, {param: value}):
    # a typical call, rendered by `portakern show` and measured by `portakern tune`, compiled by
    # register_op(check=True) (and by the compile-only checks when `examples` is absent), and
    # used to check the spec's functions at registration. Keyword size parameters with defaults
    # (example(dtype, *, M=256, N=256)) are what `--shape M=512` sets; names it lacks are ignored.
    example: Callable[..., tuple[dict[str, Any], dict[str, Any]]] | None = None
    # examples(dtype) -> [(label, {operand: ArrayMeta or array}, {param: value}), ...]: the
    # representative calls the compile-only checks (NVRTC, hipcc) and `portakern resources`
    # render, chosen to cover what changes the rendered source (dtype aside: each dtype is
    # asked for). Absent: [("example", the example)], or nothing without example/shapes.
    examples: Callable[[str], Sequence[tuple[str, Mapping[str, Any], Mapping[str, Any]]]] \
        | None = None
    # cases(chooser, dtype) -> Case: the generator the shared suite and `portakern check` draw
    # from. Absent: one is derived from `shapes` (or from the example's shapes).
    cases: Callable[[Chooser, str], Case] | None = None
    # shapes: {operand: dims}, each dim a size name shared across operands or a fixed int, e.g.
    # {"x": ("rows", "n"), "w": ("n",)}: the shape family the derived generator draws from.
    shapes: Mapping[str, Sequence[str | int] | str] | None = None
    # statistical(p, inputs64, ref) -> portakern.StatModel(sigma, slack, group_axes): the op's
    # probabilistic rounding-error model for one problem, behind the statistical check of
    # pk.verify, the suite and `portakern check` (portakern.verify's docstring). ``inputs64``:
    # the operands by name, float ones in float64 (absent optional ones left out); ``ref``: the
    # float64 oracle. sigma (the random part's scale) and slack (the deterministic part's
    # bound) broadcast to the output; group_axes: output axes whose errors may be correlated
    # (softmax and rmsnorm: (-1,), a row shares its sum). One-output ops only. Absent: the
    # worst-case check alone. The model describes `semantics`' errors: `replace(semantics=...)`
    # without a new `statistical` drops it.
    statistical: Callable[[Problem, dict[str, np.ndarray], np.ndarray], StatModel] | None = None
    # statistical_ordered(p, inputs64, ref) -> StatModel: the same, for results of this spec's
    # own C kernel (`source`), whose summation order it knows (matmul: 512-term blocks). It
    # judges a result only where the caller says the result came from `source`
    # (compare_arrays(..., ordered=True): the suite and `portakern check` on C-kernel
    # backends); `statistical` judges everything else (pk.verify of foreign results, array
    # backends). Absent: `statistical` judges those too. `replace(source=...)` or
    # `replace(semantics=...)` without a new one drops it.
    statistical_ordered: Callable[[Problem, dict[str, np.ndarray], np.ndarray],
                                  StatModel] | None = None
    # A process-unique identity for caches (compiled kernels, plans, validated problems).
    # Not id(spec): a freed spec's id is reused, and a cache would hand its kernel to another.
    token: int = field(default_factory=lambda: next(_SPEC_TOKENS), init=False, compare=False,
                       repr=False)

    # --- validation ---------------------------------------------------------------------
    @functools.cached_property
    def _operand_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    @functools.cached_property
    def _no_optional_operands(self) -> bool:
        return not any(o.optional for o in self.operands)

    def all_positional(self, args: Sequence[object]) -> bool:
        """Whether ``args`` are exactly the operands, in order, none None (no optional ones):
        then binding is a zip and the parameters are the defaults."""
        if len(args) != len(self._operand_names) or not self._no_optional_operands:
            return False
        for a in args:
            if a is None:
                return False
        return True

    def bind(self, args: Sequence[object], kwargs: Mapping[str, Any]
             ) -> tuple[dict[str, object], dict[str, Any]]:
        """Split a call into operand arrays (by name) and parameters (defaults filled)."""
        names = self._operand_names
        if not kwargs and self.all_positional(args):
            return dict(zip(names, args)), dict(self.params)
        arrays: dict[str, object] = {}
        if len(args) > len(names):
            raise InvalidArgumentError(
                f"{self.name}() takes {len(names)} array arguments ({', '.join(names)}); "
                f"got {len(args)}.")
        for n, a in zip(names, args):
            arrays[n] = a
        params = dict(self.params)
        for k, v in kwargs.items():
            if k in names:
                if k in arrays:
                    raise InvalidArgumentError(f"{self.name}(): {k!r} given twice.")
                arrays[k] = v
            elif k in params:
                params[k] = v
            else:
                raise InvalidArgumentError(
                    f"{self.name}() got an unexpected argument {k!r}; expected operands "
                    f"{names} and parameters {sorted(self.params)}.")
        for o in self.operands:
            if o.name not in arrays:
                if not o.optional:
                    raise InvalidArgumentError(f"{self.name}() is missing the array {o.name!r}.")
                arrays[o.name] = None
            elif arrays[o.name] is None and not o.optional:
                raise NotAnArrayError(
                    f"{self.name}: argument {o.name!r} must be an array; got None.")
        return arrays, params

    def problem(self, arrays: Mapping[str, object], params: Mapping[str, Any]) -> Problem:
        """Validate metadata and build the Problem. Raises before any backend is touched."""
        metas: dict[str, ArrayMeta | None] = {}
        float_dtypes: dict[str, str] = {}  # float operand -> its dtype's name
        acc_dtypes: dict[str, str] = {}  # compute-type operand -> its dtype's name
        for o in self.operands:
            x = arrays.get(o.name)
            if x is None:
                metas[o.name] = None
                continue
            m = array_meta(o.name, x, self.name)
            metas[o.name] = m
            check_index_range(self.name, f"operand {o.name!r}", m.shape)
            name = dtypes.dtype_name(m.dtype)
            if o.kind == "bool":
                if name != "bool":
                    raise DTypeError(f"{self.name}: {o.name!r} must be a boolean array (True = "
                                     f"keep); got dtype {name}. Use x.astype(bool).")
            elif o.kind == "int32":
                if name != "int32":
                    raise DTypeError(f"{self.name}: {o.name!r} is an index table and must have "
                                     f"dtype int32; got {name}. Use x.astype(np.int32) (indices "
                                     "are never converted from float, nor narrowed silently).")
            elif o.kind == "float32":
                if name != "float32":
                    raise DTypeError(f"{self.name}: {o.name!r} must have dtype float32 whatever "
                                     f"the other operands' dtype; got {name}. Use "
                                     "x.astype(np.float32).")
            elif o.kind == "acc":
                acc_dtypes[o.name] = name
            else:
                dtypes.info(m.dtype)
                float_dtypes[o.name] = name
        if len(set(float_dtypes.values())) > 1:
            listing = ", ".join(f"{n}={d}" for n, d in float_dtypes.items())
            raise DTypeError(f"{self.name}: mixed input dtypes ({listing}); expected one dtype "
                             "for all float operands. Cast explicitly; portakern never promotes.")
        if acc_dtypes and float_dtypes:
            shared = next(iter(float_dtypes.values()))
            want = dtypes.compute_dtype_name(shared)
            for n, d in acc_dtypes.items():
                if d != want:
                    raise DTypeError(
                        f"{self.name}: {n!r} has dtype {d}; expected {want}, the compute type "
                        f"of the {shared} operands. Pass it as the op that made it returned "
                        f"it, or cast it: x.astype({want!r}).")
        prob = self.validate(metas, dict(params))
        check_index_range(self.name, "the output", prob.out_shape)
        if prob.outputs is not None:
            for oname, (oshape, _) in prob.outputs.items():
                check_index_range(self.name, f"output {oname!r}", oshape)
        return prob

    # --- rendering ----------------------------------------------------------------------
    def render(self, dialect: str, problem: Problem, config: Mapping[str, int],
               fragments: codegen.Lowering | None = None) -> str:
        """This op's kernel source in a C dialect for one problem and validated config: the
        slots and defines the spec derives, substituted by portakern.core.codegen.render.
        ``fragments``: the target's fragment-API lowering (None: the emulation)."""
        return codegen.render(self.source, dialect, slots=self.slots(problem),
                              defines=self.defines(problem, config), fragments=fragments)

    # --- tunables -----------------------------------------------------------------------
    def schedule_for(self, schedule_class: str) -> Mapping[str, int]:
        """The default schedule for a class: its own ('cpu256'), else its family's ('cpu'),
        else the 'gpu' one every spec has (empty for a spec without tunables)."""
        for key in (schedule_class, schedule_family(schedule_class), "gpu"):
            if key in self.schedules:
                return self.schedules[key]
        return {}

    def config(self, device_class: str, overrides: Mapping[str, object] | None = None,
               problem: Problem | None = None, *, matrix: bool = False) -> dict[str, int]:
        """Default schedule for a device's schedule class ('gpu', 'cpu', 'cpu256': see
        ``schedule_for``), overridden and validated.
        ``matrix``: the device has matrix units (``Backend.matrix_unit``); a spec's "mma"
        schedule, where it has one, is then the default (docs/fragments.md)."""
        # overrides may hold anything a caller passed: each value is checked below
        sched = self.schedules.get("mma") if matrix else None
        base: dict[str, object] = dict(sched or self.schedule_for(device_class))
        if overrides:
            base.update(overrides)
        known = {t.name: t for t in self.tunables}
        unknown = set(base) - set(known)
        if unknown:
            raise InvalidArgumentError(f"{self.name}: unknown tunables {sorted(unknown)}; "
                                       f"this op declares {sorted(known)}.")
        missing = set(known) - set(base)
        if missing:
            raise SpecError(f"spec {self.name!r}: schedule {device_class!r} lacks tunables "
                            f"{sorted(missing)}; give every tunable a default.")
        cfg = {k: known[k].check(v, self.name) for k, v in base.items()}
        if self.config_check is not None:
            why = self.config_check(problem, cfg)
            if why:
                raise InvalidArgumentError(f"{self.name}: configuration {cfg} is invalid: {why}")
        return cfg

    def replace(self, **changes: Any) -> KernelSpec:
        """A copy with ``changes``. A copy given other ``semantics`` and no ``statistical``
        loses the statistical model: that model describes the errors of this spec's semantics,
        not of the new ones (a matmul copy computing something else must not be judged by
        matmul's model); give ``statistical=`` again to keep one. Likewise other ``source``
        or ``semantics`` and no ``statistical_ordered`` lose the ordered model (it describes
        this source's summation order)."""
        if "semantics" in changes and "statistical" not in changes \
                and changes["semantics"] is not self.semantics:
            changes = {**changes, "statistical": None}
        if "statistical_ordered" not in changes and any(
                f in changes and changes[f] != getattr(self, f)
                for f in ("source", "semantics")):
            changes = {**changes, "statistical_ordered": None}
        return dataclasses.replace(self, **changes)

