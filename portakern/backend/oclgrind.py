"""opencl:oclgrind — portakern's kernels on the Oclgrind OpenCL simulator, with its checks on.

What it is for. PoCL runs a work-group's items one after another on a CPU, so a missing
barrier or a read one element past a buffer often gives the right values there and wrong ones
on a GPU now and then. Oclgrind (Debian/Ubuntu package ``oclgrind``) interprets the kernel the
way a GPU runs it — items interleaved at barriers, one local memory per group — and checks
every access: data races (OCLGRIND_DATA_RACES), out-of-bounds reads and writes (always on),
uses of uninitialised values (OCLGRIND_UNINITIALIZED) and invalid OpenCL API use
(OCLGRIND_CHECK_API). Every report raises ``portakern.KernelFaultError`` naming the kernel,
the kind, the rendered source line and the work-items. It also counts every instruction a
launch executes, bytes loaded and stored per address space included (OCLGRIND_INST_COUNTS),
which ``portakern trace`` reads. It is an interpreter (thousands of times slower than PoCL):
never chosen automatically and not in the shared suite's targets; tests/backend/test_simulator.py
sweeps it at small shapes. It proves nothing about timing or CUDA-only behaviour.

How it is loaded. The package's ICD library (``liboclgrind-rt-icd.so``) is opened with ctypes
and its platform handed to PyOpenCL (``clIcdGetPlatformIDsKHR`` -> ``Platform.from_int_ptr``):
OpenCL calls on its objects dispatch through the ICD loader like any platform's. Nothing is
registered anywhere: /etc/OpenCL/vendors and $OCL_ICD_VENDORS are not read or written, the
other platforms are unaffected, and it works at any point of a process (no variable has to be
set before pyopencl first loads the ICD loader). Under the ``oclgrind`` launcher, or with
its ICD registered system-wide, the "Oclgrind" platform PyOpenCL already lists is used
instead. ``PORTAKERN_OCLGRIND_ICD=/path/liboclgrind-rt-icd.so`` names the library;
``PORTAKERN_OCLGRIND=0`` hides the simulator.

Settings. Oclgrind reads its OCLGRIND_* variables when an OpenCL context is created (and
OCLGRIND_CHECK_API at each API error): this backend sets them for that moment only, under a
lock, and restores the caller's environment. Each instance logs to its own file in a private
temporary directory (removed at exit), read after every launch. Buffers are allocated at their
exact size (no memory pool), so a read past an array's end is out of bounds, not a read of a
pool block's slack.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import settings
from ..core.errors import (
    BackendUnavailable,
    KernelFaultError,
    ToolchainError,
    UnknownBackendError,
)
from ..core.spec import Launch
from . import opencl
from .base import Availability, DeviceInfo
from .opencl import OpenCLBackend
from .opencl_devices import all_devices, cl, is_allocation_failure, load_icd_platforms

ALIAS = "oclgrind"
PURPOSE = ("the Oclgrind simulator: GPU-style execution with race, bounds, uninitialised-value "
           "and API checks, and exact memory-traffic counts (portakern trace); slow, never "
           "chosen automatically")
ICD_NAME = "liboclgrind-rt-icd.so"
ICD_CANDIDATES = (
    "/usr/lib/oclgrind/" + ICD_NAME,  # Debian / Ubuntu
    "/usr/lib/x86_64-linux-gnu/oclgrind/" + ICD_NAME,
    "/usr/lib64/oclgrind/" + ICD_NAME,
    "/usr/local/lib/oclgrind/" + ICD_NAME,
    "/usr/local/lib/" + ICD_NAME,  # a source build's default prefix
    "/usr/lib/" + ICD_NAME,
)
# Settings this backend owns at context creation; the rest of OCLGRIND_* (device limits,
# thread count) stay as the user set them.
CHECKS = {"OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1",
          "OCLGRIND_MAX_ERRORS": "1000000000"}  # the limit is process-wide; never hit it
UNSET = ("OCLGRIND_QUICK", "OCLGRIND_INTERACTIVE")  # skip work-groups / stop for a debugger

_LOCK = threading.Lock()
_ENV_LOCK = threading.Lock()
_PLATFORM: list[Any] = []  # [pyopencl.Platform] once loaded; [None] when it cannot be


def find_icd() -> str | None:
    """Path of Oclgrind's ICD library, or None when it is not installed."""
    given = settings.oclgrind.icd
    if given:
        return given if os.path.exists(given) else None
    exe = shutil.which("oclgrind")
    extra = []
    if exe:
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(exe)))
        extra = [os.path.join(prefix, "lib", "oclgrind", ICD_NAME),
                 os.path.join(prefix, "lib", ICD_NAME)]
    for path in (*ICD_CANDIDATES, *extra):
        if os.path.exists(path):
            return path
    return None


