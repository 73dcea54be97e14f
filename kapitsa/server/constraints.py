"""Output grammars for the APIs' structured modes (pure functions → `Constraint`).

JSON modes become a JSON Schema; a required or named tool becomes a Lark grammar of one or more calls
in the model's own tool-call format (the formats `tool_calls.py` reads), with each call's arguments
held to its tool's schema; strict tools without a required call become a triggered grammar: free
text until the model opens a call, then a valid call. When the output starts inside reasoning, the
grammar lets it close `</think>` first.
"""

from __future__ import annotations

import json
from typing import Any

from kapitsa.engine.types import Constraint, ModelInfo
from kapitsa.server.anthropic_input import output_schema
from kapitsa.server.errors import param_error
from kapitsa.server.schema_refs import hoisted, reachable_defs, ref_target

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_PARALLEL_CALLS = 8  # calls one required turn may hold: a grammar always ends, even a weak model's
_THINK = r"think[lazy]: /(?s:.*)<\/think>/"
_WS = r"WS: /[ \t\n]{0,4}/"
# JSON inside a grammar gets the engine's whitespace cap too (an endless run of blanks never closes).
_JSON_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}


def json_constraint(schema: dict[str, Any] | None, *, reasoning: bool) -> Constraint:
    """Any JSON object (`schema` None: json_object mode) or a value valid against `schema`."""
    schema_text = json.dumps(schema if schema is not None else _ANY_OBJECT)
    if not reasoning:
        return Constraint("json_schema", schema_text)
    answer = _embedded_json(schema if schema is not None else _ANY_OBJECT)
    return Constraint("lark", f"start: think WS answer\nanswer: {answer}\n{_THINK}\n{_WS}\n")


def output_constraint(
    model: ModelInfo,
    *,
    thinking: bool | None,
    json_schema: dict[str, Any] | None = None,
    json_mode: bool = False,
    tools: list[dict[str, Any]] | None = None,
    tool_required: bool = False,
    strict_tools: bool = False,
    parallel_calls: bool = True,
    reasoning: bool | None = None,
) -> Constraint | None:
    """The grammar a request's structured modes ask for (None: free output).

    A required call wins over a JSON format (the answer is then the call); a JSON format holds the
    answer to its grammar only without tools (with tools a call may come first, so the format is
    the instruction's); strict tools without a required call give the triggered grammar.

    Args:
        model: the model (its tool-call format and whether its output starts inside reasoning).
        thinking: the request's `enable_thinking` (None: the template's default).
        json_schema: the schema of a json_schema format; `json_mode`: a json_object format.
        tools: the tools the model may call, after `tool_choice` narrowed them.
        tool_required: `tool_choice` requires a call (required / any / a named tool).
        strict_tools: some tool is `strict`: a call the model opens must be valid.
        parallel_calls: a required turn may hold several calls (else exactly one).
        reasoning: the output starts inside reasoning (None: as the template's generation prompt
            leaves it with this `thinking`; a continued answer says for itself).
    """
    if reasoning is None:
        reasoning = model.thinking_prompt.starts_in_reasoning(thinking)
    tool_format = model.tool_call_format
    if tool_required and not tools:  # as OpenAI and Anthropic answer: no call could be made
        raise param_error(
            "tool_choice", "`tool_choice` requires a tool call, but the request declares no tools."
        )
    if tools and tool_required:
        max_calls = MAX_PARALLEL_CALLS if parallel_calls else 1
        return tool_call_constraint(tools, tool_format=tool_format, reasoning=reasoning, max_calls=max_calls)
    if (json_schema is not None or json_mode) and not tools:
        # with tools the model may still call one first (the JSON is the final answer's), so the
        # format is the prompt's instruction only; strict tools keep their triggered grammar
        return json_constraint(json_schema, reasoning=reasoning)
    if tools and strict_tools:
        return tool_call_constraint(tools, tool_format=tool_format, reasoning=reasoning, required=False)
    return None


