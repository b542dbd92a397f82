"""cuda: NVIDIA GPUs through CuPy, kernels compiled at run time by NVRTC.

Renders each spec's C kernel in the ``cuda`` dialect (codegen.DIALECTS["cuda"]), compiles it
with NVRTC through ``cupy.cuda.compiler.compile_using_nvrtc`` and loads it as a
``cupy.cuda.function.Module``. ``cupy.ndarray`` in -> ``cupy.ndarray`` out with no host copy;
numpy in -> numpy out with one counted copy each way.

Why not ``cupy.RawModule(code=..., backend="nvrtc")``: RawModule compiles through CuPy's
``_compile_with_cache_cuda``, which appends ``-ftz=true`` after the caller's options (checked
against CuPy 14.2's cupy/cuda/compiler.py), so denormals would flush to zero whatever we ask.
``compile_using_nvrtc`` passes our options unchanged (it only adds the architecture and
``--device-as-default-execution-space``); the binary cache CuPy would have given us is kept
here instead (see ``module_key``).

Numerics (why each option in ``BASE_OPTIONS`` is what it is):

* ``--fmad=true`` is written out although it is NVRTC's default: a * b + c may contract to one
  FMA (one rounding instead of two). Every op's tolerance rule is derived for any summation
  order with or without FMA, and OpenCL C contracts by default too, so both dialects agree.
* no ``--use_fast_math``; ``--ftz=false --prec-div=true --prec-sqrt=true`` stated explicitly:
  ``exp`` stays the accurate libdevice function, division and sqrt are IEEE-rounded and
  denormals are kept, which the tolerance rules' underflow floors rely on.
* TF32 is never used by us: our kernels are plain FP32/FP64 FMA code and never call cuBLAS or
  tensor-core MMA. ``CUPY_TF32`` only affects CuPy's own matmul (a benchmark peer), which the
  benchmarks run with ``CUPY_TF32=0``.
* fp16 storage goes through ``cuda_fp16.h`` (``__half2float`` / ``__float2half_rn``: round to
  nearest even); bf16 is stored as 16-bit integers and converted by the shared preamble with
  round-to-nearest-even, so no ``cuda_bf16.h`` (and no sm_80 requirement) is needed.
* ``--std=c++14``: the kernels are C-style code; C++14 is accepted by every NVRTC >= 11 and by
  hipRTC, so one option set serves the compile-only check for old and new architectures.

Headers: NVRTC has no default include path, so ``-I`` names the first directory holding
``cuda_fp16.h``: $CUDA_PATH/$CUDA_HOME, the toolkit CuPy found, cuda-pathfinder, the
``nvidia-cuda-runtime-cu12`` wheel, /usr/local/cuda. ``compile_options()`` is also what the
compile-only NVRTC driver (portakern/toolchains/nvrtc.py) uses, so the check compiles what we run.

Caching: a module is identified by (rendered source, options, compute capability, NVRTC and
CuPy versions); it is cached per backend instance (one per device) in memory and, as the
compiled binary, on disk under $PORTAKERN_CUDA_CACHE (default ~/.cache/portakern/cuda; "off"
disables it).

bfloat16: CuPy >= 14 accepts ``ml_dtypes.bfloat16`` as an array dtype, so bf16 data stays bf16:
``cupy.ndarray`` (dtype bfloat16) in -> bf16 ``cupy.ndarray`` out; numpy bf16 in -> numpy bf16
out. On a CuPy that refuses the dtype, device storage is ``uint16`` holding the bf16 bit
patterns; numpy results are still returned as ``ml_dtypes.bfloat16`` (viewed, not converted),
and only ``portakern.to_backend(x_bf16, "cuda")`` hands out the raw ``uint16`` array.

AMD: the ``hip`` dialect renders for hipRTC, but a ROCm build of CuPy is reported unavailable
here until that path has been run on AMD hardware (docs/cuda.md); use the opencl backend there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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
from ..core.host import c_strides
from ..core.lru import LRUCache
from ..core.spec import Launch, storage_dtype
from .base import KERNEL_CACHE_SIZE, Availability, DeviceInfo, KernelBackend, bound_slots

try:  # optional dependency: guarded, with an install hint in the availability record
    import cupy as cp

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the machine
    cp = None  # type: ignore[assignment]  # cupy is optional: None says why not
    _IMPORT_ERROR = exc

INSTALL_FIX = "pip install 'portakern[cuda]'"
DRIVER_FIX = ("install an NVIDIA driver for CUDA 12.x (nvidia-smi must list the GPU) or choose "
              "another backend (see `portakern info`)")

# The options every module is compiled with (arch and include dirs are added per device).
# --diag-suppress=177: "function declared but never referenced" for the shared preamble's
# helpers (bf16 conversions in an fp32 kernel); it would bury real errors in every log.
BASE_OPTIONS: tuple[str, ...] = ("--std=c++14", "--fmad=true", "--ftz=false", "--prec-div=true",
                                 "--prec-sqrt=true", "--diag-suppress=177")
FORBIDDEN_OPTIONS: tuple[str, ...] = ("--use_fast_math", "-use_fast_math", "--ftz=true",
                                      "--prec-div=false", "--prec-sqrt=false")
_MARKER_HEADER = "cuda_fp16.h"


# --- compiler environment (no driver needed) -------------------------------------------
def _header_dirs_candidates() -> Iterable[str]:
    """Where cuda_fp16.h may live, most specific first: what the user set, then the headers
    that ship with the NVRTC wheels, then whatever toolkit CuPy or the system has."""
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root:
            yield os.path.join(root, "include")
    try:
        from cuda import pathfinder  # type: ignore[import-not-found]  # optional wheel

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            yield str(found)
    except Exception:
        pass
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            yield os.path.join(loc, "include")
    if cp is not None:
        try:
            root = cp.cuda.get_cuda_path()
        except Exception:
            root = None
        if root:
            yield os.path.join(root, "include")
    yield "/usr/local/cuda/include"


def find_cuda_include_dir() -> str | None:
    """The first directory holding cuda_fp16.h (NVRTC has no default include path)."""
    for d in _header_dirs_candidates():
        if os.path.isfile(os.path.join(d, _MARKER_HEADER)):
            return os.path.abspath(d)
    return None


def include_options() -> tuple[str, ...]:
    """``-I`` for the CUDA headers (empty when none are found: the compile log will say so)."""
    d = find_cuda_include_dir()
    return (f"-I{d}",) if d else ()


def compile_options() -> tuple[str, ...]:
    """The NVRTC options of every portakern CUDA module (architecture excluded)."""
    return BASE_OPTIONS + include_options()


def compile_error_message(what: str, log: str) -> str:
    """The headline of a CompileError, with the fix when the CUDA headers were not found."""
    if _MARKER_HEADER in log and ("cannot open" in log or "could not open" in log):
        return (f"{what}: NVRTC found no {_MARKER_HEADER}. Fix: pip install "
                "'portakern[cuda]' (nvidia-cuda-runtime-cu12 ships the headers) or set CUDA_PATH "
                "to a CUDA 12 toolkit")
    return what


def nvrtc_version() -> str:
    """NVRTC's version as 'major.minor' (raises if libnvrtc cannot be loaded)."""
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


