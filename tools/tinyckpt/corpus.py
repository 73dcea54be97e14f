"""The training text: the standard library sources of the running Python, split by file into train/held-out."""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Folders that are tests, data tables, vendored tools or generated text rather than ordinary library code.
SKIPPED_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "pydoc_data",
    "idlelib",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "__phello__",
}
HELD_OUT_PERCENT = 5


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to the stdlib root, '/'-separated
    text: str


@dataclass(frozen=True)
class Function:
    name: str
    header: str  # the `def` line(s) up to and including the colon
    docstring: str | None
    source: str  # the whole function, dedented


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(name: str) -> bool:
    # A hash of the relative path, not a random draw: the split is the same on every machine.
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def read_stdlib(root: Path | None = None) -> list[SourceFile]:
    root = root or stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        for file_name in sorted(names):
            if not file_name.endswith(".py"):
                continue
            path = Path(folder) / file_name
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            files.append(SourceFile(path.relative_to(root).as_posix(), text))
    return files


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_held_out(f.name)]
    held_out = [f for f in files if is_held_out(f.name)]
    return train, held_out


def functions_in(source: SourceFile, max_lines: int = 40) -> list[Function]:
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    lines = source.text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
            continue
        start, end = node.lineno - 1, node.end_lineno
        if end - start > max_lines or not node.body:
            continue
        body_start = node.body[0].lineno - 1
        if body_start <= start:  # a one-line `def f(): return x`
            continue
        function_text = textwrap.dedent("\n".join(lines[start:end]))
        header_text = textwrap.dedent("\n".join(lines[start:body_start]))
        if not header_text.rstrip().endswith(":"):
            continue  # a comment line between the header and the body
        found.append(Function(node.name, header_text.rstrip(), ast.get_docstring(node), function_text))
    return found
