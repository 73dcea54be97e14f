"""Constrained decoding on a tiny random checkpoint (whose free output is never JSON)."""

from __future__ import annotations

import json
import random

import pytest

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig
from kapitsa.engine.speculative.decoder import SpeculativeDecode
from kapitsa.engine.speculative.drafter import Draft
from kapitsa.engine.types import (
    Constraint,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kapitsa.errors import InvalidRequest
from kapitsa.testing.schema_check import schema_errors
from kapitsa.testing.tiny import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "size": {"$ref": "#/$defs/size"},
    },
    "required": ["name", "count", "tags", "size"],
    "additionalProperties": False,
    "$defs": {"size": {"anyOf": [{"type": "null"}, {"enum": ["S", "M", "L"]}]}},
}
JSON_SCHEMA = Constraint("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3_5"))


@pytest.fixture
def engine(loaded):
    client = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefill_chunk=64, prefix_cache_bytes=0))
    yield client
    client.close()


def _request(prompt: str, *, seed: int | None = None, constraint: Constraint | None = None, max_tokens=120):
    sampling = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens, constraint=constraint
    )
    return GenerationRequest(prompt=prompt, sampling=sampling)


async def _run(client, request) -> tuple[str, str, list[int]]:
    text, reason, ids = "", "", []
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            text += event.text
            ids += event.token_ids
        elif isinstance(event, FinishEvent):
            reason = event.finish_reason
        elif isinstance(event, ErrorEvent):
            raise event.error
    return text, reason, ids


async def test_free_output_of_the_tiny_model_is_not_json(engine) -> None:
    text, _, _ = await _run(engine, _request("hello", seed=1, max_tokens=40))
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("seed", range(20))
async def test_json_schema_output_validates(engine, seed) -> None:
    text, reason, _ = await _run(engine, _request(f"prompt {seed}", seed=seed, constraint=JSON_SCHEMA))
    assert reason == "stop", text
    assert schema_errors(json.loads(text), SCHEMA) == [], text


async def test_greedy_json_object_and_lark_and_regex(engine) -> None:
    text, reason, _ = await _run(
        engine, _request("x", constraint=Constraint("json_schema", '{"type": "object"}'))
    )
    assert text.startswith("{")  # free keys and strings: a random model may not close it in time
    assert reason == "length" or isinstance(json.loads(text), dict)
    lark = 'start: "yes" | "no" | "maybe"'
    text, reason, _ = await _run(engine, _request("x", seed=3, constraint=Constraint("lark", lark)))
    assert (text, reason) in {("yes", "stop"), ("no", "stop"), ("maybe", "stop")}
    text, _, _ = await _run(
        engine, _request("x", seed=4, constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2}"))
    )
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


async def test_batched_constrained_rows_leave_free_rows_unchanged(engine) -> None:
    import asyncio

    free = [_request(f"free {i}", seed=None if i % 2 else 10 + i, max_tokens=24) for i in range(4)]
    alone = [await _run(engine, r) for r in free]
    mixed = free + [_request(f"json {i}", seed=i, constraint=JSON_SCHEMA) for i in range(4)]
    together = await asyncio.gather(*(_run(engine, r) for r in mixed))
    assert [t[2] for t in together[:4]] == [a[2] for a in alone]
    for text, _, _ in together[4:]:
        assert schema_errors(json.loads(text), SCHEMA) == [], text


async def test_constrained_alone_equals_batched(engine) -> None:
    import asyncio

    requests = [_request(f"json {i}", seed=i, constraint=JSON_SCHEMA) for i in range(3)]
    alone = [await _run(engine, r) for r in requests]
    assert list(await asyncio.gather(*(_run(engine, r) for r in requests))) == alone


async def test_invalid_grammar_is_an_invalid_request(engine) -> None:
    for bad in (Constraint("json_schema", "{not json"), Constraint("lark", "start: undefined_rule")):
        with pytest.raises(InvalidRequest, match="grammar is invalid"):
            await _run(engine, _request("x", constraint=bad))


class _NoiseDrafter:
    """Proposes random tokens: almost none is allowed by the grammar, so verification must reject them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def observe(self, new_tokens) -> None:
        pass

    def propose(self, context, max_tokens: int) -> Draft:
        return Draft(tuple(self.rng.randrange(0, 480) for _ in range(max_tokens)))


async def test_speculative_drafts_are_checked_against_the_grammar(loaded, engine) -> None:
    requests = [_request(f"json {i}", constraint=JSON_SCHEMA) for i in range(2)]
    requests += [_request("json s", seed=5, constraint=JSON_SCHEMA)]
    plain = [await _run(engine, r) for r in requests]
    spec = InProcessEngine.from_loaded(
        loaded,
        config=EngineConfig(prefill_chunk=64, prefix_cache_bytes=0),
        decode=SpeculativeDecode(lambda: _NoiseDrafter(1), name="noise", max_draft=4, adaptive=False),
    )
    try:
        drafted = [await _run(spec, r) for r in requests]
    finally:
        spec.close()
    assert [d[2] for d in drafted[:2]] == [p[2] for p in plain[:2]]  # greedy: exactly the same tokens
    for text, _, _ in drafted:
        assert schema_errors(json.loads(text), SCHEMA) == [], text