# --- the backend --------------------------------------------------------------------------
class CudaBackend(KernelBackend):
    name = "cuda"
    dialect = "cuda"
    array_modules = ("cupy", "cupy_backends")
    install_hint = f"{INSTALL_FIX} and an NVIDIA driver for CUDA 12.x"

    @classmethod
    def _probe(cls) -> Availability:
        if cp is None:
            return Availability(False, f"cupy is not importable ({_IMPORT_ERROR})", INSTALL_FIX)
        rt = cp.cuda.runtime
        versions = {"cupy": cp.__version__}
        try:
            versions["nvrtc"] = nvrtc_version()
        except Exception as exc:
            versions["nvrtc"] = f"unavailable ({type(exc).__name__})"
        try:
            versions["cuda_runtime"] = _cuda_version(int(rt.runtimeGetVersion()))
        except Exception:
            pass
        driver = 0
        try:
            driver = int(rt.driverGetVersion())
        except Exception:
            pass
        if driver:
            versions["cuda_driver"] = _cuda_version(driver)
        if getattr(rt, "is_hip", False):
            return Availability(
                False, "this CuPy is built for ROCm/HIP; the hip dialect renders but has not been "
                "run on AMD hardware, so the cuda backend refuses it rather than guess",
                "use the opencl backend on AMD GPUs (see docs/cuda.md, AMD/HIP)", versions)
        try:
            count = int(rt.getDeviceCount())
        except Exception as exc:
            what = "no CUDA driver" if not driver else "the CUDA driver cannot be used"
            return Availability(False, f"{what} ({type(exc).__name__}: {exc})", DRIVER_FIX,
                                versions)
        if count == 0:
            return Availability(False, "no CUDA device: the driver reports 0 GPUs",
                                "check nvidia-smi and CUDA_VISIBLE_DEVICES", versions)
        devices = [cls._device_info(i, driver) for i in range(count)]
        return Availability(True, versions=versions, devices=devices)

    @staticmethod
    def _device_info(i: int, driver: int) -> DeviceInfo:
        p = cp.cuda.runtime.getDeviceProperties(i)
        name = p.get("name", b"")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        cc = f"{p.get('major', 0)}.{p.get('minor', 0)}"
        return DeviceInfo(
            index=i, name=name.strip(), kind="gpu", vendor="NVIDIA",
            driver=_cuda_version(driver) if driver else "",
            platform=f"CUDA {_cuda_version(int(cp.cuda.runtime.runtimeGetVersion()))}",
            fp64=True,
            max_work_group_size=int(p.get("maxThreadsPerBlock", 1024)),
            local_mem_bytes=int(p.get("sharedMemPerBlock", 48 * 1024)),
            compute_units=int(p.get("multiProcessorCount", 1)),
            extra={"compute_capability": cc,
                   # what codegen's matrix_units match (sm_80+: mma.sync)
                   "arch": "sm_" + cc.replace(".", ""),
                   "memory_bytes": int(p.get("totalGlobalMem", 0)),
                   "shared_mem_per_block": int(p.get("sharedMemPerBlock", 0)),
                   "shared_mem_per_block_optin": int(p.get("sharedMemPerBlockOptin", 0)),
                   "max_threads_per_block": int(p.get("maxThreadsPerBlock", 0)),
                   "max_block_dims": tuple(p.get("maxThreadsDim", ())),
                   "max_grid_dims": tuple(p.get("maxGridSize", ())),
                   "pci_bus_id": int(p.get("pciBusID", -1))})

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        av = cls.probe()
        if not av.available:
            return []
        return [(90, f"cuda:{d.index}",
                 f"CUDA GPU {d.name} (compute capability {d.extra.get('compute_capability')})")
                for d in av.devices]

    def _open(self, selector: str | None) -> DeviceInfo:
        av = self.probe()
        if not av.available:
            raise BackendUnavailable(f"cuda cannot run here: {av.reason}. Fix: {av.fix}.")
        listing = "; ".join(f"cuda:{d.index} = {d.name}" for d in av.devices)
        if selector in (None, ""):
            idx = 0
        else:
            try:
                idx = int(selector)
            except ValueError:
                raise UnknownBackendError(
                    f"cuda device selector must be an index, e.g. cuda:0; got cuda:{selector}. "
                    f"Devices: {listing}") from None
        if not 0 <= idx < len(av.devices):
            raise BackendUnavailable(f"cuda:{idx} does not exist; this machine has "
                                     f"{len(av.devices)} CUDA device(s): {listing}")
        self._cp_device = cp.cuda.Device(idx)
        self._options = compile_options()
        # loaded modules by module_key: two plans rendering the same source share one module.
        # Bounded like _kernels (which holds what calls use): an unbounded dict kept every
        # module loaded after _kernels evicted it; an evicted module is reloaded from disk.
        self._modules: LRUCache = LRUCache(KERNEL_CACHE_SIZE)
        self._bf16_native = True  # cleared if this CuPy refuses ml_dtypes.bfloat16
        return av.devices[idx]

    @property
    def compute_capability(self) -> str:
        return str(self.device.extra.get("compute_capability", ""))

    # --- arrays --------------------------------------------------------------------------
    def is_native(self, x: object) -> bool:
        return cp is not None and isinstance(x, cp.ndarray)

    def prepare_native(self, name: str, x: Any) -> Any:
        dev = int(x.device.id)
        if dev != self.device.index:
            raise BackendUnavailable(
                f"argument {name!r} lives on cuda:{dev}, but this call runs on {self.describe()}; "
                f"pass backend='cuda:{dev}' or copy it over inside `with cupy.cuda.Device("
                f"{self.device.index}): x = cupy.asarray(x)`.")
        if not x.flags.c_contiguous:
            raise InvalidArgumentError(
                f"argument {name!r} is a non-contiguous cupy view (shape {x.shape}, strides "
                f"{x.strides}); expected a C-contiguous array. Pass cupy.ascontiguousarray(x).")
        return x

    def _free_total(self) -> str:
        try:
            with self._cp_device:
                free, total = cp.cuda.runtime.memGetInfo()
            return f"{free} of {total} bytes free"
        except Exception:
            return "free memory unknown"

    def _oom(self, what: str, nbytes: int, exc: Exception) -> DeviceMemoryError:
        return DeviceMemoryError(
            f"cannot allocate {nbytes} bytes for {what} on {self.describe()} "
            f"({self._free_total()}; CuPy's pool holds "
            f"{cp.get_default_memory_pool().total_bytes()} bytes): {exc}. Fix: free arrays or "
            "call cupy.get_default_memory_pool().free_all_blocks(), or split the call.")

    def _device_dtype(self, st: np.dtype) -> np.dtype:
        if st == dtypes.bfloat16 and not self._bf16_native:
            return np.dtype(np.uint16)
        return st

    def _allocate(self, fn: Any, shape: tuple[int, ...], dtype: str) -> Any:
        st = storage_dtype(dtype)  # a float dtype's storage, or int32 (index buffers)
        nbytes = int(np.prod(shape)) * st.itemsize
        with self._cp_device:
            try:
                try:
                    return fn(shape, self._device_dtype(st))
                except (TypeError, ValueError):
                    if st != dtypes.bfloat16 or not self._bf16_native:
                        raise
                    self._bf16_native = False  # old CuPy: keep bf16 as its 16-bit patterns
                    return fn(shape, np.dtype(np.uint16))
            except cp.cuda.memory.OutOfMemoryError as exc:
                raise self._oom(f"an array {shape} {dtype}", nbytes, exc) from None

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._allocate(cp.empty, shape, dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self._allocate(cp.zeros, shape, dtype)

    def to_native(self, x: np.ndarray) -> Any:
        self.transfers.add("h2d", x.nbytes)
        with self._cp_device:
            try:
                if x.dtype == dtypes.bfloat16 and not self._bf16_native:
                    return cp.asarray(x.view(np.uint16))
                try:
                    return cp.asarray(x)
                except (TypeError, ValueError):
                    if x.dtype != dtypes.bfloat16:
                        raise
                    self._bf16_native = False
                    return cp.asarray(x.view(np.uint16))
            except cp.cuda.memory.OutOfMemoryError as exc:
                raise self._oom(f"an input {x.shape} {x.dtype}", x.nbytes, exc) from None

    def to_numpy(self, x: Any) -> np.ndarray:
        self.transfers.add("d2h", x.nbytes)
        with self._cp_device:
            return cp.asnumpy(x)

    def from_foreign(self, x: Any) -> Any:
        """Zero-copy import of another framework's CUDA array via DLPack; None if not CUDA."""
        if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            return None
        try:
            dev_type, dev_id = x.__dlpack_device__()
        except Exception:
            return None
        if int(dev_type) != 2 or int(dev_id) != self.device.index:  # 2 = kDLCUDA
            return None
        with self._cp_device:
            return cp.from_dlpack(x)

    def synchronize(self) -> None:
        self._cp_device.synchronize()

    def device_scope(self) -> Any:
        """Every call runs with this device current (CuPy allocates and launches there)."""
        return self._cp_device

    # --- kernels -------------------------------------------------------------------------
    def compile(self, source: str, entry_points: tuple[str, ...]) -> dict[str, Any]:
        """NVRTC -> cubin (or PTX) -> cuModuleLoadData; cached in memory and on disk."""
        options = self._options
        key = module_key(source, options, self.compute_capability,
                         f"{_safe_nvrtc_version()} driver {self.device.driver}", cp.__version__)
        got = self._modules.get(key)
        if got is not None and all(n in got for n in entry_points):
            return got
        with self._cp_device:
            binary = _disk_cache_load(key)
            if binary is None:
                try:
                    # compile_using_nvrtc, not RawModule: RawModule appends -ftz=true (CuPy's
                    # _compile_with_cache_cuda), flushing denormals behind our options' back.
                    out = cp.cuda.compiler.compile_using_nvrtc(source, options, None,
                                                                "portakern.cu")
                except cp.cuda.compiler.CompileException as exc:
                    log = exc.get_message()
                    raise CompileError(
                        compile_error_message(
                            f"NVRTC failed to compile the kernel for compute capability "
                            f"{self.compute_capability} (entry points {', '.join(entry_points)})",
                            log),
                        source=source, log=log, options=options,
                        device=self.describe()) from None
                binary = out[0] if isinstance(out, tuple) else out
                _disk_cache_store(key, binary)
            module = cp.cuda.function.Module()
            module.load(binary)
            kernels = {name: _Kernel.of(module, name) for name in entry_points}
        self._modules[key] = kernels
        return kernels

    def buffer_arg(self, x: Any) -> Any:
        return x

    def kernel_limits(self, kernel: Any) -> tuple[int | None, int | None]:
        """The compiled function's static shared memory and its max threads per block."""
        shared, most = kernel.shared_bytes, kernel.max_threads
        return (int(shared) if shared else None), (int(most) if most else None)

    def program(self, kernel: Any, launch: Launch, template: Sequence[Any],
                slots: Sequence[int] | None = None) -> Any:
        """The cupy Function with its grid, block, scalar arguments and buffer slots bound
        once; a call fills in the buffers and launches with this device made current."""
        threads = launch.local[0] * launch.local[1] * launch.local[2]
        if kernel.max_threads and threads > kernel.max_threads:
            raise InvalidArgumentError(
                f"kernel {launch.kernel!r}: a block of {threads} threads {launch.local} exceeds "
                f"the {kernel.max_threads} this compiled kernel allows on {self.describe()} "
                f"({kernel.num_regs} registers per thread); lower the work-group tunables.")
        return _CudaProgram(kernel.fn, launch, template, bound_slots(template, slots),
                            self._cp_device, self.describe())

    def argument_checker(self, shape: tuple[int, ...], dtype: Any, writable: bool = False
                         ) -> Any:
        """A CuPy array of exactly this shape's C strides and this dtype, on this device, is
        its own kernel argument (``buffer_arg``; a contiguous view passes its own pointer);
        anything else (another device, strided, a
        foreign ``__cuda_array_interface__`` array) takes the checked path. ``out=`` arrays
        (``writable``) always take the checked path: CuPy arrays compare elementwise, not by
        memory, so the runner's aliasing test could not use them; its full test (by device
        pointer, ``memory_span``) runs there."""
        if writable:
            return None
        if cp is None or not int(np.prod(shape, dtype=np.int64)):
            return None
        st = self._device_dtype(np.dtype(dtype))
        strides, cls, dev = c_strides(shape, st.itemsize), cp.ndarray, self.device.index

        def check(x: Any) -> Any:
            if x.__class__ is cls and x.strides == strides and x.dtype == st \
                    and x.device.id == dev:
                return x
            return None

        return check

    def raw_launcher(self, kernel: Any, launch: Launch, template: Sequence[Any],
                     buffers: Mapping[str, Any]) -> Any:
        fn, grid, block = kernel.fn, tuple(launch.groups), tuple(launch.local)
        argv = tuple(buffers[a] if a.__class__ is str else a for a in template)

        def launch_raw() -> None:  # the cupy Function call; the caller makes the device current
            fn(grid, block, argv)

        return launch_raw


class _CudaProgram:
    """One CUDA launch: the scalars sit in an argument list made once; a call puts the
    buffers in their positions and calls the cupy Function inside the device's scope."""

    __slots__ = ("fn", "launch", "grid", "block", "args", "pairs", "device", "label")

    def __init__(self, fn: Any, launch: Launch, template: Sequence[Any],
                 pairs: tuple[tuple[int, int], ...], device: Any, label: str) -> None:
        self.fn, self.launch, self.device, self.label = fn, launch, device, label
        self.grid, self.block = tuple(launch.groups), tuple(launch.local)
        self.args = list(template)
        self.pairs = pairs  # (argument position, handle index) per buffer

    def __call__(self, handles: Sequence[Any]) -> None:
        args = self.args.copy()
        for i, s in self.pairs:
            args[i] = handles[s]
        with self.device:
            try:
                self.fn(self.grid, self.block, tuple(args))
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"portakern: launching {self.launch.kernel!r} with grid "
                                 f"{self.launch.groups} and block {self.launch.local} on "
                                 f"{self.label}")
                raise


