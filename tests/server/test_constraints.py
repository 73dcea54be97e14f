"""The grammars server/constraints.py builds, checked against the tiny tokenizer with llguidance:
what they accept, what they refuse, and that the tool-call parser reads what they accept."""

from __future__ import annotations

import json

import pytest
from server_harness import grammar_accepts

from kapitsa.server.constraints import json_constraint, tool_call_constraint
from kapitsa.server.tool_calls import ToolCall, ToolCallParser

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLS = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "nemotron": '<TOOLCALL>\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]\n</TOOLCALL>',
}


@pytest.mark.parametrize("tool_format", list(CALLS))
def test_required_call_in_each_format_is_read_by_the_parser(compiler, tool_format) -> None:
    constraint = tool_call_constraint(TOOLS, tool_format=tool_format, reasoning=False)
    assert grammar_accepts(compiler, constraint, CALLS[tool_format])
    assert not grammar_accepts(compiler, constraint, "Sure, let me check.")
    assert not grammar_accepts(compiler, constraint, CALLS[tool_format].replace("3", '"three"'))
    parsed = ToolCallParser(TOOLS).feed(CALLS[tool_format])
    calls = [p for p in parsed if isinstance(p, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


@pytest.mark.parametrize("tool_format", list(CALLS))
def test_strict_tools_leave_text_free_until_a_call_opens(compiler, tool_format) -> None:
    constraint = tool_call_constraint(TOOLS, tool_format=tool_format, reasoning=False, required=False)
    assert grammar_accepts(compiler, constraint, "Just an answer, no call.")
    assert grammar_accepts(compiler, constraint, "Let me look. " + CALLS[tool_format])
    bad = (
        CALLS[tool_format]
        .replace('"days": 3', '"days": 3, "extra": 1')
        .replace("<parameter=days>", "<parameter=x>")
    )
    assert not grammar_accepts(compiler, constraint, "Let me look. " + bad)


def test_reasoning_prefix_is_closed_before_the_json(compiler) -> None:
    constraint = json_constraint({"type": "object"}, reasoning=True)
    assert grammar_accepts(compiler, constraint, 'thinking it over</think>\n{"a": 1}')
    assert not grammar_accepts(compiler, constraint, '{"a": 1}')
