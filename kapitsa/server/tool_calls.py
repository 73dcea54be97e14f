"""Tool calls parsed from the model's own text formats, streaming-safe.

Formats (any of them is recognised, whatever the model family says, because fine-tunes mix them):
- Qwen3-coder / Nemotron 3 XML: `<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`
  (the `<tool_call>` wrapper is optional);
- hermes JSON: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- Nemotron-H v2: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.
Text is released only once it cannot be the start of a tag; a call is released whole when its block closes.
Arguments are coerced to the JSON-schema types the tool declared.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kapitsa.server.reasoning import held_suffix_length
from kapitsa.server.schema_refs import schema_types

_BLOCKS = {"<tool_call>": "</tool_call>", "<TOOLCALL>": "</TOOLCALL>", "<function=": "</function>"}
_START_TAGS = tuple(_BLOCKS)
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER_RE = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name → its parameters JSON schema, from OpenAI-style `{"type":"function","function":{...}}` entries."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


class ToolCallParser:
    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.schemas = tool_schemas(tools)
        self._buffer = ""
        self._open: str | None = None  # the start tag of the block being read
        self.calls_seen = 0
        self._glue = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        """Text pieces and whole tool calls, in output order."""
        self._buffer += text
        out: list[str | ToolCall] = []
        while self._buffer:
            if self._open is None:
                if not self._scan_text(out):
                    break
            elif not self._scan_block(out):
                break
        return out

    def flush(self, *, truncated: bool = False) -> list[str | ToolCall]:
        """At the end of output: an unclosed block still counts if it parses (EOS often eats the close tag),
        unless the output was cut by the token limit, when the block is surely incomplete."""
        text, self._buffer = self._buffer, ""
        if self._open is None:
            return [text] if text.strip() or (text and not self.calls_seen) else []
        opened, self._open = self._open, None
        calls = [] if truncated else self._parse_block(opened, text)
        return list(calls) if calls else [opened + text]

    def _scan_text(self, out: list[str | ToolCall]) -> bool:
        hits = [(self._buffer.find(tag), tag) for tag in _START_TAGS if tag in self._buffer]
        if not hits:
            keep = held_suffix_length(self._buffer, _START_TAGS)
            self._emit_text(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        start, tag = min(hits)
        self._emit_text(out, self._buffer[:start])
        self._open = tag
        self._buffer = self._buffer[start + len(tag) :]
        return True

    def _emit_text(self, out: list[str | ToolCall], text: str) -> None:
        # Whitespace between or after calls is template glue, not an answer: held until real text follows.
        if self.calls_seen and not text.strip():
            self._glue += text
            return
        if text:
            out.append(self._glue + text)
            self._glue = ""

    def _scan_block(self, out: list[str | ToolCall]) -> bool:
        assert self._open is not None
        close = _BLOCKS[self._open]
        end = self._buffer.find(close)
        if end < 0:
            return False
        body, self._buffer = self._buffer[:end], self._buffer[end + len(close) :]
        opened, self._open = self._open, None
        calls = self._parse_block(opened, body)
        out.extend(calls if calls else [opened + body + close])
        return True

    def _parse_block(self, opened: str, body: str) -> list[ToolCall]:
        if opened == "<function=":
            raw = _parse_xml("<function=" + body + "</function>")
        elif opened == "<TOOLCALL>":
            raw = _parse_json_calls(body)
        else:
            raw = _parse_xml(body) if body.lstrip().startswith("<function=") else _parse_json_calls(body)
        calls = [self._make_call(name, args) for name, args in raw]
        self.calls_seen += len(calls)
        self._glue = ""
        return calls

    def _make_call(self, name: str, args: dict[str, Any]) -> ToolCall:
        schema = self.schemas.get(name, {})
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        typed = {k: coerce(v, props.get(k), root=schema) for k, v in args.items()}
        return ToolCall(new_call_id(), name, json.dumps(typed, ensure_ascii=False))


def _parse_xml(text: str) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for fn in _FUNCTION_RE.finditer(text):
        params = {m.group(1).strip(): _trim_value(m.group(2)) for m in _PARAMETER_RE.finditer(fn.group(2))}
        calls.append((fn.group(1).strip(), params))
    return calls


def _trim_value(value: str) -> str:
    # The template writes "\n" around each value; strip exactly those, not the value's own whitespace.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parse_json_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        data = json.loads(text.strip())
    except ValueError:
        return []
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        if not isinstance(args, dict):
            return []
        calls.append((item["name"], args))
    return calls


def coerce(value: Any, schema: Any, *, root: Any = None) -> Any:
    """`value` converted to the first declared type it fits; unchanged when none fits or there is no
    schema. `root`: the tool's whole schema, which the property's refs point into."""
    types = schema_types(schema, root)
    if not types or (isinstance(value, str) and "string" in types):
        return value
    for kind in types:
        converted = _convert(value, kind)
        if converted is not _NO:
            return converted
    return value


_NO = object()


def _convert(value: Any, kind: str) -> Any:
    if kind == "string":
        return (
            value
            if isinstance(value, str)
            else json.dumps(value)
            if isinstance(value, (dict, list))
            else str(value)
        )
    if not isinstance(value, str):
        return (
            value
            if _json_kind(value) == kind or (kind == "number" and _json_kind(value) == "integer")
            else _NO
        )
    text = value.strip()
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO)
    if kind == "null":
        return None if text.lower() in ("null", "none") else _NO
    try:
        parsed = json.loads(text)
    except ValueError:
        return _NO
    if kind == "number" and _json_kind(parsed) in ("number", "integer"):
        return parsed
    return parsed if _json_kind(parsed) == kind else _NO


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"
