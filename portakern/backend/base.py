"""What every backend is: probing and a device, plus three small parts.

A backend owns exactly: probing (usable here? if not, why and how to fix), devices, and three
parts, declared below as Protocols and enforced by the abstract base classes (a backend class
that lacks one is refused when the registry loads it, not at its first call):

* an **allocator** (``Allocator``): device arrays made, zeroed, uploaded and downloaded
  (counted), and the device's memory limits;
* a **compiler** (``Compiler``): rendered C source -> compiled kernels by entry-point name;
* a **program** (``Program``): one compiled kernel with its launch geometry and scalar
  arguments bound once, called with its buffer arguments to enqueue.

An array backend (numpy, jax: ``ArrayBackend``) has no compiler or program: it evaluates the
spec's array-API semantics with its own array library (``execute``). Nothing here knows an op;
the checks and the launch loop are the runtime's (runtime/execute.py, runtime/plan.py).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from ..core import codegen, dtypes, settings
from ..core.errors import DeviceMemoryError, ForkedProcessError, UnsupportedDTypeError
from ..core.host import nbytes_of
from ..core.lru import LRUCache
from ..core.spec import KernelSpec, Launch, Problem, storage_dtype


@dataclass
class DeviceInfo:
    index: int
    name: str
    kind: str  # 'cpu' | 'gpu' | 'tpu' | 'accelerator'
    vendor: str = ""
    driver: str = ""
    platform: str = ""
    fp64: bool = True
    max_work_group_size: int = 1024
    local_mem_bytes: int = 48 * 1024
    compute_units: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Availability:
    available: bool
    reason: str = ""
    fix: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    devices: list[DeviceInfo] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["devices"] = [x.as_dict() for x in self.devices]
        return d


class TransferCounter:
    """Host<->device copies of operand/result data made by a backend (tests assert on it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.h2d = self.d2h = self.h2d_bytes = self.d2h_bytes = 0

    def add(self, direction: str, nbytes: int) -> None:
        with self._lock:
            setattr(self, direction, getattr(self, direction) + 1)
            setattr(self, direction + "_bytes", getattr(self, direction + "_bytes") + int(nbytes))

    def snapshot(self) -> dict[str, int]:
        return {"h2d": self.h2d, "d2h": self.d2h, "h2d_bytes": self.h2d_bytes,
                "d2h_bytes": self.d2h_bytes}


_INSTANCES: weakref.WeakSet = weakref.WeakSet()  # every Backend instance of this process


# Bounds of the compiled-code caches (each entry holds a compiled program or executable, about
# 1 MiB of host memory on PoCL and XLA:CPU): least recently used entries are dropped beyond.
KERNEL_CACHE_SIZE = settings.kernels.cache_size  # per C-kernel backend
FUNCTION_CACHE_SIZE = settings.jax.function_cache_size  # per jax backend


def _backends_after_fork_in_child() -> None:
    for inst in list(_INSTANCES):
        try:
            inst.after_fork_in_child()
        except Exception:  # pragma: no cover - a hook must never break the child
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_backends_after_fork_in_child)


class ForkGuard:
    """For a driver that does not survive fork(): once this process has initialised it
    (``enter``), a child made by fork() refuses every device operation at once with
    ForkedProcessError (``check`` before opening a device; the methods named in ``methods``
    of every instance ``watch`` was given), instead of waiting forever on driver threads the
    child does not have (PoCL's workers: measured, even a fresh context in the child hangs).
    Children made by spawn or forkserver start clean, and so does a fork made before the
    driver was first touched."""

    FIX = ("create worker processes with the spawn or forkserver start method, e.g. "
           "multiprocessing.get_context('spawn').Pool(...) or "
           "concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context("
           "'forkserver')), or use the device only in the children")

    def __init__(self, driver: str, methods: tuple[str, ...]) -> None:
        self.driver, self.methods = driver, methods
        self.initialised = self.forked = False
        self._live: weakref.WeakSet = weakref.WeakSet()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def error(self, what: str) -> ForkedProcessError:
        return ForkedProcessError(
            f"{what} cannot be used in this process: it was created by fork() after its "
            f"parent (pid {os.getppid()}) had initialised {self.driver}, and {self.driver} "
            f"drivers do not survive fork (the first upload would wait forever). Fix: "
            f"{self.FIX}.")

    def check(self, what: str) -> None:
        """Raise in a forked child; otherwise note that the driver is now initialised."""
        if self.forked:
            raise self.error(what)
        self.initialised = True

    def watch(self, instance: Backend) -> None:
        self._live.add(instance)

    def _after_fork_in_child(self) -> None:
        if not self.initialised:
            return  # nothing was initialised before the fork: the child may start it itself
        self.forked = True
        for inst in list(self._live):
            label = inst.label

            def refuse(*args: Any, _label: str = label, **kwargs: Any) -> Any:
                raise self.error(_label)

            for name in self.methods:  # the driver objects are left alone (releasing could
                setattr(inst, name, refuse)  # block too); caches dropped: no plan enqueues
            for value in vars(inst).values():
                if isinstance(value, LRUCache):
                    value.clear()