@dataclass(frozen=True)
class _Kernel:
    """A loaded entry point and the limits the driver reports for it."""

    fn: Any
    max_threads: int
    num_regs: int
    shared_bytes: int

    @classmethod
    def of(cls, module: Any, name: str) -> _Kernel:
        fn = module.get_function(name)
        drv = cp.cuda.driver

        def attr(which: str) -> int:
            try:
                return int(drv.funcGetAttribute(getattr(drv, which), fn.ptr))
            except Exception:
                return 0

        return cls(fn, attr("CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
                   attr("CU_FUNC_ATTRIBUTE_NUM_REGS"), attr("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"))


def module_key(source: str, options: tuple[str, ...], cc: str, nvrtc: str, cupy_version: str
               ) -> str:
    """What identifies a compiled module: source, options, architecture, compiler (and driver:
    CuPy emits PTX instead of a cubin when the device is newer than NVRTC) versions."""
    h = hashlib.sha256()
    for part in (source, "\0".join(options), cc, nvrtc, cupy_version):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


def _cache_dir() -> str | None:
    """PORTAKERN_CUDA_CACHE (a directory, or off); default <PORTAKERN_CACHE_DIR root>/cuda.
    CuPy's own kernel cache (its matmul, used as a benchmark peer) follows it unless
    CUPY_CACHE_DIR is set: every cache portakern causes lives under one root."""
    if settings.Cache.cuda.text() is not None:
        got = settings.cache.cuda
    else:
        from ..core.cache import cache_root

        got = str(cache_root() / "cuda")
    if got is not None:
        os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(got, "cupy"))
    return got


