"""`kapitsa run --hostfile`: ranks on 127.0.0.1 (ring backend, CPU) give the greedy tokens of one
process, for every architecture, split by layers (pipeline) or by heads and experts (tensor).

The tiny checkpoints are float32, and the CPU computes in float32, so a split changes at most the
order of a sum: the greedy tokens must be equal.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from conftest import ARCHITECTURES, MAX_TOKENS, PROMPT, run_json

pytest.importorskip("mlx.core")


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


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("parallel", ["pipeline"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_ranks_give_the_single_process_greedy_tokens(
    kind: str, parallel: str, ranks: int, checkpoints, hostfiles, group_env, reference
) -> None:
    out = run_json(group_args(hostfiles[ranks], parallel, checkpoints[kind]), group_env)
    assert out["token_ids"] == reference[kind]
    assert out["generation_tokens"] == MAX_TOKENS


def test_a_different_model_gives_different_tokens(checkpoints, hostfiles, group_env, reference) -> None:
    """The comparison has teeth: the group's answer depends on the weights it loaded."""
    out = run_json(group_args(hostfiles[2], "pipeline", checkpoints["qwen3_5_moe"]), group_env)
    assert out["token_ids"] != reference["qwen3_5"]
