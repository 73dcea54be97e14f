"""Shared pieces of the distributed tests: tiny checkpoints of every architecture, hostfiles of
local ranks, the single-process greedy reference, and process-group bookkeeping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "nemotron_h", "flint")
PROMPT = "the quick brown fox jumps"
MAX_TOKENS = 10


def write_checkpoint(folder: Path, kind: str, **config_overrides: object) -> Path:
    if kind == "flint":
        from kapitsa.testing.tiny_flint import write_tiny_flint

        return write_tiny_flint(folder, **config_overrides)
    from kapitsa.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(folder, kind, **config_overrides)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny float32 checkpoint per architecture, and "nemotron_h4": Nemotron-H with 4 Mamba-2
    groups, which tensor parallel splits over 4 ranks (the default tiny one has 2)."""
    from kapitsa.testing.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("group-ckpt")
    folders = {kind: write_checkpoint(root / kind, kind) for kind in ARCHITECTURES}
    folders["nemotron_h4"] = write_tiny_checkpoint(root / "nemotron_h4", "nemotron_h", n_groups=4)
    return folders


@pytest.fixture(scope="session")
def group_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of launched ranks: a private state folder, no hub."""
    state = tmp_path_factory.mktemp("group-state")
    return {**os.environ, "KAPITSA_CACHE_DIR": str(state), "KAPITSA_CONFIG": str(state / "none.toml")}


def hostfile(folder: Path, ranks: int) -> Path:
    path = folder / f"hosts{ranks}.json"
    path.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * ranks))
    return path


@pytest.fixture(scope="session")
def hostfiles(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("hosts")
    return {n: hostfile(root, n) for n in (1, 2, 4)}


def launch_cases(
    script: Path, cases: list[str], hostfile: Path, env: dict[str, str], *, num_lines: int
) -> list[dict]:
    """`script` on each rank of `hostfile`'s group under mlx.launch, given `cases`; the `num_lines`
    JSON lines the ranks print."""
    from kapitsa.commands.group import free_port_run

    launch = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", launch, "--hostfile", str(hostfile), "--starting-port", str(free_port_run(4)),
         "--", sys.executable, str(script), *cases],
        capture_output=True, text=True, env=env, timeout=240, start_new_session=True,
    )  # fmt: skip
    lines = rank_lines(done.stdout)
    assert len(lines) == num_lines, done.stderr[-3000:]
    return lines


def rank_lines(stdout: str) -> list[dict]:
    """The ranks' JSON objects in the launcher's merged output. mlx.launch forwards each rank's output
    as it reads it, so under an unbuffered Python (PYTHONUNBUFFERED) one rank's newline may follow
    another rank's line: objects are read wherever they start, not line by line."""
    decoder, found, start = json.JSONDecoder(), [], stdout.find('{"')
    while start != -1:
        try:
            obj, end = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            end = start + 1
        else:
            found.append(obj)
        start = stdout.find('{"', end)
    return found


def run_json(args: list[str], env: dict[str, str], timeout: float = 120) -> dict:
    """`kapitsa run ... --json` in a new session; its JSON line."""
    done = subprocess.run(
        [sys.executable, "-m", "kapitsa", "run", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # rank 0 prints, the other ranks do not
    return json.loads(lines[0])


def session_pids(session: int) -> list[int]:
    """Live processes of a session (the launcher and its ranks), zombies left out."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def rank_pid(session: int, rank: int) -> int | None:
    """The pid of the kapitsa process of `rank` in a session (mlx.launch sets MLX_RANK)."""
    for pid in session_pids(session):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in environ and b"kapitsa" in cmdline:
            return pid
    return None


def one_rank_engine(folder: Path, parallel: str = "pipeline", **options: object):  # noqa: ANN201 - a GroupEngine
    """Rank 0 of a group of one, in this process: the group's engine with no launch."""
    import mlx.core as mx

    from kapitsa.engine.distributed.engine import GroupEngine
    from kapitsa.engine.distributed.group import Group
    from kapitsa.engine.distributed.loading import load_shard
    from kapitsa.engine.distributed.start import make_shard
    from kapitsa.engine.options import KernelOptions

    handle = mx.distributed.init(strict=False)
    group = Group(handle.rank(), handle.size(), handle)
    loaded = load_shard(str(folder), group=group, parallel=parallel)
    return GroupEngine(make_shard(loaded, group, parallel, KernelOptions()), loaded, **options)
