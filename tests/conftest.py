"""Shared fixtures: every registered backend's test targets, hypothesis profiles, and a loud
summary line naming each backend that was NOT tested and why.

PORTAKERN_TEST_BACKENDS=cuda,opencl restricts the targets (the GPU script uses it).
PORTAKERN_TEST_TARGET_TESTS_ONLY=1 also drops the tests that do not depend on the targets
(parametrized over none, not marked per_target, not about jax): scripts/test.sh runs the
jax targets in a second process that way, so nothing target-independent runs twice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from portakern.backend import registry

# tests/ mirrors the package's folders; a few tables are shared between test modules of
# different folders (test_errors.BAD_CALLS, test_ops.ALTERNATIVE_CONFIGS,
# test_simulator.cases_for), so every folder is importable whichever file is collected first
for _folder in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir()
                      and not p.name.startswith((".", "_"))):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

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


def require_tool(found: object, what: str, fix: str) -> None:
    """For a test that needs a tool the set-up installs (ptxas, cuobjdump, hipcc, Oclgrind):
    nothing when ``found`` is truthy; else under CI (CI set) a failure naming the fix — CI
    installs it, so a missing one is a broken set-up, and a check that skips proves nothing —
    and elsewhere a skip with the same reason."""
    if found:
        return
    msg = f"{what}. Fix: {fix}."
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)



def require_simulator() -> None:
    """For a test on opencl:oclgrind: a failure under CI (scripts/setup.sh installs pyopencl
    and Oclgrind), else a skip (require_tool)."""
    try:
        from portakern.backend.oclgrind import simulator_info
    except Exception as exc:  # pyopencl missing
        require_tool(None, f"opencl:oclgrind needs pyopencl ({exc})",
                     "pip install 'portakern[opencl]'")
    require_tool(simulator_info() is not None,
                 "opencl:oclgrind: the Oclgrind simulator is not installed",
                 "apt-get install oclgrind (scripts/setup.sh installs it)")


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


# XLA:CPU keeps a few memory mappings per compiled executable (3-6 measured with jaxlib
# 0.10.2) until its caches are cleared. The jax half of the suite compiles well over ten
# thousand distinct shapes, and at vm.max_map_count (65530 by default) the next compilation
# segfaults inside XLA (seen twice in CI at the same test). Dropping jax's caches once the
# process nears the limit keeps every test's compilation real and the process alive.
MAP_COUNT_LIMIT = 0.5


def _map_count() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to watch
        return None


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


MAX_MAPS = _max_map_count()
# per process: under pytest-xdist (the jax half of scripts/test.sh) each worker clears its own
# caches, and only the controller's (none) reach the summary below
JAX_CACHE_CLEARS: list[int] = []


@pytest.fixture(autouse=True)
def _bounded_jax_executables() -> object:
    yield
    import sys

    jax = sys.modules.get("jax")
    if jax is None:
        return
    n = _map_count()
    if n is not None and n > MAP_COUNT_LIMIT * MAX_MAPS:
        jax.clear_caches()
        JAX_CACHE_CLEARS.append(n)


TARGET_FIXTURES = ("target", "device_target", "kernel_target", "jtarget")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PORTAKERN_TEST_TARGET_TESTS_ONLY") != "1":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        wanted = (any(k in params for k in TARGET_FIXTURES)
                  or item.get_closest_marker("per_target") is not None
                  or "jax" in item.nodeid)
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
    # numpy:0 *is* the float64 oracle (semantics in float64, cast): its tests compare the
    # oracle with itself, so they prove plumbing (validation, dispatch, casts, shapes), not
    # that an implementation agrees with the oracle.
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed"):
        for rep in tr.stats.get(outcome, []):
            nodeid = getattr(rep, "nodeid", "")
            for t in TARGETS:
                if f"[{t}-" in nodeid or f"-{t}-" in nodeid or f"-{t}]" in nodeid \
                        or f"[{t}]" in nodeid:
                    counts.setdefault(t, {}).setdefault(outcome, 0)
                    counts[t][outcome] += 1
                    break
    for t in TARGETS:
        c = counts.get(t, {})
        n = f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed"
        if t.startswith("numpy"):
            tr.write_line(f"PLUMBING ONLY: {t}: {n} — the float64 oracle compared with itself "
                          "(dispatch, validation, casts), not agreement evidence", yellow=True)
        else:
            tr.write_line(f"agreement with the float64 oracle: {t}: {n}")
    if JAX_CACHE_CLEARS:
        tr.write_line(f"jax caches cleared {len(JAX_CACHE_CLEARS)} time(s) to stay under "
                      f"vm.max_map_count={MAX_MAPS} (memory maps then: {JAX_CACHE_CLEARS})")
    if SKIPPED:
        for name, why in SKIPPED.items():
            tr.write_line(f"NOT TESTED: backend {name!r}: {why}", yellow=True, bold=True)
        tr.write_line(f"SKIPPED BACKENDS: {', '.join(SKIPPED)} — their tests did not run here.",
                      red=True, bold=True)
