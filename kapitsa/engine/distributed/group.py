"""The process group: MLX's distributed init, and collectives that turn a lost peer into an error.

A dead peer on the same host closes its sockets and the ring backend usually raises at once; when
it does not (a collective inside a tensor-parallel step stays blocked, a machine loses power),
the watchdog (watchdog.py) ends the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from kapitsa.errors import KapitsaError

log = logging.getLogger(__name__)

PARALLEL_MODES = ("pipeline", "tensor")
# rank 0 sends an idle command this often, so followers tell a quiet server from a dead one
HEARTBEAT_S = 1.0


class PeerLost(KapitsaError):
    """A rank of the group stopped answering; the group cannot serve any further request."""

    http_status = 503


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place in the group: `rank` of `size`, and the MLX group object."""

    rank: int
    size: int
    handle: object

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size


def init_group(backend: str = "any") -> Group:
    """Join the group mlx.launch started this process in (MLX_RANK, MLX_HOSTFILE are its own)."""
    try:
        handle = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as err:
        if not _alone():
            raise KapitsaError(f"cannot join the distributed group ({backend} backend): {err}") from err
        # MLX parses the empty file at any init: without it, init gives the group of one
        os.environ.pop("MLX_HOSTFILE")
        handle = mx.distributed.init(strict=False)
    return Group(handle.rank(), handle.size(), handle)


def _alone() -> bool:
    """mlx.launch with a one-host hostfile gives its one rank an empty ring hostfile."""
    path = os.environ.get("MLX_HOSTFILE")
    return bool(path) and os.path.isfile(path) and not open(path).read().strip()


def evaluate(*arrays: mx.array, what: str) -> None:
    """`mx.eval` of a step that holds collectives; a lost connection becomes `PeerLost`."""
    try:
        mx.eval(*arrays)
    except RuntimeError as err:
        raise PeerLost(f"a rank of the group stopped during {what}: {err}") from err


EXIT_HOOKS: list[Callable[[int], None]] = []  # called with the code before a hard exit (commands/group.py)


def hard_exit(message: str, code: int = 1) -> None:
    """Leave now: a thread blocked in a collective never returns, so no orderly shutdown can run."""
    log.error("%s", message)
    os.write(2, f"kapitsa: {message}\n".encode())
    for hook in EXIT_HOOKS:
        with contextlib.suppress(Exception):  # nothing may stop the exit
            hook(code)
    os._exit(code)


def barrier(group: Group, *, what: str) -> None:
    """Wait until every rank reaches this point (after loading: ranks load at their own pace)."""
    total = mx.distributed.all_sum(mx.array([1], dtype=mx.int32), group=group.handle)
    evaluate(total, what=what)


def gather_ints(group: Group, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same length on each), in rank order."""
    gathered = mx.distributed.all_gather(mx.array([values], dtype=mx.int64), group=group.handle)
    evaluate(gathered, what="a gather")
    return gathered.tolist()
