"""Which OpenCL devices this machine has and what they are called, shared by the opencl
backend (opencl.py) and its simulator device (oclgrind.py).

Devices are listed through the ICD loader, in its order (``opencl:0``, ``opencl:1``, ...), and
named by their platform (``opencl:pocl``, ``opencl:intel``, ``opencl:oclgrind``): an index
moves when a platform is added, a name does not. The default device follows one stated rule
(``DEFAULT_RULE``). OpenCL drivers do not survive fork(): ``FORK_GUARD``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..core import settings
from ..core.errors import BackendUnavailable, ContextMismatchError, UnknownBackendError
from .base import Availability, DeviceInfo, ForkGuard

try:  # optional dependency: guarded, with an install hint in the availability record
    import pyopencl as cl
    import pyopencl.array as cla

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the machine
    cl = cla = None  # type: ignore[assignment]  # pyopencl is optional
    _IMPORT_ERROR = exc

# OpenCL status codes that mean "this allocation cannot be had", whatever exception class
# pyopencl maps them to: MEM_OBJECT_ALLOCATION_FAILURE (MemoryError), OUT_OF_RESOURCES and
# OUT_OF_HOST_MEMORY (RuntimeError), INVALID_BUFFER_SIZE (LogicError: more than the device's
# max_mem_alloc_size, e.g. an output that fits 32-bit indexing but not one buffer).
_ALLOCATION_FAILURES = frozenset((-4, -5, -6, -61))


def is_allocation_failure(exc: BaseException) -> bool:
    if cl is None or not isinstance(exc, cl.Error):
        return False
    if isinstance(exc, cl.MemoryError):
        return True
    try:
        return int(exc.code) in _ALLOCATION_FAILURES
    except Exception:  # an Error built by hand has no status record
        return False


def device_kind(dev: Any) -> str:
    t = dev.type
    if t & cl.device_type.GPU:
        return "gpu"
    if t & cl.device_type.CPU:
        return "cpu"
    return "accelerator"


# OpenCL drivers do not survive fork() (PoCL's worker threads are not copied into the
# child): after this process has listed its platforms, a forked child refuses every device
# operation (base.ForkGuard).
FORK_GUARD = ForkGuard("OpenCL", (
    "to_native", "to_numpy", "empty", "zeros", "program", "buffer_arg", "argument_checker",
    "held_queue", "raw_launcher", "synchronize", "prepare_native", "compile",
    "free_pooled_memory", "fill_zero", "kernels_for"))

# Short, stable device names by platform (``opencl:pocl``, ``opencl:intel``), beside the
# indices, which change when a platform is added: (platform name starts with, alias). A
# platform not listed is named by the first word of its name; a second device of one
# platform adds its position (``pocl1``).
PLATFORM_ALIASES: tuple[tuple[str, str], ...] = (
    ("portable computing language", "pocl"), ("intel(r) opencl", "intel"),
    ("intel(r) fpga", "intelfpga"), ("nvidia", "nvidia"), ("amd accelerated", "amd"),
    ("oclgrind", "oclgrind"), ("clover", "clover"), ("rusticl", "rusticl"))
# Automatic choice among the CPU implementations (after any GPU): PoCL, the embedded default
# the benchmarks are quoted on, then the others in the ICD loader's order.
PREFERRED_CPU_ALIASES: tuple[str, ...] = ("pocl",)


def platform_alias(platform_name: str) -> str:
    low = platform_name.strip().lower()
    got = next((alias for start, alias in PLATFORM_ALIASES if low.startswith(start)), "")
    return got or re.sub(r"[^a-z0-9]", "", (low.split() or ["opencl"])[0]) or "opencl"


# --- ICD libraries portakern loads itself ------------------------------------------------
# An OpenCL implementation is normally found by the ICD loader through a file in
# /etc/OpenCL/vendors (root) or $OCL_ICD_VENDORS (set before the first OpenCL call). A library
# installed by pip into this environment (Intel's CPU runtime: `pip install
# 'portakern[intel]'` puts libintelocl.so in <venv>/lib) is also loaded directly, as the
# simulator's is: its platform is asked for through the ICD entry point
# clIcdGetPlatformIDsKHR and handed to PyOpenCL, whose calls then dispatch through the
# loader like any platform's. Nothing is written anywhere; a platform the loader already
# lists (scripts/setup.sh registers Intel's as root) is not loaded twice.
VENV_ICDS: tuple[str, ...] = ("libintelocl.so",)  # looked for in <sys.prefix>/lib
_DIRECT: dict[str, list[Any]] = {}  # library path -> its platforms, loaded once per process
_LIBRARIES: list[Any] = []  # loaded libraries stay loaded: their platforms live in them
ICD_PROBLEMS: dict[str, str] = {}  # library path -> why it gave no platform (portakern info)


def extra_icds() -> list[str]:
    """The ICD libraries to load directly: $PORTAKERN_OPENCL_ICDS (paths separated by ':',
    or off), else those of VENV_ICDS in this environment's lib/."""
    given = settings.opencl.icds
    if given is not None:
        return [] if given.strip().lower() in settings.OFF else \
            [x for x in given.split(os.pathsep) if x]
    lib = os.path.join(sys.prefix, "lib")
    return [os.path.join(lib, n) for n in VENV_ICDS if os.path.isfile(os.path.join(lib, n))]