def _registered_platform() -> Any:
    """The Oclgrind platform when the ICD loader already lists it (launcher or system ICD)."""
    for plat, _ in all_devices():
        if plat.name.strip().lower().startswith("oclgrind"):
            return plat
    return None


def platform() -> Any:
    """Oclgrind's pyopencl Platform, loaded once per process; None when not installed."""
    with _LOCK:
        if _PLATFORM:
            return _PLATFORM[0]
        got = None
        try:
            got = _registered_platform()
        except cl.Error:
            got = None
        if got is None:
            path = find_icd()
            if path is not None:
                got = load_icd_platforms(path)[0]
        _PLATFORM.append(got)
        return got


def add_simulator(av: Availability) -> Availability:
    """The OpenCL probe's devices plus the simulator (``opencl:oclgrind``, index after the
    real devices). Never raises: a broken simulator is noted in the versions and left out."""
    if cl is None or not settings.oclgrind.enabled:
        return av
    try:
        for d in av.devices:  # listed by the ICD loader itself (launcher, system ICD)
            if d.platform.lower().startswith("oclgrind"):
                d.extra.update(simulator=True, alias=ALIAS, purpose=PURPOSE)
                return av
        plat = platform()
        if plat is None:
            return av
        dev = plat.get_devices()[0]
    except Exception as exc:  # e.g. a library built for another ICD loader
        av.versions["oclgrind"] = f"unusable ({type(exc).__name__}: {exc})"
        return av
    info = DeviceInfo(
        index=len(av.devices), name=dev.name.strip(), kind="gpu", vendor=dev.vendor.strip(),
        driver=dev.driver_version, platform=f"{plat.name} {plat.version}".strip(),
        fp64="cl_khr_fp64" in dev.extensions, max_work_group_size=int(dev.max_work_group_size),
        local_mem_bytes=int(dev.local_mem_size), compute_units=int(dev.max_compute_units),
        extra={"opencl_c": dev.opencl_c_version, "fp16_arith": "cl_khr_fp16" in dev.extensions,
               "device_id": dev.int_ptr, "simulator": True, "alias": ALIAS, "purpose": PURPOSE,
               "library": find_icd()})
    av.versions.setdefault("oclgrind", plat.version.strip())
    if not av.available:  # no other OpenCL device: the backend runs, on the simulator only
        av = Availability(True, versions=av.versions, devices=[info])
        info.index = 0
    else:
        av.devices.append(info)
    return av


def simulator_info() -> DeviceInfo | None:
    av = OpenCLBackend.probe()
    for d in av.devices:
        if d.extra.get("simulator"):
            return d
    return None


def require_simulator(what: str = "opencl:oclgrind") -> DeviceInfo:
    """The simulator's device, or why ``what`` cannot have it: hidden by PORTAKERN_OCLGRIND=0,
    PORTAKERN_OCLGRIND_ICD naming no file, a library that would not load or list its device
    (ToolchainError: the library, the loader's message, the fix), or not installed."""
    info = simulator_info()
    if info is not None:
        return info
    fix = "apt-get install oclgrind, or set PORTAKERN_OCLGRIND_ICD to its " + ICD_NAME
    if not settings.oclgrind.enabled:
        raise BackendUnavailable(f"{what} needs the Oclgrind simulator, which "
                                 "PORTAKERN_OCLGRIND=0 hides. Fix: unset PORTAKERN_OCLGRIND.")
    given = settings.oclgrind.icd
    if given and not os.path.exists(given):
        raise BackendUnavailable(f"{what} needs the Oclgrind simulator, but "
                                 f"PORTAKERN_OCLGRIND_ICD={given} names no file. Fix: point it "
                                 f"at {ICD_NAME} (Debian: {ICD_CANDIDATES[0]}) or unset it.")
    broken = OpenCLBackend.probe().versions.get("oclgrind", "")
    if broken.startswith("unusable"):
        path = find_icd() or ICD_NAME
        raise ToolchainError(f"{what} needs the Oclgrind simulator, whose OpenCL library "
                             "could not be loaded or listed no device", tool="oclgrind",
                             command=("dlopen", path), stderr=broken,
                             fix=f"reinstall it ({fix}); PORTAKERN_OCLGRIND=0 hides it")
    raise BackendUnavailable(f"{what} needs the Oclgrind simulator, which is not installed "
                             f"here (looked for {ICD_NAME} in {', '.join(ICD_CANDIDATES[:2])}, "
                             f"...). Fix: {fix}.")


