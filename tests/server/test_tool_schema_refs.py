"""Tool schemas with `$defs` / `definitions` and `$ref`s (what Pydantic models with nested models emit)
under a call grammar: every tool's refs resolve to its own definitions in each tool-call format, and
requests that force or strictly check a call answer 200 in all three APIs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import grammar_accepts, tiny_engine_client

from kapitsa.errors import InvalidRequest
from kapitsa.server.constraints import tool_call_constraint
from kapitsa.server.tool_calls import ToolCall, ToolCallParser

FORMATS = ["hermes", "nemotron", "qwen3_coder"]
_ADDRESS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer", "maximum": 99}},
    "required": ["city", "zip"],
    "additionalProperties": False,
}


def _person(keyword: str) -> dict[str, Any]:
    """A Pydantic-style model with a nested model under `keyword` ("$defs" or draft-07 "definitions")."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {"$ref": f"#/{keyword}/Address"},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
        keyword: {"Address": _ADDRESS},
    }


PERSON = _person("$defs")
TREE = {
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/Node"}},
    "required": ["root"],
    "additionalProperties": False,
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
}
LINKED = {  # a root self-reference and a pointer into the tool's own properties
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 8},
        "size": {"type": "integer"},
        "copy_size": {"$ref": "#/properties/size"},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["label", "size", "copy_size", "next"],
    "additionalProperties": False,
}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _with_a(a: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}},
        "required": ["a"],
        "additionalProperties": False,
        "$defs": {"A": a},
    }


PAINT = {  # a Pydantic str enum: a ref to a string schema (raw text in the XML format)
    "type": "object",
    "properties": {"color": {"$ref": "#/$defs/Color"}, "coats": {"type": "integer"}},
    "required": ["color", "coats"],
    "additionalProperties": False,
    "$defs": {"Color": {"type": "string", "enum": ["red", "blue"]}},
}
TWO_AS = [  # both tools define `$defs/A`, with different shapes
    _tool("first", _with_a({"type": "integer"})),
    _tool("second", _with_a({"type": "object", "properties": {"s": {"type": "boolean"}}, "required": ["s"]})),
]
# (tools, (name, arguments) a valid call, (name, arguments) a call that breaks a nested definition)
CASES = {
    "defs": (
        [_tool("save", _person("$defs"))],
        ("save", {"name": "Ann", "address": {"city": "Paris", "zip": 7}}),
        ("save", {"name": "Ann", "address": {"city": "Paris", "zip": "7"}}),
    ),
    "definitions": (
        [_tool("save", _person("definitions"))],
        ("save", {"name": "Ann", "address": {"city": "Paris", "zip": 7}}),
        ("save", {"name": "Ann", "address": {"city": "Paris"}}),
    ),
    "recursive": (
        [_tool("tree", TREE)],
        (
            "tree",
            {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}]}},
        ),
        ("tree", {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": "x"}]}]}}),
    ),
    "string_enum": (
        [_tool("paint", PAINT)],
        ("paint", {"color": "red", "coats": 2}),
        ("paint", {"color": "green", "coats": 2}),
    ),
    "same_name_first": (TWO_AS, ("first", {"a": 1}), ("first", {"a": {"s": True}})),
    "same_name_second": (TWO_AS, ("second", {"a": {"s": True}}), ("second", {"a": 1})),
    "root_and_property_pointers": (
        [_tool("link", LINKED)],
        (
            "link",
            {
                "label": "a",
                "size": 1,
                "copy_size": 2,
                "next": {"label": "b", "size": 3, "copy_size": 4, "next": None},
            },
        ),
        (
            "link",
            {
                "label": "a",
                "size": 1,
                "copy_size": 2,
                "next": {"label": "b", "size": 3, "copy_size": "4", "next": None},
            },
        ),
    ),
}


def _call_text(tool_format: str, tools: list[dict[str, Any]], name: str, args: dict[str, Any]) -> str:
    """One call as the model writes it in `tool_format` (XML parameters in the schema's order)."""
    if tool_format == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    if tool_format == "nemotron":
        return f"<TOOLCALL>\n{json.dumps([{'name': name, 'arguments': args}])}\n</TOOLCALL>"
    params = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    parts = [
        f"<parameter={key}>\n{args[key] if isinstance(args[key], str) else json.dumps(args[key])}\n</parameter>\n"
        for key in params["properties"]
        if key in args
    ]
    return f"<tool_call>\n<function={name}>\n{''.join(parts)}</function>\n</tool_call>"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tool_format", FORMATS)
@pytest.mark.parametrize("required", [True, False], ids=["forced", "strict"])
def test_refs_resolve_to_the_tools_own_definitions(compiler, tool_format, case, required) -> None:
    tools, good, bad = CASES[case]
    constraint = tool_call_constraint(tools, tool_format=tool_format, reasoning=False, required=required)
    prefix = "" if required else "Let me do it. "
    assert grammar_accepts(compiler, constraint, prefix + _call_text(tool_format, tools, *good))
    assert not grammar_accepts(compiler, constraint, prefix + _call_text(tool_format, tools, *bad))