def load_icd_platforms(path: str) -> list[Any]:
    """The pyopencl Platforms of one ICD library, loaded with ctypes (once per process).
    OSError when it is not loadable or not an ICD: the loader's or our message."""
    if path in _DIRECT:
        return _DIRECT[path]
    lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_LOCAL", 0))
    proto = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_uint32))
    try:
        get_ids = proto(("clIcdGetPlatformIDsKHR", lib))
    except AttributeError:  # not exported (Intel's): reached through the extension query
        query = lib.clGetExtensionFunctionAddress
        query.restype, query.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
        addr = query(b"clIcdGetPlatformIDsKHR")
        if not addr:
            raise OSError(f"{path} is not an OpenCL ICD (no clIcdGetPlatformIDsKHR)") from None
        get_ids = proto(addr)
    n = ctypes.c_uint32(0)
    if get_ids(0, None, ctypes.byref(n)) != 0 or not n.value:
        raise OSError(f"{path} lists no OpenCL platform")
    ids = (ctypes.c_void_p * n.value)()
    if get_ids(n.value, ids, None) != 0:
        raise OSError(f"{path}: clIcdGetPlatformIDsKHR failed")
    _LIBRARIES.append(lib)
    _DIRECT[path] = [cl.Platform.from_int_ptr(int(i)) for i in ids if i]
    return _DIRECT[path]


def all_devices() -> list[tuple[Any, Any]]:
    """(platform, device) of every device: the ICD loader's platforms in its order, then
    those of ``extra_icds`` the loader does not list. cl.Error when there is none at all."""
    FORK_GUARD.check("OpenCL")
    try:
        platforms = list(cl.get_platforms())
    except cl.Error:  # no registered platform (PLATFORM_NOT_FOUND_KHR)
        platforms = []
    listed = {plat.name.strip() for plat in platforms}
    for path in extra_icds():
        try:
            platforms += [p for p in load_icd_platforms(path) if p.name.strip() not in listed]
        except (OSError, cl.Error) as exc:
            ICD_PROBLEMS[path] = f"{type(exc).__name__}: {exc}"
    if not platforms:
        raise cl.Error("no OpenCL platform: the ICD loader lists none and no ICD library "
                       "was loaded directly")
    out = []
    for plat in platforms:
        try:
            devs = plat.get_devices()
        except cl.Error:
            continue
        out.extend((plat, d) for d in devs)
    return out


DEFAULT_RULE = ("the default OpenCL device: the first GPU, else the first accelerator, else "
                "the first CPU implementation in the order PoCL, then the ICD loader's; "
                "never the simulator")


