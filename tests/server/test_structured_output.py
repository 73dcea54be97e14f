"""Structured output through the real server over a tiny random checkpoint (its free output is
never JSON): JSON Schema formats and required tool calls in all three APIs hold every time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_harness import assert_error_shape, tiny_engine_client

from kapitsa.testing.schema_check import schema_errors

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["title", "score", "ok", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
RUNS = 50  # per API and model family: 100 structured answers per API over the two families
CONCURRENT = 8  # requests in flight: the engine decodes them as one batch, each under its own grammar
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def http(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with tiny_engine_client(tmp_path_factory.mktemp("tiny") / request.param, request.param) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={**body, "model": http.model_id})
    assert response.status_code == 200, response.text
    return response.json()


def _post_all(http: httpx.Client, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body's answer, in order, `CONCURRENT` requests at a time."""
    with ThreadPoolExecutor(CONCURRENT) as pool:
        return list(pool.map(lambda body: _post(http, path, body), bodies))


def _chat(seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"question {seed}"}],
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 200,
        **NO_THINKING,
        **extra,
    }


def _valid(text: str, schema: dict[str, Any]) -> None:
    assert schema_errors(json.loads(text), schema) == [], text


def test_json_schema_in_chat_completions(http) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    bodies = [_chat(seed, response_format=fmt) for seed in range(RUNS)]
    for body in _post_all(http, "/v1/chat/completions", bodies):
        _valid(body["choices"][0]["message"]["content"], SCHEMA)


def test_json_schema_in_responses(http) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    bodies = [
        {
            "model": "tiny",
            "input": f"question {seed}",
            "temperature": 1.0,
            "max_output_tokens": 200,
            "reasoning": {"effort": "none"},
            "text": {"format": fmt},
            "store": False,
        }
        for seed in range(RUNS)
    ]
    for body in _post_all(http, "/v1/responses", bodies):
        texts = [c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"]]
        _valid("".join(texts), SCHEMA)


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_structured_output_matches_the_schema(http, field) -> None:
    """`output_config.format` (and the beta's top-level `output_format`): the answer's text is JSON
    that matches the schema."""
    fmt = {"type": "json_schema", "schema": WEATHER}
    bodies = [
        {
            "model": "tiny",
            "max_tokens": 400,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": f"weather as JSON {seed}"}],
            "thinking": {"type": "disabled"},
            field: {"format": fmt} if field == "output_config" else fmt,
        }
        for seed in range(RUNS // 5)
    ]
    for body in _post_all(http, "/v1/messages", bodies):
        text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
        assert body["stop_reason"] == "end_turn", body
        assert schema_errors(json.loads(text), WEATHER) == [], text


def _anthropic_choice(seed: int) -> dict[str, Any]:
    choice = {"type": "any"} if seed % 2 else {"type": "tool", "name": "get_weather"}
    return {**choice, "disable_parallel_tool_use": seed % 3 != 0}


def test_required_tool_call_in_anthropic_messages(http) -> None:
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS
    ]
    choices = [_anthropic_choice(seed) for seed in range(RUNS)]
    bodies = [
        {
            "model": "tiny",
            "max_tokens": 800 if choice["disable_parallel_tool_use"] else 1000,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": f"weather {seed}"}],
            "thinking": {"type": "disabled"},
            "tools": tools,
            "tool_choice": choice,
        }
        for seed, choice in enumerate(choices)
    ]
    for choice, body in zip(choices, _post_all(http, "/v1/messages", bodies), strict=True):
        uses = [b for b in body["content"] if b["type"] == "tool_use"]
        assert uses and body["stop_reason"] == "tool_use", body
        for use in uses:
            assert use["name"] in ("get_weather", "ping")
            if choice["type"] == "tool":
                assert use["name"] == "get_weather"
            if use["name"] == "get_weather":
                assert schema_errors(use["input"], WEATHER) == [], use


def test_required_tool_call_in_chat_completions(http) -> None:
    choices = [
        "required" if seed % 2 else {"type": "function", "function": {"name": "get_weather"}}
        for seed in range(RUNS)
    ]
    bodies = []
    for seed, choice in enumerate(choices):
        parallel = seed % 3 == 0  # up to MAX_PARALLEL_CALLS calls, else exactly one
        body = _chat(seed, tools=OPENAI_TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        bodies.append({**body, "max_tokens": 1000 if parallel else 800})
    for choice, body in zip(choices, _post_all(http, "/v1/chat/completions", bodies), strict=True):
        calls = body["choices"][0]["message"].get("tool_calls")
        assert calls and body["choices"][0]["finish_reason"] == "tool_calls", body
        for call in calls:
            if call["function"]["name"] == "get_weather":
                assert schema_errors(json.loads(call["function"]["arguments"]), WEATHER) == [], call
            else:
                assert choice == "required" and call["function"]["name"] == "ping"


def test_required_tool_call_in_responses(http) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    bodies = [
        {
            "model": "tiny",
            "input": f"weather {seed}",
            "temperature": 1.0,
            "max_output_tokens": 800,
            "reasoning": {"effort": "none"},
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "store": False,
        }
        for seed in range(RUNS)
    ]
    for body in _post_all(http, "/v1/responses", bodies):
        calls = [item for item in body["output"] if item["type"] == "function_call"]
        assert len(calls) == 1, body  # parallel_tool_calls false: exactly one call
        assert body["parallel_tool_calls"] is False
        for call in calls:
            assert schema_errors(json.loads(call["arguments"]), WEATHER) == [], call


def test_json_object_with_reasoning_closes_the_thought_first(http) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = _chat(1, response_format=fmt, temperature=0.0, max_tokens=400)
    body.pop("chat_template_kwargs")
    message = _post(http, "/v1/chat/completions", body)["choices"][0]
    if message["finish_reason"] == "stop":  # a random thought may outrun the budget
        _valid(message["message"]["content"], schema)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            _chat(
                0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            ),
        ),
        (
            "/v1/responses",
            {
                "model": "tiny",
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}},
            },
        ),
    ],
)
def test_invalid_schema_is_a_clear_400(http, path, body) -> None:
    response = http.post(path, json={**body, "model": http.model_id})
    error = assert_error_shape(path, response, 400)
    assert "grammar is invalid" in json.dumps(error), error


RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER},
    {"type": "function", "name": "ping", "parameters": {"type": "object", "additionalProperties": False}},
    {"type": "custom", "name": "apply_patch", "description": "edit files"},
]


def test_responses_allowed_tools_in_required_mode_force_a_call_of_one_of_them(http) -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    }
    bodies = [
        {
            "input": f"do something {seed}",
            "temperature": 1.0,
            "max_output_tokens": 400,
            "reasoning": {"effort": "none"},
            "tools": RESPONSES_TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "store": False,
        }
        for seed in range(8)
    ]
    for body in _post_all(http, "/v1/responses", bodies):
        calls = [item for item in body["output"] if item["type"].endswith("call")]
        assert [(c["type"], c["name"]) for c in calls] == [("function_call", "get_weather")], body


def test_responses_named_custom_tool_is_a_required_call() -> None:
    """A custom tool named in `tool_choice` is held to a call grammar like a named function (its
    free-text input is unbounded, so a random model's call is checked at the grammar, not by
    sampling one)."""
    from kapitsa.engine.types import ModelInfo
    from kapitsa.server.constraints import responses_constraint
    from kapitsa.server.responses_input import ResponsesRequest, function_tools

    info = ModelInfo(id="m", family="qwen3_5", context_length=4096, max_output_tokens=512)
    for choice in ({"type": "custom", "name": "apply_patch"}, "auto"):
        body = ResponsesRequest(input="x", tools=RESPONSES_TOOLS, tool_choice=choice)
        tools = function_tools(body)[0]
        constraint = responses_constraint(body, info, tools, thinking=None)
        if choice == "auto":
            assert constraint is None  # no strict tool, no required call: free output
        else:
            assert [t["function"]["name"] for t in tools] == ["apply_patch"]
            assert constraint is not None and constraint.value.startswith("start: call")


def test_a_json_format_beside_tools_leaves_room_for_a_call() -> None:
    """With tools (no call required) the model may call one before its JSON answer: the format is
    the prompt's instruction, not the grammar; without tools the grammar holds the answer."""
    from kapitsa.engine.types import ModelInfo
    from kapitsa.server.constraints import output_constraint

    info = ModelInfo(id="m", family="qwen3_5", context_length=4096, max_output_tokens=512)
    assert output_constraint(info, thinking=None, json_schema=WEATHER, tools=OPENAI_TOOLS) is None
    alone = output_constraint(info, thinking=None, json_schema=WEATHER)
    assert alone is not None and alone.kind == "json_schema"
    required = output_constraint(
        info, thinking=None, json_schema=WEATHER, tools=OPENAI_TOOLS, tool_required=True
    )
    assert required is not None and required.value.startswith("start: call")


def test_chat_allowed_tools_in_required_mode_force_a_call_of_one_of_them(http) -> None:
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        },
    }
    bodies = [
        {**_chat(seed, tools=OPENAI_TOOLS, tool_choice=choice, parallel_tool_calls=False), "max_tokens": 400}
        for seed in range(8)
    ]
    for body in _post_all(http, "/v1/chat/completions", bodies):
        calls = body["choices"][0]["message"].get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == ["get_weather"], body
