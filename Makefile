# Developer shortcuts. The test command itself is `bash scripts/test.sh` (what CI runs).
PY := .venv/bin/python

.PHONY: test check lock formula dist

test:
	bash scripts/test.sh

# Lint, formatting and the engine's import boundary.
check:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	.venv/bin/lint-imports

# After editing dependencies in pyproject.toml: refresh uv.lock and the Homebrew formula.
lock:
	.venv/bin/uv lock
	$(PY) tools/gen_formula.py

# After changing what the sdist holds (kapitsa/, metal/, README.md, pyproject.toml): re-pin the formula's sha256.
formula:
	$(PY) tools/gen_formula.py

# The release artifacts, reproducibly: dist/kapitsa-X.Y.Z.tar.gz (uploaded to PyPI) and its wheel.
dist:
	$(PY) tools/build_dist.py dist
