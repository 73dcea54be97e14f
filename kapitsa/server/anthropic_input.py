"""Anthropic Messages request → chat-template messages and tools (pure functions)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kapitsa.engine.types import ModelInfo
from kapitsa.errors import InvalidRequest
from kapitsa.server.anthropic_client_tools import client_tool
from kapitsa.server.anthropic_documents import readable_blocks
from kapitsa.server.errors import param_error
from kapitsa.server.images import content_parts, is_image_part
from kapitsa.server.prompt import fold_system_messages, json_mode_instruction, strip_attribution
from kapitsa.server.settings import MAX_MESSAGES
from kapitsa.server.tool_schema import check_tool_schema
from kapitsa.server.wire import WireModel

_UNSUPPORTED_BLOCKS = ("container_upload",)
_DOCUMENT_BLOCKS = ("document", "search_result")  # read as text (server.anthropic_documents)
log = logging.getLogger("kapitsa.server")
_SKIPPED_BLOCKS = ("redacted_thinking", "server_tool_use", "web_search_tool_result", "tool_reference")


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(WireModel):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the most likely token only
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format`: structured output (`effort` has no local effect)
    # the structured-outputs beta's spelling of `output_config.format`
    output_format: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    """The system prompt, without Claude Code's per-conversation attribution block."""
    if system is None:
        return ""
    if isinstance(system, str):
        return strip_attribution(system)
    texts = [strip_attribution(_block_text(b)) for b in system if b.get("type", "text") == "text"]
    return "\n".join(t for t in texts if t.strip())


def _block_text(block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("A text block needs a string `text`.")
    return text


def _texts(blocks: list[dict[str, Any]]) -> str:
    return "\n".join(_block_text(b) for b in blocks)


def _result_content(content: Any) -> str | list[dict[str, Any]]:
    """A tool result's text, or its text and images (a screenshot tool's) as template parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest("tool_result `content` must be a string or a list of blocks.")
    kept = []
    for block in content:
        if not isinstance(block, dict):
            raise InvalidRequest("tool_result content blocks must be objects.")
        if block.get("type") in ("text", "image"):
            kept.append(block)
        elif block.get("type") in _DOCUMENT_BLOCKS:
            kept += readable_blocks(block)
        elif block.get("type") in _UNSUPPORTED_BLOCKS:
            raise InvalidRequest(
                f"`{block.get('type')}` blocks are not supported: the served model reads text and images only."
            )
    if any(is_image_part(b) for b in kept):
        return content_parts(kept, _texts)
    return _texts(kept)


def _skip(kind: Any, role: str) -> None:
    """Blocks the local model cannot use are dropped; new block types from newer clients must not end a session."""
    if not isinstance(kind, str):
        raise InvalidRequest(f"A content block in a {role} message has no `type`.")
    if kind not in _SKIPPED_BLOCKS:
        log.warning("ignoring unknown content block type %r in a %s message", kind, role)


def _user_messages(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results become `tool` messages (in order); the remaining text one user message after them."""
    out: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []  # the user's own text and image blocks, in order
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            out.append(_tool_message(block))
        elif kind in ("text", "image"):
            kept.append(block)
        elif kind in _DOCUMENT_BLOCKS:
            kept += readable_blocks(block)
        elif kind in _UNSUPPORTED_BLOCKS:
            raise InvalidRequest(
                f"`{kind}` blocks are not supported: the served model reads text and images only."
            )
        else:
            _skip(kind, "user")
    if any(is_image_part(b) for b in kept):
        out.append({"role": "user", "content": content_parts(kept, _texts)})
    elif kept:
        out.append({"role": "user", "content": _texts(kept)})
    return out


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    content = _result_content(block.get("content"))
    if isinstance(content, str) and block.get("is_error") and not content.startswith("Error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content}


def _assistant_message(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, thoughts, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block))
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            arguments = block.get("input") if isinstance(block.get("input"), dict) else {}
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {"name": str(block.get("name", "")), "arguments": arguments},
                }
            )
        else:
            _skip(kind, "assistant")
    message["content"] = "\n".join(texts)
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def output_schema(body: MessagesRequest) -> dict[str, Any] | None:
    """The JSON schema the answer must match (`output_config.format`, or the beta `output_format`), or None."""
    fmt = (body.output_config or {}).get("format") or body.output_format
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise param_error(
            "output_config", "`output_config.format` must be {type: json_schema, schema: {...}}."
        )
    return fmt["schema"]


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    system = system_text(body.system)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    schema = output_schema(body)
    if schema is not None:  # the grammar holds the answer to it; the instruction says what it is for
        messages.insert(0, {"role": "system", "content": json_mode_instruction(schema)})
    for m in body.messages:
        if isinstance(m.content, str):
            content = strip_attribution(m.content) if m.role == "system" else m.content
            messages.append({"role": m.role, "content": content})
        elif m.role == "assistant":
            messages.append(_assistant_message(m.content))
        elif m.role == "system":
            messages.append({"role": "system", "content": system_text(m.content)})
        else:
            messages.extend(_user_messages(m.content))
    return fold_system_messages(messages)