# Called (no arguments) when a C-kernel backend's compiled-code cache evicts a program: the
# runtime's plan cache (runtime/plan.py) registers its clear here, so no plan keeps an evicted
# program alive and the KERNEL_CACHE_SIZE bound holds.
KERNEL_EVICTION_LISTENERS: list[Any] = []


def _kernels_evicted() -> None:
    for fn in list(KERNEL_EVICTION_LISTENERS):
        fn()


class Allocator(Protocol):
    """Device memory. ``to_native`` uploads a host array, ``to_numpy`` downloads one (both
    counted in ``transfers``); ``limits`` is what one allocation and all of them may take."""

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def to_native(self, x: np.ndarray) -> Any: ...
    def to_numpy(self, x: Any) -> np.ndarray: ...
    def limits(self) -> MemoryLimits: ...


class Compiler(Protocol):
    """Rendered source -> {entry point: compiled kernel}; raises CompileError with the log."""

    def compile(self, source: str, entry_points: tuple[str, ...]) -> Mapping[str, Any]: ...


class Program(Protocol):
    """One kernel launch with its geometry, scalar arguments and buffer slots bound once:
    called with a call's buffer handles (kernel arguments as ``buffer_arg`` gives them), it
    takes the handle of each of its slots (``slots``, given to ``KernelBackend.program``)
    and enqueues the kernel. All of a plan's programs are called with one handle list, so
    the launch loop builds no per-launch argument list."""

    def __call__(self, handles: Sequence[Any]) -> None: ...


def bound_slots(template: Sequence[Any], slots: Sequence[int] | None
                ) -> tuple[tuple[int, int], ...]:
    """(argument position, handle index) for each buffer of a Program's ``template``:
    ``slots`` given to ``KernelBackend.program``, or None for the template's buffer order."""
    positions = [i for i, a in enumerate(template) if a.__class__ is str]
    if slots is None:
        slots = range(len(positions))
    if len(slots) != len(positions):
        raise ValueError(f"a program of {len(positions)} buffer arguments was given "
                         f"{len(slots)} slots; expected one handle index per buffer name.")
    return tuple(zip(positions, (int(s) for s in slots)))


@dataclass(frozen=True)
class MemoryLimits:
    """Bytes one allocation (``max_allocation``) and all of them (``total``) may take on the
    device; None: not known (only the host budget is judged)."""

    max_allocation: int | None = None
    total: int | None = None


class Step(NamedTuple):
    """One launch of a plan: the ``program`` and the buffer each of its buffer slots takes
    (``slots``: buffer names, in the template's order; the program was bound to their
    positions in the plan's ``buffer_names``). ``kernel``,
    ``launch`` and ``template`` (buffer names as str, packed scalars) are kept for the tools
    (the dispatch benchmark's raw baseline)."""

    program: Program
    slots: tuple[str, ...]
    kernel: Any
    launch: Launch
    template: tuple[Any, ...]


