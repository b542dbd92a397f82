"""Which backend runs a call: ``backend=`` > ``with use(...)`` > $PORTAKERN_BACKEND > automatic.

Strict: a backend that is unknown or cannot run raises BackendUnavailable with the reason and
the fix; there is never a silent fallback. ``use`` is a contextvar, so threads and asyncio
tasks each see their own choice. Automatic selection prefers an accelerator and can say what
it picked and why (``explain()``, ``portakern info``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..backend import registry
from ..backend.base import Backend
from ..core import settings
from ..core.errors import BackendUnavailable, UnknownBackendError
from ..core.lru import LRUCache

ENV_VAR = "PORTAKERN_BACKEND"
_SELECTOR = re.compile(r"^([a-z][a-z0-9_]*)(?::([A-Za-z0-9_]+))?$")
_current: contextvars.ContextVar[str | Backend | None] = contextvars.ContextVar(
    "portakern_backend", default=None)
# the ``use`` choice of this thread/task, read on every call's path (plan keys include it)
current_choice = _current.get
_instances: dict[tuple[str, str | None], Backend] = {}
_lock = threading.Lock()


def _reset_lock_after_fork() -> None:  # another thread may have held them at the fork
    global _lock, _owners_lock
    _lock = threading.Lock()
    _owners_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def _shown(value: object, limit: int = 60) -> str:
    """repr of a user's selector for an error message, cut to ``limit`` characters (a
    selector can come from anywhere, e.g. a pasted environment variable)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse(text: str, origin: str = "backend") -> tuple[str, str | None]:
    if not isinstance(text, str):
        raise UnknownBackendError(f"{origin} must be a string like 'opencl' or 'opencl:0'; got "
                                  f"{type(text).__name__} {_shown(text)}.")
    m = _SELECTOR.match(text.strip())
    if not m:
        raise UnknownBackendError(
            f"{origin} {_shown(text)} is malformed; expected NAME or NAME:DEVICE, e.g. 'opencl', "
            f"'opencl:1', 'jax:cpu'. Registered backends: {', '.join(registry.names())}.")
    name, dev = m.group(1), m.group(2)
    if name not in registry.names():
        raise UnknownBackendError(f"{origin} {_shown(text)} names no registered backend; "
                                  f"expected one of {', '.join(registry.names())}.")
    return name, dev


_by_text: dict[str, Backend] = {}


def get(text: str, origin: str = "backend") -> Backend:
    """The backend instance for 'name[:device]', created once and reused (thread-safe)."""
    inst = _by_text.get(text) if isinstance(text, str) else None
    if inst is not None:  # hot path: no parsing, no registry lookups
        return inst
    inst = _get(text, origin)
    _by_text[text] = inst
    return inst


def _forget(name: str) -> None:
    """Drop the instances of backend ``name`` (``registry.unregister_backend``)."""
    with _lock:
        for key in [k for k in _instances if k[0] == name]:
            _instances.pop(key, None)
        for text in [t for t in list(_by_text) if t.strip().partition(":")[0] == name]:
            _by_text.pop(text, None)


registry.UNREGISTER_LISTENERS.append(_forget)


def _get(text: str, origin: str) -> Backend:
    """One instance (one device context) per device: the selector is normalised first, so
    'opencl', 'opencl:0', 'opencl:00' and automatic selection of that device share it."""
    name, dev = parse(text, origin)
    inst = _instances.get((name, dev))
    if inst is not None:
        return inst
    with _lock:
        cls = registry.load(name)
        if not isinstance(cls, type):
            raise BackendUnavailable(f"backend {name!r} cannot run here: {cls.reason}. "
                                     f"Fix: {cls.fix}.")
        av = cls.probe()
        if not av.available:
            raise BackendUnavailable(f"backend {name!r} cannot run here: {av.reason}. "
                                     f"Fix: {av.fix}.")
        canon = cls.canonical_device(dev)
        inst = _instances.get((name, canon))
        if inst is None:
            inst = cls.opener(canon)(canon)
            _instances[(name, canon)] = inst
        _instances[(name, dev)] = inst
    return inst


def automatic() -> tuple[str, str]:
    """(selector, why) of the best usable backend: highest score across backends.

    Called with inputs, ``resolve`` first follows them: device arrays of a backend run there.
    """
    best: tuple[int, str, str] | None = None
    for name in registry.names():
        cls = registry.load(name)
        if not isinstance(cls, type):
            continue
        try:
            choices = cls.auto_choices()
        except Exception:
            continue
        for c in choices:
            if best is None or c[0] > best[0]:
                best = c
    if best is None:  # pragma: no cover - numpy is always there
        raise BackendUnavailable("no backend is usable; reinstall portakern")
    return best[1], best[2]


