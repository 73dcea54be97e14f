"""N-gram speculation in a group gives the single process's greedy tokens, with drafts accepted.

Tiny checkpoints with tied embeddings repeat themselves (the head reads the embedding back), so
their greedy answers copy what came before and n-gram drafts pay. One rank runs in this process
for every architecture, with n-gram drafts and with drafts made to fail at every depth (rollbacks
of every cache kind, on the untied checkpoints whose answers a stale token would change); two local ranks
run one architecture per mode, and `--speculative none` once.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tests.distributed.conftest import ARCHITECTURES, PROMPT, run_json, write_checkpoint

pytest.importorskip("mlx.core")

TOKENS = 24
LAUNCHED = [("nemotron_h", "pipeline"), ("qwen3_5", "tensor")]


@pytest.fixture(scope="session")
def tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tied-ckpt")
    return {kind: write_checkpoint(root / kind, kind, tie_word_embeddings=True) for kind in ARCHITECTURES}


def _request(max_tokens: int = TOKENS, temperature: float = 0.0):  # noqa: ANN202
    from kapitsa.commands.run import RunOptions, make_request

    options = RunOptions(model=None, raw=True, max_tokens=max_tokens, temperature=temperature, seed=7)
    return make_request(PROMPT, options)


def _single_process(folder: Path) -> list[int]:
    from kapitsa.commands.run import generate
    from kapitsa.engine.inprocess import InProcessEngine
    from kapitsa.engine.loading.loader import load_model

    with contextlib.closing(InProcessEngine.from_loaded(load_model(folder))) as engine:
        return asyncio.run(generate(engine, _request(), None)).token_ids


@pytest.fixture(scope="session")
def reference(tied: dict[str, Path]) -> dict[str, list[int]]:
    return {kind: _single_process(folder) for kind, folder in tied.items()}


@pytest.fixture(scope="session")
def untied_reference(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    """The conftest's checkpoints, whose answers depend on the whole context (a stale token in a
    cache changes them, where the tied ones mostly repeat their last token whatever came before)."""
    return {kind: _single_process(checkpoints[kind]) for kind in ARCHITECTURES}


def _one_rank_engine(folder: Path, parallel: str = "pipeline"):  # noqa: ANN202 - a GroupEngine
    import mlx.core as mx

    from kapitsa.engine.distributed.engine import GroupEngine
    from kapitsa.engine.distributed.group import Group
    from kapitsa.engine.distributed.loading import load_shard
    from kapitsa.engine.distributed.speculation import GroupSpeculation
    from kapitsa.engine.distributed.start import make_shard
    from kapitsa.engine.options import KernelOptions

    handle = mx.distributed.init(strict=False)
    group = Group(handle.rank(), handle.size(), handle)
    loaded = load_shard(str(folder), group=group, parallel=parallel)
    shard = make_shard(loaded, group, parallel, KernelOptions())
    return GroupEngine(shard, loaded, speculation=GroupSpeculation())


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_one_rank_verifies_drafts_and_keeps_the_greedy_tokens(kind: str, tied, reference) -> None:
    from kapitsa.commands.run import generate

    engine = _one_rank_engine(tied[kind])
    try:
        first = asyncio.run(generate(engine, _request(), None))
        again = asyncio.run(generate(engine, _request(), None))  # a new request starts a new cache
    finally:
        engine.close()
    assert first.token_ids == reference[kind] and again.token_ids == reference[kind]
    stats = engine.stats()
    assert stats.speculative == "ngram" and stats.tokens_per_step > 1
    assert engine.speculation.stats.accepted > 0
    # verifies, not every step: each verify proposes at least one token
    assert 0 < stats.speculative_verifies <= stats.draft_tokens_proposed
    assert stats.speculative_verifies < engine.speculation.stats.steps


def _corrupting_oracle(reference: list[int], vocab: int):  # noqa: ANN202 - a GroupSpeculation
    """Drafts 1-4 tokens of the known answer with one of them wrong, at a depth that cycles, so
    every verify drops a different number of tokens on every rank."""
    from kapitsa.engine.distributed.speculation import GroupSpeculation

    class Oracle(GroupSpeculation):
        calls = 0

        def propose(self, seq) -> list[int]:  # noqa: ANN001
            done, self.calls = len(seq.output_ids), self.calls + 1
            room = seq.max_tokens - done - 1
            draft = list(reference[done : done + min(1 + self.calls % 4, room)])
            if draft:
                wrong = self.calls % len(draft)
                draft[wrong] = (draft[wrong] + 1) % vocab
            return draft

    return Oracle()


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_rejected_drafts_roll_back_exactly(kind: str, parallel: str, checkpoints, untied_reference) -> None:
    from kapitsa.commands.run import generate

    expected = untied_reference[kind]
    engine = _one_rank_engine(checkpoints[kind], parallel)
    engine.speculation = oracle = _corrupting_oracle(expected, engine.info.vocab_size)
    try:
        out = asyncio.run(generate(engine, _request(), None))
    finally:
        engine.close()
    assert out.token_ids == expected
    assert oracle.stats.proposed > oracle.stats.accepted > 0


def test_one_rank_samples_with_drafts(tied) -> None:
    """Sampling goes through speculative sampling's acceptance: the run ends and stays in the vocabulary."""
    from kapitsa.commands.run import generate

    engine = _one_rank_engine(tied["qwen3_5"])
    try:
        out = asyncio.run(generate(engine, _request(temperature=0.8), None))
    finally:
        engine.close()
    assert out.generation_tokens == TOKENS and all(0 <= t < engine.info.vocab_size for t in out.token_ids)
    assert engine.speculation.stats.proposed > 0


