"""Compiled functions kept per owner: `compiled(owner, name, fn)`.

Used by the models' compiled decode and verify steps (models/base.py) and the cache's compiled
rollback (replay.py). A trace captures the weight arrays it reads as constants, so it lives on
the module that owns those weights and goes with it; code that replaces weights afterwards drops
the modules' `_compiled_steps` (fuse_model does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import mlx.core as mx


def drop_traces(model) -> None:  # noqa: ANN001 - any nn.Module
    """Forget every compiled function of the model's modules (their traces captured the weights
    and settings they were made with)."""
    for _, sub in model.named_modules():
        sub.__dict__.pop("_compiled_steps", None)


def compiled(owner: object, name: Hashable, fn: Callable) -> Callable:
    """`mx.compile(fn)`, made once per (owner, name, thread): each layer keeps its own traces.

    Per thread because MLX's trace cache is thread-local and keyed by the Python function's id,
    while a compiled function erases its traces only from the cache of the thread that called it
    last. One function called from two threads (a test's forward, then the engine thread) left a
    trace behind in the first thread's cache; once the model was freed, a new function reusing
    that id found the other model's trace (wrong weights and shapes)."""
    table = owner.__dict__.setdefault("_compiled_steps", {})
    key = (name, threading.get_ident())
    if key not in table:
        table[key] = mx.compile(fn)
    return table[key]