def tool_call_constraint(
    tools: list[dict[str, Any]],
    *,
    tool_format: str,
    reasoning: bool,
    required: bool = True,
    max_calls: int = MAX_PARALLEL_CALLS,
) -> Constraint:
    """Calls of `tools` in `tool_format` ("qwen3_coder", "hermes", "nemotron").

    Args:
        tools: OpenAI-style function tools (`{"type": "function", "function": {...}}`).
        tool_format: the model's format (`ModelInfo.tool_call_format`).
        reasoning: the output starts inside `<think>`.
        required: the output is only calls; otherwise free text, with any call it opens held valid.
        max_calls: the most calls a required output holds.
    """
    functions = [t.get("function", t) for t in tools]
    if tool_format == "nemotron":
        rules = _nemotron_rules(functions, max_calls if required else MAX_PARALLEL_CALLS)
    elif tool_format == "hermes":
        rules = _hermes_rules(functions)
    else:
        rules = _xml_rules(functions)
    think = "think WS " if reasoning else ""
    if required and tool_format == "nemotron":
        head = f"start: {think}call"  # one list holds every call
    elif required:
        head = f"start: {think}call{'(WS call' * (max_calls - 1)}{')?' * (max_calls - 1)}"
    else:  # triggered: prose ends at the first opening tag, TAIL is text without one
        opener = rules.pop(0)
        head = f"start: {think}TAIL | {think}(prose call_body)+ TAIL\n{opener}"
    lines = [head, *rules, _THINK, _WS]
    return Constraint("lark", "\n".join(lines) + "\n")


def _hermes_rules(functions: list[dict[str, Any]]) -> list[str]:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    calls, defs = _named_call_schemas(functions)
    return _wrapped("<tool_call>", "</tool_call>", _embedded_json(_with_defs({"anyOf": calls}, defs)))


def _nemotron_rules(functions: list[dict[str, Any]], max_calls: int) -> list[str]:
    """`<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`: the calls of a turn in one list."""
    calls, defs = _named_call_schemas(functions)
    schema = {"type": "array", "minItems": 1, "maxItems": max_calls, "items": {"anyOf": calls}}
    return _wrapped("<TOOLCALL>", "</TOOLCALL>", _embedded_json(_with_defs(schema, defs)))


def _wrapped(open_tag: str, close_tag: str, body: str) -> list[str]:
    """The opener rule first (the triggered grammar replaces it), then the call rules."""
    return [
        f"prose[lazy]: /(?s:.*){_regex_text(open_tag)}/\n"
        f"TAIL: /(?s:.*)/ & ~/(?s:.*){_regex_text(open_tag)}(?s:.*)/",
        f'call: "{open_tag}" call_body',
        f'call_body: "\\n" {body} "\\n{close_tag}"',
    ]


