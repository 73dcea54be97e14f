"""Every test module gets a unique import name, or pytest stops the whole run at collection.

pytest (default "prepend" import mode) imports a test file by its basename unless its folder is a package
(has __init__.py); two `test_x.py` in plain folders collide. Fix: rename one, or add `__init__.py` to the
folder (then import helpers as `tests.<folder>.<module>`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _import_name(path: Path) -> str:
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def test_test_modules_have_unique_import_names() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_") or path.name == "conftest.py":
            by_name[_import_name(path)].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name != "conftest"}
    assert clashes == {}, f"rename one, or add __init__.py to its folder: {clashes}"