def chat_tools(body: MessagesRequest) -> list[dict[str, Any]] | None:
    """The function tools the model may call: custom tools, and Anthropic-defined client tools (bash,
    text editor, memory, computer) with their documented schemas; after `tool_choice`."""
    choice = (body.tool_choice or {}).get("type", "auto")
    if choice == "none":
        return None
    tools, skipped = [], []
    for index, tool in enumerate(body.tools or []):
        function = _function(tool, index)
        if function is None:
            skipped.append(f"{tool.get('name')} ({tool.get('type')})")
        else:
            tools.append({"type": "function", "function": function})
    if skipped:  # the client asked for them: the log says why the model never calls them
        log.info(
            "skipping tools that Anthropic's servers run (the local model cannot): %s", ", ".join(skipped)
        )
    server_only = "a tool that Anthropic's servers run, which the local model cannot call"
    if choice == "tool":
        name = (body.tool_choice or {}).get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools and any(t.get("name") == name for t in body.tools or []):
            raise InvalidRequest(f"tool_choice names `{name}`, {server_only}.")
        if not tools:
            raise InvalidRequest(f"tool_choice names `{name}`, which is not among the tools.")
    elif choice == "any" and skipped and not tools:
        raise InvalidRequest(f"tool_choice `any` requires a call, but each tool is {server_only}.")
    return tools or None


def _function(tool: dict[str, Any], index: int) -> dict[str, Any] | None:
    """A tool as a chat-template function; None for a server tool (web search, code execution...)."""
    custom = tool.get("type") in (None, "custom")
    defined = None if custom else client_tool(tool)
    if not custom and defined is None:
        return None
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequest(f"`tools[{index}].name` must be a non-empty string.")
    if defined is not None:
        return {"name": tool["name"], **defined}
    schema = (
        check_tool_schema(tool["input_schema"], f"tools[{index}].input_schema")
        if "input_schema" in tool
        else {"type": "object", "properties": {}}
    )
    return {"name": tool["name"], "description": tool.get("description") or "", "parameters": schema}


def thinking_choice(body: MessagesRequest) -> bool | None:
    """`enabled`/`disabled` ask; `adaptive` (what Claude Code sends) leaves it to the model's template;
    no `thinking` at all is no thinking, as the Messages API defines it (a client's quick side calls,
    titles and summaries, leave it out). A prefilled answer is no thinking: the API refuses a prefill
    with extended thinking, and `adaptive` decides against it."""
    if body.thinking is None:
        return False
    kind = body.thinking.get("type")
    choice = None if kind in (None, "adaptive") else kind != "disabled"
    if choice is not False and assistant_prefill(body):
        if choice:
            raise param_error(
                "thinking", "Prefilling the assistant message is not supported with extended thinking."
            )
        return False
    return choice


def thinking_budget(body: MessagesRequest, model: ModelInfo, reasoning: bool) -> tuple[int, int] | None:
    """`thinking.budget_tokens` as the sampler's reasoning budget (most tokens, `</think>`'s id): only
    when the answer starts in reasoning and the model's `</think>` is one token. Anthropic asks for
    at least 1024 tokens; a smaller budget is honoured here, as a local model may want one."""
    budget = (body.thinking or {}).get("budget_tokens")
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise param_error("thinking.budget_tokens", "`thinking.budget_tokens` must be a positive integer.")
    close = model.thinking_prompt.close_token
    if not reasoning or (body.thinking or {}).get("type") != "enabled" or close is None:
        return None
    return (budget, close)


def assistant_prefill(body: MessagesRequest) -> str | None:
    """The text the answer continues: the final message's, when an assistant wrote it (None when the
    conversation ends with a user turn). As the Messages API defines it, that text cannot end in
    whitespace, and a final assistant message cannot hold a `tool_use` (its result must follow it)."""
    last = body.messages[-1]
    if last.role != "assistant":
        return None
    if isinstance(last.content, str):
        text = last.content
    else:
        if any(b.get("type") == "tool_use" for b in last.content):
            raise param_error(
                "messages",
                "The final assistant message cannot hold `tool_use` blocks: each needs its "
                "`tool_result` in a user message after it.",
            )
        text = _texts([b for b in last.content if b.get("type") == "text"])
    if text != text.rstrip():
        raise param_error("messages", "final assistant content cannot end with trailing whitespace")
    return text
