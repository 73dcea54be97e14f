"""Paths and helpers shared by the tests of the trained checkpoints (issue 9)."""

from __future__ import annotations

import json
import struct
import sys
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAINED = Path(__file__).resolve().parent / "trained"
DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))

# A few lines of ordinary Python that appear in no training file.
SNIPPET = '''def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path*, without their line endings."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''

if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))


def safetensors_header(path: Path) -> dict:
    """Tensor names -> {dtype, shape, ...} read from the file's JSON header (no framework needed)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


@pytest.fixture(scope="module")
def demo_model():
    from kapitsa.engine.loading.loader import load_model

    return load_model(DEMO)
