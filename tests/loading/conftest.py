from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.testing.tiny import write_tiny_checkpoint

PROMPT = "Hello world! def f(x): return x + 1 日本"


@pytest.fixture
def tiny(tmp_path):
    """`tiny(kind, name=None, **kwargs)` writes a tiny checkpoint under tmp_path and returns its folder."""

    def make(kind, name=None, **kwargs):
        return write_tiny_checkpoint(tmp_path / (name or kind), kind, **kwargs)

    return make


def logits_of(loaded, text=PROMPT):
    ids = mx.array([loaded.tokenizer.encode(text)])
    out = loaded.model(ids).astype(mx.float32)
    mx.eval(out)
    return out
