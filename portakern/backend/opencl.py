"""opencl: PyOpenCL on any OpenCL platform — AMD, Intel, NVIDIA, and PoCL on the CPU.

Renders each spec's C kernel in the OpenCL dialect and builds it per device; programs are
cached per (rendered source, options, device) in memory, and PyOpenCL/PoCL keep their own
binary caches on disk. ``pyopencl.array.Array`` in -> ``Array`` out with no host copy.
Numerics: no -cl-fast-relaxed-math or -cl-mad-enable (contraction to FMA stays the OpenCL C
default, which the tolerance rules allow); fp16 storage uses core vload_half/vstore_half_rte.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import mmap
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..core import dtypes, settings
from ..core.errors import (
    BackendUnavailable,
    CompileError,
    DeviceMemoryError,
    InvalidArgumentError,
    UnknownBackendError,
)
from ..core.host import c_strides, native_byte_order
from ..core.lru import LRUCache
from ..core.spec import Launch, storage_dtype
from .base import Availability, DeviceInfo, KernelBackend, MemoryLimits, bound_slots
from .opencl_devices import (
    DEFAULT_RULE,
    FORK_GUARD,
    all_devices,
    cache_dir,
    cl,
    cla,
    context_error,
    default_device,
    device_of_array,
    is_allocation_failure,
    probe_devices,
    select_device,
)

BUILD_OPTIONS: tuple[str, ...] = ()
# buffers this large on a CPU device are advised for transparent huge pages (``_advise_huge``)
HUGEPAGE_MIN_BYTES = 4 << 20
HUGEPAGE_BYTES = 2 << 20
# output templates kept per backend instance, one per (shape, dtype): least recently made
# dropped beyond (``empty``), like the plan cache's bound
OUTPUT_TEMPLATE_CACHE_SIZE = 4096

# What extends the OpenCL backend without this module importing it (so no import cycle): the
# Oclgrind simulator (backend/oclgrind.py, which the registry loads with this backend) adds
# its device to the probe's list and picks its own subclass for its selector.
PROBE_HOOKS: list[Callable[[Availability], Availability]] = []
SELECTOR_HOOKS: list[Callable[[str], type[OpenCLBackend] | None]] = []


# pyopencl.array.Array's parameters, in order, as ``output_maker`` passes them by position
_ARRAY_FAST_ARGS = ("self", "cq", "shape", "dtype", "order", "allocator", "data", "offset",
                    "strides", "events", "_flags", "_fast", "_size", "_context", "_queue")


@functools.cache
def _array_takes_fast_args_by_position() -> bool:
    """Whether the installed pyopencl's Array constructor has the parameters ``output_maker``
    passes by position, in that order (checked once: a release that reorders them gets the
    keywords, never a misplaced argument)."""
    try:
        params = tuple(inspect.signature(cla.Array.__init__).parameters)
    except (TypeError, ValueError):
        return False
    return params[:len(_ARRAY_FAST_ARGS)] == _ARRAY_FAST_ARGS


class OpenCLBackend(KernelBackend):
    name = "opencl"
    dialect = "opencl"
    in_order_queue = True
    array_modules = ("pyopencl",)
    install_hint = ("pip install 'portakern[opencl]' and an OpenCL driver: "
                    "apt-get install pocl-opencl-icd (CPU) or your GPU vendor's ICD")
    extra_build_options: tuple[str, ...] = ()  # per device (the simulator: -cl-opt-disable)
    # the device's own defines, on every build (the simulator: no prefetch hints, codegen)
    device_build_options: tuple[str, ...] = ()

    @classmethod
    def opener(cls, selector: str | None) -> type[OpenCLBackend]:
        """The class that opens a selector: e.g. opencl:oclgrind, the simulator's subclass."""
        for hook in SELECTOR_HOOKS:
            got = hook(selector) if selector else None
            if got is not None:
                return got
        return cls

    @classmethod
    def _probe(cls) -> Availability:
        av = probe_devices()
        for hook in PROBE_HOOKS:  # e.g. opencl:oclgrind, one more device when installed
            av = hook(av)
        return av

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        """The default device (``default_device``) of the automatic choice: a GPU scores 80,
        an accelerator 40, a CPU 30."""
        av = cls.probe()
        d = default_device(av.devices) if av.available else None
        if d is None:
            return []
        score = 80 if d.kind == "gpu" else 40 if d.kind == "accelerator" else 30
        return [(score, f"opencl:{d.index}", f"OpenCL {d.kind} {d.name} ({d.platform}), "
                 f"opencl:{d.extra.get('alias', d.index)}; {DEFAULT_RULE}")]

    @classmethod
    def selector_of(cls, x: Any) -> str | None:
        return device_of_array(x, cls.probe().devices)

    @classmethod
    def canonical_device(cls, device: str | None) -> str | None:
        """'', None (automatic) -> the default device's index; '00' -> '0'; 'pocl' -> its
        index. A selector naming no device is kept for ``_open`` to refuse."""
        av = cls.probe()
        try:
            return str(select_device(av.devices, device).index)
        except UnknownBackendError:
            return device

    def _open(self, selector: str | None) -> DeviceInfo:
        FORK_GUARD.check(f"opencl:{selector}" if selector else "opencl")
        av = self.probe()
        if not av.available:
            raise BackendUnavailable(f"opencl cannot run here: {av.reason}. Fix: {av.fix}.")
        info = select_device(av.devices, selector)
        self._cl_device = self._device_handle(info)
        self.ctx = cl.Context([self._cl_device])
        FORK_GUARD.watch(self)
        self._limits = (int(self._cl_device.max_mem_alloc_size),
                        int(self._cl_device.global_mem_size))
        # (shape, dtype) -> (attributes of a new Array, nbytes): see ``empty``
        self._output_templates: LRUCache = LRUCache(OUTPUT_TEMPLATE_CACHE_SIZE)
        self.queue = cl.CommandQueue(self.ctx)
        # The pyopencl MemoryPool every device buffer of this backend comes from (None:
        # PORTAKERN_OPENCL_POOL=0, or the simulator's exact-size buffers): read its
        # held_bytes/active_bytes, or give its idle blocks back with free_pooled_memory().
        self.memory_pool: Any = None
        if settings.opencl.pool:
            import pyopencl.tools as cl_tools

            self.memory_pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(self.queue))
        # the buffers (cl_mem handles) already advised for huge pages, and whether to advise
        self._huge_advised: set[int] = set()
        self._advise_huge_pages = (self.advise_huge_pages and info.kind == "cpu"
                                   and sys.platform.startswith("linux")
                                   and settings.opencl.hugepages)
        return info

    advise_huge_pages = True  # (the simulator: its buffers are not the host's)

    def _advise_huge(self, buf: Any, nbytes: int) -> None:
        """Ask Linux for transparent huge pages under a large new buffer of a CPU device.

        Why: a CPU runtime's buffers are ordinary host pages, and Linux's default THP mode
        (madvise) gives an unadvised mapping 4 KiB pages. A kernel that reads a large buffer
        out of order then misses the TLB on every page: paged decode over a 1 GiB cache (B8 x
        32768 tokens, pages in block-table order) ran 1.2-1.4x faster on PoCL and Intel's
        runtime with the advice (2-core Zen 4), and no slower over 128 MiB. The buffer's host
        address comes from a map (a CPU device's map is its memory, no copy), taken once per
        buffer when it is made (the pool's reused blocks keep theirs), before anything writes
        it, so the first touches fault in huge pages. Advice only: where the OS declines, or
        THP is off, nothing changes. PORTAKERN_OPENCL_HUGEPAGES=0 turns it off."""
        key = int(buf.int_ptr)
        if key in self._huge_advised:
            return
        if self.memory_pool is not None:  # without a pool every buffer is new
            self._huge_advised.add(key)
        try:
            host, _ev = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ, 0, (1,),
                                              np.uint8)
            addr = int(host.ctypes.data)
            host.base.release(self.queue)
            lo = -(-addr // HUGEPAGE_BYTES) * HUGEPAGE_BYTES
            hi = (addr + nbytes) // HUGEPAGE_BYTES * HUGEPAGE_BYTES
            if hi > lo:
                _madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)
        except (cl.Error, OSError, AttributeError, ValueError):
            pass  # advice: a runtime that cannot map, or an OS without it, keeps its pages

    @property
    def cl_device(self) -> Any:
        """The ``pyopencl.Device`` this backend runs on (its context is ``ctx``, its queue
        ``queue``): e.g. to make arrays in a context of one's own on the same device."""
        return self._cl_device

    def _device_handle(self, info: DeviceInfo) -> Any:
        """The pyopencl Device behind a probed DeviceInfo (the simulator overrides it)."""
        return all_devices()[info.index][1]

    _limits: tuple[int, int] = (1 << 62, 1 << 62)  # (max_mem_alloc_size, global_mem_size)

    # arrays
    def is_native(self, x: object) -> bool:
        return cla is not None and isinstance(x, cla.Array)

    def _oom(self, what: str, nbytes: int, exc: BaseException) -> DeviceMemoryError:
        """DeviceMemoryError naming the request and what the device offers."""
        dev = self._cl_device
        return DeviceMemoryError(
            f"cannot allocate {nbytes} bytes for {what} on {self.describe()}: the device has "
            f"{dev.global_mem_size} bytes of global memory and allows at most "
            f"{dev.max_mem_alloc_size} bytes in one allocation ({type(exc).__name__}: {exc}). "
            "Fix: split the call into smaller pieces (e.g. over the batch), free device "
            "arrays you no longer need, or use a device with more memory.")

    def prepare_native(self, name: str, x: Any) -> Any:
        """A pyopencl Array the kernels may use, checked before any launch: its context is
        this backend's, it is a contiguous, offset-free view, and its buffer holds all the
        bytes its shape and dtype say (a short buffer would be read or written past its end:
        a crash, or another allocation's memory overwritten)."""
        ctx = x.context
        if ctx is not self.ctx and ctx != self.ctx:  # identity first: the per-call path
            raise context_error(self, name, x)
        if not x.dtype.isnative:
            raise InvalidArgumentError(
                f"argument {name!r} is a pyopencl Array of non-native byte order (dtype "
                f"{x.dtype.str}); the kernels read and write native-order values, so its "
                "values would be misread. Expected a native-order array: "
                "pk.to_backend(x.get().astype(x.dtype.newbyteorder('=')), ...).")
        if x.events and x.queue is not self.queue:
            # written (or being written) through another queue of this context: this queue
            # waits for that work before the kernels read the array (an in-order queue of our
            # own orders its own work already)
            cl.enqueue_marker(self.queue, wait_for=list(x.events))
        if x.offset or not x.flags.c_contiguous:
            raise InvalidArgumentError(
                f"argument {name!r} is a non-contiguous or offset pyopencl view (strides "
                f"{x.strides}, offset {x.offset}); expected a contiguous array. Pass x.copy().")
        nbytes = x.nbytes
        if nbytes:
            bd = x.base_data
            have = -1 if bd is None else bd.size
            if nbytes > have or nbytes != x.size * x.dtype.itemsize:
                raise InvalidArgumentError(
                    f"argument {name!r} (pyopencl Array, shape {tuple(x.shape)}, dtype "
                    f"{dtypes.dtype_name(x.dtype)}) needs {x.size * x.dtype.itemsize} bytes but "
                    f"its buffer holds {max(have, 0)} (nbytes {nbytes}); the kernel would read "
                    "or write past its end. Expected an array whose buffer is at least "
                    "shape x itemsize bytes: make it with pyopencl.array.empty/to_device (or "
                    "portakern.to_backend), not Array(..., data=<smaller buffer>).")
        return x

    def argument_checker(self, shape: tuple[int, ...], dtype: Any, writable: bool = False
                         ) -> Any:
        """``prepare_native``'s checks for one shape and dtype, each a comparison: the class
        and context by identity, the C-contiguous strides of ``shape`` (which imply no gaps),
        offset 0, the buffer's size (one clGetMemObjectInfo) and, for an output, that it is
        not READ_ONLY. Returns the buffer (pyopencl buffers compare equal when they are one
        cl_mem). (pyopencl hands out a new Context wrapper per access, so the context is
        compared by value unless the array was made on this backend's own queue.)"""
        if cla is None:
            return None
        st = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * st.itemsize
        if not nbytes:
            return None  # an empty operand: buffer_arg's placeholder, on the checked path
        strides = c_strides(shape, st.itemsize)
        cls, ctx, queue = cla.Array, self.ctx, self.queue
        read_only = cl.mem_flags.READ_ONLY if writable else 0

        # (another queue's array with pending events, or one of another byte order, takes
        # the checked path: prepare_native orders the events first, or refuses the array)
        def check(x: Any) -> Any:  # an array made on our queue is in our context
            if x.__class__ is cls and (x.queue is queue or (x.context == ctx and not x.events)) \
                    and x.strides == strides and not x.offset \
                    and (x.dtype is st or x.dtype == st):  # numpy's dtypes: one object
                bd = x.base_data  # size and flags: a driver query each, flags for outputs only
                if bd is not None and bd.size >= nbytes \
                        and not (read_only and bd.flags & read_only):
                    return bd
            return None

        return check

    def limits(self) -> MemoryLimits:
        return MemoryLimits(*self._limits)

    def check_writable(self, spec: Any, out: Any) -> None:
        bd = out.base_data
        if bd is not None and bd.flags & cl.mem_flags.READ_ONLY:
            raise InvalidArgumentError(
                f"{spec.name}: out= is backed by a READ_ONLY OpenCL buffer; the kernel must "
                "write it. Expected a READ_WRITE (or WRITE_ONLY) array: make it with "
                "pyopencl.array.empty, or drop out= and use the returned array.")

    def memory_span(self, x: Any) -> tuple[Any, int, int] | None:
        bd = x.base_data
        if bd is None or not x.nbytes:
            return None
        return ("cl", bd.int_ptr), x.offset, x.offset + x.nbytes

    def to_native(self, x: np.ndarray) -> Any:
        x = native_byte_order(x)  # kernels read native-order floats; '>f4' is float32 too
        self.transfers.add("h2d", x.nbytes)
        try:
            return cla.to_device(self.queue, x, allocator=self._new_buffer)
        except cl.Error as exc:
            if not is_allocation_failure(exc):
                raise
            raise self._oom(f"an input {x.shape} {dtypes.dtype_name(x.dtype)}", x.nbytes,
                            exc) from None

    def to_numpy(self, x: Any) -> np.ndarray:
        self.transfers.add("d2h", x.nbytes)
        return x.get(queue=self.queue)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """An uninitialised output array, made on the hot path of every call without out=.

        ``pyopencl.array.empty`` spends ~20 µs in Python re-deriving size and strides (more
        than the whole rest of a call); the clBuffer itself costs well under 1 µs. So the
        layout of the first array of each (shape, dtype) is kept, and later ones are made by
        ``output_maker``'s constructor call with that layout."""
        key = (shape, dtype)
        make = self._output_templates.lookup(key)
        if make is None:
            arr = self._allocate(cla.empty, shape, dtype)
            if arr.nbytes:
                self._output_templates[key] = self.output_maker(shape, dtype, arr)
            return arr
        return make()[0]

    def output_maker(self, shape: tuple[int, ...], dtype: str, like: Any = None
                     ) -> Callable[[], tuple[Any, Any]]:
        """New arrays of one shape and dtype, each with its own buffer and event list, made
        by pyopencl's constructor on its fast path (what ``Array._new_with_changes`` does) with
        the layout of ``like`` (an array of that shape and dtype; made once if None), its
        arguments passed by position when the installed pyopencl's signature is the one
        ``_ARRAY_FAST_ARGS`` names (half the cost of keywords: ~0.4 µs, where the driver's
        buffer costs ~0.2 µs), by keyword otherwise."""
        if like is None:
            like = self._allocate(cla.empty, shape, dtype)
        st, strides, size, nbytes = like.dtype, like.strides, like.size, like.nbytes
        if not nbytes:
            return super().output_maker(shape, dtype)
        cls, ctx, queue, alloc = cla.Array, self.ctx, self.queue, self._new_buffer
        positional = _array_takes_fast_args_by_position()

        def make() -> tuple[Any, Any]:
            pool = self.memory_pool
            try:  # nbytes was judged against the device's limits when ``like`` was made
                data = pool.allocate(nbytes) if pool is not None else alloc(nbytes)
            except cl.Error:  # the pool's retry after freeing what it holds, else the error
                data = self._output_buffer(shape, dtype, nbytes)
            if nbytes >= HUGEPAGE_MIN_BYTES and pool is not None and self._advise_huge_pages:
                self._advise_huge(data, nbytes)  # (without a pool, _new_buffer advised it)
            if positional:
                return cls(None, shape, st, "C", alloc, data, 0, strides, None, None, True,
                           size, ctx, queue), data
            return cls(None, shape, st, allocator=alloc, strides=strides, data=data, offset=0,
                       events=None, _fast=True, _context=ctx, _queue=queue, _size=size), data

        return make

    def _output_buffer(self, shape: tuple[int, ...], dtype: str, nbytes: int) -> Any:
        try:
            return self._new_buffer(nbytes)
        except cl.Error as exc:
            if not is_allocation_failure(exc):
                raise
            raise self._oom(f"an output {shape} {dtype}", nbytes, exc) from None

    def fill_zero(self, out: Any) -> None:
        """Zero ``out`` by its bytes: pyopencl's fill() builds a kernel for the element type,
        which has no mapping for float16/bfloat16 ('unable to map dtype')."""
        if out.nbytes:
            cl.enqueue_fill_buffer(self.queue, out.base_data, np.zeros(1, np.uint8),
                                   out.offset, out.nbytes)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._allocate(cla.zeros, shape, dtype)

    def _new_buffer(self, nbytes: int) -> Any:
        """Device memory for every array this backend makes: from the memory pool, like CuPy's
        and XLA's allocators (a fresh clBuffer on a CPU device is fresh pages, and touching
        them costs more than a memory-bound kernel on them); PORTAKERN_OPENCL_POOL=0 turns the
        pool off. An allocation failure first frees what the pool holds, then raises."""
        if nbytes > self._limits[0]:  # never ask the driver for what it cannot give
            raise self._oom("a buffer", nbytes, RuntimeError(
                "larger than max_mem_alloc_size; refused before allocating"))
        buf = self._driver_buffer(nbytes)
        if nbytes >= HUGEPAGE_MIN_BYTES and self._advise_huge_pages:
            self._advise_huge(buf, nbytes)
        return buf

    def _driver_buffer(self, nbytes: int) -> Any:
        pool = self.memory_pool
        if pool is None:
            return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes)
        try:
            return pool.allocate(nbytes)
        except cl.Error as exc:
            if not is_allocation_failure(exc):
                raise
            pool.free_held()
            return pool.allocate(nbytes)

    def free_pooled_memory(self) -> int:
        """Return the pool's unused blocks to the driver; the bytes it held are returned."""
        pool = self.memory_pool
        if pool is None:
            return 0
        held = int(pool.managed_bytes) - int(pool.active_bytes)
        pool.free_held()
        self._huge_advised.clear()  # a freed handle may come back as another buffer
        return held

    def _allocate(self, fn: Any, shape: tuple[int, ...], dtype: str) -> Any:
        st = storage_dtype(dtype)  # a float dtype's storage, or int32 (index buffers)
        try:
            return fn(self.queue, shape, st, allocator=self._new_buffer)
        except cl.Error as exc:
            if not (is_allocation_failure(exc) or isinstance(exc, cl.RuntimeError)):
                raise
            nbytes = int(np.prod(shape, dtype=np.int64)) * st.itemsize
            raise self._oom(f"an output {shape} {dtype}", nbytes, exc) from None

    def synchronize(self) -> None:
        self.queue.finish()

    # kernels
    def compile(self, source: str, entry_points: tuple[str, ...]) -> dict[str, Any]:
        options = [*BUILD_OPTIONS, *self.device_build_options, *self.extra_build_options]
        prg = cl.Program(self.ctx, source)
        try:
            with warnings.catch_warnings():  # a successful build's log is not a warning:
                # Intel's runtime logs every build (vectorizer remarks); see build_log
                warnings.simplefilter("ignore", cl.CompilerWarning)
                prg = prg.build(options=options, devices=[self._cl_device],
                                cache_dir=cache_dir())
        except cl.RuntimeError as exc:
            try:
                log = prg.get_build_info(self._cl_device, cl.program_build_info.LOG)
            except cl.Error:
                log = str(exc)
            raise CompileError("OpenCL build failed", source=source, log=log or str(exc),
                               options=tuple(options), device=self.describe()) from None
        kernels = {name: cl.Kernel(prg, name) for name in entry_points}
        for k in kernels.values():  # kept: some drivers (Intel's CPU runtime) refuse to
            k.built_program = prg  # hand a kernel's program back (INVALID_PROGRAM)
        return kernels

    def buffer_arg(self, x: Any) -> Any:
        return x.base_data if x.size else cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, 1)

    def program(self, kernel: Any, launch: Launch, template: Sequence[Any],
                slots: Sequence[int] | None = None) -> Any:
        """One launch on its own kernel object (a second cl_kernel of the same compiled
        program): the scalar arguments, fixed by the plan, are set once here, and a call
        sets only the buffer arguments (clSetKernelArg per buffer: 0.06 µs each, where
        setting all of attention's 20 arguments at once costs 1.4 µs). Kernel objects shared
        between plans could not keep scalars: another plan may set other values. Calls run
        under the backend's launch lock (runtime/execute.enqueue_steps): clSetKernelArg is
        not thread-safe. A closure, not an object: each attribute read of the per-call path
        would cost more than the driver call it precedes."""
        own = cl.Kernel(kernel.built_program, kernel.function_name)
        # declared once: without it PyOpenCL probes each scalar's type on every set_arg
        own.set_arg_types([None if a.__class__ is str else a.dtype for a in template])
        for i, a in enumerate(template):
            if a.__class__ is not str:
                own.set_arg(i, a)
        pairs = bound_slots(template, slots)
        set_arg, queue, gsize, local = own.set_arg, self.queue, launch.global_size, launch.local
        failed = self.launch_failed

        def run(handles: Sequence[Any]) -> None:
            for i, s in pairs:
                set_arg(i, handles[s])
            try:
                cl.enqueue_nd_range_kernel(queue, own, gsize, local)
            except cl.Error as exc:
                failed(launch, [handles[s] for _, s in pairs], exc)

        return run

    def kernel_limits(self, kernel: Any) -> tuple[int | None, int | None]:
        """clGetKernelWorkGroupInfo: LOCAL_MEM_SIZE and WORK_GROUP_SIZE on this device."""
        try:
            info = cl.kernel_work_group_info
            return (int(kernel.get_work_group_info(info.LOCAL_MEM_SIZE, self._cl_device)),
                    int(kernel.get_work_group_info(info.WORK_GROUP_SIZE, self._cl_device)))
        except Exception:
            return None, None

    def raw_launcher(self, kernel: Any, launch: Launch, template: Sequence[Any],
                     buffers: Mapping[str, Any]) -> Any:
        """A kernel object of its own with every argument set once; per call the buffers are
        set again and the kernel enqueued, as code written against the OpenCL API does."""
        own = cl.Kernel(kernel.built_program, kernel.function_name)
        bufs = [(i, self.buffer_arg(buffers[a])) for i, a in enumerate(template)
                if a.__class__ is str]
        for i, a in enumerate(template):
            if a.__class__ is not str:
                own.set_arg(i, a)
        queue, gsize, local, set_arg = self.queue, launch.global_size, launch.local, own.set_arg
        enqueue = cl.enqueue_nd_range_kernel

        def launch_raw() -> None:  # clSetKernelArg per buffer; clEnqueueNDRangeKernel
            for i, b in bufs:
                set_arg(i, b)
            enqueue(queue, own, gsize, local)

        return launch_raw

    def held_queue(self) -> Any:
        """A user event gates a marker on this in-order queue: every later command waits
        until the block exits and the event completes; then the queue is drained."""
        queue, ctx = self.queue, self.ctx

        @contextlib.contextmanager
        def hold() -> Any:
            gate = cl.UserEvent(ctx)
            cl.enqueue_marker(queue, wait_for=[gate])
            try:
                yield
            finally:
                gate.set_status(cl.command_execution_status.COMPLETE)
                queue.finish()

        return hold()

    def launch_failed(self, launch: Launch, buffers: Sequence[Any], exc: BaseException) -> None:
        """A failed enqueue: an allocation failure (drivers may allocate buffers lazily, at
        first launch) becomes DeviceMemoryError naming the kernel; anything else is raised."""
        if not is_allocation_failure(exc):
            raise exc
        nbytes = sum(int(a.size) for a in buffers if isinstance(a, cl.MemoryObjectHolder))
        raise self._oom(f"the buffers of kernel {launch.kernel!r}", nbytes, exc) from None


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def _madvise(addr: int, length: int, advice: int) -> None:
    """madvise(2) on a range of this process's memory (Python's mmap module advises only its
    own mappings); OSError with errno when the OS refuses."""
    if _libc().madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {err}")