def names_simulator(name: str, device: str | None) -> bool:
    """Whether a parsed selector (backend name, device or None) can mean the simulator: the
    OpenCL backend with no device (``trace`` then picks the simulator), its alias or its index."""
    if name != OpenCLBackend.name:
        return False
    if device is None or device == ALIAS:
        return True
    info = simulator_info()
    return info is not None and device == str(info.index)


def simulator_class(selector: str) -> type[OclgrindBackend] | None:
    """OclgrindBackend when ``opencl:<selector>`` names the simulator (by alias or index)."""
    if selector == ALIAS:
        return OclgrindBackend
    if selector.isdigit():
        info = simulator_info()
        if info is not None and info.index == int(selector):
            return OclgrindBackend
    return None


# --- the simulator's reports ----------------------------------------------------------------
KINDS = (  # (headline pattern, kind), first match wins
    (re.compile(r"data race", re.I), "race"),
    (re.compile(r"^Invalid (read|write) of size", re.I), "out-of-bounds"),
    (re.compile(r"uninitiali[sz]ed", re.I), "uninitialised read"),
    (re.compile(r"divergence", re.I), "barrier divergence"),
    (re.compile(r"not aligned|unaligned", re.I), "misaligned access"),
    (re.compile(r"read-only|write-only|mapped|OpenCL runtime error", re.I), "invalid API use"),
)
# the cause first (a race, a bad address), then what follows from it (an undefined value)
PRIORITY = ("race", "out-of-bounds", "barrier divergence", "misaligned access", "invalid API use",
            "uninitialised read")
_ENTITY = re.compile(r"(?:Entity|First entity|Second entity):\s*(.+)")
_LINE = re.compile(r"At line (\d+)(?: \(column (\d+)\))?")


@dataclass
class Report:
    """One simulator message: what happened, where in the source, and to which work-items."""

    kind: str
    headline: str
    kernel: str = ""
    line: int | None = None
    lines: tuple[int, ...] = ()
    work_items: tuple[str, ...] = ()
    text: str = ""
    count: int = 1
    source_line: str = ""
    extra_items: list[str] = field(default_factory=list)


def parse_log(text: str) -> list[Report]:
    """Oclgrind's log text -> one Report per message (each starts at an unindented line)."""
    blocks: list[list[str]] = []
    for raw in text.splitlines():
        if not raw.strip():
            if blocks:
                blocks[-1].append(raw)
            continue
        if not raw[0].isspace():
            blocks.append([raw])
        elif blocks:
            blocks[-1].append(raw)
    reports = []
    for block in blocks:
        head = block[0].strip()
        if head.startswith("Oclgrind:") and "suppressing" in head:
            continue
        kind = next((k for pat, k in KINDS if pat.search(head)), "simulator report")
        body = "\n".join(block[1:])
        kernel = re.search(r"Kernel:\s*(\S+)", body)
        lines = tuple(int(m.group(1)) for m in _LINE.finditer(body))
        items = tuple(m.group(1).strip() for m in _ENTITY.finditer(body))
        reports.append(Report(kind, head, kernel.group(1) if kernel else "",
                              lines[0] if lines else None, lines, items,
                              "\n".join(block).rstrip()))
    return reports


