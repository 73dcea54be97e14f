#!/usr/bin/env bash
# The project's one test command (README and .ci/run both run it): makes .venv if needed,
# installs kapitsa with its test dependencies, then runs pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade "pip>=25.1"
.venv/bin/python -m pip install -q -e . --group test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
