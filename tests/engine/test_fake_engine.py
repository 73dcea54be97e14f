from __future__ import annotations

from kapitsa.engine import EngineClient, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from kapitsa.testing.fake_engine import FakeEngine


async def _collect(engine: FakeEngine, request: GenerationRequest) -> list:
    return [event async for event in engine.generate(request)]


async def test_fake_engine_plays_script_and_honours_stop_and_max_tokens() -> None:
    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    engine.enqueue("one two three STOP four")
    events = await _collect(engine, GenerationRequest(prompt="hi", sampling=SamplingParams(stop=("STOP",))))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text == "one two three "
    assert isinstance(events[-1], FinishEvent) and events[-1].stop_sequence == "STOP"

    engine.enqueue("abcdefgh")
    events = await _collect(engine, GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=3)))
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "abc"
    assert events[-1].finish_reason == "length"