def owner_of(arrays: Iterable[Any] | None) -> str | None:
    """The backend whose native array type appears among the inputs, if any (by module).

    Memoised on the inputs' types and the registry's version: this is on every call that
    names no backend (the quick start's path)."""
    if not arrays:
        return None
    types_key = tuple([x.__class__ for x in arrays])
    if _OWNERS_VERSION[0] == registry.VERSION:
        got = _OWNERS.get(types_key, _UNKNOWN)
        if got is not _UNKNOWN:
            return got
    got = _owner_of_types(types_key)
    with _owners_lock:  # LRUCache writers hold its owner's lock
        if _OWNERS_VERSION[0] != registry.VERSION:
            _OWNERS.clear()
            _OWNERS_VERSION[0] = registry.VERSION
        _OWNERS[types_key] = got
    return got


# the inputs' types -> their owner's name (None: no owner), LRU-bounded: a process sees few
# combinations of array types
_OWNERS: LRUCache = LRUCache(1024)
_OWNERS_VERSION = [-1]
_UNKNOWN = object()
_owners_lock = threading.Lock()


def _owner_of_types(types: tuple[type, ...]) -> str | None:
    mods = {t.__module__.split(".")[0] for t in types if t is not type(None)}
    mods.discard("numpy")
    mods.discard("builtins")
    if not mods:
        return None
    for name in registry.names():
        cls = registry.load(name)
        if isinstance(cls, type) and mods & set(cls.array_modules):
            return name
    return None


def _where(owner: str, arrays: Iterable[Any] | None) -> str:
    """The selector of the device the owner's first native input lives on ('opencl:1'), or
    the owner's name (its default device) when the backend cannot tell."""
    cls = registry.load(owner)
    if isinstance(cls, type):
        mods = set(cls.array_modules)
        for x in arrays or ():
            if x.__class__.__module__.split(".")[0] in mods:
                dev = cls.selector_of(x)
                return f"{owner}:{dev}" if dev is not None else owner
    return owner


def follows_inputs(backend: str | Backend | None, arrays: Iterable[Any] | None) -> bool:
    """Whether ``resolve(backend, arrays)`` picks the device by where the inputs live: no
    backend=, no ``use``, no $PORTAKERN_BACKEND, and a native input (a plan made so must
    check, when an input is on another device, that it still runs where the inputs are)."""
    if backend is not None or _current.get() is not None or settings.selection.backend is not None:
        return False
    owner = owner_of(arrays)
    # only where the owner tells devices apart (OpenCL): jax's and CuPy's arrays go to their
    # backend's default device, so their plans never need the re-check on the call path
    return owner is not None and _where(owner, arrays) != owner


_AUTO: dict[int, Backend] = {}  # registry version -> the automatic choice's instance


def resolve(backend: str | Backend | None = None, arrays: Iterable[Any] | None = None
            ) -> Backend:
    if backend is not None:
        if isinstance(backend, Backend):
            return backend
        return get(backend, "backend=")
    cur = _current.get()
    if cur is not None:
        return cur if isinstance(cur, Backend) else get(cur, "portakern.use(...)")
    env = settings.selection.backend
    if env is not None:
        return get(env, f"${ENV_VAR}")
    owner = owner_of(arrays)
    if owner is not None:
        return get(_where(owner, arrays))
    inst = _AUTO.get(registry.VERSION)
    if inst is None:
        sel, _ = automatic()
        inst = get(sel)
        _AUTO.clear()
        _AUTO[registry.VERSION] = inst
    return inst


def explain(backend: str | None = None) -> str:
    """One line saying which backend a call would use and why."""
    if backend is not None:
        return f"{resolve(backend).describe()}: given as backend="
    cur = _current.get()
    if cur is not None:
        return f"{resolve().describe()}: set by portakern.use({cur!r})"
    env = settings.selection.backend
    if env is not None:
        return f"{resolve().describe()}: set by ${ENV_VAR}={env}"
    sel, why = automatic()
    return (f"{get(sel).describe()}: automatic choice — {why}. Device arrays run where they "
            "live (an array made on opencl:1 runs on opencl:1)")


@contextlib.contextmanager
def use(backend: str | Backend) -> Iterator[Backend]:
    """Select a backend for the calls in this block (this thread / task only)."""
    # fail now, at the with-statement, if it cannot run; errors name portakern.use(...)
    inst = backend if isinstance(backend, Backend) else get(backend, "portakern.use(...)")
    token = _current.set(inst)
    try:
        yield inst
    finally:
        _current.reset(token)
