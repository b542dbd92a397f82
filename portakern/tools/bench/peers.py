"""Native peers: the best implementation of each op that the device's own vendor stack has.

A peer runs on the *same device* as the portakern target it is compared with, in the same
run, on inputs already resident where it computes (uploads are never timed):

- numpy  — numpy/OpenBLAS (or whatever BLAS numpy loaded) on a CPU target, in a subprocess
  started without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (see numpy_worker.py);
- torch  — PyTorch's CPU kernels (oneDNN/MKL matmul, the fused flash-attention SDPA,
  softmax, the RMSNorm expression) on a CPU target, in a second such subprocess (its
  OpenMP pool and OpenBLAS's threads would spin against each other in one), threads = cores;
- xla    — jax.jit of the plain jnp expression (precision HIGHEST, so fp32 is not TF32 on
  GPUs) on the jax device of the same kind;
- clblast — CLBlast's GEMM through pyclblast on the target's own context and queue, for a
  target whose arrays are pyopencl's (``Backend.array_modules``: the OpenCL backend);
- cublas — cupy.matmul (cuBLAS, or hipBLAS under ROCm) with CUPY_TF32=0, on the CUDA device;
- cupy   — cupy's elementwise softmax expression on the CUDA device;
- cudnn  — jax.nn.dot_product_attention(implementation="cudnn") on an NVIDIA GPU.

No backend is named here: what ties a peer to a target is the backend's data. A target whose
arrays are cupy's (``array_modules``) hands its own arrays to the cupy peers and numbers its
devices as CUDA does; a target with a jax device of its own (the jax backend) is measured
there; every other GPU is matched to cupy's and jax's devices by name.

Ops without hand-written peers (rmsnorm, user and plugin ops) are compared with their own
``spec.semantics`` on the device's native array library (semantics_peer.py): numpy on a CPU
(in the numpy process when it knows the op, else in this process, which the record says),
XLA (jax.jit of lower_semantics: the same computation as portakern's jax target) on the jax
device of the same kind, and cupy on a CUDA device. An OpenCL GPU with neither a matching
jax device nor a CUDA one gets no peer, and the record says why.

A peer that cannot run is recorded with the reason (missing library, no such device, dtype it
does not support) instead of being silently left out.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...backend.base import Backend
from ...ops import get_op
from . import semantics_peer
from .numpy_worker import TORCH_OPS
from .semantics_peer import has_handwritten_peers
from .suites import BenchCase, operand_names, peer_skip
from .timing import Measurement, Sampler, TimingConfig, not_run, prepare, run_rounds

PEER_KEYS = ("numpy", "torch", "xla", "clblast", "cublas", "cupy", "cudnn")
# the numpy/BLAS peer's key: a peer named after its library, not the numpy backend
NUMPY_PEER = "numpy"
PEER_NAMES = {"numpy": "numpy/BLAS", "torch": "PyTorch (CPU)", "xla": "XLA (jax.jit)",
              "clblast": "CLBlast (pyclblast)",
              "cublas": "cuBLAS (cupy.matmul)", "cupy": "cupy (elementwise)",
              "cudnn": "cuDNN attention (jax)"}
SEMANTICS_NAMES = {"numpy": "numpy (spec semantics)", "xla": "XLA (spec semantics)",
                   "cupy": "cupy (spec semantics)"}
UNSET_FOR_NUMPY = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# how to get each peer's library (the README promises them; a missing one is warned about)
INSTALL_HINT = {
    "numpy": "pip install threadpoolctl (numpy's BLAS and threads are recorded through it)",
    "torch": "pip install -e '.[peers]' (torch==2.13.0+cpu, the CPU wheel)",
    "xla": "pip install -e '.[jax]'",
    "clblast": "apt-get install libclblast-dev && pip install pyclblast (with build "
               "isolation: it builds with scikit-build-core)",
    "cublas": "pip install -e '.[cuda]'", "cupy": "pip install -e '.[cuda]'",
    "cudnn": "pip install 'jax[cuda12]'",
}
# the Python module each peer needs
PEER_MODULE = {"numpy": "threadpoolctl", "torch": "torch", "xla": "jax",
               "clblast": "pyclblast", "cublas": "cupy", "cupy": "cupy", "cudnn": "jax"}


def missing_promised(targets: Any, wanted: tuple[str, ...] = PEER_KEYS) -> dict[str, str]:
    """Peers the README promises for these targets' devices whose library is not installed:
    peer -> why and how to fix. A run prints them at the top of its output and its report,
    not only in a table cell (issue 18: a fresh machine silently lacked CLBlast)."""
    need: set[str] = set()
    for be in targets:
        for op in ("matmul", "softmax", "attention"):
            need.update(applicable(op, be))
    out: dict[str, str] = {}
    for key in PEER_KEYS:
        if key not in need or key not in wanted or key == "cudnn":
            continue  # cuDNN needs an NVIDIA jax: judged per case, where it says why
        mod = PEER_MODULE[key]
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out[key] = f"{PEER_NAMES[key]}: Python module {mod!r} is not installed; fix: " \
                       + INSTALL_HINT[key]
    return out


def peer_name(key: str, op: str) -> str:
    """The column name of a peer: the library, and '(spec semantics)' where that is what it
    runs (so a reader never mistakes an op's own expression for a vendor library call)."""
    if not has_handwritten_peers(op) and key in SEMANTICS_NAMES:
        return SEMANTICS_NAMES[key]
    return PEER_NAMES[key]


def applicable(op: str, be: Backend) -> list[str]:
    """Peers that make sense for ``op`` on ``be``'s device (each may still be unavailable)."""
    keys: list[str] = []
    if not has_handwritten_peers(op):  # its semantics on numpy / XLA / cupy
        if be.device.kind == "cpu":
            keys.append("numpy")
            if op in TORCH_OPS:
                keys.append("torch")
        keys.append("xla")
        if be.device.kind == "gpu":
            keys.append("cupy")
        return keys
    if be.device.kind == "cpu":
        keys.append("numpy")
        if op in TORCH_OPS:
            keys.append("torch")
    keys.append("xla")
    if op == "matmul" and _owns(be, "pyopencl"):  # GEMM on the target's own queue and arrays
        keys.append("clblast")
    if be.device.kind == "gpu":
        if op == "matmul":
            keys.append("cublas")
        if op == "softmax":
            keys.append("cupy")
        if op == "attention":
            keys.append("cudnn")
    return keys


# --- numpy in its own process ---------------------------------------------------------------
class NumpyWorker:
    """A long-lived child process serving numpy peer measurements (numpy_worker.py)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in UNSET_FOR_NUMPY}
        self.unset = [k for k in UNSET_FOR_NUMPY if k in os.environ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "portakern.tools.bench.numpy_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.hello = self._read()
        self._next_id = 0
        if self.hello.get("kind") != "hello":
            raise RuntimeError(f"numpy peer process sent {self.hello!r} instead of its hello "
                               "record; expected JSON lines from "
                               "portakern.tools.bench.numpy_worker.")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.poll()
            raise RuntimeError(f"the numpy peer process ended (exit code {code}); its stderr "
                               "above says why. Run python -m portakern.tools.bench.numpy_worker "
                               "to reproduce.")
        return json.loads(line)

    @property
    def info(self) -> dict[str, Any]:
        blas = self.hello.get("blas", {})
        return {"blas": blas.get("name"), "blas_version": blas.get("version"),
                "architecture": blas.get("architecture"), "threads": blas.get("threads"),
                "numpy": self.hello.get("numpy"), "env_seen": self.hello.get("env"),
                "unset_for_this_process": self.unset, "pid": self.hello.get("pid")}

    def knows(self, op: str) -> bool:
        """Whether this process has the parent's op (same semantics function): built-in and
        entry-point ops yes, ops registered in the parent's code no."""
        theirs = self.hello.get("ops")
        if has_handwritten_peers(op):
            return True
        return isinstance(theirs, dict) and theirs.get(op) == semantics_peer.identity(
            get_op(op))

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One request, one reply (numpy_worker's protocol)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _own(self, m: Measurement, peer: str) -> Measurement:
        if peer == NUMPY_PEER:
            m.info.update(self.info)
        else:
            m.info.update(process="a peer process of its own (portakern.tools.bench.numpy_worker, "
                          "started without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE)",
                          pid=self.hello.get("pid"))
        return m

    def run(self, case: BenchCase, timing: TimingConfig, peer: str = NUMPY_PEER) -> Measurement:
        """The peer measured on its own in the child (first call, warm-up, samples)."""
        reply = self.request({"case": case.as_dict(), "timing": timing.as_dict(), "peer": peer})
        if reply.get("kind") == "error":
            return not_run("error", reply.get("error", "unknown error"))
        return self._own(Measurement.from_dict(reply["measurement"]), peer)

    def prepare(self, case: BenchCase, timing: TimingConfig, peer: str = NUMPY_PEER
                ) -> Sampler | Measurement:
        """The peer prepared in the child for interleaved rounds (first call and warm-up
        done there), or the measurement of a peer that does not apply."""
        self._next_id += 1
        rid = self._next_id
        reply = self.request({"op": "prepare", "id": rid, "case": case.as_dict(),
                              "timing": timing.as_dict(), "peer": peer})
        if reply.get("kind") == "error":
            return not_run("error", reply.get("error", "unknown error"))
        m = self._own(Measurement.from_dict(reply["measurement"]), peer)
        if reply.get("kind") != "prepared":
            return m
        return RemoteSampler(self, rid, m)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()  # our own child, by handle
                self.proc.wait()


class RemoteSampler(Sampler):
    """A peer prepared in the peer process: each sample is one request there, timed there
    around the call alone (numpy_worker.handle)."""

    def __init__(self, worker: NumpyWorker, rid: int, m: Measurement) -> None:
        self.worker, self.rid, self.m = worker, rid, m
        self.closed = False

    def sample(self) -> float:
        reply = self.worker.request({"op": "sample", "id": self.rid})
        if reply.get("kind") != "sample":
            raise RuntimeError(f"the peer process answered {str(reply)[:300]} to a sample "
                               "request")
        t = float(reply["s"])
        self.m.samples.append(t)
        return t

    def close(self) -> None:
        if self.closed or self.worker.proc.poll() is not None:
            return
        self.closed = True
        try:
            reply = self.worker.request({"op": "release", "id": self.rid})
        except (RuntimeError, BrokenPipeError, OSError, ValueError):
            return
        extra = reply.get("info") or {}
        if "untimed_calls_before_samples" in extra:
            self.m.info["untimed_calls_before_samples"] = extra["untimed_calls_before_samples"]


# --- device matching -------------------------------------------------------------------------
def _owns(be: Backend, module: str) -> bool:
    """Whether ``be``'s native arrays are ``module``'s (``Backend.array_modules``); a
    duck-typed stand-in without the attribute owns none."""
    return module in getattr(be, "array_modules", ())


def own_jax_device(be: Backend) -> Any:
    """The jax device ``be`` itself computes on (the jax backend's), else None."""
    return getattr(be, "jax_device", None) or getattr(be, "_jax_device", None)


def _same_name(a: str, b: str) -> bool:
    a, b = a.lower().strip(), b.lower().strip()
    return bool(a) and bool(b) and (a == b or a in b or b in a)


def jax_device_for(be: Backend) -> tuple[Any, str]:
    """(jax device on the same hardware as ``be``, '') or (None, why not)."""
    try:
        import jax
    except Exception as exc:
        return None, f"jax is not importable ({exc}); pip install 'portakern[jax]'"
    own = own_jax_device(be)
    if own is not None:
        return own, ""
    if be.device.kind == "cpu":
        return jax.devices("cpu")[0], ""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:
        return None, f"jax has no GPU backend here ({exc}); install jax[cuda12] or jax[rocm]"
    if _owns(be, "cupy") and be.device.index < len(gpus):  # CUDA's numbering, as jax's
        return gpus[be.device.index], ""
    for d in gpus:
        if _same_name(getattr(d, "device_kind", ""), be.device.name):
            return d, ""
    return None, (f"no jax GPU device matches {be.device.name!r} (jax sees "
                  f"{[getattr(d, 'device_kind', str(d)) for d in gpus]})")


def cupy_device_for(be: Backend) -> tuple[int | None, str]:
    """(cupy device index on the same GPU as ``be``, '') or (None, why not)."""
    os.environ.setdefault("CUPY_TF32", "0")
    try:
        import cupy
    except Exception as exc:
        return None, f"cupy is not importable ({exc}); pip install 'portakern[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"cupy sees no GPU ({type(exc).__name__}: {exc})"
    if _owns(be, "cupy"):  # the target's devices are cupy's
        return (be.device.index, "") if be.device.index < n else (None, "no such cupy device")
    for i in range(n):
        name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        if _same_name(name, be.device.name):
            return i, ""
    return None, f"no CUDA device matches {be.device.name!r}"


# --- in-process peers -------------------------------------------------------------------------
def _scale(case: BenchCase) -> float:
    return float(case.params.get("scale") or 1.0 / math.sqrt(case.size["D"]))


def _xla_fn(case: BenchCase) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST
    if case.op == "matmul":
        return jax.jit(lambda a, b: jnp.matmul(a, b, precision=hi))
    if case.op == "softmax":
        return jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
    if case.op in ("attention", "attention_backward"):
        s = case.size
        B, Hq, Hkv, Sq, Sk, D = s["B"], s["Hq"], s["Hkv"], s["Sq"], s["Sk"], s["D"]
        g, scale, causal = Hq // Hkv, _scale(case), bool(case.params.get("causal"))

        def attention(q: Any, k: Any, v: Any) -> Any:
            qg = q.reshape(B, Hkv, g, Sq, D)
            sc = jnp.einsum("bkgqd,bkjd->bkgqj", qg, k, precision=hi) * scale
            if causal:
                keep = jnp.arange(Sq)[:, None] >= jnp.arange(Sk)[None, :]
                sc = jnp.where(keep, sc, -jnp.inf)
            p = jax.nn.softmax(sc, axis=-1)
            o = jnp.einsum("bkgqj,bkjd->bkgqd", p, v, precision=hi)
            return o.reshape(B, Hq, Sq, v.shape[-1])

        if case.op == "attention":
            return jax.jit(attention)

        def attention_backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any) -> Any:
            # XLA's autodiff of the semantics: it recomputes its own forward (o and lse,
            # which the fused backward reads, are not used)
            _, vjp = jax.vjp(attention, q, k, v)
            return vjp(do)

        return jax.jit(attention_backward)
    raise ValueError(f"xla peer: no expression for op {case.op!r}")


XLA_WHAT = {"matmul": "jax.jit(jnp.matmul, precision=HIGHEST)",
            "softmax": "jax.jit(jax.nn.softmax(x, axis=-1))",
            "attention": "jax.jit(einsum q.k^T * scale -> jax.nn.softmax -> einsum p.v, "
                         "precision=HIGHEST, GQA by reshape)",
            "attention_backward": "jax.jit(jax.vjp(attention's XLA expression: einsum q.k^T * "
                                  "scale -> jax.nn.softmax -> einsum p.v, precision=HIGHEST, "
                                  "GQA by reshape) applied to do): XLA's autodiff of the "
                                  "semantics; it recomputes the scores and softmax itself "
                                  "(the forward's o and lse are not read; XLA drops the unused "
                                  "p.v)"}


def _validated_params(case: BenchCase, host: Mapping[str, np.ndarray | None]) -> dict[str, Any]:
    """The case's parameters as the op's validate normalises them (defaults filled)."""
    spec = get_op(case.op)
    prob = spec.problem(*spec.bind([host[n] for n in operand_names(case.op)],
                                   dict(case.params)))
    return dict(prob.params)


def prepare_numpy_here(case: BenchCase, host: Mapping[str, np.ndarray | None],
                       timing: TimingConfig) -> Sampler:
    """The semantics peer on numpy in this process, for an op the numpy process cannot see
    (registered in code). OpenBLAS here runs with this process's environment, so the record
    says which of the variables that slow it down are set."""
    from .numpy_worker import BLAS_ENV, blas_info

    spec = get_op(case.op)
    seen = {k: os.environ.get(k) for k in BLAS_ENV}
    pinned = {k: v for k, v in seen.items() if k in UNSET_FOR_NUMPY and v is not None}
    what = (semantics_peer.what(spec, "numpy", case.dtype) + f" in the benchmark's own process "
            f"({case.op!r} is registered in code, so the numpy peer process cannot import it): "
            "OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE are as the parent has them ("
            + (", ".join(f"{k}={v}" for k, v in pinned.items()) or "neither is set") + ")")
    arrays = [host[n] for n in operand_names(case.op)]
    fn = semantics_peer.semantics_call(spec, np, arrays, _validated_params(case, host),
                                       case.dtype)
    p = prepare(fn, lambda: None, timing, what=what, scope=lambda: np.errstate(all="ignore"))
    blas = blas_info()
    p.m.info.update(process="in-process (parent)", env_seen=seen, unset_for_this_process=[],
                  blas=blas.get("name"), architecture=blas.get("architecture"),
                  threads=blas.get("threads"), numpy=np.__version__)
    return p


def prepare_xla(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray | None],
                timing: TimingConfig) -> Sampler | Measurement:
    semantic = not has_handwritten_peers(case.op)
    what = (semantics_peer.what(get_op(case.op), "jax.numpy", case.dtype)
            + ", jax.jit(lower_semantics(...)): the same computation portakern's jax target "
            "runs" if semantic else XLA_WHAT.get(case.op, case.op))
    dev, why = jax_device_for(be)
    if dev is None:
        return not_run("unavailable", why, what)
    import jax

    names = operand_names(case.op)
    if semantic:  # every operand in order, None for absent optional ones
        args = [None if host[n] is None else jax.device_put(host[n], dev) for n in names]
    else:  # the hand-written expressions take the operands the built-in cases have
        args = [jax.device_put(host[n], dev) for n in names if host[n] is not None]
    if semantic:
        from ...backend.jax import lower_semantics

        f = jax.jit(lower_semantics(get_op(case.op), _validated_params(case, host), case.dtype))
    else:
        f = _xla_fn(case)
    p = prepare(lambda: jax.block_until_ready(f(*args)), lambda: None, timing, what=what)
    p.m.info.update(device=str(dev), jax=jax.__version__)
    return p


