"""jax: each op's array-API semantics lowered by XLA under jax.jit, plus Pallas kernels.

Selectors: ``jax`` (the default device: the first accelerator, else the CPU), ``jax:cpu``,
``jax:gpu``, ``jax:tpu`` (the first device of that kind), ``jax:N`` (index N of this backend's
device list: ``jax.devices()`` first, then the CPU devices when the default platform is an
accelerator), and ``jax:pallas`` (the Pallas path on the default device; ``jax:pallas_cpu``,
``jax:pallas_N`` pick another). On the Pallas path an op with a Pallas kernel (``spec.pallas``:
attention) runs it — through Pallas' interpreter when the device is a CPU — and every other op
uses the XLA path.

Why this shape: the semantics are the single source of truth, so lowering them with
jax.numpy gives every op on CPU, GPU and TPU for free, and makes every op traceable: inside
``jax.jit``, ``jax.vmap``, ``jax.grad`` and ``shard_map`` our inputs are tracers, which this
backend accepts as native arrays, so portakern composes with JAX's transformations and its
distributed runtime instead of reinventing them.

Numerics (pinned, so results do not depend on the chip's default matmul mode): float16 and
bfloat16 are widened to float32 before any arithmetic and the result is rounded back to the
input dtype; every matmul runs with precision=HIGHEST and preferred_element_type = the compute
dtype, so TPUs never drop to one-pass bf16 and GPUs never to TF32. float64 needs
``jax_enable_x64`` (off by default in JAX); without it float64 is not a supported dtype.

Arrays: numpy in -> numpy out (one counted upload per operand, one counted download);
``jax.Array`` (or a tracer) in -> ``jax.Array`` out with no host copy. jax Arrays run where
they live (their device or sharding decides, as in JAX itself); the selected device decides
where numpy inputs are placed.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core import dtypes, settings
from ..core.errors import (
    BackendUnavailable,
    DeviceMemoryError,
    InvalidArgumentError,
    UnknownBackendError,
    UnsupportedDTypeError,
)
from ..core.host import native_byte_order
from ..core.lru import LRUCache
from ..core.spec import KernelSpec, Problem, storage_dtype
from .base import (
    FUNCTION_CACHE_SIZE,
    ArrayBackend,
    Availability,
    DeviceInfo,
)

try:  # optional dependency: guarded, with an install hint in the availability record
    import jax
    import jax.numpy as jnp
    from jax import lax

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the machine
    jax = jnp = lax = None  # type: ignore[assignment]  # None: jax is not installed
    _IMPORT_ERROR = exc

INSTALL_HINT = "pip install 'portakern[jax]'"
_KINDS = ("cpu", "gpu", "tpu")
_KIND_FIX = {
    "gpu": "install a CUDA or ROCm build of jax (pip install -U 'jax[cuda12]') on a machine "
           "with a GPU, or use jax:cpu",
    "tpu": "run on a TPU VM with pip install -U 'jax[tpu]', or use jax:cpu",
    "cpu": "the CPU platform is always present in jaxlib; check JAX_PLATFORMS",
}


def _kind(platform: str) -> str:
    p = platform.lower()
    if p in ("gpu", "cuda", "rocm"):
        return "gpu"
    if p in ("cpu", "tpu"):
        return p
    return "accelerator"


def _device_list() -> list[Any]:
    """jax.devices() (default platform) followed by the CPU devices if the default isn't CPU."""
    devs = list(jax.devices())
    if devs and devs[0].platform != "cpu":
        try:
            devs += [d for d in jax.devices("cpu") if d not in devs]
        except RuntimeError:  # JAX_PLATFORMS may exclude the CPU
            pass
    return devs


def x64_enabled() -> bool:
    """Whether jax keeps float64 (``jax_enable_x64``); read at call time, it can change."""
    return bool(jax is not None and jax.config.read("jax_enable_x64"))


def _is_tracer(x: object) -> bool:
    return jax is not None and isinstance(x, jax.core.Tracer)


