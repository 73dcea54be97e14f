"""Chat templates rendered the way Hugging Face transformers renders them.

Same jinja2 environment as `transformers.utils.chat_template_utils`: a sandbox with
`trim_blocks`/`lstrip_blocks`, loop controls, the `{% generation %}` tag, a `tojson` that does not
HTML-escape, `raise_exception`, `strftime_now`, and reasoning aliased under `reasoning_content`,
`thinking` and `reasoning`. A template's `raise_exception` becomes an `InvalidRequest`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kapitsa.errors import CheckpointError, InvalidRequest

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(Exception):
    """`raise_exception(...)` from inside a template: the request does not fit the template."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _make_environment()


def _plain(value: Any) -> Any:
    """Rebuild inputs from plain JSON types so the sandbox sees no rich objects (as transformers does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return str(value)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One compiled chat template plus the special-token strings templates may reference."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None] | None = None) -> None:
        try:
            self._template = _ENVIRONMENT.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (and `tools`) to the prompt text, with Hugging Face semantics.

        Args:
            messages: chat messages (`role`, `content`, optional `tool_calls`, `reasoning_content`...).
            tools: JSON-schema tool definitions, or None.
            add_generation_prompt: end with the assistant turn's opening.
            template_kwargs: extra template variables, e.g. `enable_thinking=False`.
        Returns:
            The rendered text.
        Raises:
            InvalidRequest: the template rejected the conversation (its `raise_exception`), or the
                conversation is not a list of message objects.
        """
        chat = _plain(list(messages))
        if not all(isinstance(m, dict) for m in chat):
            raise InvalidRequest("chat messages must be objects with a role and content")
        # a key set to None counts as absent (transformers drops them): templates test `is defined`
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in chat]
        context = {**self.special_tokens, **_plain(template_kwargs)}
        context.update(
            messages=chat, tools=_plain(list(tools)) if tools is not None else None, documents=None
        )
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise InvalidRequest(f"the model's chat template rejected the conversation: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidRequest(f"the model's chat template failed on this conversation: {e}") from e


def pick_template(candidates: Mapping[str, str], *, has_tools: bool) -> str | None:
    """Choose among named templates (tokenizer_config's list form): `tool_use` when tools are given."""
    if has_tools and "tool_use" in candidates:
        return candidates["tool_use"]
    return candidates.get("default") or next(iter(candidates.values()), None)