def default_device(devices: Sequence[DeviceInfo]) -> DeviceInfo | None:
    """The device ``opencl`` with no device names (DEFAULT_RULE); None: only the simulator."""
    real = [d for d in devices if not d.extra.get("simulator")]

    def rank(d: DeviceInfo) -> tuple[int, int, int]:
        kind = {"gpu": 0, "accelerator": 1}.get(d.kind, 2)
        alias = str(d.extra.get("alias", ""))
        pref = PREFERRED_CPU_ALIASES.index(alias) if alias in PREFERRED_CPU_ALIASES else \
            len(PREFERRED_CPU_ALIASES)
        return kind, pref if kind == 2 else 0, d.index

    return min(real, key=rank) if real else None


def select_device(devices: Sequence[DeviceInfo], selector: str | None) -> DeviceInfo:
    """The device a selector names: none (the default device), an index or an alias."""
    listing = "; ".join(f"opencl:{d.index} = opencl:{d.extra.get('alias', '?')} = {d.name}"
                        for d in devices)
    if selector in (None, ""):
        got = default_device(devices)
        if got is None:
            raise BackendUnavailable("the only OpenCL device here is the Oclgrind simulator;"
                                     " select it by name: opencl:oclgrind")
        return got
    if selector.isdigit():  # int() alone would take '0_0' and ' 0'
        idx = int(selector)
        if not 0 <= idx < len(devices):
            raise BackendUnavailable(f"opencl:{idx} does not exist; this machine has "
                                     f"{len(devices)} OpenCL device(s): {listing}")
        return devices[idx]
    named = [d for d in devices if d.extra.get("alias") == selector]
    if not named:
        raise UnknownBackendError(f"opencl:{selector} names no OpenCL device; expected an "
                                  f"index or a platform's name. Devices: {listing}")
    return named[0]


def device_of_array(x: Any, devices: Sequence[DeviceInfo]) -> str | None:
    """The index (as a selector) of the device whose context holds a pyopencl array, by its
    cl_device_id; None when it is none of ``devices``."""
    try:
        ptr = x.context.devices[0].int_ptr
    except Exception:
        return None
    return next((str(d.index) for d in devices if d.extra.get("device_id") == ptr), None)


def context_error(backend: Any, name: str, x: Any) -> ContextMismatchError:
    """An array of another context passed to ``backend``: both contexts named (their
    devices, and the portakern backend that owns the array's context when there is one),
    and the fix."""
    from .base import _INSTANCES

    def devices(ctx: Any) -> str:
        try:
            return ", ".join(d.name.strip() for d in ctx.devices)
        except Exception:
            return "?"

    owner = next((i for i in list(_INSTANCES) if i.name == "opencl" and i is not backend
                  and getattr(i, "ctx", None) == x.context), None)
    theirs = (f"the context of {owner.label} ({devices(x.context)})" if owner is not None
              else f"a context made outside portakern (device {devices(x.context)})")
    move = (f"portakern.to_backend(x.get(), {backend.label!r})" if owner is None else
            f"backend={owner.label!r} to run where it lives, or "
            f"portakern.to_backend(x.get(), {backend.label!r}) to move it")
    return ContextMismatchError(
        f"argument {name!r} lives in {theirs}, but this call runs on {backend.label} "
        f"({devices(backend.ctx)}, context of portakern's {backend.label} backend). A kernel "
        f"can only use buffers of its own context. Fix: pass {move}; arrays made by "
        "portakern.to_backend(x, 'opencl:N') are in that device's one shared context.")