def fault_error(reports: list[Report], kernel: str, source: str, device: str,
                log: str) -> KernelFaultError:
    """KernelFaultError for a launch's reports: distinct (kind, line) pairs, counted, each with
    its rendered source line and the first work-items involved."""
    src_lines = source.splitlines()
    distinct: dict[tuple[str, int | None, tuple[int, ...]], Report] = {}
    for r in reports:
        key = (r.kind, r.line, r.lines)
        if key in distinct:
            got = distinct[key]
            got.count += 1
            if len(got.extra_items) < 4:
                got.extra_items.extend(r.work_items[:1])
            continue
        if r.line is not None and 0 < r.line <= len(src_lines):
            r.source_line = src_lines[r.line - 1].strip()
        distinct[key] = r
    rows = sorted(distinct.values(), key=lambda r: PRIORITY.index(r.kind)
                  if r.kind in PRIORITY else len(PRIORITY))
    out = [f"kernel {kernel!r} on {device}: {len(reports)} simulator report(s), "
           f"{len(rows)} distinct"]
    for r in rows[:8]:
        where = (" at lines " + ", ".join(map(str, r.lines)) if len(set(r.lines)) > 1
                 else f" at line {r.line}" if r.line is not None else "")
        out.append(f"  {r.kind}{where} ({r.count}x): {r.headline}")
        for n in sorted(set(r.lines)):
            if 0 < n <= len(src_lines):
                out.append(f"    {n:>5} | {src_lines[n - 1].strip()}")
        items = list(r.work_items) + [w for w in r.extra_items if w not in r.work_items]
        if items:
            out.append("    work-items: " + "; ".join(items[:4])
                       + (" ..." if r.count > 1 or len(items) > 4 else ""))
    if len(rows) > 8:
        out.append(f"  ... {len(rows) - 8} more distinct report(s): see the exception's .reports")
    out.append("Fix the kernel (a barrier between a local write and another item's read, the "
               "bounds of a load, a value written before it is read); the rendered source is "
               "`portakern show OP --backend opencl`.")
    first = rows[0]
    return KernelFaultError("\n".join(out), kernel=first.kernel or kernel, kind=first.kind,
                            line=first.line, source_line=first.source_line,
                            work_items=first.work_items, reports=tuple(rows), log=log[:200_000])


# --- output capture: instruction counts go to stdout, API errors to stderr --------------------
_LIBC: list[Any] = []


def _fflush() -> None:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(ctypes.util.find_library("c") or None))
    _LIBC[0].fflush(None)


@contextlib.contextmanager
def _captured(fd: int, sink: list[str]) -> Iterator[None]:
    """Redirect file descriptor ``fd`` into a temporary file; its text lands in ``sink``."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    _fflush()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(fd)
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            _fflush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode("utf-8", "replace"))


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the block; restore them after."""
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in values}
        try:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# --- instruction counts ---------------------------------------------------------------------
_COUNT = re.compile(r"^\s*([\d.,'\s\u00a0\u202f]+?)\s+-\s+(.+?)\s*$")
_MEMOP = re.compile(r"^(load|store) (\w+) \(([\d.,'\s\u00a0\u202f]+) bytes\)$")
_VEC = re.compile(r"\.v(\d+)f(?:16|32|64)\b|Dv(\d+)_")
_BUILTIN_MEM = re.compile(r"^call _Z\d+(vload|vstore)(_half|a_half)?(\d*)(?:_rt\w)?.*?PU3AS(\d)")
_ADDRESS_SPACES = {"0": "private", "1": "global", "2": "constant", "3": "local"}


def _int(text: str) -> int:
    return int(re.sub(r"\D", "", text) or 0)


@dataclass
class LaunchCounts:
    """What one kernel launch executed on the simulator (from OCLGRIND_INST_COUNTS)."""

    kernel: str
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None
    counts: dict[str, int]
    bytes: dict[str, int]  # "load global", "store local", ... -> bytes

    @property
    def barriers(self) -> int:
        """Barrier calls executed, summed over work-items."""
        return sum(n for k, n in self.counts.items() if "barrier" in k and k.startswith("call"))

    @property
    def fma(self) -> int:
        """Fused or contracted multiply-adds, one per lane (fmuladd, fma, mad; vectors count
        their width)."""
        total = 0
        for k, n in self.counts.items():
            if not k.startswith("call"):
                continue
            name = k[5:]
            if not re.match(r"(llvm\.(fmuladd|fma)\.|_Z\d+(fma|mad)[A-Z])", name):
                continue
            m = _VEC.search(name)
            total += n * int((m.group(1) or m.group(2)) if m else 1)
        return total