class _HighestPrecisionNumpy:
    """jax.numpy for the semantics, except that ``matmul`` pins precision.

    ``precision=HIGHEST`` keeps float32 products exact on TPUs (no one-pass bf16) and on
    GPUs (no TF32); ``preferred_element_type`` keeps accumulation in the compute dtype.
    """

    __name__ = "portakern.backend.jax.xp"

    def __getattr__(self, name: str) -> Any:
        return getattr(jnp, name)

    @staticmethod
    def matmul(a: Any, b: Any) -> Any:
        return jnp.matmul(a, b, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.result_type(a, b))


XP = _HighestPrecisionNumpy()


def _operand(x: Any, kind: str, compute: Any) -> Any:
    """An operand as the semantics see it: bool masks as bool, int32 index tables as int32,
    float operands in the compute dtype."""
    if x is None:
        return None
    if kind == "bool":
        return x.astype(bool)
    if kind == "int32":
        return x.astype(jnp.int32)
    return x.astype(compute)


def _cast_result(res: Any, storage: Any, out_dtypes: tuple[str, ...] | None) -> Any:
    """The semantics' result in the output dtype; several outputs (``out_dtypes``, from
    Problem.outputs): a tuple, each in its own dtype."""
    if out_dtypes is None:
        return res.astype(storage)
    return tuple(r.astype(storage_dtype(dt)) for r, dt in zip(res, out_dtypes, strict=True))


def lower_semantics(spec: KernelSpec, params: Mapping[str, Any], dtype: str,
                    out_dtypes: tuple[str, ...] | None = None) -> Any:
    """``f(*operands)``: spec.semantics with jax.numpy in the compute dtype, cast back.

    Not jitted here, so the Pallas path can reuse it as the reference whose VJP is its
    backward pass.
    """
    info = dtypes.info(dtype)
    compute, storage = np.dtype(info.compute), np.dtype(info.storage)
    kinds = tuple(o.kind for o in spec.operands)
    static = dict(params)

    def lowered(*arrays: Any) -> Any:
        args = [_operand(x, kind, compute) for x, kind in zip(arrays, kinds, strict=True)]
        return _cast_result(spec.semantics(XP, *args, **static), storage, out_dtypes)

    return lowered


def lower_semantics_traced(spec: KernelSpec, params: Mapping[str, Any], traced: tuple[str, ...],
                           dtype: str, out_dtypes: tuple[str, ...] | None = None) -> Any:
    """``f(*operands, *values)``: like ``lower_semantics``, with the parameters named in
    ``traced`` passed as (traced) arguments after the operands instead of baked in as
    constants: one compiled function serves every ``scale`` or ``eps``."""
    info = dtypes.info(dtype)
    compute, storage = np.dtype(info.compute), np.dtype(info.storage)
    kinds = tuple(o.kind for o in spec.operands)
    n = len(kinds)
    static = {k: v for k, v in params.items() if k not in traced}

    def lowered(*arrays: Any) -> Any:
        args = [_operand(x, kind, compute) for x, kind in zip(arrays[:n], kinds, strict=True)]
        kw = dict(static)
        kw.update(zip(traced, arrays[n:]))
        return _cast_result(spec.semantics(XP, *args, **kw), storage, out_dtypes)

    return lowered