def prepare_clblast(be: Backend, case: BenchCase, native: Mapping[str, Any],
                    timing: TimingConfig) -> Sampler | Measurement:
    what = "pyclblast.gemm into a preallocated C on the target's queue"
    try:
        import pyclblast
    except Exception as exc:
        return not_run("unavailable", f"pyclblast is not importable ({exc}); apt-get install "
                       "libclblast-dev && pip install cython pyclblast", what)
    queue = getattr(be, "queue", None)
    if queue is None:
        return not_run("unavailable", f"{be.label} exposes no OpenCL queue", what)
    if case.dtype == "bfloat16":
        return not_run("unavailable", "CLBlast has no bfloat16 GEMM", what)
    if case.dtype == "float16" and not be.device.extra.get("fp16_arith"):
        return not_run("unavailable", f"CLBlast's HGEMM needs cl_khr_fp16, which "
                       f"{be.device.name} lacks", what)
    if case.dtype == "float64" and not be.device.fp64:
        return not_run("unavailable", f"{be.device.name} has no fp64", what)
    import pyopencl.array as cla

    s = case.size
    M, N, K = s["M"], s["N"], s["K"]
    batch = int(np.prod(s.get("batch") or [1]))
    a, b = native["a"], native["b"]
    c = cla.empty(queue, tuple(s.get("batch") or ()) + (M, N), a.dtype)
    if batch == 1:
        def fn() -> None:
            pyclblast.gemm(queue, M, N, K, a, b, c, a_ld=K, b_ld=N, c_ld=N)
    else:
        def fn() -> None:
            pyclblast.gemmStridedBatched(queue, M, N, K, batch, a, b, c, K, N, N, M * K,
                                         K * N, M * N)
    p = prepare(fn, be.synchronize, timing, what=what)
    try:
        from importlib.metadata import version

        p.m.info["pyclblast"] = version("pyclblast")
    except Exception:
        pass
    p.m.info["note"] = "output allocated once outside the timed region (CLBlast writes into C)"
    return p