def parse_counts(text: str) -> list[tuple[str, dict[str, int], dict[str, int]]]:
    """Oclgrind's instruction histograms -> [(kernel, {name: count}, {space op: bytes})].

    Plain loads and stores carry their bytes; vload/vstore builtins (vloadN, vload_half, ...)
    are calls, so their bytes are derived from the call counts (element size times width)."""
    out: list[tuple[str, dict[str, int], dict[str, int]]] = []
    for raw in text.splitlines():
        m = re.match(r"Instructions executed for kernel '([^']+)':", raw.strip())
        if m:
            out.append((m.group(1), {}, {}))
            continue
        m = _COUNT.match(raw)
        if not m or not out:
            continue
        n, name = _int(m.group(1)), m.group(2)
        _, counts, nbytes = out[-1]
        mem = _MEMOP.match(name)
        if mem:
            key = f"{mem.group(1)} {mem.group(2)}"
            nbytes[key] = nbytes.get(key, 0) + _int(mem.group(3))
            counts[key] = counts.get(key, 0) + n
            continue
        counts[name] = counts.get(name, 0) + n
        b = _BUILTIN_MEM.match(name)
        if b:
            op = "load" if b.group(1) == "vload" else "store"
            width = int(b.group(3) or 1)
            elem = 2 if b.group(2) else _element_size(name)
            key = f"{op} {_ADDRESS_SPACES.get(b.group(4), 'private')}"
            nbytes[key] = nbytes.get(key, 0) + n * width * elem
    return out


def _element_size(mangled: str) -> int:
    """Element size of a vloadN/vstoreN builtin from its Itanium-mangled pointer type."""
    m = re.search(r"PU3AS\dK?([fdhDtsjicamlyx])", mangled)
    code = m.group(1) if m else "f"
    return {"f": 4, "d": 8, "h": 1, "a": 1, "c": 1, "t": 2, "s": 2, "j": 4, "i": 4,
            "m": 8, "l": 8, "y": 8, "x": 8, "D": 2}.get(code, 4)


# --- the backend ----------------------------------------------------------------------------
_POISON_SOURCE = """
__kernel void portakern_poison(__global uchar* p, int n)
{
    uchar undefined;  /* never written: its shadow is "uninitialised" */
    __builtin_memset(p, undefined, n);
}
"""
_SERIAL = itertools.count()


