"""Responses API request → chat-template messages and tools (pure functions).

Codex is stateless over HTTP: every turn re-sends the whole history as items (`message`, `function_call`,
`function_call_output`, `reasoning`, …), with `store: false` and no `previous_response_id`. Other clients
keep OpenAI's default `store: true` and continue a stored response with `previous_response_id`: its
conversation (response_store.py) comes before the new input items, and only the new `instructions` apply.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field

from kapitsa.errors import InvalidRequest
from kapitsa.server.common import flatten_text
from kapitsa.server.constraints import narrow_tools
from kapitsa.server.errors import param_error
from kapitsa.server.images import content_parts, is_image_part
from kapitsa.server.prompt import fold_system_messages, json_mode_instruction, parse_arguments
from kapitsa.server.settings import MAX_MESSAGES
from kapitsa.server.tool_schema import check_tool_schema
from kapitsa.server.wire import WireModel

log = logging.getLogger("kapitsa.server")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_IGNORED_ITEMS = (
    "web_search_call",
    "local_shell_call",
    "local_shell_call_output",
    "compaction",
    "item_reference",
    "file_search_call",
    "image_generation_call",
    "mcp_list_tools",
    "ghost_snapshot",
)


class ResponsesRequest(WireModel):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default, True; False: one call at most
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the most likely token only
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None  # "message.output_text.logprobs" asks for logprobs too
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns go when it won't fit
    # OpenAI-hosted state this server does not keep: refused rather than answered without it
    conversation: Any = None
    prompt: Any = None


def _text(content: Any) -> str:
    if isinstance(content, list):
        return flatten_text([p for p in content if isinstance(p, dict)], allowed=_TEXT_PARTS)
    return flatten_text(content)


def _user_content(content: Any) -> str | list[dict[str, Any]]:
    """A user message's or a tool output's content: text, or text and `input_image` parts (resolved
    by server.images)."""
    if isinstance(content, list) and any(is_image_part(p) for p in content):
        return content_parts([p for p in content if isinstance(p, dict)], _text)
    return _text(content)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def input_messages(
    body: ResponsesRequest, history: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Instructions, then the items of `history` (a stored conversation) and of the input, as messages."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return system + items_to_messages([*(history or []), *input_items(body)])


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items → messages: consecutive calls join one assistant turn; reasoning rides on the next assistant turn."""
    messages: list[dict[str, Any]] = []
    pending_reasoning = ""
    for item in items:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            pending_reasoning += _reasoning_text(item)
        elif kind == "message":
            role = _role(item.get("role"))
            content = _user_content(item.get("content")) if role == "user" else _text(item.get("content"))
            messages.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            _append_call(messages, item)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(
                {
                    "role": "tool",
                    "content": _user_content(item.get("output")),  # a string, or text and image items
                    "tool_call_id": str(item.get("call_id", "")),
                }
            )
        elif not isinstance(kind, str):
            raise InvalidRequest("An input item has neither `type` nor `role`.")
        elif kind not in _IGNORED_ITEMS:
            log.warning("ignoring unknown input item type %r", kind)  # newer clients add item types
        if pending_reasoning and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = pending_reasoning
            pending_reasoning = ""
    return messages


def _role(role: Any) -> str:
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(f"Unsupported message role `{role}`.")
    return str(role)


def _reasoning_text(item: dict[str, Any]) -> str:
    # Our own reasoning items carry the text in `content` and, for clients that only echo it, `encrypted_content`.
    text = _text(item.get("content") or [])
    if not text and isinstance(item.get("encrypted_content"), str):
        text = item["encrypted_content"]
    return text or _text(item.get("summary") or [])