def prepare_cupy(key: str, be: Backend, case: BenchCase,
                 host: Mapping[str, np.ndarray | None], native: Mapping[str, Any],
                 timing: TimingConfig) -> Sampler | Measurement:
    semantic = key == "cupy" and not has_handwritten_peers(case.op)
    what = (semantics_peer.what(get_op(case.op), "cupy", case.dtype) if semantic else
            {"cublas": "cupy.matmul (CUPY_TF32=0)",
             "cupy": "cupy max-subtracted exp / sum along the last axis"}[key])
    idx, why = cupy_device_for(be)
    if idx is None:
        return not_run("unavailable", why, what)
    import cupy

    names = operand_names(case.op)
    with cupy.cuda.Device(idx) as dev:
        if case.dtype == "bfloat16":
            return not_run("unavailable", "cupy has no bfloat16 arithmetic", what)
        if _owns(be, "cupy"):  # the target's own arrays
            args = [native.get(n) for n in names]
        else:
            args = [None if host[n] is None else cupy.asarray(host[n]) for n in names]
        if not semantic:  # the hand-written expressions take the present operands
            args = [a for a in args if a is not None]
        if semantic:
            fn = semantics_peer.semantics_call(get_op(case.op), cupy, args,
                                               _validated_params(case, host), case.dtype)
        elif key == "cublas":
            def fn() -> Any:
                return cupy.matmul(args[0], args[1])
        else:
            def fn() -> Any:
                x = args[0]
                e = cupy.exp(x - x.max(axis=-1, keepdims=True))
                return e / e.sum(axis=-1, keepdims=True)
        # the device is made current around each call (outside the timed region)
        p = prepare(fn, dev.synchronize, timing, what=what,
                    scope=lambda: cupy.cuda.Device(idx))
    p.m.info.update(CUPY_TF32=os.environ.get("CUPY_TF32"), cupy=cupy.__version__,
                    device=idx)
    return p


