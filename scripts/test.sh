#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite on every backend present.
# Under CI=true the hypothesis profile "ci" is used (derandomized, deadline=None, 100 examples).
#
# Two pytest processes: the jax targets run in their own, which runs only the tests that
# depend on the targets (tests/conftest.py), so target-independent tests run once. (XLA:CPU
# keeps memory maps per compiled executable; tests/conftest.py clears jax's caches before
# vm.max_map_count is reached, which once segfaulted a single long process.) Every backend is
# still tested; each run prints its own summary of the backends it did NOT test and why.
# Both halves run on two pytest-xdist workers (work stealing: a few long cases would otherwise
# leave one worker idle at the end). On a fresh machine they are bound by compilations, each
# on one thread: XLA's (one per new shape) and the OpenCL compilers' (PoCL's and Intel's
# LLVM, one per new kernel variant), while one process left half of two cores idle.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
status=0
# Lint and type check first (seconds; mypy's scope is [tool.mypy] files in pyproject.toml):
# a failure fails the test command, and pytest still runs so one run reports everything.
.venv/bin/ruff check . || { echo "test.sh: ruff check failed" >&2; status=1; }
.venv/bin/mypy || { echo "test.sh: mypy failed" >&2; status=1; }
run() {
  PORTAKERN_TEST_BACKENDS="$1" .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=8 "${@:2}"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests for backends $1 — treating that as a failure" >&2
    rc=1
  fi
  [ "$rc" -eq 0 ] || status=$rc
}
run numpy,opencl,cuda -n 2 --dist worksteal "$@"
PORTAKERN_TEST_TARGET_TESTS_ONLY=1 run jax -n 2 --dist worksteal "$@"
exit "$status"
