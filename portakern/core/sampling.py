"""Drawing test cases: the pieces every op's case generator is built from (core layer).

A ``Chooser`` abstracts where randomness comes from: hypothesis' ``data.draw`` in the test
suite (so failures shrink) or a seeded numpy Generator in ``portakern check``. A generator is
``(Chooser, dtype) -> Case`` and lives in its op's spec (``KernelSpec.cases``); shapes come from
lists chosen to hit edges: 1, primes, tile sizes +- 1 (the default schedules tile by 8, 16, 32
and 64), tall-skinny, odd head dims (40, 59, 80, 111). portakern.tools.cases (a tool) finds the
generator for an op and compares a result with the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes

EDGE_SIZES = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
HEAD_DIMS = (1, 8, 16, 40, 59, 64, 80, 111, 128)


class Chooser:
    """Draws primitive choices; subclasses wrap hypothesis or numpy."""

    def choice(self, options: Sequence[Any]) -> Any:
        raise NotImplementedError

    def boolean(self, p: float = 0.5) -> bool:
        raise NotImplementedError

    def seed(self) -> int:
        raise NotImplementedError


class NumpyChooser(Chooser):
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def choice(self, options: Sequence[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def boolean(self, p: float = 0.5) -> bool:
        return bool(self.rng.random() < p)

    def seed(self) -> int:
        return int(self.rng.integers(2**31))


@dataclass
class Case:
    """One call: operand arrays (storage dtype), keyword params, and a readable description."""

    arrays: dict[str, np.ndarray | None]
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def describe(self) -> str:
        shapes = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self.arrays.items() if v is not None)
        extra = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        note = f" [{self.note}]" if self.note else ""
        return f"{shapes}{'; ' + extra if extra else ''}{note}"


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0,
            offset: float = 0.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale + offset
    big = float(np.finfo(np.float16).max if dtype == "float16" else 1e300)
    return dtypes.cast_to(np.clip(x, -big, big), dtype)  # near the range, never past it


def batch_pair(ch: Chooser) -> tuple[tuple[int, ...], tuple[int, ...]]:
    full = ch.choice(((), (1,), (3,), (2, 3), (2, 1, 3)))
    def variant() -> tuple[int, ...]:
        dims = list(full)
        if dims and ch.boolean(0.3):
            dims = dims[ch.choice(range(len(dims) + 1)):]  # drop leading dims
        return tuple(1 if ch.boolean(0.25) else d for d in dims)
    return variant(), variant()


def finite_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    big = float(np.finfo(np.float16).max if dtype == "float16" else 1e300)
    return dtypes.cast_to(np.where(np.isfinite(x), np.clip(x, -big, big), x), dtype)


CaseGenerator = Callable[[Chooser, str], Case]
