"""The environment a result was measured in: enough to tell two machines (or two driver
versions on one machine) apart when result files from a fleet are merged.

Everything is collected defensively: a missing tool (no nvidia-smi, no git, no jax) becomes a
recorded reason, never a crash, because the machines this runs on differ by design.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from ...core import settings

# The environment variables a result file records: an allow-list of settings that change
# what is measured (BLAS and OpenMP threading, PoCL, PyOpenCL, CUDA/CuPy, ROCm, XLA/JAX and
# portakern's own knobs), by exact name. Never a prefix: TF_TOKEN_*, TF_VAR_*, AWS_*,
# GITHUB_TOKEN, HF_TOKEN and any other variable stay out of files meant to be committed.
ENV_ALLOW = frozenset((
    # BLAS / OpenMP / threading
    "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_VERBOSE", "OPENBLAS_MAIN_FREE",
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_DYNAMIC", "OMP_SCHEDULE",
    "OMP_WAIT_POLICY", "OMP_STACKSIZE", "OMP_MAX_ACTIVE_LEVELS", "MKL_NUM_THREADS",
    "MKL_DYNAMIC", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_THREADING_LAYER",
    "GOTO_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "KMP_AFFINITY",
    "KMP_BLOCKTIME", "GOMP_CPU_AFFINITY",
    # PoCL / PyOpenCL
    "POCL_DEVICES", "POCL_MAX_PTHREAD_COUNT", "POCL_CPU_MAX_CU_COUNT", "POCL_AFFINITY",
    "POCL_KERNEL_CACHE", "POCL_CACHE_DIR", "POCL_WORK_GROUP_METHOD", "POCL_CPU_LOCAL_MEM_SIZE",
    "POCL_MAX_WORK_GROUP_SIZE", "POCL_DEBUG", "POCL_VECTORIZER_REMARKS", "POCL_CPU_VARIANT",
    "PYOPENCL_CTX", "PYOPENCL_COMPILER_OUTPUT", "PYOPENCL_NO_CACHE", "PYOPENCL_TEST",
    "OCL_ICD_VENDORS", "OPENCL_VENDOR_PATH",
    # CUDA / CuPy / ROCm
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
    "CUDA_PATH", "CUDA_HOME", "CUDA_CACHE_DISABLE", "CUPY_ACCELERATORS", "CUPY_TF32",
    "CUPY_CACHE_DIR", "CUPY_COMPILE_WITH_DEBUG", "CUPY_CUDA_COMPILE_WITH_DEBUG",
    "NVIDIA_TF32_OVERRIDE", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "HSA_OVERRIDE_GFX_VERSION",
    # XLA / JAX (and XLA's log level, which is spelled TF_CPP_*)
    "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "JAX_PLATFORM_NAME", "JAX_ENABLE_X64",
    "JAX_DEFAULT_MATMUL_PRECISION", "JAX_DISABLE_JIT", "JAX_COMPILATION_CACHE_DIR",
    "JAX_TRACEBACK_FILTERING", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
    # portakern's own: every declared setting
    *settings.SETTINGS,
))
PACKAGES = ("numpy", "pyopencl", "jax", "jaxlib", "cupy-cuda12x", "cupy-cuda11x", "cupy-rocm-5-0",
            "cupy", "pyclblast", "threadpoolctl", "matplotlib", "ml_dtypes", "portakern",
            "jax-cuda12-plugin", "nvidia-cuda-nvrtc-cu12")


def _run(cmd: list[str], timeout: float = 10.0, cwd: str | None = None) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def cpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "processor": platform.processor(),
                            "logical_cpus": os.cpu_count()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.lower().startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
        # x86's family and model numbers: "AMD EPYC" names a Zen 1 and a Zen 4 alike
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("cpu family", "model") and value.strip().isdigit():
                info.setdefault("family" if key == "cpu family" else "model_number",
                                int(value))
            if "family" in info and "model_number" in info:
                break
        for line in text.splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["simd"] = sorted(f for f in flags if f.startswith(("avx", "fma", "sse4"))
                                      or f in ("neon", "asimd", "sve"))
                break
    except OSError:
        pass
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0]
        info["memory_kib"] = int(mem.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return info


def gpu_info() -> dict[str, Any]:
    """GPU model, memory and driver from nvidia-smi / rocm-smi, and CUDA versions via cupy."""
    out: dict[str, Any] = {}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pci.bus_id",
                "--format=csv,noheader"])
    if smi:
        out["nvidia_smi"] = [dict(zip(("name", "driver", "memory", "pci_bus_id"),
                                      (p.strip() for p in row.split(",")), strict=False))
                             for row in smi.splitlines()]
    rocm = _run(["rocm-smi", "--showproductname"])
    if rocm:
        out["rocm_smi"] = rocm[:2000]
    try:
        import cupy

        rt = cupy.cuda.runtime
        out["cupy"] = cupy.__version__
        try:
            out["cuda_runtime"] = rt.runtimeGetVersion()
            out["cuda_driver"] = rt.driverGetVersion()
            n = rt.getDeviceCount()
            devs = []
            for i in range(n):
                p = rt.getDeviceProperties(i)
                name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
                devs.append({"index": i, "name": name, "cc": f"{p['major']}.{p['minor']}",
                             "memory_bytes": int(p["totalGlobalMem"]),
                             "sms": int(p["multiProcessorCount"])})
            out["cuda_devices"] = devs
        except Exception as exc:
            out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        out["cupy_error"] = f"{type(exc).__name__}: {exc}"
    return out


def jax_info() -> dict[str, Any]:
    try:
        import jax

        return {"jax": jax.__version__, "default_backend": jax.default_backend(),
                "devices": [str(d) for d in jax.devices()],
                "device_kinds": [getattr(d, "device_kind", "") for d in jax.devices()]}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def opencl_info() -> dict[str, Any]:
    try:
        from ...backend import registry

        av = registry.availability("opencl")
        return av.as_dict()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return out


def relevant_env() -> dict[str, str]:
    """The allow-listed settings (``ENV_ALLOW``) that are set, by exact name."""
    return {k: _no_home(v) for k, v in sorted(os.environ.items()) if k in ENV_ALLOW}


def no_home(text: str) -> str:
    """``text`` with the home directory written as '~' (for paths a result file records)."""
    return _no_home(text)


def _no_home(text: str) -> str:
    """``text`` with the home directory written as '~' (a path would name the user)."""
    home = os.environ.get("HOME") or os.path.expanduser("~")
    if home and home not in ("/", "~") and home in text:
        return text.replace(home, "~")
    return text


def git_info() -> dict[str, Any]:
    """Commit and dirtiness of the portakern checkout (read-only git commands only)."""
    root = Path(__file__).resolve().parents[2]
    head = _run(["git", "rev-parse", "HEAD"], cwd=str(root))
    if head is None:
        return {"commit": None, "note": f"{root} is not a git checkout (or git is missing)"}
    # --no-optional-locks: never refresh (write) the index while others work in this tree
    st = _run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
              cwd=str(root))
    branch = _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=str(root))
    return {"commit": head, "branch": branch,
            "dirty_files": None if st is None else len([x for x in st.splitlines() if x])}


def machine_id() -> str | None:
    """A hash of the machine id (tells machines apart when files are merged; the raw id is
    a stable identifier of the machine that result files must not publish)."""
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            raw = Path(p).read_text().strip()
        except OSError:
            continue
        if raw:
            return "sha256:" + hashlib.sha256(f"portakern-machine:{raw}".encode()).hexdigest()[:16]
    return None


def collect() -> dict[str, Any]:
    """The whole environment record of a result file (no user name, no secrets: see
    ``ENV_ALLOW`` and ``machine_id``; paths under the home directory are written '~/...')."""
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "machine_id": machine_id(),
        "platform": platform.platform(), "python": sys.version,
        "executable": _no_home(sys.executable),
        "cpu": cpu_info(), "gpu": gpu_info(), "opencl": opencl_info(), "jax": jax_info(),
        "versions": versions(), "env": relevant_env(), "git": git_info(),
    }


class CpuMeter:
    """CPU time that *other* processes used while a case ran (Linux /proc; else nothing).

    Why: on a shared machine another job's threads steal cores from ours and from the peers,
    unevenly, so a ratio can be off without anything looking wrong. The system's busy time
    minus our own processes' CPU time (this process and the numpy peer child) over the same
    interval is the foreign load; the hypervisor's steal time is recorded beside it.
    """

    def __init__(self) -> None:
        try:
            self.tick = float(os.sysconf("SC_CLK_TCK"))
        except (AttributeError, ValueError, OSError):
            self.tick = 100.0
        self.ncpu = os.cpu_count() or 1

    @staticmethod
    def _system() -> tuple[float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()
        except (OSError, IndexError):
            return None
        v = [float(x) for x in fields[1:]]
        v += [0.0] * (8 - len(v))
        busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
        return busy, v[7]  # steal

    def _process(self, pid: int | str) -> float:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return 0.0
        rest = text.rsplit(")", 1)[-1].split()
        return (float(rest[11]) + float(rest[12]))  # utime, stime (fields 14, 15)

    def cpu_seconds(self, pid: int) -> float:
        """CPU time (user + system) process ``pid`` has used so far; 0 once it is gone."""
        return self._process(pid) / self.tick

    def snapshot(self, pids: tuple[int, ...] = ()) -> dict[str, float] | None:
        sysv = self._system()
        if sysv is None:
            return None
        import time

        ours = self._process("self") + sum(self._process(p) for p in pids)
        return {"busy": sysv[0], "steal": sysv[1], "ours": ours, "wall": time.monotonic()}

    def since(self, before: dict[str, float] | None, pids: tuple[int, ...] = ()
              ) -> dict[str, float] | None:
        after = self.snapshot(pids)
        if before is None or after is None:
            return None
        wall = after["wall"] - before["wall"]
        if wall <= 0:
            return None
        other = max(0.0, (after["busy"] - before["busy"]) - (after["ours"] - before["ours"]))
        other /= self.tick
        steal = (after["steal"] - before["steal"]) / self.tick
        cap = wall * self.ncpu
        # /proc/stat counts in ticks (10 ms): over a short window a tick or two can exceed
        # wall * ncpu, so shares are clamped to what they mean, a fraction of the machine
        return {"wall_s": wall, "other_cpu_s": other, "other_share": min(1.0, other / cap),
                "steal_share": min(1.0, max(0.0, steal / cap))}
