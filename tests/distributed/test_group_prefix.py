"""A group's prefix cache: a request that extends an earlier one resumes from the state every rank
saved for it, computes only its new tokens, and gives the tokens a fresh single process gives.

One rank in this process runs every architecture in both modes (chat turns, resuming at the end
of the last message or of the reply; token prompts with n-gram drafts, resuming at the end of the
reply). Two launched ranks run every architecture in both modes in one launch
(prefix_ranks.py), with an eviction that every rank must apply alike.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.distributed.conftest import ARCHITECTURES, launch_cases, one_rank_engine, write_checkpoint

pytest.importorskip("mlx.core")

SYSTEM = {"role": "system", "content": "you answer in one line"}
FIRST = {"role": "user", "content": "the quick brown fox jumps over the lazy dog"}
NEXT = {"role": "user", "content": "and what did the dog do"}
TOKENS = 12
MODES = ("pipeline", "tensor")


def _request(*, messages=None, ids=None, max_tokens: int = TOKENS):  # noqa: ANN001, ANN202
    from kapitsa.engine.types import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest(messages=messages, prompt_token_ids=ids, sampling=sampling)


def _fresh_tokens(folder: Path, request) -> list[int]:  # noqa: ANN001
    """What one process with no prefix cache answers."""
    from kapitsa.commands.run import generate
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model
    from kapitsa.engine.options import EngineConfig

    config = EngineConfig(prefix_cache_bytes=0)
    with contextlib.closing(InProcessEngine.from_loaded(load_model(folder), config=config)) as engine:
        return asyncio.run(generate(engine, request, None)).token_ids


def _ask(engine, request) -> tuple:  # noqa: ANN001
    """The answer and the prompt tokens this request computed."""
    from kapitsa.commands.run import generate

    before = engine.stats().prompt_tokens_computed
    out = asyncio.run(generate(engine, request, None))
    return out, engine.stats().prompt_tokens_computed - before


def _prompt_ids(engine, request) -> list[int]:  # noqa: ANN001
    from kapitsa.engine.text.prepare import prepare_prompt

    return prepare_prompt(engine.tokenizer, request, encode=engine.encoder.encode).ids


def _deepest_saved(first_prompt: list[int], first_answer: list[int], boundaries, prompt: list[int]) -> int:  # noqa: ANN001
    """Where the second prompt should resume: the deepest state the first request saved (its
    message boundaries, the end of its reply) that the prompt starts with, short of its end."""
    saved = [first_prompt[: b.pos] for b in boundaries] + [first_prompt + first_answer[:-1]]
    return max((len(s) for s in saved if len(s) < len(prompt) and prompt[: len(s)] == s), default=0)


def test_the_index_resumes_short_of_the_prompt_and_evicts_the_least_recent_first() -> None:
    from kapitsa.engine.distributed.prefix import GroupPrefix

    class TenBytesEach:
        def nbytes(self, ids: list[int]) -> int:
            return 10 * len(ids)

    prefix = GroupPrefix(TenBytesEach(), budget_bytes=25)
    system, turn, final = (
        prefix.add([1, 2], "system"),
        prefix.add([1, 2, 3, 4], "turn"),
        prefix.add([1, 2, 3, 4, 5, 6], "final"),
    )
    assert prefix.add([1, 2, 3, 4], "turn") == 0  # saved already
    assert prefix.lookup([1, 2, 3, 4, 5, 6]) == (turn, 4)  # no state holds logits: one token is computed
    assert prefix.lookup([1, 2, 3, 4, 5, 6, 7]) == (final, 6)
    assert prefix.lookup([1, 2, 9]) == (system, 2) and prefix.lookup([7, 1, 2]) == (0, 0)
    assert prefix.victims() == [turn]  # 30 bytes: the least recently used goes, the system prompt last
    assert prefix.ids() == [system, final] and prefix.lookup([1, 2, 3, 4, 8]) == (system, 2)
    assert GroupPrefix(TenBytesEach(), budget_bytes=0).add([1, 2], "turn") == 0  # the cache is off


@pytest.mark.parametrize("parallel", MODES)
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_a_second_turn_computes_only_what_no_saved_state_holds(kind: str, parallel: str, checkpoints) -> None:
    from kapitsa.engine.text.prepare import prepare_prompt

    engine = one_rank_engine(checkpoints[kind], parallel, prefix_cache_bytes=1 << 30)
    try:
        first_request = _request(messages=(SYSTEM, FIRST))
        first, _ = _ask(engine, first_request)
        reply = {"role": "assistant", "content": first.text}
        second_request = _request(messages=(SYSTEM, FIRST, reply, NEXT))
        second, computed = _ask(engine, second_request)
        prepared = prepare_prompt(engine.tokenizer, first_request, encode=engine.encoder.encode)
        prompt = _prompt_ids(engine, second_request)
    finally:
        engine.close()
    resumed = _deepest_saved(prepared.ids, first.token_ids, prepared.boundaries, prompt)
    assert resumed > len(prepared.ids) // 2  # at least the end of the first request's last message
    assert second.cached_tokens == resumed and computed == len(prompt) - resumed
    assert second.token_ids == _fresh_tokens(checkpoints[kind], second_request)


@pytest.fixture(scope="session")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tied embeddings: the tiny models repeat themselves, so n-gram drafts are accepted."""
    root = tmp_path_factory.mktemp("prefix-tied")
    return {kind: write_checkpoint(root / kind, kind, tie_word_embeddings=True) for kind in ARCHITECTURES}


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_drafts_and_the_prefix_cache_keep_the_greedy_tokens(kind: str, tied) -> None:
    """Drafts accepted past max_tokens are rolled back before the end of the reply is saved."""
    from kapitsa.engine.distributed.speculation import GroupSpeculation

    first_ids = tuple(range(11, 30))
    engine = one_rank_engine(tied[kind], speculation=GroupSpeculation(), prefix_cache_bytes=1 << 30)
    try:
        first, _ = _ask(engine, _request(ids=first_ids, max_tokens=20))
        extended = (*first_ids, *first.token_ids, 40, 41, 42)
        second, computed = _ask(engine, _request(ids=extended, max_tokens=20))
        accepted = engine.speculation.stats.accepted
    finally:
        engine.close()
    assert accepted > 0
    assert second.cached_tokens == len(first_ids) + len(first.token_ids) - 1
    assert computed == len(extended) - second.cached_tokens
    assert second.token_ids == _fresh_tokens(tied[kind], _request(ids=extended, max_tokens=20))