def _named_call_schemas(functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One `{"name", "arguments"}` schema per tool, and the `$defs` the composed root carries for them."""
    calls, defs = [], {}
    for index, fn in enumerate(functions):
        key, params = hoisted(index, fn["name"], fn.get("parameters") or _ANY_OBJECT)
        if key is not None:
            defs[key] = params
            params = {"$ref": f"#/$defs/{key}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return calls, defs


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def _xml_rules(functions: list[dict[str, Any]]) -> list[str]:
    """Qwen3-coder XML: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
    string values are raw text, other values JSON."""
    rules = [_wrapped("<tool_call>", "</tool_call>", "")[0], 'call: "<tool_call>" call_body']
    names = [f"fn_{i}" for i in range(len(functions))]
    rules.append(f'call_body: "\\n" ({" | ".join(names)}) "</tool_call>"')
    for index, (name, fn) in enumerate(zip(names, functions, strict=True)):
        rules += _xml_function(name, fn, index)
    return rules


def _xml_function(rule: str, fn: dict[str, Any], index: int) -> list[str]:
    key, params = hoisted(index, fn["name"], fn.get("parameters") or {})
    # each value compiles as its own JSON schema, so each carries the definitions its refs reach
    defs = {key: params} if key is not None else {}
    props: dict[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts, rules = [], []
    for i, (pname, pschema) in enumerate(props.items()):
        prule = f"{rule}_p{i}"
        parts.append(prule if pname in required else f"{prule}?")
        value = _xml_value(f"{prule}_v", pschema, rules, defs)
        rules.append(f'{prule}: "<parameter={pname}>\\n" {value}')
    body = " ".join(parts)
    rules.insert(0, f'{rule}: "<function={fn["name"]}>\\n" {body} "</function>\\n"')
    return rules


def _xml_value(lexeme: str, schema: Any, rules: list[str], defs: dict[str, Any]) -> str:
    """The value and its closing tag: raw text for a string (a ref to a string schema too, as a
    Pydantic enum is), JSON for anything else."""
    schema = schema if isinstance(schema, dict) else {}
    target = ref_target(schema, {"$defs": defs})
    if target.get("type") != "string":
        # the value's own `$defs` are only a container: its refs now point into the hoisted copy
        used = reachable_defs(schema, defs) if defs else {}
        return f'{_embedded_json(_with_defs(schema, used))} "\\n</parameter>\\n"'
    if isinstance(target.get("enum"), list) and target["enum"]:
        choices = " | ".join(json.dumps(str(v)) for v in target["enum"])
        return f'({choices}) "\\n</parameter>\\n"'
    length = (
        f"{{{int(target.get('minLength', 0))},{int(target['maxLength'])}}}" if "maxLength" in target else "*"
    )
    rules.append(f"{lexeme}[lazy]: /(?s:.{length})\\n<\\/parameter>\\n/")
    return lexeme


def _regex_text(text: str) -> str:
    return "".join("\\" + c if c in r"\/.*+?()[]{}|^$" else c for c in text)


def _embedded_json(schema: dict[str, Any]) -> str:
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _JSON_WHITESPACE}
    return f"%json {json.dumps(schema)}"


def narrow_tools(
    tools: list[dict[str, Any]], names: list[Any], *, mode: str = "auto"
) -> list[dict[str, Any]]:
    """The function tools a `tool_choice` names (a named tool, or `allowed_tools`' list), each of
    them among `tools`; `mode` "required" with none left is refused (no call could be made)."""
    for name in names:
        if not any(t["function"]["name"] == name for t in tools):
            raise param_error("tool_choice", f"tool_choice names `{name}`, which is not among the tools.")
    subset = [t for t in tools if t["function"]["name"] in names]
    if not subset and mode == "required":
        raise param_error("tool_choice", "tool_choice allowed_tools requires a call but allows no function.")
    return subset


def requires_call(choice: Any) -> bool:
    """Whether `tool_choice` makes the model call a tool: required, a named function or custom
    tool, or `allowed_tools` in required mode (its `mode` at the top, as Responses puts it, or
    inside `allowed_tools`, as chat does)."""
    if choice == "required":
        return True
    if not isinstance(choice, dict):
        return False
    if choice.get("type") == "allowed_tools":
        return (choice.get("mode") or (choice.get("allowed_tools") or {}).get("mode")) == "required"
    return choice.get("type") in ("function", "custom")


def responses_constraint(
    body: Any, model: ModelInfo, tools: list[dict[str, Any]], thinking: bool | None
) -> Constraint | None:
    """`output_constraint` for a Responses body: `text.format` and `tool_choice`."""
    fmt = (body.text or {}).get("format") or {}
    choice = body.tool_choice
    return output_constraint(
        model,
        thinking=thinking,
        json_schema=fmt.get("schema") if fmt.get("type") == "json_schema" else None,
        json_mode=fmt.get("type") == "json_object",
        tools=tools,
        tool_required=requires_call(choice),
        strict_tools=any(isinstance(t, dict) and t.get("strict") is True for t in body.tools or []),
        parallel_calls=getattr(body, "parallel_tool_calls", None) is not False,
    )


def anthropic_constraint(
    body: Any,
    model: ModelInfo,
    tools: list[dict[str, Any]] | None,
    thinking: bool | None,
    reasoning: bool | None = None,
) -> Constraint | None:
    """`output_constraint` for a Messages body: `tool_choice` any / tool, and `strict` tools."""
    choice = (body.tool_choice or {}).get("type")
    return output_constraint(
        model,
        thinking=thinking,
        reasoning=reasoning,
        json_schema=output_schema(body),
        tools=tools,
        tool_required=choice in ("any", "tool"),
        strict_tools=any(isinstance(t, dict) and t.get("strict") is True for t in body.tools or []),
        parallel_calls=not (body.tool_choice or {}).get("disable_parallel_tool_use", False),
    )
