"""Continuous batching in a group: concurrent requests share decode steps (rows joining and leaving
at different steps, a long prompt prefilled between them) and each gets exactly the tokens it gets
alone from a single process; the end state a batch row saves resumes the request's next turn.

One rank in this process runs every architecture in both modes, with n-gram drafts on tied
checkpoints (drafts while a request decodes alone, plain steps while several do); two launched
ranks run one architecture per mode in one launch (batch_ranks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.distributed.batch_ranks import AGAIN_TOKENS, REQUESTS, request, serve
from tests.distributed.conftest import ARCHITECTURES, launch_cases, one_rank_engine, write_checkpoint

pytest.importorskip("mlx.core")

MODES = ("pipeline", "tensor")
LAUNCHED = (("qwen3_5", "pipeline"), ("nemotron_h", "tensor"))


def _alone(folder: Path, prompts: list[tuple[tuple[int, ...], int]]) -> list[list[int]]:
    """What one process without a prefix cache answers to each prompt, one at a time."""
    from kapitsa.commands.run import generate
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.options import EngineConfig

    config = EngineConfig(prefix_cache_bytes=0)
    with contextlib.closing(InProcessEngine.from_loaded(load_model(folder), config=config)) as engine:
        return [asyncio.run(generate(engine, request(ids, n), None)).token_ids for ids, n in prompts]


def _check(folder: Path, out: dict) -> None:
    """Each answer equals its single-process answer alone; the batch grew past one row; the
    extension resumed where the first request's batch row saved its end."""
    names = list(REQUESTS)
    extended = tuple(out["extended"])
    expected = _alone(folder, [REQUESTS[name] for name in names] + [(extended, AGAIN_TOKENS)])
    got = [out["answers"][name]["tokens"] for name in names] + [out["again"]["tokens"]]
    assert got == expected
    assert out["peak"] > 1
    first_ids, first_answer = REQUESTS["first"][0], out["answers"]["first"]["tokens"]
    assert out["again"]["cached"] == len(first_ids) + len(first_answer) - 1


@pytest.fixture(scope="session")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tied embeddings: the tiny models repeat themselves, so n-gram drafts are accepted."""
    root = tmp_path_factory.mktemp("batch-tied")
    return {kind: write_checkpoint(root / kind, kind, tie_word_embeddings=True) for kind in ARCHITECTURES}


@pytest.mark.parametrize("parallel", MODES)
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_concurrent_requests_share_steps_and_keep_their_tokens(kind: str, parallel: str, tied) -> None:
    from kapitsa.engine.distributed.speculation import GroupSpeculation

    engine = one_rank_engine(tied[kind], parallel, speculation=GroupSpeculation(), prefix_cache_bytes=1 << 30)
    try:
        out = serve(engine)
        stats = engine.stats()
    finally:
        engine.close()
    _check(tied[kind], out)
    assert stats.requests_finished == len(REQUESTS) + 1 and stats.batch_size == 0


@pytest.fixture(scope="session")
def launched(checkpoints, hostfiles, group_env) -> dict[str, dict]:
    """Rank 0's JSON line per case, from one launch of two ranks over both cases."""
    cases = [f"{parallel}={checkpoints[kind]}" for kind, parallel in LAUNCHED]
    lines = launch_cases(
        Path(__file__).with_name("batch_ranks.py"), cases, hostfiles[2], group_env, num_lines=len(cases)
    )
    return {line["case"]: line for line in lines}


@pytest.mark.parametrize(("kind", "parallel"), LAUNCHED)
def test_two_ranks_batch_concurrent_requests(kind: str, parallel: str, checkpoints, launched) -> None:
    _check(checkpoints[kind], launched[f"{parallel}={checkpoints[kind]}"])


def test_more_rows_than_ride_inline_keep_their_tokens(checkpoints) -> None:
    """Ten requests at once: a step's tokens need the second collective (control.INLINE is 8)."""
    from kapitsa.engine.distributed.control import INLINE
    from tests.distributed.batch_ranks import ask_all

    prompts = [(tuple(range(20 + 3 * i, 26 + 4 * i)), 24 + i) for i in range(INLINE + 2)]
    engine = one_rank_engine(checkpoints["flint"], "tensor", prefix_cache_bytes=0)
    try:
        answers, peak = asyncio.run(ask_all(engine, prompts))
    finally:
        engine.close()
    assert answers == _alone(checkpoints["flint"], prompts)
    assert peak > INLINE
