"""`kapitsa serve`: resolve settings, refuse unsafe binds before loading anything, open the engine, serve."""

from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path
from typing import Any

from kapitsa.commands.group import join_as_rank, launched_rank, leave, relaunch, wants_group
from kapitsa.server.runner import bound_port, check_bind, check_port_free, reserve_port, serve_forever
from kapitsa.server.settings import ServerSettings


def make_settings(
    *,
    model: str | None,
    host: str | None,
    port: int | None,
    speculative: str | None,
    reasoning_budget: int | None = None,
) -> ServerSettings:
    """Flags override `KAPITSA_*` variables, which override the user's config file, then defaults."""
    from pydantic import ValidationError

    from kapitsa.settings import load_settings, settings_error

    user = load_settings()  # host and port from config.toml (or KAPITSA_HOST / KAPITSA_PORT)
    flags = {
        "model": model,
        "host": host or user.host,
        "port": user.port if port is None else port,
        "speculative": speculative,
        "reasoning_budget": reasoning_budget,
    }
    try:
        return ServerSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as err:
        names = {"port": "port", "host": "host", "model": "model", "reasoning_budget": "reasoning-budget"}
        raise settings_error(err, flag_names=names) from None


def cmd_serve(
    *,
    model: str | None,
    host: str | None,
    port: int | None,
    speculative: str | None,
    draft: str | None = None,
    draft_tokens: int | None = None,
    tree: bool | None = None,
    kv_bits: str | None = None,
    hostfile: Path | None = None,
    parallel: str = "pipeline",
    reasoning_budget: int | None = None,
) -> None:
    from kapitsa.kv_fit import parse_kv_bits
    from kapitsa.opener import check_speculation, open_engine

    settings = make_settings(
        model=model, host=host, port=port, speculative=speculative, reasoning_budget=reasoning_budget
    )
    if wants_group(hostfile):
        flags = {"draft": draft, "draft_tokens": draft_tokens, "tree": tree, "kv_bits": kv_bits}
        return _serve_group(settings, hostfile, parallel=parallel, flags=flags)
    check_bind(settings)
    check_speculation(settings.speculative, draft)
    parse_kv_bits(kv_bits)  # a bad flag fails before the port check and the weights
    with contextlib.closing(reserve_port(settings.host, settings.port)) as sock:
        settings = settings.model_copy(update={"port": bound_port(sock)})  # port 0: the one it got
        engine = open_engine(
            settings.model,
            speculative=settings.speculative,
            draft=draft,
            draft_tokens=draft_tokens,
            tree=tree,
            kv_bits=kv_bits,
            warm_batches=True,  # concurrent agents' requests form batches: ready them while idle
        )
        with contextlib.closing(engine) as client:
            _serve_recorded(client, settings, sock)


def _serve_group(
    settings: ServerSettings, hostfile: Path | None, *, parallel: str, flags: dict[str, Any]
) -> None:
    """Rank 0 serves the API over the group's engine; the other ranks run its steps.

    `flags`: the engine's `--draft`, `--draft-tokens`, `--tree` and `--kv-bits` as given."""
    from kapitsa.opener import check_group_flags, open_group_engine

    check_group_flags(
        parallel=parallel,
        speculative=settings.speculative,
        draft=flags["draft"],
        kv_bits=flags["kv_bits"],
        model=settings.model,
        tree=flags["tree"],
    )
    rank = launched_rank()
    if rank in (None, 0):  # the port is rank 0's: check it before any rank loads
        check_bind(settings)
    if rank is None:
        check_port_free(settings)
        relaunch(hostfile, sys.argv[1:])
    sock = reserve_port(settings.host, settings.port) if rank == 0 else None
    if sock is not None:
        settings = settings.model_copy(update={"port": bound_port(sock)})
    join_as_rank()
    engine = open_group_engine(
        settings.model,
        parallel=parallel,
        speculative=settings.speculative,
        draft_tokens=flags["draft_tokens"],
    )
    if engine is None:
        leave(0)
    with contextlib.closing(engine) as client:
        _serve_recorded(client, settings, sock)
        healthy = client.stats().alive  # a lost rank fails the group: the command does not exit 0
    leave(0 if healthy else 1)


def _serve_recorded(client: object, settings: ServerSettings, sock: socket.socket | None) -> None:
    """Serve, with `server.json` naming the port while it runs (what `kapitsa env` prints)."""
    from kapitsa.server_state import forget_server, record_server
    from kapitsa.settings import load_settings

    state_dir = load_settings().state_dir
    record_server(state_dir, host=settings.host, port=settings.port)
    try:
        serve_forever(client, settings, sock)  # type: ignore[arg-type]
    finally:
        forget_server(state_dir)
