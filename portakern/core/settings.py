"""Every ``PORTAKERN_*`` environment variable, declared once: name, type, default and meaning.

Read through ``get`` (the typed value) or ``raw`` (the text, None when unset or blank), both
here and nowhere else: ``os.environ`` is consulted on each read, so a test's monkeypatch or a
user's ``os.environ[...] = ...`` takes effect without a reload. "Off" is spelled one way for
every switch: 0, off, no, false or none (any case). `portakern info` lists them all.
Core layer: imports nothing of portakern, so every layer may read a setting.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OFF = ("0", "off", "no", "false", "none")


@dataclass(frozen=True)
class Setting:
    """One variable: ``kind`` is 'str', 'path', 'path|off' (a directory or a switch that turns
    the feature off), 'int' (a positive count), 'switch' (on unless off) or one of ``choices``."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()


_ALL = (
    Setting("PORTAKERN_BACKEND", "str", None,
            "the backend selector a call uses when neither backend= nor portakern.use() says "
            "(e.g. opencl, cuda:1, jax:pallas); unset: the automatic choice"),
    Setting("PORTAKERN_CACHE_DIR", "path", None,
            "the root of every portakern cache (tuning database, CUDA modules, PyOpenCL's "
            "compiled programs under <cache dir>/pyopencl); unset: $XDG_CACHE_HOME/portakern "
            "or ~/.cache/portakern, and PyOpenCL keeps its own default"),
    Setting("PORTAKERN_CUDA_CACHE", "path|off", None,
            "compiled CUDA modules on disk, and CuPy's own cache (CUPY_CACHE_DIR) when that is "
            "unset: a directory, or off; unset: <cache dir>/cuda"),
    Setting("PORTAKERN_OPENCL_CACHE", "path", None,
            "PyOpenCL's compiled-program cache; unset: <cache dir>/pyopencl when "
            "PORTAKERN_CACHE_DIR is set or there is no home directory, else PyOpenCL's "
            "default (~/.cache/pyopencl)"),
    Setting("PORTAKERN_TUNING", "choice", "nearest",
            "tuned-config lookups: nearest (the nearest tuned problem bucket), exact (only the "
            "same bucket) or off", choices=("nearest", "exact", "off")),
    Setting("PORTAKERN_KERNEL_CACHE_SIZE", "int", 128,
            "compiled programs kept per C-kernel backend (least recently used evicted)"),
    Setting("PORTAKERN_FUNCTION_CACHE_SIZE", "int", 64,
            "jitted functions kept per jax backend"),
    Setting("PORTAKERN_EXECUTABLE_CACHE_SIZE", "int", 64,
            "XLA executables kept in all by a jax backend's jitted functions"),
    Setting("PORTAKERN_HOST_MEMORY_BUDGET", "str", None,
            "the most host memory one call may ask for, e.g. 8G or 512M; unset: half of "
            "physical memory, less if /proc/meminfo or ulimit -v says so"),
    Setting("PORTAKERN_COMPILE_JOBS", "int", None,
            "worker processes of `portakern check --compile-only`; unset: the CPUs, at most 8"),
    Setting("PORTAKERN_OPENCL_POOL", "switch", True,
            "allocate OpenCL arrays from a memory pool (off: one clCreateBuffer each)"),
    Setting("PORTAKERN_OCLGRIND", "switch", True,
            "offer the Oclgrind simulator as opencl:oclgrind when it is installed"),
    Setting("PORTAKERN_OCLGRIND_ICD", "path", None,
            "Oclgrind's ICD library (liboclgrind-rt-icd.so); unset: found beside oclgrind"),
    Setting("PORTAKERN_PTXAS", "path", None,
            "the ptxas the resource report runs; unset: PATH, beside nvcc, $CUDA_PATH/bin, "
            "/usr/local/cuda/bin"),
    Setting("PORTAKERN_HIPCC", "path", None,
            "the hipcc the AMD compile check runs; unset: PATH, then /opt/rocm/bin/hipcc"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}


def is_off(text: str | None) -> bool:
    """Whether a value says off (0, off, no, false, none; any case, spaces ignored)."""
    return text is not None and text.strip().lower() in OFF


def raw(name: str) -> str | None:
    """The variable's text, stripped; None when unset or blank."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a declared setting (portakern/core/settings.py)")
    text = os.environ.get(name)
    return text.strip() if text is not None and text.strip() else None


def watcher(name: str) -> Callable[[], object]:
    """A zero-argument callable giving a cheap token of the variable's current value (equal
    tokens: the same value), for the per-call dispatch path, whose key must change when the
    variable does (``os.environ.get`` costs ~0.7 µs: it encodes the name and decodes the
    value every time).

    On POSIX CPython, ``os.environ`` keeps its data in a dict of bytes (``_data``) which every
    ``os.environ[...] = ...``, ``del`` and ``monkeypatch.setenv`` updates: the token is that
    dict's raw bytes value (~50 ns). Anywhere else it is ``os.environ.get(name)``. Like
    ``raw``, this sees changes made through ``os.environ``, not a C-level ``putenv``."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a declared setting (portakern/core/settings.py)")
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        try:
            key = encode(name)
        except Exception:
            key = None
        if isinstance(key, bytes) and all(isinstance(k, bytes) for k in list(data)[:1]):
            return functools.partial(data.get, key)
    return functools.partial(os.environ.get, name)


def get(name: str) -> Any:
    """The typed value: the default when unset, blank or malformed (an int that is not a
    positive integer, a choice not listed); 'path|off' gives None when off; 'switch' a bool."""
    s = SETTINGS[name]
    text = raw(name)
    if text is None:
        return s.default
    if s.kind == "switch":
        return not is_off(text)
    if s.kind == "path|off":
        return None if is_off(text) else os.path.expanduser(text)
    if s.kind == "path":
        return os.path.expanduser(text)
    if s.kind == "int":
        try:
            value = int(text)
        except ValueError:
            return s.default
        return value if value > 0 else s.default
    if s.kind == "choice":
        if is_off(text):
            return "off"
        low = text.lower()
        return low if low in s.choices else s.default
    return text


def describe() -> list[tuple[str, str, str]]:
    """(name, 'value (set)' or 'default value', doc) for every setting: `portakern info`."""
    out = []
    for s in _ALL:
        text = raw(s.name)
        shown = f"{text} (set)" if text is not None else \
            f"default: {'unset' if s.default is None else s.default}"
        out.append((s.name, shown, s.doc))
    return out