def test_an_xml_value_of_a_ref_to_a_string_is_raw_text_the_parser_reads(compiler) -> None:
    tools = [_tool("paint", PAINT)]
    text = _call_text("qwen3_coder", tools, "paint", {"color": "blue", "coats": 1})
    constraint = tool_call_constraint(tools, tool_format="qwen3_coder", reasoning=False)
    assert "<parameter=color>\nblue\n" in text and grammar_accepts(compiler, constraint, text)
    calls = [p for p in ToolCallParser(tools).feed(text) if isinstance(p, ToolCall)]
    assert [json.loads(c.arguments) for c in calls] == [{"color": "blue", "coats": 1}]


def test_an_xml_value_of_a_ref_to_an_object_is_read_as_an_object() -> None:
    tools = [_tool("save", PERSON)]
    args = {"name": "Ann", "address": {"city": "Paris", "zip": 7}}
    calls = [p for p in ToolCallParser(tools).feed(_call_text("qwen3_coder", tools, "save", args))]
    assert [json.loads(c.arguments) for c in calls if isinstance(c, ToolCall)] == [args]


@pytest.mark.parametrize("tool_format", FORMATS)
def test_a_ref_outside_the_tools_schema_is_a_clear_400(tool_format) -> None:
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(InvalidRequest, match="fetch_it"):
        tool_call_constraint([_tool("fetch_it", remote)], tool_format=tool_format, reasoning=False)


def test_tools_without_refs_keep_their_grammar() -> None:
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for tool_format in FORMATS:
        constraint = tool_call_constraint([_tool("p", plain)], tool_format=tool_format, reasoning=False)
        assert "$defs" not in constraint.value


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def http(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with tiny_engine_client(tmp_path_factory.mktemp("tiny") / request.param, request.param) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={**body, "model": http.model_id, "temperature": 0.0})
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_required_call_with_defs(http) -> None:
    body = _post(
        http,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "save Ann"}],
            "max_tokens": 400,
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [_tool("save", PERSON)],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    )
    choice = body["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["save"]


def test_anthropic_any_tool_with_defs(http) -> None:
    body = _post(
        http,
        "/v1/messages",
        {
            "max_tokens": 400,
            "messages": [{"role": "user", "content": "save Ann"}],
            "thinking": {"type": "disabled"},
            "tools": [{"name": "save", "input_schema": PERSON}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        },
    )
    if body["stop_reason"] == "tool_use":
        assert [b["name"] for b in body["content"] if b["type"] == "tool_use"] == ["save"]


def test_responses_strict_tool_with_defs(http) -> None:
    body = _post(
        http,
        "/v1/responses",
        {
            "input": "save Ann",
            "max_output_tokens": 400,
            "reasoning": {"effort": "none"},
            "tools": [{"type": "function", "name": "save", "parameters": PERSON, "strict": True}],
            "store": False,
        },
    )
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert all(call["name"] == "save" for call in calls), body


def test_a_cyclic_or_fanned_out_ref_costs_its_size_when_a_call_is_typed() -> None:
    """Reading a call's arguments follows each ref once: a cycle ends, and a ref fan-out nine levels
    deep (8**9 paths unwalked) types its value at once."""
    import time

    cyclic = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}},
    }
    fanned: dict[str, Any] = {"type": "object", "properties": {"a": {"$ref": "#/$defs/D0"}}, "$defs": {}}
    for i in range(9):
        fanned["$defs"][f"D{i}"] = {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}] * 8}
    fanned["$defs"]["D9"] = {"type": "integer"}
    start = time.monotonic()
    for schema, want in ((cyclic, "7"), (fanned, 7)):
        tools = [_tool("f", schema)]
        (call,) = [c for c in ToolCallParser(tools).feed(_call_text("qwen3_coder", tools, "f", {"a": "7"}))]
        assert json.loads(call.arguments) == {"a": want}
    assert time.monotonic() - start < 2.0


def test_an_xml_grammar_carries_each_value_only_the_definitions_it_reaches() -> None:
    """The qwen3-coder format compiles each value alone; a value holds the definitions its refs reach,
    so a tool of many properties and one large definition stays about one definition's size."""
    big = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(300)}}
    props: dict[str, Any] = {f"n{i}": {"type": "integer"} for i in range(200)}
    props["big"] = {"$ref": "#/$defs/Big"}
    schema = {"type": "object", "properties": props, "$defs": {"Big": big}}
    grammar = tool_call_constraint([_tool("f", schema)], tool_format="qwen3_coder", reasoning=False).value
    assert grammar.count('"k299"') == 1
    assert len(grammar) < 3 * len(json.dumps(big)) + 200 * 200