def prepare_cudnn(be: Backend, case: BenchCase, host: Mapping[str, np.ndarray],
                  timing: TimingConfig) -> Sampler | Measurement:
    what = ("jax.nn.dot_product_attention(implementation='cudnn') on (B, S, H, D) inputs "
            "(transposed outside the timed region)")
    if "nvidia" not in (be.device.vendor + " " + be.device.name).lower():
        return not_run("unavailable", f"cuDNN runs on NVIDIA GPUs; {be.device.name} is not one",
                       what)
    dev, why = jax_device_for(be)
    if dev is None:
        return not_run("unavailable", why, what)
    if case.dtype not in ("float16", "bfloat16"):
        return not_run("unavailable", f"cuDNN fused attention supports float16/bfloat16, not "
                       f"{case.dtype}", what)
    import jax

    q, k, v = (jax.device_put(np.ascontiguousarray(np.swapaxes(host[n], 1, 2)), dev)
               for n in ("q", "k", "v"))
    scale, causal = _scale(case), bool(case.params.get("causal"))
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="cudnn"))
    try:
        p = prepare(lambda: f(q, k, v).block_until_ready(), lambda: None, timing, what=what)
    except Exception as exc:  # cuDNN refuses some shapes/dtypes at trace time: say which
        return not_run("unavailable", f"cuDNN attention refused this case: "
                       f"{type(exc).__name__}: {str(exc)[:300]}", what)
    p.m.info["device"] = str(dev)
    return p


