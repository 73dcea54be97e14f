"""Opening the local in-process engine for `kapitsa bench --model X`: the opener `kapitsa serve` uses,
with serve's idle warm-up, waited for before the workloads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from kapitsa.engine.client import EngineClient
from kapitsa.engine.options import DEFAULT_SPECULATIVE
from kapitsa.errors import NotBuilt

# The longest the bench waits for the engine's warm-up (a fresh machine compiles kernels for a
# minute or more); past it the workloads run and pay what is left
WARM_UP_LIMIT_S = 600.0
POLL_S = 0.1


@contextlib.asynccontextmanager
async def open_local_engine(
    model: str | None, *, speculative: str = DEFAULT_SPECULATIVE
) -> AsyncIterator[EngineClient]:
    """Load `model` (default: the settings' default model) into an engine thread opened as `kapitsa
    serve` opens one: it readies its decode batch sizes and prefill lengths while idle (on a GPU),
    and the workloads start once that is done, so the bench times what a server's clients get
    rather than the one-time compiles a first process pays. Stopped afterwards."""
    from kapitsa.opener import open_engine

    try:
        engine = open_engine(model, speculative=speculative, warm_batches=True)
    except NotBuilt as err:
        raise NotBuilt(f"{err}; bench another server with `--no-local --compare URL`") from err
    with contextlib.closing(engine) as client:
        await until_warm(client)
        yield client


async def until_warm(client: EngineClient, limit_s: float = WARM_UP_LIMIT_S) -> float:
    """Wait until `client`'s idle warm-up has nothing pending (at most `limit_s`); its seconds."""
    started = time.monotonic()
    while (stats := client.stats()).warm_batches_pending and stats.alive:
        if time.monotonic() - started > limit_s:
            break
        await asyncio.sleep(POLL_S)
    return time.monotonic() - started
