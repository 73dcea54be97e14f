"""A predicted output (OpenAI's Predicted Outputs) in the engine, on the trained demo: the n-gram
drafter copies from it, so a prediction of the answer is accepted in long drafts, and the answer is
the model's own greedy one whatever the prediction says, for every choice of the request."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.factory import make_decode_strategy
from kapitsa.engine.speculative.ngram import NGramDrafter
from kapitsa.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent, Usage

DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))
PROMPT = "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n"
N_TOKENS = 48


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO)


def _client(loaded, decode=None) -> InProcessEngine:
    return InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0), decode=decode)


async def _texts(client, prediction: str | None = None, n: int = 1, usages: list | None = None) -> list[str]:
    params = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
    request = GenerationRequest(prompt=PROMPT, sampling=params, prediction=prediction, n=n)
    texts = [""] * n
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            texts[event.index] += event.text
        elif isinstance(event, FinishEvent) and usages is not None:
            usages.append(event.usage)
    return texts


def _forced() -> SpeculativeDecode:
    return SpeculativeDecode(NGramDrafter, name="ngram", max_draft=8, adaptive=False)


async def _plain(demo) -> str:
    client = _client(demo)
    try:
        return (await _texts(client))[0]
    finally:
        client.close()


async def test_a_prediction_is_drafted_from_and_changes_no_token(demo) -> None:
    expected = await _plain(demo)
    edited = expected[:20] + "# an edit\n" + expected[20:]  # the answer with an insertion
    for strategy, prediction in [
        (_forced(), edited),
        (_forced(), "nothing like it"),
        (make_decode_strategy("ngram"), edited),  # the adaptive default
    ]:
        client = _client(demo, strategy)
        try:
            assert await _texts(client, prediction) == [expected], prediction
        finally:
            client.close()
    with_it, without = _forced(), _forced()
    for strategy, prediction in [(with_it, expected), (without, None)]:
        client = _client(demo, strategy)
        try:
            assert await _texts(client, prediction) == [expected]
        finally:
            client.close()
    # the answer itself as the prediction is accepted in long drafts, beyond what the context gives
    assert (
        with_it.stats.tokens_per_step > 4
        and with_it.stats.tokens_per_step > 2 * without.stats.tokens_per_step
    )


async def test_every_choice_drafts_from_the_prediction(demo) -> None:
    expected = await _plain(demo)
    forced = _forced()
    client = _client(demo, forced)
    usages: list[Usage] = []
    try:
        assert await _texts(client, expected, n=2, usages=usages) == [expected, expected]
    finally:
        client.close()
    assert forced.stats.tokens_per_step > 4
    # each choice's usage counts its own drafts, and together they are the decoder's
    assert all(u.draft_tokens_accepted > N_TOKENS // 2 for u in usages) and len(usages) == 2
    assert sum(u.draft_tokens_accepted for u in usages) == forced.stats.accepted
    assert sum(u.draft_tokens_proposed for u in usages) == forced.stats.proposed


async def _usage(demo, strategy: SpeculativeDecode, prediction: str | None) -> Usage:
    client = _client(demo, strategy)
    usages: list[Usage] = []
    try:
        await _texts(client, prediction, usages=usages)
    finally:
        client.close()
    return usages[0]


async def test_only_drafts_copied_from_the_prediction_count_as_prediction_tokens(demo) -> None:
    """OpenAI's accepted/rejected prediction tokens are the prediction's: drafts copied from the
    context are speculative decoding's own, and a request without a prediction has none."""
    expected = await _plain(demo)
    without = await _usage(demo, _forced(), None)
    assert without.draft_tokens_proposed > 0  # the context's drafts were verified
    assert without.prediction_tokens_proposed == without.prediction_tokens_accepted == 0
    unrelated = await _usage(demo, _forced(), "nothing like it")
    assert unrelated.prediction_tokens_accepted == 0
    answer = await _usage(demo, _forced(), expected)
    assert N_TOKENS // 2 < answer.prediction_tokens_accepted <= answer.draft_tokens_accepted
    assert answer.prediction_tokens_accepted <= answer.prediction_tokens_proposed


async def test_a_tree_counts_the_prediction_path_it_kept(demo) -> None:
    expected = await _plain(demo)
    tree = SpeculativeDecode(NGramDrafter, name="ngram", max_draft=8, adaptive=False, tree=True)
    client = _client(demo, tree)
    usages: list[Usage] = []
    try:
        assert await _texts(client, expected, usages=usages) == [expected]
    finally:
        client.close()
    (usage,) = usages
    assert N_TOKENS // 2 < usage.prediction_tokens_accepted <= usage.draft_tokens_accepted
    assert usage.prediction_tokens_proposed <= usage.draft_tokens_proposed


async def test_the_choices_of_a_request_share_one_prediction_index(demo) -> None:
    expected = await _plain(demo)
    forced = _forced()
    client = _client(demo, forced)
    try:
        assert await _texts(client, expected, n=3) == [expected] * 3
    finally:
        client.close()
    indexes = {id(st.drafter._reference.index) for st in forced._states.values()}
    assert len(forced._states) == 3 and len(indexes) == 1


class _Spy:
    """The demo's tokenizer, noting the length of every text it encodes."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self._tokenizer, self.encoded = tokenizer, []

    def encode(self, text: str, **kwargs) -> list[int]:  # noqa: ANN003
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._tokenizer, name)


def test_a_huge_prediction_is_read_only_as_far_as_an_answer_could_repeat_it(demo) -> None:
    """No answer is longer than the window: a prediction is tokenized at most as far as a prompt
    could be (the window's worth of its longest tokens) and kept to the window's tokens, not
    tokenized whole and indexed on the engine thread (a 30 MB one took seconds and gigabytes)."""
    window, longest = 256, 8
    spy = _Spy(demo.tokenizer)
    info = dataclasses.replace(demo.info, context_length=window, max_token_bytes=longest)
    client = InProcessEngine(demo.model, spy, info, config=EngineConfig(prefix_cache_bytes=0))
    try:
        request = GenerationRequest(
            prompt=PROMPT, sampling=SamplingParams(max_tokens=8), prediction="x = 1\n" * 200_000
        )
        seq = client._make_sequence(request)
    finally:
        client.close()
    assert 0 < len(seq.prediction_ids) <= window
    assert max(spy.encoded) <= window * longest


async def test_drafts_past_a_stop_are_not_counted_as_kept(demo) -> None:
    """A verify that keeps drafts past a stop string emits only the tokens before it: the drafts
    after it did not appear in the answer, so they are not accepted prediction tokens (they were
    counted, and the usage said more prediction tokens were kept than the answer had)."""
    expected = await _plain(demo)
    words = [w for w in expected.replace("(", " ").replace(",", " ").split() if w.isidentifier()][2:12]
    for stop in words:
        client = _client(demo, _forced())
        usages: list[Usage] = []
        try:
            params = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, stop=(stop,))
            request = GenerationRequest(prompt=PROMPT, sampling=params, prediction=expected)
            async for event in client.generate(request):
                if isinstance(event, FinishEvent):
                    usages.append(event.usage)
        finally:
            client.close()
        (usage,) = usages
        # the first token comes from the prefill, never from a draft
        assert usage.prediction_tokens_accepted <= usage.draft_tokens_accepted < usage.completion_tokens, stop