def traced_params(spec: KernelSpec, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The parameters that are traced arguments rather than compile-time constants: every
    real-valued (float) parameter, such as attention's ``scale`` and rmsnorm's ``eps``, unless
    the spec lists it in ``static_params`` (an optional KernelSpec attribute) or its
    semantics turned out to need a concrete value (then every parameter of it is static)."""
    if spec.token in _STATIC_SPECS:
        return ()
    static = getattr(spec, "static_params", ()) or ()
    return tuple(k for k, v in params.items()
                 if isinstance(v, float) and k not in static)


_STATIC_SPECS: set[int] = set()  # spec tokens whose semantics branch on a parameter's value
# Each jitted function may hold one executable per input shape; beyond this many in all (per
# backend instance), least recently used functions are dropped with their executables.
EXECUTABLE_CACHE_SIZE = settings.jax.executable_cache_size


def _freeze(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                        for k, v in params.items()))


class JaxBackend(ArrayBackend):
    name = "jax"
    array_modules = ("jax", "jaxlib")
    install_hint = INSTALL_HINT

    # --- probing --------------------------------------------------------------------------
    @classmethod
    def _probe(cls) -> Availability:
        if jax is None:
            return Availability(False, f"jax is not importable ({_IMPORT_ERROR})", INSTALL_HINT)
        import jaxlib

        versions = {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?")}
        try:
            devs = _device_list()
        except RuntimeError as exc:
            return Availability(False, f"jax found no usable platform ({exc})",
                                "check JAX_PLATFORMS and the jaxlib/plugin installation",
                                versions)
        if not devs:
            return Availability(False, "jax.devices() is empty",
                                "check JAX_PLATFORMS and the jaxlib/plugin installation",
                                versions)
        infos = []
        for i, d in enumerate(devs):
            kind = _kind(d.platform)
            try:
                pv = str(d.client.platform_version).strip()
            except Exception:
                pv = ""
            plat = d.platform if pv in ("", d.platform) else f"{d.platform} ({pv})"
            vendor = ("Google" if kind == "tpu" else "AMD" if "rocm" in pv.lower()
                      else "NVIDIA" if kind == "gpu" else "")
            infos.append(DeviceInfo(
                index=i, name=str(getattr(d, "device_kind", d.platform)), kind=kind,
                vendor=vendor, driver=f"jaxlib {versions['jaxlib']}", platform=plat,
                fp64=x64_enabled() and kind != "tpu",
                compute_units=int(getattr(d, "core_count", 1) or 1),
                extra={"jax_id": int(d.id), "process_index": int(d.process_index)}))
        return Availability(True, versions=versions, devices=infos)

    @classmethod
    def auto_choices(cls) -> list[tuple[int, str, str]]:
        av = cls.probe()
        if not av.available:
            return []
        d = av.devices[0]
        score = {"tpu": 90, "gpu": 60, "cpu": 20}.get(d.kind, 50)
        return [(score, "jax", f"JAX/XLA on {d.kind} {d.name}")]

    @classmethod
    def test_targets(cls) -> list[str]:
        av = cls.probe()
        if not av.available:
            return []
        return [f"jax:{_default(av.devices).kind}", "jax:pallas"]

    # --- instance -------------------------------------------------------------------------
    def _open(self, selector: str | None) -> DeviceInfo:
        av = self.probe()
        if not av.available:
            raise BackendUnavailable(f"jax cannot run here: {av.reason}. Fix: {av.fix}.")
        self.pallas = False
        sel = (selector or "").strip()
        if sel == "pallas" or sel.startswith("pallas_"):
            self.pallas = True
            sel = sel[len("pallas_"):] if sel.startswith("pallas_") else ""
        if sel == "":
            info = _default(av.devices)
        elif sel in _KINDS:
            found = [d for d in av.devices if d.kind == sel]
            if not found:
                raise BackendUnavailable(
                    f"jax:{selector} asks for a {sel} device but jax sees only "
                    + ", ".join(f"jax:{d.index} = {d.kind} {d.name}" for d in av.devices)
                    + f". Fix: {_KIND_FIX[sel]}.")
            info = found[0]
        elif sel.isdigit():
            idx = int(sel)
            if idx >= len(av.devices):
                raise BackendUnavailable(
                    f"jax:{selector} does not exist; jax has {len(av.devices)} device(s): "
                    + ", ".join(f"jax:{d.index} = {d.kind} {d.name}" for d in av.devices)
                    + ". Pick one of those indices.")
            info = av.devices[idx]
        else:
            raise UnknownBackendError(
                f"jax device selector {selector!r} is not understood; expected jax, jax:cpu, "
                "jax:gpu, jax:tpu, jax:N (device index), jax:pallas, jax:pallas_cpu|gpu|tpu|N.")
        self._jax_device = _device_list()[info.index]
        # jitted functions, LRU-bounded (FUNCTION_CACHE_SIZE), and the executables they hold
        # bounded in all by EXECUTABLE_CACHE_SIZE (see ``execute``)
        self._functions: LRUCache = LRUCache(FUNCTION_CACHE_SIZE)
        self._fn_lock = threading.Lock()
        self._pending: Any = None
        self.dlpack_imports = 0
        return info

    @property
    def label(self) -> str:
        return f"jax:pallas_{self.device.index}" if self.pallas else f"jax:{self.device.index}"

    @property
    def interpret(self) -> bool:
        """Pallas runs through its interpreter on CPUs (no Pallas CPU lowering exists)."""
        return self.device.kind == "cpu"

    def describe(self) -> str:
        path = "Pallas kernels" + (" (interpret mode)" if self.interpret else "") \
            if self.pallas else "XLA"
        return f"{self.label} ({self.device.kind} {self.device.name}, {path})"

    def supported_dtypes(self) -> tuple[str, ...]:
        base = ("float32", "float16", "bfloat16")
        return base + ("float64",) if x64_enabled() and self.device.kind != "tpu" else base

    def check_dtype(self, spec: KernelSpec, prob: Problem) -> None:
        if prob.dtype == "float64" and "float64" not in self.supported_dtypes():
            if self.device.kind == "tpu":
                fix = "TPUs have no float64; cast to float32 or run on jax:cpu"
            else:
                fix = ("enable 64-bit mode before creating arrays: "
                       "jax.config.update('jax_enable_x64', True) or JAX_ENABLE_X64=1; "
                       "or cast to float32")
            raise UnsupportedDTypeError(
                f"{spec.name}: dtype float64 cannot run on {self.describe()}: JAX computes in "
                f"float32 unless jax_enable_x64 is on (it is "
                f"{'on' if x64_enabled() else 'off'}). Fix: {fix}.")
        super().check_dtype(spec, prob)

    # --- arrays ---------------------------------------------------------------------------
    def is_native(self, x: object) -> bool:
        return jax is not None and (isinstance(x, jax.Array) or _is_tracer(x))

    def _oom(self, what: str, nbytes: int, exc: BaseException) -> DeviceMemoryError:
        """DeviceMemoryError naming the request and, where XLA reports it, the device's memory."""
        try:
            stats = self._jax_device.memory_stats() or {}
        except Exception:
            stats = {}
        have = (f"{stats['bytes_limit'] - stats.get('bytes_in_use', 0)} of "
                f"{stats['bytes_limit']} bytes free" if "bytes_limit" in stats
                else "free memory not reported")
        return DeviceMemoryError(
            f"cannot allocate {nbytes} bytes for {what} on {self.describe()} ({have}): "
            f"{str(exc)[:300]}. Fix: split the call into smaller pieces, delete arrays you no "
            "longer need, or use a device with more memory.")

    def to_native(self, x: np.ndarray) -> Any:
        x = native_byte_order(x)  # XLA refuses non-native byte orders
        self.transfers.add("h2d", x.nbytes)
        try:
            return jax.device_put(x, self._jax_device)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            raise self._oom(f"an input {x.shape} {dtypes.dtype_name(x.dtype)}", x.nbytes,
                            exc) from None

    def to_numpy(self, x: Any) -> Any:
        if _is_tracer(x):  # numpy operands inside a trace give a traced result, as jnp does
            return x
        self.transfers.add("d2h", int(x.nbytes))
        return np.asarray(jax.device_get(x))

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        with jax.default_device(self._jax_device):
            return jnp.zeros(shape, storage_dtype(dtype))

    def synchronize(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            jax.block_until_ready(pending)

    def from_foreign(self, x: Any) -> Any:
        """Import another framework's array (CuPy, numpy, torch, ...) through DLPack.

        Used by ``portakern.to_backend``. Counted as one h2d transfer of x.nbytes (the data
        enters this backend from outside, whether DLPack aliased it or copied it) and in
        ``self.dlpack_imports``. Like ``jax.dlpack.from_dlpack`` the result may share memory
        with ``x``: do not mutate ``x`` afterwards (pass ``x.copy()`` if you must). Returns
        None (caller falls back to a counted host copy) where DLPack cannot carry the array,
        e.g. ml_dtypes bfloat16 numpy arrays or a GPU array on a CPU-only jax.
        """
        if not hasattr(x, "__dlpack__"):
            return None
        try:
            got = jax.dlpack.from_dlpack(x)
        except Exception:
            got = None
        if got is None:
            if isinstance(x, np.ndarray):
                return None
            host = x.get() if hasattr(x, "get") else np.asarray(x)  # e.g. CuPy without a GPU jax
            return self.to_native(np.ascontiguousarray(host))
        if self._jax_device not in got.devices():
            got = jax.device_put(got, self._jax_device)  # device-to-device, no host copy
        self.transfers.add("h2d", int(got.nbytes))
        self.dlpack_imports += 1
        return got

    # --- execution ------------------------------------------------------------------------
    def compiled(self, spec: KernelSpec, prob: Problem,
                 config: Mapping[str, int] | None = None) -> Any:
        """The jitted callable for (spec, static params, dtype, path, blocks); built once.

        Float parameters (``traced_params``) are arguments, not constants, on the XLA path:
        a new ``scale`` or ``eps`` reuses the function and its executables. The Pallas
        kernel builder takes its parameters as Python values, so there they stay static (and
        the cache's LRU bound applies). Call it as ``fn(*operands, *traced values)``; the
        traced names are ``fn.portakern_traced``."""
        use_pallas = self.pallas and spec.pallas is not None
        blocks = self._pallas_blocks(spec, prob, config) if use_pallas else None
        if not use_pallas and config:
            spec.config(self.device_class, config, prob)  # same validation as other backends
        traced = () if use_pallas else traced_params(spec, prob.params)
        static = {k: v for k, v in prob.params.items() if k not in traced}
        out_dtypes = None if prob.outputs is None else tuple(d for _, d in prob.outputs.values())
        key = (spec.name, spec.token, _freeze(static), traced, prob.dtype, out_dtypes,
               use_pallas, tuple(sorted((blocks or {}).items())))
        fn = self._functions.get(key)
        if fn is None:
            with self._fn_lock:
                fn = self._functions.get(key)
                if fn is None:
                    if use_pallas:
                        lowered = lower_semantics(spec, prob.params, prob.dtype)
                        kernel = spec.pallas(prob, self.interpret, platform=self.device.kind,
                                             reference=lowered, **(blocks or {}))
                        if self.interpret and prob.dtype == "bfloat16":
                            kernel = _widened(kernel, jnp.bfloat16)
                        fn = jax.jit(kernel)
                    elif spec.xla is not None:  # the op's own XLA function (e.g. its VJP)
                        fn = jax.jit(spec.xla(prob, traced))
                    else:
                        fn = jax.jit(lower_semantics_traced(spec, prob.params, traced,
                                                            prob.dtype, out_dtypes))
                    fn = _Compiled(fn, traced, key)
                    self._functions[key] = fn
        return fn

    def cache_info(self) -> dict[str, dict[str, int]]:
        """``Backend.cache_info`` (``functions``: the jitted functions) plus ``executables``:
        the compiled executables those functions hold, bounded in all by
        EXECUTABLE_CACHE_SIZE."""
        info = super().cache_info()
        info["executables"] = {
            "size": sum(f.executables() for f in self._functions.values()),
            "maxsize": EXECUTABLE_CACHE_SIZE}
        return info

    def _bound_executables(self, current: Any) -> None:
        """After a compilation: drop least recently used functions (and so their
        executables) until at most EXECUTABLE_CACHE_SIZE remain; the current function is
        dropped last (the next call rebuilds it)."""
        with self._fn_lock:
            fns = self._functions
            total = sum(f.executables() for f in fns.values())
            for key in fns.keys():
                if total <= EXECUTABLE_CACHE_SIZE:
                    break
                f = fns.get(key) if key != current.key else None
                if f is not None:
                    total -= f.executables()
                    fns.pop(key, None)
            if total > EXECUTABLE_CACHE_SIZE:
                fns.pop(current.key, None)

    def _pallas_blocks(self, spec: KernelSpec, prob: Problem,
                       config: Mapping[str, int] | None) -> dict[str, int]:
        """config for the Pallas path: the block tunables the spec's Pallas kernel declares
        (``PallasKernel.tunables``), or the C-kernel tunables it names as their aliases."""
        if not config:
            return {}
        kernel = spec.pallas
        known = {t.name: t for t in getattr(kernel, "tunables", ())}
        alias = dict(getattr(kernel, "aliases", None) or {})
        what = f"{spec.name} (Pallas)"
        out: dict[str, int] = {}
        for k, v in config.items():
            if k in alias and alias[k] in known:
                spec.config(self.device_class, {k: v}, prob)
                out[alias[k]] = known[alias[k]].check(v, what)
            elif k in known:
                out[k] = known[k].check(v, what)
            else:
                takes = " and ".join(known) or "no tunables"
                also = f" (or {'/'.join(alias)})" if alias else ""
                raise InvalidArgumentError(
                    f"{spec.name} on {self.label}: unknown tunable {k!r}; the Pallas kernel "
                    f"takes {takes}{also}.")
        check = getattr(kernel, "check", None)
        if check is not None:
            check(self.device.kind, out)  # validate for the platform now, not at trace time
        return out

    def execute(self, spec: KernelSpec, prob: Problem, ins: dict[str, Any],
                config: Mapping[str, int] | None) -> Any:
        if prob.dtype == "float64":
            # per call, not only when the call was planned: jax_enable_x64 can be switched
            # off after (jax then computes a planned float64 call in float32, silently)
            self.check_dtype(spec, prob)
        fn = self.compiled(spec, prob, config)
        args = [ins.get(o.name) for o in spec.operands]
        params = prob.params
        args += [params[k] for k in fn.traced]
        before = fn.executables()
        try:
            out = fn.jitted(*args)
        except jax.errors.ConcretizationTypeError:
            if not fn.traced:
                raise
            # the semantics need a parameter's value (Python control flow on it): compile
            # this spec with constants from now on
            _STATIC_SPECS.add(spec.token)
            with self._fn_lock:
                self._functions.pop(fn.key, None)
            return self.execute(spec, prob, ins, config)
        except ValueError as exc:
            if "incompatible devices" not in str(exc):
                raise
            from ..core.errors import ContextMismatchError

            where = "; ".join(f"{o.name}: {sorted(str(d) for d in x.devices())}"
                              for o, x in zip(spec.operands, args) if hasattr(x, "devices"))
            raise ContextMismatchError(
                f"{spec.name}: the jax operands live on different devices ({where}); one call "
                f"runs on one device (or one sharding). Fix: put them together first, e.g. "
                f"jax.device_put(x, jax.devices()[0]) for each, or pass numpy arrays and "
                f"backend='jax:N'.") from None
        except Exception as exc:
            if not _is_oom(exc):
                raise
            nbytes = int(np.prod(prob.out_shape, dtype=np.int64)) * prob.info.storage.itemsize
            raise self._oom(f"{spec.name} (output {prob.out_shape} {prob.dtype} and XLA's "
                            "temporaries)", nbytes, exc) from None
        if not _is_tracer(out):
            self._pending = out
        if fn.executables() > before:  # compiled a new shape: keep the total bounded
            self._bound_executables(fn)
        return out


class _Compiled:
    """A jitted function, the parameter names it takes as traced arguments, its cache key."""

    __slots__ = ("jitted", "traced", "key", "__weakref__")

    def __init__(self, jitted: Any, traced: tuple[str, ...], key: tuple) -> None:
        self.jitted = jitted
        self.traced = traced
        self.key = key

    def executables(self) -> int:
        size = getattr(self.jitted, "_cache_size", None)
        try:
            return int(size()) if size is not None else 0
        except Exception:
            return 0


def _is_oom(exc: BaseException) -> bool:
    """XLA reports an allocation failure as a runtime error whose status is RESOURCE_EXHAUSTED."""
    return isinstance(exc, RuntimeError) and "RESOURCE_EXHAUSTED" in str(exc)


def _default(devices: list[DeviceInfo]) -> DeviceInfo:
    acc = [d for d in devices if d.kind != "cpu"]
    return (acc or devices)[0]


__all__ = ["XP", "JaxBackend", "lower_semantics", "x64_enabled"]


def _widened(kernel: Any, storage: Any) -> Any:
    """Run an interpreted Pallas kernel on float32 copies of bfloat16 operands.

    Why: XLA:CPU (jaxlib 0.10.2) segfaulted compiling the interpreted bf16 attention kernel
    after many earlier compilations in one process (reproduced twice in CI-profile runs).
    The kernel computes in float32 anyway and bf16 widens to float32 exactly, so the result
    is the same; only interpret mode (CPU) takes this path — GPUs and TPUs run bf16 as is.
    """

    def run(*operands: Any) -> Any:
        wide = [x.astype(jnp.float32) if x is not None and x.dtype == storage else x
                for x in operands]
        got = kernel(*wide)
        if isinstance(got, tuple):  # (out, lse): lse stays in the compute type (float32)
            return (got[0].astype(storage), *got[1:])
        return got.astype(storage)

    return run
