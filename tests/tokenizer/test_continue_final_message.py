"""A continued final assistant message (a prefilled answer) renders exactly as transformers'
`continue_final_message=True` renders it, on the real Qwen3.6 and Nemotron 3 templates and the tiny
checkpoints' templates; what cannot be continued is refused."""

from __future__ import annotations

from typing import Any

import pytest

from kapitsa.engine.text.chat_template import ChatTemplate
from kapitsa.engine.text.prepare import conversation
from kapitsa.engine.types import GenerationRequest
from kapitsa.errors import InvalidRequest
from tests.tokenizer.test_chat_template import TEMPLATES, TOOLS

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")


class TemplateOnly:
    """The part of a tokenizer that rendering needs."""

    def __init__(self, source: str) -> None:
        self.template = ChatTemplate(source)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kwargs: Any) -> str:
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )


PREFILLED = {
    "json": [{"role": "user", "content": "Give me JSON."}, {"role": "assistant", "content": '{"name":'}],
    "sentence": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "  The second answer is"},
    ],
    "parts": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "text", "text": "My favourite colour is"}]},
    ],
}
PAIRS = [
    (t, c)
    for t in TEMPLATES
    for c in PREFILLED
    if not (t in ("tiny_nemotron", "tiny_qwen_hermes") and c == "parts")  # string content only
]


def _reference(source: str, messages, tools, **kwargs) -> str:
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=tools, chat_template=source, continue_final_message=True, **kwargs
    )
    return rendered[0]


@pytest.mark.parametrize(("template_name", "name"), PAIRS)
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_the_continued_prompt_matches_transformers(template_name, name, with_tools, kwargs) -> None:
    source, messages = TEMPLATES[template_name], PREFILLED[name]
    tools = TOOLS if with_tools else None
    request = GenerationRequest(
        messages=tuple(messages),
        tools=tuple(tools) if tools else None,
        continue_final_message=True,
        chat_template_kwargs=tuple(kwargs.items()),
    )
    text = conversation(request).text(TemplateOnly(source), request)
    assert text == _reference(source, messages, tools, **kwargs)
    assert text.endswith(messages[-1]["content"].strip() if name != "parts" else "colour is")


@pytest.mark.parametrize("template_name", sorted(TEMPLATES))
@pytest.mark.parametrize("prefill", ["<", "end", ">", "|"])
def test_a_prefill_that_the_turn_end_repeats_is_cut_where_it_ends(template_name, prefill) -> None:
    """Short text that `<|im_end|>` also holds: the cut is after the message's own text, not inside
    the end-of-turn marker the template writes after it."""
    source = TEMPLATES[template_name]
    messages = [{"role": "user", "content": "Answer in XML."}, {"role": "assistant", "content": prefill}]
    request = GenerationRequest(messages=tuple(messages), continue_final_message=True)
    text = conversation(request).text(TemplateOnly(source), request)
    assert text == _reference(source, messages, None)
    assert "<|im_end|>" not in text.rsplit("<|im_start|>", 1)[-1] and text.endswith(prefill)


def test_an_empty_final_message_is_answered_afresh() -> None:
    messages = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": ""})
    request = GenerationRequest(messages=messages, continue_final_message=True)
    tokenizer = TemplateOnly(TEMPLATES["qwen3_6"])
    plain = GenerationRequest(messages=messages[:1])
    assert conversation(request).text(tokenizer, request) == conversation(plain).text(tokenizer, plain)


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": "hi"}], "must end with"),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "calling",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
                },
            ],
            "tool calls",
        ),
    ],
)
def test_what_cannot_be_continued_is_refused(messages, says) -> None:
    request = GenerationRequest(messages=tuple(messages), continue_final_message=True)
    with pytest.raises(InvalidRequest, match=says):
        conversation(request)


def test_a_template_that_rewrites_the_text_is_refused() -> None:
    shouting = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    messages = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "well then"})
    request = GenerationRequest(messages=messages, continue_final_message=True)
    with pytest.raises(InvalidRequest, match="changes the final assistant message"):
        conversation(request).text(TemplateOnly(shouting), request)


def test_continuing_needs_messages() -> None:
    with pytest.raises(ValueError, match="continue_final_message"):
        GenerationRequest(prompt="x", continue_final_message=True)
