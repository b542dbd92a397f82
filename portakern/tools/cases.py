"""Test cases that break kernels and numerics, drawn from one source for pytest and `check`.

Each op's generator lives in its spec (``KernelSpec.cases``; the built-in ops' in
portakern/ops/<op>.py, built from portakern.core.sampling). This module (a tool, never loaded by a
call) finds the generator for an op (``case_generator``, ``CASES``), lets a user override it
(``register_cases``) and checks a backend's output against the float64 oracle (``compare``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.sampling import Case, CaseGenerator
from ..core.spec_checks import derived_cases


class _CaseTable(dict[str, CaseGenerator]):
    """Generators set with register_cases, by op name; any other registered op falls back to its
    spec's generator (``case_generator``), so ``CASES[op]`` works for every op in the registry."""

    def __missing__(self, op: str) -> CaseGenerator:
        from ..ops import OPS

        spec = OPS.get(op)
        gen = case_generator(spec) if spec is not None else None
        if gen is None:
            raise KeyError(op)
        return gen

    def get(  # type: ignore[override]  # one of Mapping.get's overloads, not all
            self, op: str, default: CaseGenerator | None = None
            ) -> CaseGenerator | None:
        try:
            return self[op]
        except KeyError:
            return default


CASES: dict[str, CaseGenerator] = _CaseTable()  # register_cases overrides; else the spec's


def register_cases(op: str, fn: CaseGenerator) -> None:
    """Give an op a case generator that takes precedence over its spec's `cases` field."""
    CASES[op] = fn


def case_generator(spec: Any) -> CaseGenerator | None:
    """The generator the suite and `portakern check` use for a spec, first found of:
    register_cases, ``spec.cases``, one derived from ``spec.shapes`` or ``spec.example``
    (portakern.core.spec_checks.derived_cases); else None."""
    got = dict.get(CASES, spec.name) or getattr(spec, "cases", None)
    if got is not None:
        return got
    return derived_cases(spec)


def compare(spec: Any, case: Case, got: Any) -> Any:
    """Check a backend's output against the float64 oracle: the op's worst-case bound and its
    statistical check (portakern.verify, the one code path behind pk.verify, the suite and
    `portakern check`). Returns a portakern.verify.Verdict.

    ``got`` is what the call returned: one array, or for an op with several outputs
    (``Problem.outputs``) a tuple with one array per output, each checked against its own
    bound and dtype (an int32 output exactly) and named in the verdict. Device arrays (jax,
    CuPy, PyOpenCL) are copied to host first."""
    from ..runtime.verify import _host, compare_arrays

    arrays, params = spec.bind((), {k: v for k, v in case.arrays.items()} | case.params)
    if isinstance(got, (tuple, list)):
        got = tuple(_host(f"got[{i}]", g, spec.name) for i, g in enumerate(got))
    elif got is not None and not isinstance(got, np.ndarray):
        got = _host("got", got, spec.name)
    return compare_arrays(spec, arrays, params, got)