class Backend(abc.ABC):
    """Probing, one device, and the allocator's array side. Subclasses set ``name`` and
    implement the abstract members (the registry refuses a class that lacks one)."""

    name: ClassVar[str] = ""
    dialect: ClassVar[str | None] = None  # C dialect for KernelBackend subclasses
    install_hint: ClassVar[str] = ""
    # top-level modules whose array types this backend owns (automatic selection follows the
    # inputs: jax arrays go to jax, cupy arrays to cuda, pyopencl arrays to opencl)
    array_modules: ClassVar[tuple[str, ...]] = ()
    supports_out: ClassVar[bool] = False  # may results be written into a caller's array?
    # may the autotuner's stored entries choose this backend's kernel configs (configs.config_for)?
    uses_tuned_configs: ClassVar[bool] = True
    # the float64 reference every other backend is checked against (numpy)? `portakern bench`
    # measures it as a peer, never as a target
    oracle: ClassVar[bool] = False
    _probe_cache: ClassVar[dict[type, Availability]] = {}

    # --- required ------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def _probe(cls) -> Availability:
        """Usable here? Availability with versions and devices, or the reason and the fix."""

    @abc.abstractmethod
    def _open(self, selector: str | None) -> DeviceInfo:
        """Open the device a selector names (BackendUnavailable/UnknownBackendError if not)."""

    @abc.abstractmethod
    def is_native(self, x: object) -> bool:
        """Is ``x`` this backend's own array type (no upload needed)?"""

    @abc.abstractmethod
    def to_native(self, x: np.ndarray) -> Any:
        """Upload a host array (counted: ``self.transfers.add("h2d", nbytes)``)."""

    @abc.abstractmethod
    def to_numpy(self, x: Any) -> np.ndarray:
        """Download a native array (counted: ``self.transfers.add("d2h", nbytes)``)."""

    @abc.abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A zero-filled native array of a dtype name."""

    # --- probing ---------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        """Availability, versions and devices; cached per class (probing can be slow)."""
        got = Backend._probe_cache.get(cls)
        if got is None:
            try:
                got = cls._probe()
            except Exception as exc:  # a broken driver must not take the other backends down
                got = Availability(False, f"probing raised {type(exc).__name__}: {exc}",
                                   cls.install_hint)
            Backend._probe_cache[cls] = got
        return got

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        """(score, selector, why) for automatic selection; higher score wins. Default: none."""
        return []

    @classmethod
    def canonical_device(cls, device: str | None) -> str | None:
        """The one spelling of a device selector ('' and None = the default device), so that
        selectors naming the same device share one instance (one context). Called after a
        successful probe; a selector it cannot make sense of is returned as is, for ``_open``
        to refuse with its own message. Default: unchanged."""
        return device

    @classmethod
    def selector_of(cls, x: Any) -> str | None:
        """The device part of the selector of the device a native array lives on (automatic
        selection runs a call where its inputs are: 'opencl:1', not the default device).
        Default: None, the backend's default device."""
        return None

    @classmethod
    def opener(cls, selector: str | None) -> type[Backend]:
        """The class whose instance serves a (canonical) selector: a backend may hand a
        device to a subclass (OpenCL's opencl:oclgrind). Default: this class."""
        return cls

    @classmethod
    def test_targets(cls) -> list[str]:
        """Selectors the shared test suite runs on: by default every device of the backend
        but a simulator (``extra["simulator"]``: opencl:oclgrind has its own sweep)."""
        av = cls.probe()
        return [f"{cls.name}:{d.index}" for d in av.devices
                if not d.extra.get("simulator")] if av.available else []

    # --- instance: one device ------------------------------------------------------------
    def __init__(self, selector: str | None = None) -> None:
        self.selector = selector
        self.transfers = TransferCounter()
        self.device: DeviceInfo = self._open(selector)
        self._lock = threading.RLock()
        _INSTANCES.add(self)

    def after_fork_in_child(self) -> None:
        """Called in a child made by fork() for every backend instance the parent had: locks
        another thread may have held at the fork are made anew. (OpenCL, whose drivers cannot
        survive fork, refuses its operations in its own at-fork hook: backend/opencl.py.)"""
        self._lock = threading.RLock()
        self.transfers._lock = threading.Lock()

    @property
    def label(self) -> str:
        return f"{self.name}:{self.device.index}"

    @property
    def device_class(self) -> str:
        return "cpu" if self.device.kind == "cpu" else "gpu"

    @property
    def schedule_class(self) -> str:
        """The key of the spec schedules this device starts from (KernelSpec.schedule_for):
        'cpu256' for a CPU whose native float vectors are 256 bits wide (AVX2: the CPU
        schedules are written for AVX-512's 32 zmm registers; their 16-lane register blocks
        take two of AVX2's 16 ymm registers each and spill), else the device class."""
        if self.device_class == "cpu" and self.device.extra.get("vector_bits") == 256:
            return "cpu256"
        return self.device_class

    def supported_dtypes(self) -> tuple[str, ...]:
        base = ("float32", "float16", "bfloat16")
        return base + ("float64",) if self.device.fp64 else base

    def describe(self) -> str:
        return f"{self.label} ({self.device.name})"

    def cache_info(self) -> dict[str, dict[str, int]]:
        """This instance's in-memory caches by name, each a dict with at least ``size`` and
        ``maxsize``: for monitoring a long-running process, e.g. that the compiled-code
        caches stop growing once its shapes are warm. Every ``LRUCache`` the instance holds,
        named by its attribute (``_kernels`` -> ``kernels``: compiled programs on a C-kernel
        backend; ``functions`` on jax), as ``LRUCache.info`` gives it (also ``inserts`` and
        ``evictions``); a backend may add others (jax: ``executables``)."""
        return {name.lstrip("_"): value.info() for name, value in vars(self).items()
                if isinstance(value, LRUCache)}

    # --- optional hooks (defaults fit a host-memory array library) ---------------------------
    def synchronize(self) -> None:
        """Block until queued work on this device has finished (benchmarks call it).
        Default: nothing queued (a synchronous array library)."""
        return None

    def limits(self) -> MemoryLimits:
        """The device's memory limits (judged before a call allocates). Default: unknown."""
        return MemoryLimits()

    def as_input(self, name: str, x: Any) -> Any:
        """A native, contiguous copy-free view when possible; numpy uploads are counted."""
        if self.is_native(x):
            return self.prepare_native(name, x)
        arr = np.asarray(x)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return self.to_native(arr)

    def prepare_native(self, name: str, x: Any) -> Any:
        """Refuse a native array the kernels cannot use as it is (a foreign context, an
        offset or strided view, a short buffer); return what to use. Default: as it is."""
        return x

    def check_dtype(self, spec: KernelSpec, prob: Problem) -> None:
        sup = self.supported_dtypes()
        if prob.dtype not in sup:
            fix = ("use a device with fp64 support or float32" if prob.dtype == "float64"
                   else "cast to one of those")
            raise UnsupportedDTypeError(
                f"{spec.name}: dtype {prob.dtype} cannot run on {self.describe()}, which supports "
                f"{', '.join(sup)}. Fix: {fix}.")

    def device_buffers(self, spec: KernelSpec, prob: Problem, present: Mapping[str, Any],
                       out: Any) -> list[tuple[str, int]]:
        """(what, bytes) of every buffer this call would allocate on the device, from the
        shapes: an upload per host operand, and the output unless ``out=`` is given."""
        is_native = self.is_native
        parts = [(f"device copy of {k!r}", nbytes_of(v)) for k, v in present.items()
                 if not is_native(v)]
        if out is None:
            for shape, dt in prob.output_specs.values():
                n = 1
                for d in shape:
                    n *= int(d)
                parts.append((f"output {tuple(shape)} {dt}", n * storage_dtype(dt).itemsize))
        return parts

    def device_scope(self) -> Any:
        """A context manager a call runs inside (CUDA: this device made current). Default:
        none needed."""
        return contextlib.nullcontext()

    def check_writable(self, spec: KernelSpec, out: Any) -> None:
        """Refuse an ``out=`` array the device may not write (default: nothing to check)."""
        return None

    def memory_span(self, x: Any) -> tuple[Any, int, int] | None:
        """(memory object, first byte, end byte) of a native array, for the aliasing check;
        None when unknown or empty. Default: the array interfaces (numpy, CuPy), in one
        address space per interface."""
        for attr, space in (("__cuda_array_interface__", "cuda"), ("__array_interface__", "host")):
            try:
                iface = getattr(x, attr)
            except Exception:
                continue
            if iface is None:
                continue
            ptr = int(iface["data"][0])
            itemsize = int(np.dtype(iface["typestr"]).itemsize)
            shape = tuple(iface["shape"])
            if not ptr or not all(shape):
                return None
            strides = iface.get("strides")
            if strides is None:
                return space, ptr, ptr + itemsize * int(np.prod(shape))
            lo = ptr + sum(s * (n - 1) for s, n in zip(strides, shape) if s < 0)
            hi = ptr + itemsize + sum(s * (n - 1) for s, n in zip(strides, shape) if s > 0)
            return space, lo, hi
        return None

    def fill_zero(self, out: Any) -> None:
        out.fill(0)


