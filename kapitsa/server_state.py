"""Where the running server listens: `server.json` in the state folder, so `kapitsa env` prints the real port.

`kapitsa serve` and the TUI move to the next free port when the configured one is taken; whichever started
the server writes this file (atomically) and removes it when it stops. A record whose process is gone is stale.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kapitsa.private_files import atomic_write

STATE_FILE = "server.json"


def http_url(host: str, port: int) -> str:
    """The base URL of a server on host:port; an IPv6 address goes in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class ServerRecord:
    host: str
    port: int
    pid: int

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def record_server(state_dir: Path, *, host: str, port: int) -> ServerRecord:
    """Note that this process serves on host:port."""
    record = ServerRecord(host=host, port=port, pid=os.getpid())
    data = json.dumps({"host": host, "port": port, "pid": record.pid}).encode()
    atomic_write(Path(state_dir) / STATE_FILE, data)
    return record


def forget_server(state_dir: Path) -> None:
    """Remove this process's record (another process's record is left alone)."""
    record = _read(Path(state_dir) / STATE_FILE)
    if record is not None and record.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            (Path(state_dir) / STATE_FILE).unlink()


def running_server(state_dir: Path) -> ServerRecord | None:
    """The recorded server, if its process is still alive."""
    record = _read(Path(state_dir) / STATE_FILE)
    return record if record is not None and _is_alive(record.pid) else None


def _read(path: Path) -> ServerRecord | None:
    try:
        data = json.loads(path.read_text())
        return ServerRecord(host=str(data["host"]), port=int(data["port"]), pid=int(data["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True
