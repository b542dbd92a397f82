"""The statistical error model an op's ``KernelSpec.statistical`` returns (core layer).

Its own module so the ops (below the runtime) can build one without importing
portakern.verify, which checks results against it (see that module's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StatModel:
    """An op's probabilistic error model for one problem (portakern.verify's docstring).

    sigma: random part's scale (sub-Gaussian variance proxy sigma^2), broadcastable to the
    output; slack: deterministic part's bound (0 where none); group_axes: output axes along
    which errors may be correlated (reduced first, then averaged over independent groups)."""

    sigma: Any
    slack: Any = 0.0
    group_axes: tuple[int, ...] = ()