class ArrayBackend(Backend):
    """A backend that evaluates the spec's array-API semantics with its own array library
    (numpy: the float64 oracle; jax: XLA and Pallas)."""

    @abc.abstractmethod
    def execute(self, spec: KernelSpec, prob: Problem, ins: dict[str, Any],
                config: Mapping[str, int] | None) -> Any:
        """The op's result(s) on checked native operands ``ins``."""


class KernelBackend(Backend):
    """A backend that compiles the spec's C kernel in its dialect and launches it: the
    allocator's ``empty`` and ``buffer_arg``, the compiler's ``compile`` and ``program``
    (required), plus hooks the runtime and the tools use when offered."""

    supports_out = True
    # one in-order queue shared by every call, whose launches the runtime enqueues under
    # this instance's lock: a plan may then keep a small workspace across calls (no other
    # call can run between a kernel that writes it and the one that reads it)
    in_order_queue: ClassVar[bool] = False

    def __init__(self, selector: str | None = None) -> None:
        super().__init__(selector)
        # compiled programs, LRU-bounded (KERNEL_CACHE_SIZE): attention's head dims are
        # #defines, so every new D would otherwise keep one more program for good. An
        # eviction drops the runtime's plans too (they hold the evicted program's kernels).
        self._kernels: LRUCache = LRUCache(KERNEL_CACHE_SIZE, _kernels_evicted)
        # the lock one call's launches are enqueued under (runtime/execute.enqueue_steps)
        self.launch_lock: Any = self._lock

    def after_fork_in_child(self) -> None:
        super().after_fork_in_child()
        self.launch_lock = self._lock

    # --- required ------------------------------------------------------------------------
    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """An uninitialised native array of a dtype name (an output, a workspace)."""

    @abc.abstractmethod
    def buffer_arg(self, x: Any) -> Any:
        """The kernel argument of a native array (what a Program is called with)."""

    @abc.abstractmethod
    def compile(self, source: str, entry_points: tuple[str, ...]) -> Mapping[str, Any]:
        """Compile rendered source; return entry name -> kernel. Raise CompileError."""

    @abc.abstractmethod
    def program(self, kernel: Any, launch: Launch, template: Sequence[Any],
                slots: Sequence[int] | None = None) -> Program:
        """The Program of one launch: ``template`` holds buffer names (str) and packed
        scalars (numpy scalars), bound here once. ``slots``: for each buffer name of the
        template, in order, the index of its handle in the list the Program is called with
        (None: the handles come in the template's buffer order)."""

    # --- optional hooks ----------------------------------------------------------------------
    def argument_checker(self, shape: tuple[int, ...], dtype: Any, writable: bool = False
                         ) -> Callable[[Any], Any] | None:
        """The planned runner's fast check (runtime/plan.py) for arrays of exactly this shape
        and dtype (the plan key fixed an operand's; an ``out=``'s are checked here too): a
        callable ``check(x)`` giving ``x``'s kernel argument when ``x`` may be used as it is
        (this device or context, contiguous, no offset, a buffer holding every byte, and
        writable when asked), else None, and the call then takes the checked path, which
        checks again and raises the precise error. Kernel arguments must compare equal
        exactly when they are the same memory (the runner's aliasing test). None: no fast
        path on this backend."""
        return None

    def output_maker(self, shape: tuple[int, ...], dtype: str
                     ) -> Callable[[], tuple[Any, Any]]:
        """The planned runner's allocator for one output of a plan (runtime/plan.py): a
        zero-argument callable giving a new ``(array, kernel argument)``, where a backend can
        make both faster than ``empty`` + ``buffer_arg`` by knowing the shape and dtype once.
        Default: exactly those two."""
        empty, buffer_arg = self.empty, self.buffer_arg

        def make() -> tuple[Any, Any]:
            a = empty(shape, dtype)
            return a, buffer_arg(a)

        return make

    def kernel_limits(self, kernel: Any) -> tuple[int | None, int | None]:
        """(local memory bytes, largest work-group) the driver reports for one compiled kernel
        (the tuner skips configs beyond them); (None, None) when this backend cannot tell."""
        return None, None

    def raw_launcher(self, kernel: Any, launch: Launch, template: Sequence[Any],
                     buffers: Mapping[str, Any]) -> Callable[[], None] | None:
        """A zero-argument callable that enqueues ``kernel`` through the device API itself, as
        a user of that API would, with the scalars set once and the buffers set per call (no
        lock, no checks): the dispatch benchmark's baseline. None: not offered."""
        return None

    def held_queue(self) -> Any:
        """A context manager inside which work enqueued on this backend's queue waits (it
        runs when the block exits, which also waits for it): the dispatch benchmark times
        the host's side of a call with it, so a device that shares the host's cores (a CPU
        OpenCL device) cannot slow the host down while it is timed. None: not offered."""
        return None

    # --- matrix units (docs/fragments.md) ------------------------------------------------------
    @property
    def matrix_unit(self) -> str | None:
        """The native fragment lowering of this device ('sm80', 'cdna', 'rdna3', 'intel'),
        from its dialect's ``matrix_units`` and its ``extra['arch']`` text; None without one
        (a kernel that asks for fragments then runs the emulation)."""
        return codegen.matrix_unit(self.dialect or "", self.device.extra.get("arch"))

    def fragments(self) -> codegen.Lowering:
        """The fragment API's lowering here: native, or the emulation with the lane map
        $PORTAKERN_MMA_LAYOUT names (read now)."""
        return codegen.lowering(self.dialect or "", self.device.extra.get("arch"))

    # --- shared machinery --------------------------------------------------------------------
    def kernels_for(self, spec: KernelSpec, prob: Problem, cfg: Mapping[str, int]
                    ) -> Mapping[str, Any]:
        """The spec's compiled kernels for a problem and configuration, cached per rendered
        source's inputs (LRU-bounded; the fragment lowering is one of them)."""
        slots = spec.slots(prob)
        defs = spec.defines(prob, cfg)
        slot_key = tuple(sorted((k, dtypes.dtype_name(v)) for k, v in slots.items()))
        low = self.fragments() if codegen.uses_fragments(spec.source) else None
        # the entry points too: run-time switches (attention's split) change the kernels a
        # plan launches, not the source, and a compile keeps only the ones it was asked for
        entries = kernel_entry_points(spec, prob, cfg)
        key = (spec.name, spec.token, slot_key, tuple(sorted(defs.items())),
               low.key if low is not None else None, entries)
        got = self._kernels.get(key)
        if got is None:
            with self._lock:
                got = self._kernels.get(key)
                if got is None:
                    src = spec.render(self.dialect or "", prob, cfg, low)
                    got = self.compile(src, entries)
                    self._kernels[key] = got
        return got


