"""Moving arrays between backends (``pk.backends()`` itself is the registry module, callable)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import selection
from .backends.base import Backend


def to_backend(x: Any, backend: str | Backend) -> Any:
    """Move an array to a backend's native array type (counted on that backend).

    Native arrays of another library go through the host unless both sides speak DLPack,
    which backends may use in their ``from_foreign`` hook.
    """
    be = selection.resolve(backend)
    if be.is_native(x):
        return x
    hook = getattr(be, "from_foreign", None)
    if hook is not None:
        got = hook(x)
        if got is not None:
            return got
    return be.to_native(np.ascontiguousarray(np.asarray(x)))