class OclgrindBackend(OpenCLBackend):
    """``opencl:oclgrind``: the OpenCL backend on the simulator, every launch checked."""

    simulator = True
    in_order_queue = False  # a fresh, poisoned workspace per call: uninitialised reads show
    # always the spec's schedules, never a tuned entry: what the sweep and trace claim to check
    uses_tuned_configs = False
    # Oclgrind 21.10 stops on llvm.prefetch ("Undefined external function"); a prefetch hint
    # changes no value, so the simulated kernel is the same kernel without it. PK_LOOKUP8
    # is shuffle() either way (no AVX2 here); PK_NO_LOOKUP8 also tells vexp.c to look up
    # 16 lanes with one shuffle, not two halves: Oclgrind 21.10 reports every lane of a
    # 16-lane vector's .hi uninitialised
    device_build_options = ("-DPK_NO_PREFETCH", "-DPK_NO_LOOKUP8")

    @classmethod
    def probe(cls) -> Availability:
        return OpenCLBackend.probe()  # one probe: the simulator is a device of "opencl"

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        return []

    @classmethod
    def test_targets(cls) -> list[str]:
        return []

    count_instructions = False

    def __init__(self, selector: str | None = ALIAS) -> None:
        self.launch_counts: list[LaunchCounts] = []
        self._logdir = tempfile.mkdtemp(prefix="portakern-oclgrind-")
        self._log_path = os.path.join(self._logdir, f"{os.getpid()}-{next(_SERIAL)}.log")
        self._log_offset = 0
        weakref.finalize(self, shutil.rmtree, self._logdir, True)
        super().__init__(selector)

    @classmethod
    def counting(cls) -> OclgrindBackend:
        """A fresh simulator instance (its own context) that also counts instructions per
        launch into ``launch_counts`` — what ``portakern trace`` uses."""
        return CountingOclgrindBackend(ALIAS)

    @property
    def label(self) -> str:
        return f"opencl:{ALIAS}"

    def _open(self, selector: str | None) -> DeviceInfo:
        info = require_simulator()
        if selector not in (ALIAS, str(info.index)):
            raise UnknownBackendError(f"opencl:{selector} is not the simulator; use "
                                      f"opencl:{ALIAS}.")
        env: dict[str, str | None] = {**CHECKS, "OCLGRIND_LOG": self._log_path,
                                      "OCLGRIND_INST_COUNTS": "1" if self.count_instructions
                                      else None}
        env.update({k: None for k in UNSET})
        with _environment(env):  # read by the simulator when the context is created
            got = super()._open(str(info.index))
        self.memory_pool = None  # exact-size buffers: past an array's end is out of bounds
        self._poison: Any = None
        return got

    def _device_handle(self, info: DeviceInfo) -> Any:
        plat = platform()
        if plat is None:
            raise BackendUnavailable("the Oclgrind simulator could not be loaded")
        return plat.get_devices()[0]

    advise_huge_pages = False  # its buffers live in the simulator, not in host pages

    def free_pooled_memory(self) -> int:
        return 0

    def _new_buffer(self, nbytes: int) -> Any:
        """An exact-size buffer whose every byte the simulator sees as uninitialised.

        Oclgrind 21.10's uninitialised-value plugin keeps a shadow per buffer slot and never
        drops it when a buffer is released, so a new buffer in a reused slot would inherit
        the last one's shadow (a smaller one: false reports past its end; a larger one: stale
        "initialised" bytes). A host write re-creates the shadow at the right size (all
        initialised), and a one-item kernel then memsets it with an undefined byte: memset
        stores the shadow unchecked, so every byte is uninitialised again, without a report.
        """
        buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, nbytes)
        with self._lock:
            if self._poison is None:
                prg = cl.Program(self.ctx, _POISON_SOURCE).build(
                    options=["-cl-opt-disable"], devices=[self._cl_device])
                self._poison = cl.Kernel(prg, "portakern_poison")
            cl.enqueue_copy(self.queue, buf, bytes(nbytes))
            self._poison.set_args(buf, np.int32(nbytes))
            cl.enqueue_nd_range_kernel(self.queue, self._poison, (1,), (1,))
            with _captured(1, []) if self.count_instructions else contextlib.nullcontext():
                self.queue.finish()  # its instruction counts are not the op's
            self._new_reports()  # nothing is expected; never attributed to a later launch
        return buf

    def compile(self, source: str, entry_points: tuple[str, ...]) -> dict[str, Any]:
        """Oclgrind's default optimised build, unless its IR has a shufflevector with
        undefined mask lanes (two lanes of a vector combined, typically vector code): the
        uninitialised-value plugin of Oclgrind 21.10 indexes its shadow buffers with such a
        lane (-1) and reports nonsense or crashes, so that program is rebuilt unoptimised
        (-cl-opt-disable: the IR follows the source; 3-8x slower to simulate)."""
        got = super().compile(source, entry_points)
        if got and _undefined_shuffles(next(iter(got.values()))) is not False:
            self.extra_build_options = ("-cl-opt-disable",)
            try:
                got = super().compile(source, entry_points)
            finally:
                del self.extra_build_options
        for k in got.values():
            k._portakern_source = source  # reports quote the rendered line
        return got

    def program(self, kernel: Any, launch: Launch, template: Sequence[Any],
                slots: Sequence[int] | None = None) -> Any:
        """The OpenCL program, each call checked: see ``_checked_launch``."""
        inner = super().program(kernel, launch, template, slots)
        source = getattr(kernel, "_portakern_source", "")

        def run(buffers: Sequence[Any]) -> None:
            self._checked_launch(inner, launch, source, buffers)

        return run

    def _checked_launch(self, inner: Any, launch: Launch, source: str,
                        buffers: Sequence[Any]) -> None:
        """Launch, wait for it, and raise KernelFaultError on any report. The simulator prints
        API errors to stderr only (OCLGRIND_CHECK_API), so stderr is captured around the API
        calls; its other text is passed on."""
        with self._lock:
            err: list[str] = []
            failure: BaseException | None = None
            with _environment({"OCLGRIND_CHECK_API": "1"}), _captured(2, err):
                try:
                    inner(buffers)
                except cl.Error as exc:
                    if is_allocation_failure(exc):
                        raise
                    failure = exc
            api, rest = _api_errors(err[0])
            if rest.strip():
                sys.stderr.write(rest)
            if failure is not None and not api:
                api = [Report("invalid API use", f"{type(failure).__name__}: {failure}",
                              launch.kernel, text=str(failure))]
            if api:
                raise fault_error(api, launch.kernel, source, self.describe(), err[0])
            out: list[str] = []
            with _captured(1, out) if self.count_instructions else contextlib.nullcontext():
                self.queue.finish()
            reports = self._new_reports()
            if self.count_instructions:
                for name, counts, nbytes in parse_counts(out[0]):
                    self.launch_counts.append(LaunchCounts(
                        name, tuple(launch.global_size),
                        tuple(launch.local) if launch.local else None, counts, nbytes))
            if reports:
                raise fault_error(reports, launch.kernel, source, self.describe(),
                                  "\n\n".join(r.text for r in reports))

    def _new_reports(self) -> list[Report]:
        try:
            with open(self._log_path, "rb") as fh:
                fh.seek(self._log_offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._log_offset += len(data)
        return parse_log(data.decode("utf-8", "replace"))


_LLVM: list[Any] = []


def _undefined_shuffles(kernel: Any) -> bool | None:
    """Whether the kernel's program (Oclgrind's binary is LLVM bitcode) has a shufflevector
    with an undefined mask lane; None when that cannot be told (libLLVM not loadable)."""
    try:
        if not _LLVM:
            _LLVM.append(_load_llvm())
        llvm = _LLVM[0]
        if llvm is None:
            return None
        program = kernel.get_info(cl.kernel_info.PROGRAM)
        bitcode = program.get_info(cl.program_info.BINARIES)[0]
        buf = llvm.LLVMCreateMemoryBufferWithMemoryRangeCopy(bitcode, len(bitcode), b"pk")
        context = llvm.LLVMContextCreate()
        try:
            module = ctypes.c_void_p()
            if llvm.LLVMParseBitcodeInContext2(context, buf, ctypes.byref(module)):
                return None
            text_ptr = llvm.LLVMPrintModuleToString(module)
            text = ctypes.string_at(text_ptr).decode("utf-8", "replace")
            llvm.LLVMDisposeMessage(text_ptr)
        finally:
            llvm.LLVMDisposeMemoryBuffer(buf)  # parsed in full: the module keeps no reference
            llvm.LLVMContextDispose(context)  # and the module goes with its context
    except Exception:
        return None
    return any("shufflevector" in line and re.search(r"<i32 [^>]*\b(undef|poison)\b", line)
               for line in text.splitlines())


def _load_llvm() -> Any:
    """The LLVM C API of the libLLVM Oclgrind links (14 for Oclgrind 21.10), or None."""
    for name in ("libLLVM-14.so.1", "libLLVM-14.so", ctypes.util.find_library("LLVM-14")):
        if not name:
            continue
        try:
            llvm = ctypes.CDLL(name)
        except OSError:
            continue
        vp = ctypes.c_void_p
        llvm.LLVMCreateMemoryBufferWithMemoryRangeCopy.restype = vp
        llvm.LLVMCreateMemoryBufferWithMemoryRangeCopy.argtypes = [ctypes.c_char_p,
                                                                   ctypes.c_size_t,
                                                                   ctypes.c_char_p]
        llvm.LLVMContextCreate.restype = vp
        llvm.LLVMContextDispose.argtypes = [vp]
        llvm.LLVMParseBitcodeInContext2.restype = ctypes.c_int
        llvm.LLVMParseBitcodeInContext2.argtypes = [vp, vp, ctypes.POINTER(vp)]
        llvm.LLVMPrintModuleToString.restype = vp
        llvm.LLVMPrintModuleToString.argtypes = [vp]
        llvm.LLVMDisposeMessage.argtypes = [vp]
        llvm.LLVMDisposeMemoryBuffer.argtypes = [vp]
        return llvm
    return None


class CountingOclgrindBackend(OclgrindBackend):
    """The simulator with OCLGRIND_INST_COUNTS on: per-launch counts in ``launch_counts``."""

    count_instructions = True


def _api_errors(text: str) -> tuple[list[Report], str]:
    """Captured stderr -> (the simulator's API-error reports, everything else)."""
    api: list[Report] = []
    rest: list[str] = []
    for r in parse_log(text):
        (api.append(r) if r.kind == "invalid API use" else rest.append(r.text))
    return api, ("\n".join(rest) + "\n") if rest else ""


# the OpenCL backend lists the simulator and makes opencl:oclgrind an OclgrindBackend
opencl.PROBE_HOOKS.append(add_simulator)
opencl.SELECTOR_HOOKS.append(simulator_class)
