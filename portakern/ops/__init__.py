"""The op registry: name -> KernelSpec. Built-in ops register here; users call register_op.

User ops come in two ways, both through the public API: ``portakern.register_op(spec)`` in the
user's own code, or an entry point in the group ``portakern.ops`` of the user's package, e.g.
in its pyproject.toml::

    [project.entry-points."portakern.ops"]
    swish = "my_pkg.ops:SWISH"      # a KernelSpec, a list of them, a function returning
                                    # them, or a module that calls register_op on import

Plugins load lazily, the first time the registry is read (``OPS``, ``get_op``), so importing
portakern stays cheap and a plugin may itself ``import portakern``. A plugin whose import or
registration raises is reported (a RuntimeWarning and ``plugin_errors()``, printed by
``portakern check``), never fatal: the other ops keep working.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import ItemsView, Iterable, Iterator, KeysView, ValuesView
from importlib import metadata
from types import ModuleType
from typing import Any

from ..core.errors import InvalidArgumentError, SpecError
from ..core.spec import KernelSpec
from ..core.spec_checks import check_spec
from . import attention, matmul, softmax

ENTRY_POINT_GROUP = "portakern.ops"

_LOCK = threading.RLock()
_PLUGINS: dict[str, Any] = {"state": "unloaded", "errors": {}, "loaded": []}


class _Registry(dict[str, KernelSpec]):
    """A dict whose reads first load the ``portakern.ops`` entry-point plugins (once)."""

    def __getitem__(self, key: str) -> KernelSpec:
        load_plugins()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        load_plugins()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return super().__iter__()

    def __len__(self) -> int:
        load_plugins()
        return super().__len__()

    def get(self, key: str, default: Any = None) -> Any:
        load_plugins()
        return super().get(key, default)

    def keys(self) -> KeysView[str]:
        load_plugins()
        return super().keys()

    def values(self) -> ValuesView[KernelSpec]:
        load_plugins()
        return super().values()

    def items(self) -> ItemsView[str, KernelSpec]:
        load_plugins()
        return super().items()


OPS: dict[str, KernelSpec] = _Registry(
    {s.name: s for s in (matmul.SPEC, softmax.SPEC, attention.SPEC)})


def register_op(spec: KernelSpec, *, replace: bool = False) -> KernelSpec:
    """Make a spec visible to `portakern.call`, `portakern check`, the tests and the benchmark.

    The spec is checked first (portakern.core.spec_checks.check_spec): a malformed field raises
    SpecError naming the spec, the field and the fix. ``portakern.register_op(spec,
    check=True)`` also compiles the spec's example everywhere (tools/registration.py).
    """
    def refuse_duplicate() -> None:
        current = dict.get(OPS, spec.name)  # a plain read: registering never loads plugins
        if current is not None and not replace and current is not spec:
            raise SpecError(f"spec {spec.name!r}, field `name`: an op named {spec.name!r} is "
                            "already registered. Fix: pass replace=True to override it or "
                            "choose another name.")

    if isinstance(spec, KernelSpec):
        refuse_duplicate()  # before the (possibly slow) checks
    check_spec(spec)
    with _LOCK:
        refuse_duplicate()
        dict.__setitem__(OPS, spec.name, spec)
    return spec


def unregister_op(name: str) -> KernelSpec | None:
    """Remove an op (tests and notebooks that define throw-away ops); returns it or None."""
    with _LOCK:
        return OPS.pop(name, None)


def get_op(name: str) -> KernelSpec:
    if _PLUGINS["state"] == "loaded":  # the per-call path: a plain dict read
        got = dict.get(OPS, name)
        if got is not None:
            return got
    try:
        return OPS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown op {name!r}; registered ops: {sorted(OPS)}.") from None


def _entry_points() -> Iterable[Any]:
    return metadata.entry_points(group=ENTRY_POINT_GROUP)


def _register_loaded(obj: Any) -> list[str]:
    """Register what an entry point loaded: a spec, specs, a function giving them, a module."""
    if isinstance(obj, KernelSpec):
        specs: list[Any] = [obj]
    elif isinstance(obj, ModuleType):
        spec = getattr(obj, "SPEC", None)  # else the module registered its ops on import
        specs = [spec] if isinstance(spec, KernelSpec) and dict.get(OPS, spec.name) is not spec \
            else []
    elif isinstance(obj, (list, tuple)):
        specs = list(obj)
    elif callable(obj):
        got = obj()
        specs = [] if got is None else [got] if isinstance(got, KernelSpec) else list(got)
    else:
        raise SpecError(f"the entry point loaded a {type(obj).__name__}; expected a KernelSpec, "
                        "a list of them, a function returning them, or a module. Fix: point the "
                        "entry point at one of those.")
    return [register_op(s).name for s in specs]


def load_plugins(force: bool = False) -> dict[str, str]:
    """Load the ``portakern.ops`` entry points once; returns plugin name -> error for failures.

    Called by every read of the registry. ``force=True`` loads them again (after installing a
    plugin into a running process).
    """
    if _PLUGINS["state"] == "loaded" and not force:
        return dict(_PLUGINS["errors"])
    with _LOCK:  # other threads wait here until the loading thread is done
        if _PLUGINS["state"] == "loading" or (_PLUGINS["state"] == "loaded" and not force):
            return dict(_PLUGINS["errors"])  # re-entered from a plugin that reads the registry
        _PLUGINS["state"] = "loading"
        errors: dict[str, str] = {}
        try:
            try:
                eps = list(_entry_points())
            except Exception as exc:  # broken metadata must not break the built-in ops
                eps = []
                errors["<entry points>"] = f"{type(exc).__name__}: {exc}"
            for ep in eps:
                try:
                    _PLUGINS["loaded"] += _register_loaded(ep.load())
                except Exception as exc:
                    errors[ep.name] = (f"{getattr(ep, 'value', ep.name)}: "
                                       f"{type(exc).__name__}: {exc}")
                    warnings.warn(f"portakern: the op plugin {ep.name!r} "
                                  f"({getattr(ep, 'value', '?')}) failed to load and is "
                                  f"skipped: {type(exc).__name__}: {exc}", RuntimeWarning,
                                  stacklevel=3)
        finally:
            _PLUGINS["errors"] = errors
            _PLUGINS["state"] = "loaded"
    return dict(errors)


def plugin_errors() -> dict[str, str]:
    """Entry-point plugins that failed to load: name -> 'target: error' (empty if none)."""
    load_plugins()
    return dict(_PLUGINS["errors"])


# --- rmsnorm: the fourth op, registered through the public register_op like any user op -----
from . import rmsnorm  # noqa: E402  (needs register_op above; imports only public modules)

register_op(rmsnorm.SPEC)
# --- attention's fused backward (issue 28), the same way ----------------------------------
from . import attention_backward  # noqa: E402

register_op(attention_backward.SPEC)
# --- paged decode attention (issue 29), the same way --------------------------------------
from . import paged_attention  # noqa: E402

register_op(paged_attention.SPEC)

__all__ = ["ENTRY_POINT_GROUP", "OPS", "get_op", "load_plugins", "plugin_errors", "register_op",
           "unregister_op"]
