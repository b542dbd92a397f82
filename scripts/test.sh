#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite on every backend present.
# Under CI=true the hypothesis profile "ci" is used (derandomized, deadline=None, 100 examples).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests — treating that as a failure" >&2
  exit 1
fi
exit "$rc"
