"""Speculation that costs nothing while it does not pay: a host drafter's guesses are scored
against the tokens pipelined plain decoding produces (no verify forward, no sync), and
speculation turns on only once they match."""

from __future__ import annotations

import asyncio

import pytest
from engine_standins import EOS, ByteTokenizer, tiny_model  # noqa: I001

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.controller import DraftLengthController, gpu_cost_curve
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.speculative.shadow import ShadowGuess
from kapitsa.engine.types import FinishEvent, GenerationRequest, ModelInfo, SamplingParams, TokenEvent

PROMPTS = ["The quick brown fox jumps over", "def add(x, y):\n    return"]
N = 64


class HostOracle:
    """A host drafter that knows each prompt's plain continuation: right from output position
    `right_from` on, wrong before it (wrong tokens never equal the true ones)."""

    name = "host-oracle"
    drafts_on_host = True

    def __init__(self, references: dict[tuple[int, ...], list[int]], right_from: int) -> None:
        self.references, self.right_from = references, right_from
        self.proposals = 0

    def observe(self, new_tokens) -> None:  # noqa: ANN001
        pass

    def propose(self, context, max_tokens: int) -> Draft:  # noqa: ANN001
        self.proposals += 1
        for prompt, ref in self.references.items():
            if tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                tail = ref[done : done + max_tokens]
                if done < self.right_from:
                    tail = [(t + 1) % 250 + 3 if t != EOS else 7 for t in tail]
                return Draft(tuple(tail))
        return Draft(())


def _client(model, decode=None) -> InProcessEngine:  # noqa: ANN001
    info = ModelInfo(id="tiny", family="test", context_length=4096, max_output_tokens=1024)
    config = EngineConfig(prefill_chunk=64, prefix_cache_bytes=0)
    return InProcessEngine(model, ByteTokenizer(), info, eos_token_ids={EOS}, config=config, decode=decode)


async def _run(client, prompt: str) -> list[int]:  # noqa: ANN001
    ids: list[int] = []
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    async for event in client.generate(GenerationRequest(prompt=prompt, sampling=params)):
        if isinstance(event, TokenEvent):
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            assert event.finish_reason == "length"
    return ids


async def _outputs(model, decode=None) -> list[list[int]]:  # noqa: ANN001
    client = _client(model, decode)
    try:
        return [await _run(client, p) for p in PROMPTS]
    finally:
        client.close()


def _strategy(references, right_from: int) -> SpeculativeDecode:  # noqa: ANN001
    # The GPU's verify prices on any backend: a verify costs ~1.8 pipelined decode steps there.
    return SpeculativeDecode(
        lambda: HostOracle(references, right_from), name="host", max_draft=6, cost_curve=gpu_cost_curve(6)
    )


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_model("qwen3_5")


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:  # noqa: ANN001
    return asyncio.run(_outputs(model))


def _references(plain: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    tok = ByteTokenizer()
    return {tuple(tok.encode(p)): ids for p, ids in zip(PROMPTS, plain, strict=True)}


async def test_failing_guesses_never_cost_a_verify(model, plain) -> None:  # noqa: ANN001
    strategy = _strategy(_references(plain), right_from=N + 1)
    assert await _outputs(model, strategy) == plain
    assert strategy.stats.steps == 0  # every step ran pipelined: no verify, no synchronous step


async def test_guesses_that_start_matching_turn_speculation_on(model, plain) -> None:  # noqa: ANN001
    strategy = _strategy(_references(plain), right_from=16)
    assert await _outputs(model, strategy) == plain
    assert strategy.stats.steps > 0
    assert strategy.stats.accepted >= 0.6 * len(PROMPTS) * (N - 16)
    assert strategy.stats.tokens_per_step > 3


def test_a_guess_is_scored_when_it_misses_or_is_matched_in_full() -> None:
    controller = DraftLengthController(max_draft=4, prior=0.5, decay=0.5)
    shadow = ShadowGuess()
    shadow.start([5, 6, 7], at=10)
    context = list(range(10))
    shadow.score(context, controller)  # nothing arrived yet
    assert shadow.live and controller.alphas == [0.5] * 4
    shadow.score(context + [5, 6], controller)  # matching so far: not resolved
    assert shadow.live and controller.alphas == [0.5] * 4
    shadow.score(context + [5, 6, 7], controller)  # matched in full: depths 0..2 hit
    assert not shadow.live and controller.alphas == [0.75, 0.75, 0.75, 0.5]
    assert shadow.current_run == 3
    shadow.start([1, 2, 3], at=13)
    shadow.score(context + [5, 6, 7, 1], controller)
    assert shadow.live and shadow.current_run == 4
    # the run's 4th token hit, its 5th missed: both are counted at the deepest depth kept (3)
    shadow.score(context + [5, 6, 7, 1, 9], controller)
    assert not shadow.live and controller.alphas == [0.75, 0.75, 0.75, 0.375]
    assert shadow.current_run == 0


async def test_a_fixed_length_host_drafter_verifies_whenever_it_drafts(model, plain) -> None:  # noqa: ANN001
    """`adaptive=False` means every draft is verified, however badly it scores."""
    strategy = SpeculativeDecode(
        lambda: HostOracle(_references(plain), right_from=N + 1), name="host", max_draft=6, adaptive=False
    )
    assert await _outputs(model, strategy) == plain
    assert strategy.stats.steps >= len(PROMPTS) * (N - 2) // 2 and strategy.stats.accepted == 0
