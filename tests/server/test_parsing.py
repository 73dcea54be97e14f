"""Pure translation pieces: tool-call formats, `<think>` split, argument coercion, prompt hygiene."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kapitsa.server.output import OutputParser, ReasoningPart, TextPart
from kapitsa.server.prompt import fold_system_messages, strip_attribution
from kapitsa.server.tool_calls import ToolCall, ToolCallParser, coerce

SCHEMA = {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": "integer"},
        "ratio": {"type": "number"},
        "force": {"type": "boolean"},
        "paths": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object"},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "Bash", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "read", "parameters": {}}},
]

XML = "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
BARE_XML = "<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>"
HERMES = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la", "timeout": "30"}}\n</tool_call>'
NEMOTRON = '<TOOLCALL>[{"name": "Bash", "arguments": {"command": "ls -la", "timeout": 30}}]</TOOLCALL>'
EXPECTED = {"command": "ls -la", "timeout": 30}


def parse(
    text: str, *, thinking: bool = False, chunks: list[str] | None = None, tools: Any = TOOLS
) -> list[Any]:
    parser = OutputParser(thinking=thinking, tools=tools)
    parts: list[Any] = []
    for chunk in chunks if chunks is not None else [text]:
        parts += parser.feed(chunk)
    parts += parser.finish()
    return merge(parts)


def merge(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if out and type(part) is type(out[-1]) and isinstance(part, (TextPart, ReasoningPart)):
            out[-1] = type(part)(out[-1].text + part.text)
        else:
            out.append(part)
    return out


def shape(parts: list[Any]) -> list[Any]:
    return [(p.name, json.loads(p.arguments)) if isinstance(p, ToolCall) else p for p in parts]


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    "call", [XML, BARE_XML, HERMES, NEMOTRON], ids=["qwen3_coder", "bare_xml", "hermes", "nemotron"]
)
def test_every_format_gives_the_same_typed_call(call: str) -> None:
    assert shape(parse("Let me look. " + call)) == [TextPart("Let me look. "), ("Bash", EXPECTED)]


@pytest.mark.parametrize("call", [XML, HERMES, NEMOTRON])
def test_any_chunking_gives_the_same_parts_and_never_leaks_a_tag(call: str) -> None:
    text = "<think>plan <b>it</b></think>\n\nRunning " + call + "\n" + call
    whole = shape(parse(text))
    rng = random.Random(0)
    splits = [[c for c in text]] + [random_splits(text, rng) for _ in range(200)]
    for chunks in splits:
        parts = parse(text, chunks=chunks)
        assert shape(parts) == whole
        assert not any(isinstance(p, TextPart) and ("<" in p.text or "TOOLCALL" in p.text) for p in parts)
    assert whole == [
        ReasoningPart("plan <b>it</b>"),
        TextPart("Running "),
        ("Bash", EXPECTED),
        ("Bash", EXPECTED),
    ]


def test_parallel_calls_in_one_block_and_ids_are_unique() -> None:
    text = '<TOOLCALL>[{"name": "read", "arguments": {"path": "a"}}, {"name": "read", "arguments": {"path": "b"}}]</TOOLCALL>'
    calls = [p for p in parse(text) if isinstance(p, ToolCall)]
    assert [json.loads(c.arguments)["path"] for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2


def test_unclosed_call_at_eos_counts_but_not_when_truncated_by_length() -> None:
    text = "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>"
    assert shape(parse(text)) == [("Bash", {"command": "ls"})]
    parser = OutputParser(thinking=False, tools=TOOLS)
    parts = parser.feed(text) + parser.finish(truncated=True)
    assert parts == [TextPart(text)]


def test_malformed_blocks_stay_text() -> None:
    for bad in [
        "<tool_call>{not json}</tool_call>",
        "<TOOLCALL>[1, 2]</TOOLCALL>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ]:
        assert parse(bad) == [TextPart(bad)]


def test_without_tools_nothing_is_parsed() -> None:
    assert parse("a " + HERMES, tools=None) == [TextPart("a " + HERMES)]


def test_literal_tag_like_text_passes() -> None:
    assert parse("x < y and <tool> is fine") == [TextPart("x < y and <tool> is fine")]
    assert parse("use the <think> tag like this", thinking=False) == [
        TextPart("use the <think> tag like this")
    ]


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("30", {"type": "integer"}, 30),
        ("3.5", {"type": "number"}, 3.5),
        ("7", {"type": "number"}, 7),
        ("true", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),
        ('["a", "b"]', {"type": "array"}, ["a", "b"]),
        ('{"k": 1}', {"type": "object"}, {"k": 1}),
        ("null", {"type": ["integer", "null"]}, None),
        ("12", {"type": ["integer", "null"]}, 12),
        (
            "12",
            {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "12",
        ),  # a string that may stay a string does
        ("abc", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "abc"),
        ("30", {"type": "string"}, "30"),
        (30, {"type": "string"}, "30"),
        ("thirty", {"type": "integer"}, "thirty"),
        ("1e3", {"type": "integer"}, "1e3"),
        ("x", None, "x"),
        ({"a": 1}, {"type": "string"}, '{"a": 1}'),
        (5, {"type": "integer"}, 5),
    ],
)
def test_coercion_to_declared_types(value: Any, schema: Any, expected: Any) -> None:
    assert coerce(value, schema) == expected


def test_xml_values_keep_their_own_whitespace() -> None:
    text = "<function=Bash>\n<parameter=command>\n  indented\n\n</parameter>\n</function>"
    calls = ToolCallParser(TOOLS).feed(text)
    assert json.loads(calls[0].arguments) == {"command": "  indented\n"}  # type: ignore[union-attr]


def test_thinking_split_when_the_template_opened_think() -> None:
    assert parse("reasoning here</think>\n\nThe answer.", thinking=True) == [
        ReasoningPart("reasoning here"),
        TextPart("The answer."),
    ]
    assert parse("<think>\nr</think>a", thinking=True) == [ReasoningPart("r"), TextPart("a")]
    assert parse("never closed", thinking=True) == [ReasoningPart("never closed")]


def test_attribution_line_is_stripped_and_only_at_the_start() -> None:
    line = "x-anthropic-billing-header: cc_version=2.1.197.123; cc_entrypoint=sdk-cli; cch=ab12;"
    assert strip_attribution(line) == ""
    assert strip_attribution(line + "\nYou are Claude.") == "You are Claude."
    assert strip_attribution("Intro\n" + line) == "Intro\n" + line


def test_system_and_developer_messages_fold_into_one_leading_system() -> None:
    folded = fold_system_messages(
        [
            {"role": "developer", "content": "a"},
            {"role": "user", "content": "u"},
            {"role": "system", "content": "b"},
            {"role": "assistant", "content": "x"},
        ]
    )
    assert folded == [
        {"role": "system", "content": "a\n\nb"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "x"},
    ]


def test_one_call_keeps_the_first_call_only() -> None:
    """Parallel calls turned off (`parallel_tool_calls: false`, `disable_parallel_tool_use`): in an
    `auto` turn, which no grammar holds, a second call is dropped, text and all."""
    two = HERMES + "\n" + HERMES.replace("ls -la", "pwd")
    parser = OutputParser(thinking=False, tools=TOOLS, one_call=True)
    parts = merge(parser.feed(two) + parser.finish())
    assert shape(parts) == [("Bash", EXPECTED)]
    assert len(parser.tool_calls) == 1
    assert len(shape(parse(two))) == 2  # the default keeps both


@pytest.mark.parametrize(
    "thinking, events, expected",
    [
        (False, [("Let me check. ", 4), ("Done.", 2)], 0),  # an answer that opens without <think>
        (False, [("  ", 1), ("Hi", 1)], 0),  # leading whitespace decides nothing
        (False, [("<thi", 1), ("nk>a b", 2), ("</think>", 1), ("ok", 1)], 4),
        (True, [("plan", 2), ("</think>\n\nok then", 4)], 4),  # crossing: 10 of 17 characters
        (True, [("plan</th", 2), ("ink>x", 1)], 3),  # a held tag prefix stays reasoning; round(4/5)
    ],
)
def test_reasoning_tokens_count_only_the_reasoning(thinking, events, expected):
    parser = OutputParser(thinking=thinking, tools=None)
    for text, tokens in events:
        parser.feed(text, tokens)
    parser.finish()
    assert parser.reasoning_tokens == expected