def test_a_budget_of_zero_saves_nothing(checkpoints) -> None:
    engine = one_rank_engine(checkpoints["qwen3_5"], prefix_cache_bytes=0)
    try:
        first, _ = _ask(engine, _request(messages=(SYSTEM, FIRST)))
        reply = {"role": "assistant", "content": first.text}
        second, _ = _ask(engine, _request(messages=(SYSTEM, FIRST, reply, NEXT)))
        stats = engine.stats()
    finally:
        engine.close()
    assert second.cached_tokens == 0 and stats.checkpoints_in_memory == 0
    assert engine.shard.saved.ids() == []


@pytest.fixture(scope="session")
def launched(checkpoints, hostfiles, group_env) -> dict[tuple[int, str], dict]:
    """Every rank's JSON line per case, from one launch of two ranks over every case."""
    cases = [f"{parallel}={checkpoints[kind]}" for parallel in MODES for kind in ARCHITECTURES]
    lines = launch_cases(
        Path(__file__).with_name("prefix_ranks.py"), cases, hostfiles[2], group_env, num_lines=2 * len(cases)
    )
    return {(line["rank"], line["case"]): line for line in lines}


@pytest.mark.parametrize("parallel", MODES)
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_two_ranks_resume_evict_alike_and_keep_the_tokens(
    kind: str, parallel: str, checkpoints, launched
) -> None:
    from tests.distributed.prefix_ranks import FIRST as FIRST_IDS
    from tests.distributed.prefix_ranks import MAX_TOKENS

    case = f"{parallel}={checkpoints[kind]}"
    driver, follower = launched[(0, case)], launched[(1, case)]
    second, extended = driver["second"], tuple(driver["extended"])
    assert second["cached"] == len(FIRST_IDS) + len(driver["first"]["tokens"]) - 1
    assert second["computed"] == len(extended) - second["cached"]
    assert second["tokens"] == _fresh_tokens(checkpoints[kind], _request(ids=extended, max_tokens=MAX_TOKENS))
    # the unrelated prompt's state pushed the first two out: the extension computes everything again
    assert driver["other"]["bytes"] <= driver["budget"] and driver["again"]["cached"] == 0
    assert driver["again"]["tokens"] == second["tokens"]
    assert driver["index"] == driver["ids"] == follower["ids"] != []


def test_the_groups_engine_holds_the_gil_switch_interval_while_it_runs(checkpoints) -> None:
    """As a local engine does: its thread waits for the GIL from busy neighbours at most 1 ms, and
    the process's own interval comes back when it stops."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0042)
    try:
        engine = one_rank_engine(checkpoints["qwen3_5"], prefix_cache_bytes=0)
        try:
            assert sys.getswitchinterval() == pytest.approx(0.001)
        finally:
            engine.close()
        assert sys.getswitchinterval() == pytest.approx(0.0042)
    finally:
        sys.setswitchinterval(before)
