"""The one protocol every backend implements.

A backend owns exactly: probing (usable here? if not, why and how to fix), devices, moving
arrays in and out (counted), and executing a validated Problem — by compiling and launching
the spec's rendered C kernel (``KernelBackend``) or by evaluating the spec's array-API
semantics with its own array library (numpy, jax). It knows nothing about matmul or softmax
beyond what the spec hands it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..core import dtypes, settings
from ..core.errors import UnsupportedDTypeError
from ..core.host import nbytes_of
from ..core.lru import LRUCache  # also re-exported: plan, jax
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


def _cache_bound(env: str, default: int) -> int:
    """A cache bound from its setting (core.settings: a positive int, else the default)."""
    return int(settings.get(env) or default)


# Bounds of the compiled-code caches (each entry holds a compiled program or executable, about
# 1 MiB of host memory on PoCL and XLA:CPU): least recently used entries are dropped beyond.
KERNEL_CACHE_SIZE = _cache_bound("PORTAKERN_KERNEL_CACHE_SIZE", 128)  # per C-kernel backend
FUNCTION_CACHE_SIZE = _cache_bound("PORTAKERN_FUNCTION_CACHE_SIZE", 64)  # per jax backend


def _backends_after_fork_in_child() -> None:
    for inst in list(_INSTANCES):
        try:
            inst.after_fork_in_child()
        except Exception:  # pragma: no cover - a hook must never break the child
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_backends_after_fork_in_child)


# Called (no arguments) when a C-kernel backend's compiled-code cache evicts a program: the
# runtime's plan cache (runtime/plan.py) registers its clear here, so no plan keeps an evicted
# program alive and the KERNEL_CACHE_SIZE bound holds.
KERNEL_EVICTION_LISTENERS: list[Any] = []


def _kernels_evicted() -> None:
    for fn in list(KERNEL_EVICTION_LISTENERS):
        fn()


class Backend:
    """Base class. Subclasses set ``name`` and implement the abstract methods."""

    name: ClassVar[str] = ""
    dialect: ClassVar[str | None] = None  # C dialect for KernelBackend subclasses
    install_hint: ClassVar[str] = ""
    # top-level modules whose array types this backend owns (automatic selection follows the
    # inputs: jax arrays go to jax, cupy arrays to cuda, pyopencl arrays to opencl)
    array_modules: ClassVar[tuple[str, ...]] = ()
    _probe_cache: ClassVar[dict[type, Availability]] = {}

    # --- probing --------------------------------------------------------------------------
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
    def _probe(cls) -> Availability:
        raise NotImplementedError

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
    def test_targets(cls) -> list[str]:
        """Selectors the shared test suite runs on: by default every device of the backend."""
        av = cls.probe()
        return [f"{cls.name}:{d.index}" for d in av.devices] if av.available else []

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
        survive fork, refuses its operations in its own at-fork hook: backends/opencl.py.)"""
        self._lock = threading.RLock()
        self.transfers._lock = threading.Lock()

    def _open(self, selector: str | None) -> DeviceInfo:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return f"{self.name}:{self.device.index}"

    @property
    def device_class(self) -> str:
        return "cpu" if self.device.kind == "cpu" else "gpu"

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
        backend; ``functions`` on jax; ``output_templates`` on opencl), as ``LRUCache.info``
        gives it (also ``inserts`` and ``evictions``); a backend may add others (jax:
        ``executables``)."""
        return {name.lstrip("_"): value.info() for name, value in vars(self).items()
                if isinstance(value, LRUCache)}

    # --- arrays --------------------------------------------------------------------------
    def is_native(self, x: object) -> bool:
        raise NotImplementedError

    def to_native(self, x: np.ndarray) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until queued work on this device has finished (benchmarks call it)."""

    def as_input(self, name: str, x: Any) -> Any:
        """A native, contiguous copy-free view when possible; numpy uploads are counted."""
        if self.is_native(x):
            return self.prepare_native(name, x)
        arr = np.asarray(x)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return self.to_native(arr)

    def prepare_native(self, name: str, x: Any) -> Any:
        return x

    # --- execution -----------------------------------------------------------------------
    def check_dtype(self, spec: KernelSpec, prob: Problem) -> None:
        sup = self.supported_dtypes()
        if prob.dtype not in sup:
            fix = ("use a device with fp64 support or float32" if prob.dtype == "float64"
                   else "cast to one of those")
            raise UnsupportedDTypeError(
                f"{spec.name}: dtype {prob.dtype} cannot run on {self.describe()}, which supports "
                f"{', '.join(sup)}. Fix: {fix}.")

    supports_out: ClassVar[bool] = False  # may results be written into a caller's array?
    # may the autotuner's stored entries choose this backend's kernel configs (tuned.config_for)?
    uses_tuned_configs: ClassVar[bool] = True
    # the float64 reference every other backend is checked against (numpy)? `portakern bench`
    # measures it as a peer, never as a target
    oracle: ClassVar[bool] = False

    def check_config(self, spec: KernelSpec, prob: Problem, config: Mapping[str, int]) -> None:
        """Refuse bad tunable overrides when a plan is made (before anything is uploaded).
        Default: checked where they are used (``execute``)."""

    # --- memory judged before it is spent ---------------------------------------------------
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

    def check_device_buffers(self, spec: KernelSpec, parts: list[tuple[str, int]]) -> None:
        """Refuse (DeviceMemoryError) what the device cannot allocate. Default: no limits
        known beyond the host budget."""

    def device_scope(self) -> Any:
        """A context manager a call runs inside (CUDA: this device made current). Default:
        none needed."""
        return contextlib.nullcontext()

    def check_writable(self, spec: KernelSpec, out: Any) -> None:
        """Refuse an ``out=`` array the device may not write (default: nothing to check)."""

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

    def execute(self, spec: KernelSpec, prob: Problem, ins: dict[str, Any],
                config: Mapping[str, int] | None) -> Any:
        raise NotImplementedError




