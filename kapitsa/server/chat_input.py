"""OpenAI chat-completions request → `GenerationRequest` (pure functions)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from kapitsa.engine.types import GenerationRequest, ModelInfo
from kapitsa.server.common import flatten_text, openai_sampling, param_error, thinking_kwargs
from kapitsa.server.constraints import narrow_tools, output_constraint, requires_call
from kapitsa.server.images import IMAGE_PART_TYPES, content_parts, take_images
from kapitsa.server.openai_models import ChatMessage, ChatRequest
from kapitsa.server.prefill import check_unforced, starts_in_reasoning
from kapitsa.server.prompt import fold_system_messages, json_mode_instruction, parse_arguments
from kapitsa.server.tool_schema import check_tool_schema


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages → chat-template messages (HF semantics: tool-call arguments as dicts)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if (
            m.role == "user"
            and isinstance(m.content, list)
            and any(p.type in IMAGE_PART_TYPES for p in m.content)
        ):
            parts = [p.model_dump(exclude_none=True) for p in m.content]
            out.append({"role": "user", "content": content_parts(parts, flatten_text)})
            continue
        text = flatten_text(m.content)
        if m.role in ("tool", "function"):
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id or m.name or ""})
        elif m.role == "assistant":
            out.append(_assistant_message(m, text))
        else:
            out.append({"role": m.role, "content": text})
    return out


def _assistant_message(m: ChatMessage, text: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reasoning = m.reasoning_content or m.reasoning
    if reasoning:
        message["reasoning_content"] = reasoning
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id or "",
                "type": "function",
                "function": {"name": c.function.name, "arguments": parse_arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    return message


def chat_tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The function tools the model may call, after `tool_choice` (a named tool narrows the list)."""
    tools = [
        _checked(i, t.model_dump(exclude_none=True))
        for i, t in enumerate(body.tools or [])
        if t.type == "function" and t.function
    ]
    if body.tool_choice == "none" or not tools:
        return None
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "allowed_tools":
        return _allowed(tools, body.tool_choice.get("allowed_tools"))
    if isinstance(body.tool_choice, dict):
        name = (body.tool_choice.get("function") or {}).get("name") or body.tool_choice.get("name")
        return narrow_tools(tools, [name])
    return tools


def _allowed(tools: list[dict[str, Any]], allowed: Any) -> list[dict[str, Any]]:
    """`{"type": "allowed_tools", "allowed_tools": {"mode", "tools": [{"type": "function",
    "function": {"name"}}]}}`: the listed functions (other tool types are not run here)."""
    if not isinstance(allowed, dict) or allowed.get("mode", "auto") not in ("auto", "required"):
        raise param_error(
            "tool_choice", "tool_choice allowed_tools needs `allowed_tools` with mode auto or required."
        )
    names = [
        (t.get("function") or {}).get("name")
        for t in allowed.get("tools") or []
        if isinstance(t, dict) and t.get("type") == "function"
    ]
    return narrow_tools(tools, names, mode=allowed.get("mode", "auto"))


def _checked(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if "parameters" in tool["function"]:
        check_tool_schema(tool["function"]["parameters"], f"tools[{index}].function.parameters")
    return tool


def chat_thinking(body: ChatRequest) -> bool | None:
    kwargs = body.chat_template_kwargs or {}
    if isinstance(kwargs.get("enable_thinking"), bool):
        return bool(kwargs["enable_thinking"])
    if body.enable_thinking is not None:
        return body.enable_thinking
    if body.reasoning_effort is not None:
        return body.reasoning_effort != "none"
    return None


# the names the renderer sets itself: a request's template variables may not replace them
_RENDERER_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


def template_kwargs(body: ChatRequest) -> tuple[tuple[str, Any], ...]:
    """The chat template's variables: `chat_template_kwargs` as given (e.g. Qwen3.6's
    `preserve_thinking`), with `enable_thinking` from whichever of its spellings the request used."""
    given = dict(body.chat_template_kwargs or {})
    for name in given:
        if name in _RENDERER_NAMES or not name.isidentifier():
            raise param_error("chat_template_kwargs", f"`{name}` cannot be set through chat_template_kwargs.")
    given.pop("enable_thinking", None)
    return tuple(sorted(given.items())) + thinking_kwargs(chat_thinking(body))


def chat_prefill(body: ChatRequest) -> str | None:
    """The text the answer continues under `continue_final_message` (None: a new assistant turn)."""
    if not body.continue_final_message:
        return None
    if body.add_generation_prompt:
        raise param_error(
            "continue_final_message",
            "`continue_final_message` and `add_generation_prompt` cannot both be set.",
        )
    last = body.messages[-1]
    if last.role != "assistant":
        raise param_error(
            "messages", "`continue_final_message` needs the conversation to end with an assistant message."
        )
    return flatten_text(last.content)


def chat_reasoning(body: ChatRequest, model: ModelInfo) -> bool:
    """Whether the output starts inside reasoning: where the prefill leaves it, or the generation prompt
    (none with `add_generation_prompt: false`, unless a blank prefill is answered afresh)."""
    prefill = chat_prefill(body)
    with_prompt = body.add_generation_prompt is not False or prefill is not None
    return starts_in_reasoning(model, chat_thinking(body), prefill, generation_prompt=with_prompt)


def to_generation_request(body: ChatRequest, model: ModelInfo) -> GenerationRequest:
    prefill = chat_prefill(body)
    messages = chat_messages(body.messages)
    fmt = body.response_format
    schema = None
    if fmt is not None and fmt.type != "text":
        schema = (fmt.json_schema or {}).get("schema") if fmt.type == "json_schema" else None
        if fmt.type == "json_schema" and not isinstance(schema, dict):
            raise param_error("response_format", "response_format json_schema needs `json_schema.schema`.")
        # The hint stays beside the grammar: a real model writes better JSON when told to.
        messages.insert(0, {"role": "system", "content": json_mode_instruction(schema)})
    messages, images = take_images(fold_system_messages(messages), model)
    if not messages:
        raise param_error("messages", "messages holds no user or assistant message.")
    sampling = openai_sampling(
        model,
        body,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    tools = chat_tools(body)
    tool_required = requires_call(body.tool_choice)
    if prefill is not None:
        forced = fmt is not None and fmt.type != "text" or bool(tools) and tool_required
        check_unforced(prefill, forced=forced, field="continue_final_message")
    constraint = output_constraint(
        model,
        thinking=chat_thinking(body),
        reasoning=chat_reasoning(body, model),
        json_schema=schema,
        json_mode=fmt is not None and fmt.type == "json_object",
        tools=tools,
        tool_required=tool_required,
        strict_tools=any(t.function and t.function.strict for t in body.tools or []),
        parallel_calls=getattr(body, "parallel_tool_calls", None) is not False,
    )
    return GenerationRequest(
        messages=tuple(messages),
        tools=tuple(tools or ()) or None,
        sampling=dataclasses.replace(sampling, constraint=constraint),
        model=model.id,
        add_generation_prompt=body.add_generation_prompt is not False,
        prediction=flatten_text(body.prediction.content) if body.prediction else None,
        continue_final_message=prefill is not None,
        chat_template_kwargs=template_kwargs(body),
        request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        n=body.n,
        images=images,
    )
