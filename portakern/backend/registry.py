"""The backend registry (``pk.backends()`` is ``report``): the in-tree table plus the entry-point
group ``portakern.backends``.

Backends load lazily; one whose import raises is recorded as unavailable with the exception,
and every other backend keeps working. This module is the only place that names backends.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from .base import Availability, Backend, missing_members

IN_TREE: dict[str, str] = {
    "numpy": "portakern.backend.numpy:NumpyBackend",
    "opencl": "portakern.backend.opencl:OpenCLBackend",
    "cuda": "portakern.backend.cuda:CudaBackend",
    "jax": "portakern.backend.jax:JaxBackend",
}
# Modules imported together with a backend, which extend it through its hooks: the Oclgrind
# simulator adds opencl:oclgrind to the OpenCL backend. A companion that fails to import is
# left out; the backend itself still works.
COMPANIONS: dict[str, tuple[str, ...]] = {"opencl": ("portakern.backend.oclgrind",)}
ENTRY_POINT_GROUP = "portakern.backends"

_LOCK = threading.Lock()
_CLASSES: dict[str, type[Backend] | Availability] = {}
_EXTRA: dict[str, str | type[Backend]] = {}
# The entry points are read once per process (importlib.metadata scans every installed
# distribution: ~1 ms, which automatic selection used to pay on every call) and again only
# on request: refresh() (``pk.refresh_backends()``), e.g. after installing a plugin.
_ENTRY_POINTS: dict[str, object] | None = None
# Bumped whenever the table may have changed (refresh, register_backend): what selection
# memoises from it (the owner of an array type, the automatic choice) is keyed on it.
VERSION = 0


def _entry_points() -> dict[str, object]:
    global _ENTRY_POINTS
    got = _ENTRY_POINTS
    if got is None:
        got = {}
        try:
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                got.setdefault(ep.name, ep)
        except Exception:  # broken metadata must not break the in-tree backends
            pass
        _ENTRY_POINTS = got
    return got


def _targets() -> dict[str, object]:
    table: dict[str, object] = dict(IN_TREE)
    for name, ep in (_ENTRY_POINTS if _ENTRY_POINTS is not None else _entry_points()).items():
        table.setdefault(name, ep)
    table.update(_EXTRA)
    return table


def names() -> list[str]:
    """Every registered backend name (available or not), in-tree first."""
    return list(_targets())


def refresh() -> None:
    """Read the ``portakern.backends`` entry points again (after installing or removing a
    plugin in this process) and forget the classes and availability loaded from them.

    Public as ``portakern.refresh_backends()``. Backend instances already created stay as they
    are; selectors resolved from now on see the new table."""
    global _ENTRY_POINTS, VERSION
    with _LOCK:
        _ENTRY_POINTS = None
        VERSION += 1
        for name in [n for n in _CLASSES if n not in IN_TREE and n not in _EXTRA]:
            got = _CLASSES.pop(name)
            if isinstance(got, type):
                Backend._probe_cache.pop(got, None)


def register_backend(name: str, target: str | type[Backend]) -> None:
    """Register a backend class (or 'module:Class') under a name, e.g. from a plugin."""
    global VERSION
    with _LOCK:
        _EXTRA[name] = target
        _CLASSES.pop(name, None)
        VERSION += 1


# Called with a backend's name when ``unregister_backend`` removes it: the runtime's selection
# registers here the forgetting of the instances made of it.
UNREGISTER_LISTENERS: list[Callable[[str], None]] = []


def unregister_backend(name: str) -> bool:
    """Undo ``register_backend(name, ...)`` (a plugin unloading, a test cleaning up): the
    class, its cached availability and the instances made of it are forgotten, and a selector
    naming it is refused from then on (or, where the registration had replaced an in-tree or
    entry-point backend of that name, reaches that one again). False when ``name`` was not
    registered by ``register_backend``."""
    global VERSION
    with _LOCK:
        if name not in _EXTRA:
            return False
        target = _EXTRA.pop(name)
        for cls in (target, _CLASSES.pop(name, None)):
            if isinstance(cls, type):
                Backend._probe_cache.pop(cls, None)
        VERSION += 1
    for fn in list(UNREGISTER_LISTENERS):
        fn(name)
    return True


def _reset_lock_after_fork() -> None:  # another thread may have held it at the fork
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def load(name: str) -> type[Backend] | Availability:
    """The backend class, or an Availability explaining why it could not be imported."""
    with _LOCK:
        got = _CLASSES.get(name)
        if got is not None:
            return got
        target = _targets().get(name)
        if target is None:
            raise KeyError(name)
        try:
            if isinstance(target, type):
                cls = target
            elif isinstance(target, str):
                mod, _, attr = target.partition(":")
                cls = getattr(importlib.import_module(mod), attr)
                for companion in COMPANIONS.get(name, ()):
                    try:
                        importlib.import_module(companion)
                    except Exception:  # pragma: no cover - e.g. a broken optional install
                        pass
            else:
                cls = target.load()  # type: ignore[attr-defined]  # an EntryPoint
            missing = missing_members(cls)
            got = cls if not missing else Availability(
                False, f"the {name} backend class {getattr(cls, '__qualname__', cls)!r} does "
                f"not implement the required members {', '.join(missing)}",
                "implement them (docs/architecture.md, 'How to add a backend': a backend is "
                "an allocator, a compiler and a program)")
        except Exception as exc:
            got = Availability(False, f"importing the {name} backend raised "
                                      f"{type(exc).__name__}: {exc}",
                               "reinstall portakern or the plugin that provides it")
        _CLASSES[name] = got
        return got


def availability(name: str) -> Availability:
    got = load(name)
    return got if isinstance(got, Availability) else got.probe()


def available_targets(only: set[str] | None = None, exclude: tuple[str, ...] = ()
                      ) -> tuple[list[str], dict[str, str]]:
    """Every usable backend's targets (``Backend.test_targets``) and, for the rest, why not.

    The shared test suite, ``portakern check`` and ``portakern bench`` all enumerate targets
    through this one function, so they agree on what "every backend present" means."""
    targets: list[str] = []
    skipped: dict[str, str] = {}
    for name in names():
        if name in exclude or (only is not None and name not in only):
            continue
        got = load(name)
        if not isinstance(got, type):
            skipped[name] = got.reason
            continue
        av = got.probe()
        if not av.available:
            skipped[name] = f"{av.reason} (fix: {av.fix})"
            continue
        targets.extend(got.test_targets())
    return targets, skipped


def report() -> dict[str, dict[str, Any]]:
    """Every registered backend: available?, devices, versions, or why not and how to fix."""
    return {name: availability(name).as_dict() for name in names()}