class LaunchPlan(list):
    """[(compiled kernel, Launch, argument template)] in launch order, plus the workspace
    buffers {name: (elements, dtype)} each call allocates (KernelSpec.workspace) and, per
    launch, a ``steps`` entry (launcher, template, buffer slots): the backend's bound enqueue
    of that kernel (``KernelBackend.launcher``), and where its template names a buffer
    ((position, name), ...): a call copies the template and fills those in, instead of
    testing every argument."""

    workspace: dict[str, tuple[int, str]]
    steps: list[tuple[Any, list[Any], tuple[tuple[int, str], ...]]]

    def __init__(self) -> None:
        super().__init__()
        self.workspace = {}
        self.steps = []

    def add(self, kernel: Any, launch: Launch, template: list[Any], launcher: Any) -> None:
        self.append((kernel, launch, template))
        self.steps.append((launcher, template, tuple((i, a) for i, a in enumerate(template)
                                                     if a.__class__ is str)))


class KernelBackend(Backend):
    """A backend that compiles the spec's C kernel in its dialect and launches it."""

    supports_out = True
    # the usual native array class, tested by identity before ``is_native`` on the hot path
    native_type: ClassVar[type | None] = None

    def __init__(self, selector: str | None = None) -> None:
        super().__init__(selector)
        # compiled programs, LRU-bounded (KERNEL_CACHE_SIZE): attention's head dims are
        # #defines, so every new D would otherwise keep one more program for good. An
        # eviction drops the runtime's plans too (they hold the evicted program's kernels).
        self._kernels: LRUCache = LRUCache(KERNEL_CACHE_SIZE, _kernels_evicted)

    def check_config(self, spec: KernelSpec, prob: Problem, config: Mapping[str, int]) -> None:
        """Overrides are checked against the tunables' domains and the spec's own check."""
        spec.config(self.device_class, config, prob)

    # subclass API
    def compile(self, source: str, entry_points: tuple[str, ...]) -> dict[str, Any]:
        """Compile rendered source; return entry name -> launchable. Raise CompileError."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        raise NotImplementedError

    def enqueue(self, kernel: Any, launch: Launch, args: list[Any]) -> None:
        raise NotImplementedError

    def buffer_arg(self, x: Any) -> Any:
        raise NotImplementedError

    def launcher(self, kernel: Any, launch: Launch) -> Any:
        """A callable ``f(args)`` that enqueues ``kernel`` with ``args``, made once per plan.
        Default: ``enqueue`` itself; a backend may bind what it can ahead of the call."""
        enqueue = self.enqueue

        def launch_it(args: list[Any]) -> None:
            enqueue(kernel, launch, args)

        return launch_it

    # fast per-call checks: the Plan layer's runner (runtime/plan.py) uses them when offered
    def native_checker(self, shape: tuple[int, ...], dtype: Any
                       ) -> Callable[[Any], Any] | None:
        """A callable ``check(x)`` for operands of exactly this shape and dtype (the plan key
        fixed both): ``x``'s kernel argument when ``x`` may be used as it is (this device or
        context, contiguous, no offset, a buffer holding every byte), else None, and the call
        then takes ``execute.run``, which checks again and raises the precise error. None: no
        fast checks on this backend (every call takes ``execute.run``)."""
        return None

    def output_checker(self, shape: tuple[int, ...], dtype: str) -> Callable[[Any], Any] | None:
        """Like ``native_checker`` for an ``out=`` array of this shape and dtype name, which
        must also be writable. Kernel arguments must compare equal exactly when they are the
        same device memory (the runner's aliasing test)."""
        return None

    def sequence_launcher(self, plan: LaunchPlan, index: Mapping[str, int]
                          ) -> Callable[[list[Any]], None]:
        """A callable ``launch_all(handles)`` enqueueing every launch of ``plan`` in order,
        where a launch's buffer argument named ``n`` is ``handles[index[n]]`` (a kernel
        argument, as ``native_checker``/``buffer_arg``/``scratch`` give). Made once per plan
        by the Plan layer's runner. Raises KeyError when a template names a buffer ``index``
        lacks. Default: the per-launch ``launcher``s in turn."""
        steps = [(launcher, template, tuple((i, index[n]) for i, n in slots))
                 for launcher, template, slots in plan.steps]

        def launch_all(handles: list[Any]) -> None:
            for launcher, template, slots in steps:
                args = template.copy()
                for i, j in slots:
                    args[i] = handles[j]
                launcher(args)

        return launch_all

    def output_maker(self, shape: tuple[int, ...], dtype: str) -> Callable[[], tuple[Any, Any]]:
        """A callable making a new output array of this shape and dtype name: (the array, its
        kernel argument). Default: ``empty`` and ``buffer_arg``."""
        empty, buffer_arg = self.empty, self.buffer_arg

        def make() -> tuple[Any, Any]:
            arr = empty(shape, dtype)
            return arr, buffer_arg(arr)

        return make

    def reusable_workspace(self) -> bool:
        """Whether a plan may keep its workspace buffers across calls: true only where one
        call's launches are enqueued as one uninterrupted sequence (``sequence_launcher``
        under a lock) on one in-order queue, so no other call can run between a kernel that
        writes the workspace and the kernel that reads it. Default: False (made per call)."""
        return False

    def scratch(self, nbytes: int) -> Any:
        """A device buffer of ``nbytes`` bytes as a kernel argument: a plan's workspace."""
        raise NotImplementedError

    def kernel_limits(self, kernel: Any) -> tuple[int | None, int | None]:
        """(local memory bytes, largest work-group) the driver reports for one compiled kernel
        (the tuner skips configs beyond them); (None, None) when this backend cannot tell."""
        return None, None

    def raw_launcher(self, kernel: Any, launch: Launch, args: list[Any]) -> Any:
        """A zero-argument callable that enqueues ``kernel`` with ``args`` through the device
        API itself, as a user of that API would (no lock, no checks): the baseline of the
        dispatch benchmark (bench/dispatch.py). None: this backend has no raw API to offer."""
        return None

    def held_queue(self) -> Any:
        """A context manager inside which work enqueued on this backend's queue waits (it
        runs when the block exits, which also waits for it): the dispatch benchmark times
        the host's side of a call with it, so a device that shares the host's cores (a CPU
        OpenCL device) cannot slow the host down while it is timed. None: not offered."""
        return None

    def declare_arguments(self, kernel: Any, template: Sequence[Any]) -> None:
        """Tell the device API the argument kinds of ``kernel`` once, when a plan is built
        (``template``: buffer names as str, scalars as numpy scalars), so the per-call argument
        setting is a pack, not a type probe. Default: nothing to declare."""

    # shared machinery
    def kernels_for(self, spec: KernelSpec, prob: Problem, cfg: Mapping[str, int]
                    ) -> dict[str, Any]:
        slots = spec.slots(prob)
        defs = spec.defines(prob, cfg)
        slot_key = tuple(sorted((k, dtypes.dtype_name(v)) for k, v in slots.items()))
        key = (spec.name, spec.token, slot_key,
               tuple(sorted(defs.items())))
        got = self._kernels.get(key)
        if got is None:
            with self._lock:
                got = self._kernels.get(key)
                if got is None:
                    src = spec.render(self.dialect or "", prob, cfg)
                    got = self.compile(src, kernel_entry_points(spec, prob, cfg))
                    self._kernels[key] = got
        return got

def kernel_entry_points(spec: KernelSpec, prob: Problem, cfg: Mapping[str, int]) -> tuple[str, ...]:
    """Entry points a spec launches; read from its launch plan for this problem."""
    return tuple(sorted({la.kernel for la in spec.launches(prob, cfg)}))
