"""Sending parts of a forward to the device one after another, so a long prefill's transients do
not all live at once: a backend keeps an op's buffers until the command buffer holding it completes,
and a forward built as one lazy graph holds every layer's (or attention block's) at the same time.
Inside mx.compile or vmap nothing can be evaluated: the trace then stays one graph, and so does a
forward built only to hand its kernels to the compile workers (`building`), which is never run."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import mlx.core as mx

_local = threading.local()


@contextlib.contextmanager
def building() -> Iterator[None]:
    """On this thread, within the block, `send` and `eval_unless_traced` evaluate nothing: a graph
    built to hand its custom kernels to the compile workers (runner/warmup.py) stays unrun."""
    outer = getattr(_local, "building", False)
    _local.building = True
    try:
        yield
    finally:
        _local.building = outer


def _building() -> bool:
    return getattr(_local, "building", False)


def _traced(err: ValueError) -> bool:
    return "transformation" in str(err) or "compile" in str(err)


def send(x: mx.array, previous: mx.array | None) -> mx.array | None:
    """Queue `x` on the device, then wait for `previous` (the last one sent); returns what was sent,
    None inside a trace or while `building`."""
    if _building():
        return None
    try:
        mx.async_eval(x)
    except ValueError as err:
        if not _traced(err):
            raise
        return None
    if previous is not None:
        mx.eval(previous)
    return x


def eval_unless_traced(x: mx.array) -> None:
    """Evaluate `x` now, outside a trace (and unless `building`)."""
    if _building():
        return
    try:
        mx.eval(x)
    except ValueError as err:
        if not _traced(err):
            raise