class Peers:
    """Runs the peers of each case; owns the numpy child process."""

    def __init__(self, wanted: tuple[str, ...] | None = None) -> None:
        bad = [k for k in (wanted or ()) if k not in PEER_KEYS]
        if bad:
            raise ValueError(f"unknown peer(s) {bad}; expected some of {list(PEER_KEYS)}.")
        self.wanted = tuple(wanted) if wanted else PEER_KEYS
        self._numpy: NumpyWorker | None = None
        self._numpy_error = ""
        # torch gets a process of its own: its OpenMP pool and OpenBLAS's threads in one
        # process on a small machine spin against each other between calls
        self._torch: NumpyWorker | None = None
        self._torch_error = ""

    def numpy_worker(self) -> NumpyWorker | None:
        if self._numpy is None and not self._numpy_error:
            try:
                self._numpy = NumpyWorker()
            except Exception as exc:
                self._numpy_error = f"{type(exc).__name__}: {exc}"
        return self._numpy

    def numpy_info(self) -> dict[str, Any]:
        w = self.numpy_worker() if NUMPY_PEER in self.wanted else None
        return w.info if w is not None else {"error": self._numpy_error or "not started"}

    def torch_worker(self) -> NumpyWorker | None:
        if self._torch is None and not self._torch_error:
            try:
                self._torch = NumpyWorker()
            except Exception as exc:
                self._torch_error = f"{type(exc).__name__}: {exc}"
        return self._torch

    def pids(self) -> tuple[int, ...]:
        """Process ids of our peer children (their CPU time is ours, not contention)."""
        return tuple(w.proc.pid for w in (self._numpy, self._torch) if w is not None)

    def keys(self, op: str, be: Backend) -> list[str]:
        return [k for k in applicable(op, be) if k in self.wanted]

    def prepare(self, key: str, be: Backend, case: BenchCase, host: Mapping[str, np.ndarray],
                native: Mapping[str, Any], timing: TimingConfig) -> Sampler | Measurement:
        """One peer ready for interleaved rounds (its first call and warm-up done), or the
        measurement of a peer that cannot run, with the reason: failures become records,
        never exceptions."""
        runners: dict[str, Callable[[], Sampler | Measurement]] = {
            NUMPY_PEER: lambda: self._prepare_numpy(case, host, timing),
            "torch": lambda: self._prepare_torch(case, timing),
            "xla": lambda: prepare_xla(be, case, host, timing),
            "clblast": lambda: prepare_clblast(be, case, native, timing),
            "cublas": lambda: prepare_cupy("cublas", be, case, host, native, timing),
            "cupy": lambda: prepare_cupy("cupy", be, case, host, native, timing),
            "cudnn": lambda: prepare_cudnn(be, case, host, timing),
        }
        runner = runners.get(key)
        if runner is None:
            return not_run("unavailable", f"peer {key!r} has no runner")
        skip = peer_skip(case)
        if skip:
            return not_run("not_applicable", skip)
        try:
            return runner()
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            return not_run("error", f"{type(exc).__name__}: {str(exc)[:500]}")

    def run(self, key: str, be: Backend, case: BenchCase, host: Mapping[str, np.ndarray],
            native: Mapping[str, Any], timing: TimingConfig) -> Measurement:
        """One peer measured on its own (prepared, then rounds of it alone)."""
        got = self.prepare(key, be, case, host, native, timing)
        if isinstance(got, Measurement):
            return got
        try:
            run_rounds({key: got}, timing, begin=time.perf_counter(), budget_s=timing.budget_s)
        finally:
            got.close()
        return got.m

    def _prepare_numpy(self, case: BenchCase, host: Mapping[str, np.ndarray],
                       timing: TimingConfig) -> Sampler | Measurement:
        w = self.numpy_worker()
        if w is not None and not w.knows(case.op):
            return prepare_numpy_here(case, host, timing)
        if w is None:
            return not_run("error", f"the numpy peer process failed to start: "
                           f"{self._numpy_error}")
        try:
            return w.prepare(case, timing)
        except (RuntimeError, BrokenPipeError, OSError) as exc:
            self._numpy = None  # restart it for the next case
            return not_run("error", f"numpy peer process: {exc}")

    def _prepare_torch(self, case: BenchCase, timing: TimingConfig) -> Sampler | Measurement:
        if importlib.util.find_spec("torch") is None:
            return not_run("unavailable", "torch is not installed: " + INSTALL_HINT["torch"])
        w = self.torch_worker()
        if w is None:
            return not_run("error", f"the torch peer process failed to start: "
                           f"{self._torch_error}")
        try:
            return w.prepare(case, timing, peer="torch")
        except (RuntimeError, BrokenPipeError, OSError) as exc:
            self._torch = None
            return not_run("error", f"torch peer process: {exc}")

    def close(self) -> None:
        for w in (self._numpy, self._torch):
            if w is not None:
                w.close()
        self._numpy = self._torch = None
