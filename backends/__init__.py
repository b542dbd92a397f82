"""The backend registry: the in-tree table plus the entry-point group ``portakern.backends``.

Backends load lazily; one whose import raises is recorded as unavailable with the exception,
and every other backend keeps working. This module is the only place that names backends.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from importlib import metadata
from typing import Any

from .base import Availability, Backend

IN_TREE: dict[str, str] = {
    "numpy": "portakern.backends.numpy:NumpyBackend",
    "opencl": "portakern.backends.opencl:OpenCLBackend",
    "cuda": "portakern.backends.cuda:CudaBackend",
    "jax": "portakern.backends.jax:JaxBackend",
}
ENTRY_POINT_GROUP = "portakern.backends"

_LOCK = threading.Lock()
_CLASSES: dict[str, type[Backend] | Availability] = {}
_EXTRA: dict[str, str | type[Backend]] = {}


def _targets() -> dict[str, object]:
    table: dict[str, object] = dict(IN_TREE)
    try:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            table.setdefault(ep.name, ep)
    except Exception:  # broken metadata must not break the in-tree backends
        pass
    table.update(_EXTRA)
    return table


def names() -> list[str]:
    """Every registered backend name (available or not), in-tree first."""
    return list(_targets())


def register_backend(name: str, target: str | type[Backend]) -> None:
    """Register a backend class (or 'module:Class') under a name, e.g. from a plugin."""
    with _LOCK:
        _EXTRA[name] = target
        _CLASSES.pop(name, None)


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
            else:
                cls = target.load()  # type: ignore[attr-defined]
            got = cls
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


class _CallableModule(types.ModuleType):
    """``portakern.backends`` is this registry *and* callable: ``pk.backends()`` == report()."""

    def __call__(self) -> dict[str, dict[str, Any]]:
        return report()


sys.modules[__name__].__class__ = _CallableModule
