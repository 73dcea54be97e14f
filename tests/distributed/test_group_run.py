"""`kapitsa run --hostfile`: ranks on 127.0.0.1 (ring backend, CPU) give the greedy tokens of one
process, for every architecture, split by layers (pipeline) or by heads and experts (tensor).

The tiny checkpoints are float32 and the CPU computes in float32, so a split changes at most the
order of a sum: the greedy tokens must be equal. Two and four ranks run every architecture in both
modes whose heads and layers divide over them (each launch of four ranks costs ~10-15 s on a 2-core
machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kapitsa.commands.group import free_port_run
from tests.distributed.conftest import ARCHITECTURES, MAX_TOKENS, PROMPT, run_json

pytest.importorskip("mlx.core")

# nemotron_h's Mamba-2 groups do not split over 4 tensor ranks: nemotron_h4 (4 groups) takes that case
# and only that one (its pipeline split is nemotron_h's)
FOUR_RANKS = [
    (kind, parallel)
    for parallel in ("pipeline", "tensor")
    for kind in (*ARCHITECTURES, "nemotron_h4")
    if (kind, parallel) not in (("nemotron_h", "tensor"), ("nemotron_h4", "pipeline"))
]


def single_process_tokens(folder: Path) -> list[int]:
    from kapitsa.commands.run import RunOptions, generate, make_request
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model

    request = make_request(PROMPT, RunOptions(model=None, raw=True, max_tokens=MAX_TOKENS))
    with contextlib.closing(InProcessEngine.from_loaded(load_model(folder))) as engine:
        return asyncio.run(generate(engine, request, None)).token_ids


@pytest.fixture(scope="session")
def reference(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    return {kind: single_process_tokens(folder) for kind, folder in checkpoints.items()}


def group_args(hostfile: Path, parallel: str, folder: Path) -> list[str]:
    return [
        "--hostfile", str(hostfile), "--parallel", parallel, "-m", str(folder),
        "--raw", "--max-tokens", str(MAX_TOKENS), PROMPT,
    ]  # fmt: skip


def check_group(kind: str, parallel: str, ranks: int, checkpoints, hostfiles, group_env, reference) -> None:  # noqa: ANN001
    out = run_json(group_args(hostfiles[ranks], parallel, checkpoints[kind]), group_env)
    assert out["token_ids"] == reference[kind]
    assert out["generation_tokens"] == MAX_TOKENS


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_two_ranks_give_the_single_process_greedy_tokens(
    kind: str, parallel: str, checkpoints, hostfiles, group_env, reference
) -> None:
    check_group(kind, parallel, 2, checkpoints, hostfiles, group_env, reference)


def test_qwen3_next_packed_projections_split_over_two_tensor_ranks(
    tmp_path: Path, hostfiles, group_env
) -> None:
    from kapitsa.testing.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "qwen3_next", "qwen3_next")
    out = run_json(group_args(hostfiles[2], "tensor", folder), group_env)
    assert out["token_ids"] == single_process_tokens(folder)


@pytest.mark.parametrize(("kind", "parallel"), FOUR_RANKS)
def test_four_ranks_give_the_single_process_greedy_tokens(
    kind: str, parallel: str, checkpoints, hostfiles, group_env, reference
) -> None:
    check_group(kind, parallel, 4, checkpoints, hostfiles, group_env, reference)


def test_a_different_model_gives_different_tokens(reference) -> None:
    """The comparisons have teeth: the greedy tokens depend on the architecture and weights."""
    assert len({tuple(tokens) for tokens in reference.values()}) == len(reference)


def test_a_split_the_model_does_not_divide_into_fails_clearly(tmp_path: Path, hostfiles, group_env) -> None:
    """One Mamba-2 group (whose norm is per group) does not split over two ranks: exit 1, saying why."""
    from kapitsa.testing.tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "one-group", "nemotron_h", n_groups=1)
    done = subprocess.run(
        [sys.executable, "-m", "kapitsa", "run", *group_args(hostfiles[2], "tensor", folder)],
        capture_output=True, text=True, env=group_env, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert "1 Mamba-2 groups (its norm is per group) do not split over 2 ranks" in done.stderr


def test_doctor_reports_what_fits_on_the_group(hostfiles, group_env) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kapitsa", "doctor", "--hostfile", str(hostfiles[2]), "--json"],
        capture_output=True, text=True, env=group_env, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert len(report["usable_bytes"]) == 2 and all(b > 0 for b in report["usable_bytes"])
    assert report["models"] and all(len(m["rank_weights_bytes"]) == 2 for m in report["models"])


def test_started_by_mlx_launch_itself(checkpoints, hostfiles, group_env, reference) -> None:
    """`mlx.launch --hostfile hosts.json -- kapitsa run ...`: each process is already a rank."""
    launch = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
    args = ["-m", str(checkpoints["flint"]), "--raw", "--max-tokens", str(MAX_TOKENS), "--json", PROMPT]
    done = subprocess.run(
        [sys.executable, "-c", launch, "--hostfile", str(hostfiles[2]), "--starting-port", str(free_port_run(4)),
         "--", sys.executable, "-m", "kapitsa", "run", "--parallel", "tensor", *args],
        capture_output=True, text=True, env=group_env, timeout=120, start_new_session=True,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stderr[-2000:]
    assert json.loads(lines[0])["token_ids"] == reference["flint"]


def test_what_a_group_cannot_run_is_refused_before_any_rank_starts(tmp_path) -> None:
    """`:small` (its widths come from one machine's budget) and a prompt on stdin (the ranks do not
    share it) are refused by the launching process itself."""
    from kapitsa.commands.run import RunOptions, cmd_run
    from kapitsa.errors import InvalidRequest

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.1"}]')
    base = dict(hostfile=hostfile, parallel="pipeline", speculative="none")
    with pytest.raises(InvalidRequest, match="':small' recipe does not run across a group"):
        cmd_run(RunOptions(model="some/moe:small", prompt="hi", **base))
    with pytest.raises(InvalidRequest, match="do not read stdin"):
        cmd_run(RunOptions(model="some/moe", prompt_file=Path("-"), **base))
