"""Shared fixtures: every registered backend's test targets, hypothesis profiles, and a loud
summary line naming each backend that was NOT tested and why.

PORTAKERN_TEST_BACKENDS=cuda,opencl restricts the targets (the GPU script uses it).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from portakern import backends as registry

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=100, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", deadline=None, max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "thorough", deadline=None, max_examples=1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("PORTAKERN_HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") else "dev"))

SKIPPED: dict[str, str] = {}


def _targets() -> list[str]:
    wanted = os.environ.get("PORTAKERN_TEST_BACKENDS")
    only = {w.strip() for w in wanted.split(",")} if wanted else None
    out, skipped = registry.available_targets(only)
    SKIPPED.update(skipped)
    return out


TARGETS = _targets()
KERNEL_TARGETS = [t for t in TARGETS
                  if getattr(registry.load(t.split(":")[0]), "dialect", None) is not None]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", TARGETS)
    if "device_target" in metafunc.fixturenames:  # targets whose arrays live on a device
        metafunc.parametrize("device_target", [t for t in TARGETS if not t.startswith("numpy")])
    if "kernel_target" in metafunc.fixturenames:  # targets that compile portakern's C kernels
        metafunc.parametrize("kernel_target", KERNEL_TARGETS)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    tr = terminalreporter
    tr.section("portakern backends")
    tr.write_line(f"tested targets: {', '.join(TARGETS) or 'none'}")
    if SKIPPED:
        for name, why in SKIPPED.items():
            tr.write_line(f"NOT TESTED: backend {name!r}: {why}", yellow=True, bold=True)
        tr.write_line(f"SKIPPED BACKENDS: {', '.join(SKIPPED)} — their tests did not run here.",
                      red=True, bold=True)