def _disk_cache_load(key: str) -> bytes | None:
    d = _cache_dir()
    if d is None:
        return None
    try:
        with open(os.path.join(d, key + ".bin"), "rb") as f:
            return f.read() or None
    except OSError:
        return None


def _disk_cache_store(key: str, binary: bytes) -> None:
    """Atomic write (temp file + rename): concurrent processes never read half a module."""
    d = _cache_dir()
    if d is None:
        return
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(binary))
        os.replace(tmp, os.path.join(d, key + ".bin"))
    except OSError:
        pass  # a cache that cannot be written only costs a recompile


def _safe_nvrtc_version() -> str:
    try:
        return nvrtc_version()
    except Exception:
        return "?"


COMPUTE_ARCHS: tuple[str, ...] = ("70", "80", "90")  # the compile-only check's default


def normalize_arch(text: str | int) -> str:
    """'80', 'compute_80', 'sm_80', '8.0' -> '80'; refuse anything else with the expected form."""
    s = str(text).strip().lower()
    for prefix in ("compute_", "sm_"):
        if s.startswith(prefix):
            s = s[len(prefix):]
    s = s.replace(".", "")
    if not s.isdigit() or not 2 <= len(s) <= 3:
        raise InvalidArgumentError(
            f"CUDA architecture {text!r} is not understood; expected a compute capability like "
            "'80', 'compute_80', 'sm_80' or '8.0'.")
    return s