def _append_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    if item.get("type") == "custom_tool_call":
        arguments: Any = {"input": item.get("input", "")}
    else:
        arguments = parse_arguments(item.get("arguments", ""))
    call = {
        "id": str(item.get("call_id", "")),
        "type": "function",
        "function": {"name": str(item.get("name", "")), "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def function_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]], dict[str, str], set[str]]:
    """Chat-template tools; tool name → namespace for tools inside a `namespace`; names of freeform tools."""
    tools: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    custom: set[str] = set()
    for tool in body.tools or []:
        kind = tool.get("type")
        if kind == "function" and isinstance(tool.get("name"), str):
            tools.append(_function(tool))
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if (
                    isinstance(inner, dict)
                    and inner.get("type") == "function"
                    and isinstance(inner.get("name"), str)
                ):
                    tools.append(_function(inner))
                    namespaces[inner["name"]] = str(tool.get("name", ""))
        elif kind == "custom" and isinstance(tool.get("name"), str):
            custom.add(tool["name"])
            schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "description": tool.get("description", ""),
                        "parameters": schema,
                    },
                }
            )
    return _apply_choice(body.tool_choice, tools), namespaces, custom


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    params = (
        check_tool_schema(tool["parameters"], f"tools.{tool['name']}.parameters")
        if tool.get("parameters") is not None
        else {"type": "object", "properties": {}}
    )
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": params,
        },
    }


def _apply_choice(choice: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools `tool_choice` leaves the model: none, the one it names, or an `allowed_tools` subset."""
    if choice == "none":
        return []
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return narrow_tools(tools, [choice.get("name")])
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("tools")
        if choice.get("mode", "auto") not in ("auto", "required") or not isinstance(allowed, list):
            raise param_error(
                "tool_choice", "tool_choice allowed_tools needs `mode` auto or required and a `tools` list."
            )
        return narrow_tools(tools, _callable_names(allowed), mode=choice.get("mode", "auto"))
    return tools


def _callable_names(entries: list[Any]) -> list[Any]:
    """The function and custom tool names an `allowed_tools` list holds (a namespace's functions
    included); hosted tools (mcp, web search, ...) are not run here and drop out."""
    names: list[Any] = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if entry.get("type") in ("function", "custom"):
            names.append(entry.get("name"))
        elif entry.get("type") == "namespace":
            names += [t.get("name") for t in entry.get("tools") or [] if isinstance(t, dict)]
    return names


def check_hosted_state(body: ResponsesRequest) -> None:
    """Refuse what needs state kept at OpenAI: answering without it would drop context silently."""
    if body.conversation is not None:
        raise param_error(
            "conversation",
            "`conversation` (OpenAI's Conversations API) is not supported here: continue with "
            "`previous_response_id`, or send the earlier items in `input`.",
        )
    if body.prompt is not None:
        raise param_error(
            "prompt", "`prompt` (a stored prompt template) is not supported here: send `instructions`."
        )


def logprobs_wanted(body: ResponsesRequest) -> int | None:
    """Top alternatives per output token to report (0: the chosen token's only), or None: logprobs
    come back when `include` asks for them; `top_logprobs` only sets how many alternatives."""
    asked = "message.output_text.logprobs" in (body.include or [])
    return (body.top_logprobs or 0) if asked else None


def thinking_choice(body: ResponsesRequest) -> bool | None:
    effort = (body.reasoning or {}).get("effort")
    return None if effort is None else effort != "none"


def build_messages(
    body: ResponsesRequest, history: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The chat-template messages; `history` is the stored conversation `previous_response_id` names."""
    messages = input_messages(body, history)
    fmt = (body.text or {}).get("format") or {}
    if fmt.get("type") in ("json_object", "json_schema"):
        schema = fmt.get("schema") if fmt.get("type") == "json_schema" else None
        if fmt.get("type") == "json_schema" and not isinstance(schema, dict):
            raise InvalidRequest("text.format json_schema needs a `schema` object.")
        messages.insert(0, {"role": "system", "content": json_mode_instruction(schema)})
    messages = fold_system_messages(messages)
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("`input` holds no message.")
    return messages
