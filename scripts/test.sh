#!/usr/bin/env bash
# The project's one test command (README and .ci/run both run it): makes .venv if needed,
# installs kapitsa with its test dependencies, then runs pytest on every core (pytest-xdist's -n auto;
# most tests wait on subprocesses, servers or agents, so two workers nearly halve a 2-core run).
# Extra args go to pytest; a later `-n 0` runs in one process.
# It fails when no test ran: nothing collected, or everything skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "kapitsa needs Python >= 3.11 ($python is older; set PYTHON=...)" >&2; exit 1; }
  "$python" -m venv .venv \
    || { echo "'$python -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2; rm -rf .venv; exit 1; }
fi
.venv/bin/python -m pip install -q --upgrade "pip>=25.1"  # 25.1 brings --group
.venv/bin/python -m pip install -q -e . --group test

report=$(mktemp)
trap 'rm -f "$report"' EXIT
set +e
.venv/bin/python -m pytest -n auto --junitxml="$report" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
# A run where every test was skipped proves nothing either (a later --junitxml in "$@" wins: skip the check).
if [ "$rc" -eq 0 ] && [ -s "$report" ]; then
  .venv/bin/python - "$report" <<'PY' || exit 1
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
ran = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
if ran <= 0:
    sys.exit("no test ran (all skipped): failing on purpose")
PY
fi
exit "$rc"