def kernel_entry_points(spec: KernelSpec, prob: Problem, cfg: Mapping[str, int]) -> tuple[str, ...]:
    """Entry points a spec launches; read from its launch plan for this problem."""
    return tuple(sorted({la.kernel for la in spec.launches(prob, cfg)}))


def missing_members(cls: type) -> list[str]:
    """The required members a backend class does not implement (empty: complete). The
    registry refuses a class with any, naming them, when it loads it."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return ["(not a subclass of portakern.backend.base.Backend)"]
    if not inspect.isabstract(cls):
        return []
    return sorted(getattr(cls, "__abstractmethods__", ()))


def check_memory_limits(be: Backend, spec: KernelSpec, parts: list[tuple[str, int]]) -> None:
    """Refuse (DeviceMemoryError) what the device cannot allocate, by its ``limits``: each
    buffer at most one allocation, all of them at most the device's memory; judged before
    anything is copied or allocated (PoCL would otherwise abort on a failed host
    allocation, or silently overcommit)."""
    lim = be.limits()
    max_alloc, total_mem = lim.max_allocation, lim.total
    total = 0
    for what, n in parts:
        total += n
        if max_alloc is not None and n > max_alloc:
            raise DeviceMemoryError(
                f"{spec.name}: the {what} needs {n} bytes in one buffer, more than the "
                f"{max_alloc} bytes {be.describe()} allows in one allocation "
                f"(max_mem_alloc_size; global memory {total_mem} bytes). Nothing was "
                "allocated. Fix: split the call into smaller pieces (e.g. over the "
                "batch), or use a device with larger allocations.")
    if total_mem is not None and total > total_mem:
        raise DeviceMemoryError(
            f"{spec.name}: the call needs {total} bytes of device memory ("
            + "; ".join(f"{w}: {n}" for w, n in parts)
            + f"), more than the {total_mem} bytes of global memory of {be.describe()}."
            " Nothing was allocated. Fix: split the call into smaller pieces.")
