"""`--hostfile`: one model across the machines of an mlx.launch hostfile.

`kapitsa run|serve --hostfile hosts.json` re-executes itself under `mlx.launch` (one process per
host, ring/JACCL as the hostfile says); each process sees `MLX_RANK` and joins the group. Started
as `mlx.launch --hostfile hosts.json -- kapitsa serve ...`, kapitsa is already a rank.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from kapitsa.errors import InvalidRequest

_LAUNCH = (
    "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"
)
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_STATUS_VAR = "KAPITSA_GROUP_STATUS"


def launched_rank() -> int | None:
    """This process's rank when mlx.launch started it (it sets MLX_RANK), else None."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def wants_group(hostfile: Path | None) -> bool:
    return hostfile is not None or launched_rank() is not None


def read_hosts(hostfile: Path) -> list[dict]:
    """The hostfile's hosts (mlx.launch's format: a list, or {"hosts": [...], "backend": ...})."""
    try:
        data = json.loads(hostfile.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidRequest(f"cannot read the hostfile {hostfile}: {err}") from err
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) and "ssh" in h for h in hosts):
        raise InvalidRequest(
            f'{hostfile}: expected mlx.launch\'s hostfile, a list of {{"ssh": ..., "ips": [...]}}'
        )
    return hosts


def relaunch(hostfile: Path, argv: list[str]) -> NoReturn:
    """Run `kapitsa <argv>` under mlx.launch on every host of `hostfile`; exit with rank 0's code.

    mlx.launch itself exits 0 whatever its ranks did, so rank 0 writes its exit code to the file
    `KAPITSA_GROUP_STATUS` names (given with `--env`, which reaches ranks started over ssh too).
    Rank 0 on this machine that leaves no code ended without reporting it: a failure. When rank 0
    runs on another machine, the launcher's code stands.
    """
    hosts = read_hosts(hostfile)
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="kapitsa-group-") as folder:
        status = Path(folder) / "rank0-exit"
        command = [
            sys.executable,
            "-c",
            _LAUNCH,
            "--hostfile",
            str(hostfile),
            "--env",
            f"{_STATUS_VAR}={status}",
        ]
        if all(h["ssh"] in _LOCAL_HOSTS for h in hosts):  # ranks on this machine: ports nobody holds
            command += ["--starting-port", str(free_port_run(len(hosts)))]
        command += ["--", sys.executable, "-m", "kapitsa", *argv]
        launcher = subprocess.run(command, env={**os.environ, _STATUS_VAR: str(status)}, check=False)
        if status.is_file():
            code = int(status.read_text())
        else:
            code = 1 if hosts[0]["ssh"] in _LOCAL_HOSTS and launcher.returncode == 0 else launcher.returncode
    sys.stdout.flush()
    os._exit(code)  # the ranks' answer is already out: nothing of this process is left to run


def join_as_rank() -> None:
    """On rank 0: report this process's exit code to the relaunching process, however it ends."""
    if launched_rank() == 0 and os.environ.get(_STATUS_VAR):
        atexit.register(_write_status, 1)  # sys.exit and errors; `leave` writes its own code first
        from kapitsa.opener import on_group_hard_exit

        on_group_hard_exit(_write_status)  # a lost peer's hard exit skips atexit


def leave(code: int = 0) -> NoReturn:
    """End a rank's process without MLX's distributed teardown, which can abort once peers are gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    _write_status(code)
    os._exit(code)


def _write_status(code: int) -> None:
    path = os.environ.get(_STATUS_VAR)
    if launched_rank() == 0 and path and not Path(path).exists():
        Path(path).write_text(str(code))


def free_port_run(count: int) -> int:
    """A first port of `count` consecutive free ones (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(_is_free(base + i) for i in range(count)):
            return base
    raise InvalidRequest("no free run of local ports for the ranks")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