@functools.lru_cache(maxsize=4)
def host_vector_bits(cpuinfo: str = "/proc/cpuinfo") -> int:
    """The host CPU's widest float vector in bits from its flags (avx512f 512, avx/avx2 256,
    else 0: unknown). Why: a CPU OpenCL runtime may report its own preferred width as the
    native one (Intel's runtime says 8 floats on AVX2; whether it says 16 on every AVX-512
    part is not shown here), and the CPU schedules must not take AVX2's smaller blocks on an
    AVX-512 machine."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")),
                         [])
    except OSError:
        return 0
    return 512 if "avx512f" in flags else 256 if ("avx2" in flags or "avx" in flags) else 0


def vector_bits(dev: Any, kind: str) -> int:
    """A device's widest native float vector in bits: OpenCL's native_vector_width_float,
    for a CPU device raised to what the host's flags say (host_vector_bits)."""
    bits = 32 * int(getattr(dev, "native_vector_width_float", 0) or 0)
    return max(bits, host_vector_bits()) if kind == "cpu" else bits


def probe_devices() -> Availability:
    """Every OpenCL device the ICD loader lists, each with its alias; or why there is none."""
    if cl is None:
        return Availability(False, f"pyopencl is not importable ({_IMPORT_ERROR})",
                            "pip install 'portakern[opencl]'")
    versions = {"pyopencl": cl.VERSION_TEXT}
    try:
        pairs = all_devices()
        versions.update({f"icd {os.path.basename(k)}": f"unusable ({v})"
                         for k, v in ICD_PROBLEMS.items()})
    except cl.Error as exc:
        return Availability(False, f"no OpenCL platform found ({exc})",
                            "apt-get install pocl-opencl-icd (CPU), or install your GPU "
                            "vendor's OpenCL driver (ICD)", versions)
    if not pairs:
        return Availability(False, "OpenCL platforms exist but expose no device",
                            "check the driver installation (clinfo lists devices)", versions)
    devices: list[DeviceInfo] = []
    seen: dict[str, int] = {}  # alias -> devices of it so far
    for i, (plat, d) in enumerate(pairs):
        alias = platform_alias(plat.name)
        n = seen[alias] = seen.get(alias, -1) + 1
        devices.append(DeviceInfo(
            index=i, name=d.name.strip(), kind=device_kind(d), vendor=d.vendor.strip(),
            driver=d.driver_version, platform=f"{plat.name} {plat.version}".strip(),
            fp64="cl_khr_fp64" in d.extensions,
            max_work_group_size=int(d.max_work_group_size),
            local_mem_bytes=int(d.local_mem_size), compute_units=int(d.max_compute_units),
            extra={"opencl_c": d.opencl_c_version, "alias": alias + (str(n) if n else ""),
                   "device_id": d.int_ptr, "fp16_arith": "cl_khr_fp16" in d.extensions,
                   # the widest native float vector, in bits (AVX2 256, AVX-512 512):
                   # Backend.schedule_class picks the CPU schedules' register blocks by it
                   "vector_bits": vector_bits(d, device_kind(d)),
                   # what codegen's matrix_units match: the matrix extensions it offers
                   "arch": " ".join(e for e in d.extensions.split() if "matrix" in e)}))
    return Availability(True, versions=versions, devices=devices)


def cache_dir() -> str | None:
    """PyOpenCL's binary cache directory (None = PyOpenCL's default under the user cache dir).

    ``$PORTAKERN_OPENCL_CACHE`` if set; else, when ``$PORTAKERN_CACHE_DIR`` is set (the root
    of every portakern cache), a ``pyopencl`` directory under it. Without either, PyOpenCL's
    own default, except without a home directory ($HOME unset, no passwd entry, no
    XDG_CACHE_HOME), where PyOpenCL's default would be a literal '~' directory under the
    working directory: then a ``pyopencl`` directory under portakern's cache root too (with
    its fallback and warning)."""
    env = settings.cache.opencl
    if env:
        return env
    if not settings.cache.dir:
        if os.environ.get("HOME") or os.environ.get("XDG_CACHE_HOME"):
            return None
        if os.path.expanduser("~") != "~":
            return None
    from ..core.cache import cache_root

    return str(cache_root() / "pyopencl")
