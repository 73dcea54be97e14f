"""n > 1 in chat completions and completions: the chunker's framing, the SDK's view over FakeEngine,
and one prefill for three choices on a tiny real checkpoint."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import live_server, open_tiny_engine

from kapitsa.engine.types import FinishEvent, Usage
from kapitsa.server.common import Step, choice_usage
from kapitsa.server.openai_chat import ChatChunker
from kapitsa.server.output import TextPart


def frames_data(frames: list[bytes]) -> list[dict]:
    return [json.loads(f[6:]) for f in b"".join(frames).split(b"\n\n") if f.startswith(b"data: {")]


def finish(index: int, completion: int) -> FinishEvent:
    usage = Usage(prompt_tokens=10, completion_tokens=completion, cached_tokens=4)
    return FinishEvent("r", "stop", usage, index=index)


def test_choice_usage_counts_the_prompt_once_and_sums_the_outputs() -> None:
    usage = choice_usage([finish(0, 3), finish(1, 5), finish(2, 1)])
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (10, 4, 9)


def test_the_chunker_names_each_choice_and_ends_after_the_last() -> None:
    chunker = ChatChunker(completion_id="c", model="m", include_usage=True, want_logprobs=False, n=2)
    frames = [chunker.opening()]
    frames += chunker.step(Step([TextPart("a")], index=1))
    frames += chunker.step(Step([TextPart("b")], index=0))
    frames += chunker.closing(finish(1, 1), index=1)
    assert b"[DONE]" not in b"".join(frames)
    frames += chunker.closing(finish(0, 2), index=0)
    data = frames_data(frames)
    assert [c["choices"][0]["index"] for c in data[:2]] == [0, 1]
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in data[:2])
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in data[2:4]] == [
        (1, {"content": "a"}),
        (0, {"content": "b"}),
    ]
    assert [c["choices"][0]["finish_reason"] for c in data[4:6]] == ["stop", "stop"]
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 3
    assert b"".join(frames).endswith(b"data: [DONE]\n\n")


def test_the_sdk_gets_n_choices_streamed_and_not() -> None:
    with live_server() as live:
        oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=10)
        for text in ("one two", "three", "four five six"):
            live.engine.enqueue(text)
        out = oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=3)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.message.content for c in out.choices] == ["one two", "three", "four five six"]
        assert out.usage.completion_tokens == len("one twothreefour five six")
        live.engine.enqueue("alpha beta")
        live.engine.enqueue("gamma")
        stream = oai.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts = {0: "", 1: ""}
        finishes = []
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes.append(choice.index)
        assert texts == {0: "alpha beta", 1: "gamma"} and sorted(finishes) == [0, 1]
        assert chunk.usage.completion_tokens == len("alpha betagamma")
        legacy = oai.completions.create(model="fake", prompt="x", n=2, max_tokens=50)
        assert [c.index for c in legacy.choices] == [0, 1]
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=9)


def test_three_choices_share_one_prefill_on_the_real_engine(tmp_path) -> None:  # noqa: ANN001
    engine = open_tiny_engine(tmp_path / "qwen")
    try:
        with live_server(engine) as live:
            oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "Write three words about the sea, please."}]
            before = engine.stats()
            sampled = oai.chat.completions.create(
                model=engine.info.id, messages=messages, n=3, temperature=1.0, seed=7, max_tokens=6
            )
            after = engine.stats()
            greedy = oai.chat.completions.create(
                model=engine.info.id, messages=messages, n=3, temperature=0, max_tokens=6
            )
    finally:
        engine.close()
    usage = sampled.usage
    assert len(sampled.choices) == 3
    computed = after.prompt_tokens_computed - before.prompt_tokens_computed
    assert computed == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens  # prefilled once
    assert usage.completion_tokens == after.generated_tokens - before.generated_tokens
    assert len({c.message.content for c in greedy.choices}) == 1