def _group_args(hostfile: Path, parallel: str, folder: Path, *extra: str) -> list[str]:
    return [
        "--hostfile", str(hostfile), "--parallel", parallel, "-m", str(folder),
        "--raw", "--max-tokens", str(TOKENS), *extra, PROMPT,
    ]  # fmt: skip


@pytest.mark.parametrize(("kind", "parallel"), LAUNCHED)
def test_two_ranks_accept_drafts_and_give_the_greedy_tokens(
    kind: str, parallel: str, tied, hostfiles, group_env, reference
) -> None:
    out = run_json(_group_args(hostfiles[2], parallel, tied[kind]), group_env)
    assert out["token_ids"] == reference[kind]
    assert out["tokens_per_step"] > 1  # drafts were verified and accepted across the group


def test_two_ranks_without_speculation(tied, hostfiles, group_env, reference) -> None:
    out = run_json(_group_args(hostfiles[2], "pipeline", tied["qwen3_5"], "--speculative", "none"), group_env)
    assert out["token_ids"] == reference["qwen3_5"]
    assert out["tokens_per_step"] == 0  # no speculation ran


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative": "mtp"}, "--speculative mtp does not run across a group"),
        ({"speculative": "draft", "draft": "small"}, "--speculative draft does not run across a group"),
        ({"speculative": "block"}, "--speculative block does not run across a group"),
        ({"speculative": "warp"}, "unknown speculative mode 'warp'"),
        ({"draft": "small"}, "--draft does not run across a group"),
        ({"tree": True}, "--tree does not run across a group"),
    ],
)
def test_other_speculation_is_refused_for_a_group(flags: dict, message: str) -> None:
    from kapitsa.errors import InvalidRequest
    from kapitsa.opener import check_group_flags

    base = {"parallel": "pipeline", "speculative": None, "draft": None, "kv_bits": None}
    with pytest.raises(InvalidRequest, match=message):
        check_group_flags(**(base | flags))


@pytest.mark.parametrize("mode", [None, "auto", "ngram", "none"])
def test_ngram_and_none_run_in_a_group(mode: str | None) -> None:
    from kapitsa.engine.distributed.speculation import group_speculates
    from kapitsa.opener import check_group_flags

    check_group_flags(parallel="tensor", speculative=mode, draft=None, kv_bits=None)
    assert group_speculates(mode) == (mode != "none")


def test_one_rank_drafts_from_a_prediction_and_counts_its_drafts(checkpoints, untied_reference) -> None:
    """A request's `prediction` reaches rank 0's drafter (the single engine's Predicted Outputs),
    changes no token, and the usage counts the sequence's drafts and those copied from it."""
    import dataclasses

    from kapitsa.engine.types import FinishEvent, TokenEvent

    async def run(engine, request) -> tuple[list[int], object]:  # noqa: ANN001
        ids, usage = [], None
        async for event in engine.generate(request):
            if isinstance(event, TokenEvent):
                ids.extend(event.token_ids)
            elif isinstance(event, FinishEvent):
                usage = event.usage
        return ids, usage

    expected = untied_reference["qwen3_5"]
    engine = _one_rank_engine(checkpoints["qwen3_5"])
    try:
        prediction = engine.tokenizer.decode(expected)
        request = dataclasses.replace(_request(), prediction=prediction)
        ids, usage = asyncio.run(run(engine, request))
        plain_ids, plain = asyncio.run(run(engine, _request()))
    finally:
        engine.close()
    assert ids == plain_ids == expected
    assert usage.prediction_tokens_accepted > TOKENS // 2
    assert usage.draft_tokens_accepted >= usage.prediction_tokens_accepted
    assert usage.draft_tokens_accepted == engine.speculation.stats.accepted - plain.draft_tokens_accepted
    assert plain.prediction_tokens_proposed == 0
