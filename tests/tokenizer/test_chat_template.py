"""Our renderer gives exactly what transformers' renderer gives, on the real Qwen3.6 and Nemotron 3
templates and on the tiny checkpoints' templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from kapitsa.engine.text.chat_template import ChatTemplate
from kapitsa.errors import CheckpointError, InvalidRequest
from kapitsa.testing.tiny_tokenizer import NEMOTRON_TEMPLATE, QWEN_HERMES_TEMPLATE, QWEN_TEMPLATE

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = {
    "qwen3_6": (FIXTURES / "qwen3_6.jinja").read_text(),
    "nemotron_3": (FIXTURES / "nemotron_3.jinja").read_text(),
    "tiny_qwen": QWEN_TEMPLATE,
    "tiny_nemotron": NEMOTRON_TEMPLATE,
    "tiny_qwen_hermes": QWEN_HERMES_TEMPLATE,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file <from disk> & return it",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path"},
                    "limit": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    }
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there 日本 🙂"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nfirst answer"},
        {"role": "user", "content": "second"},
    ],
    "tool_round": [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "open a.txt"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should read it.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "a.txt", "limit": 5}},
                }
            ],
        },
        {"role": "tool", "content": "hello"},
        {"role": "tool", "content": "second result"},
    ],
    "content_parts": [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}]}
    ],
}


def _reference(source, messages, tools, add_generation_prompt, **kwargs):
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    return rendered[0]


# the compact tiny Nemotron and hermes templates take string content only
PAIRS = [
    (t, c)
    for t in TEMPLATES
    for c in CONVERSATIONS
    if not (t in ("tiny_nemotron", "tiny_qwen_hermes") and c == "content_parts")
]


@pytest.mark.parametrize(("template_name", "conversation"), PAIRS)
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_rendering_matches_transformers(template_name, conversation, with_tools, kwargs):
    source, messages = TEMPLATES[template_name], CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    expected = _reference(source, messages, tools, True, **kwargs)
    assert (
        ChatTemplate(source).render(messages, tools=tools, add_generation_prompt=True, **kwargs) == expected
    )
    expected_no_prompt = _reference(source, messages, tools, False, **kwargs)
    assert (
        ChatTemplate(source).render(messages, tools=tools, add_generation_prompt=False, **kwargs)
        == expected_no_prompt
    )


def test_qwen_generation_prompt_and_thinking_switch():
    template = ChatTemplate(TEMPLATES["qwen3_6"])
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages).endswith("<|im_start|>assistant\n<think>\n")
    assert template.render(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_qwen_tool_call_is_rendered_as_xml_parameters():
    text = ChatTemplate(TEMPLATES["qwen3_6"]).render(CONVERSATIONS["tool_round"], tools=TOOLS)
    assert (
        "<tool_call>\n<function=read_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=limit>\n5\n</parameter>"
        in text
    )
    assert '"description": "Read a file <from disk> & return it"' in text  # tojson does not HTML-escape


def test_template_raise_exception_is_an_invalid_request():
    with pytest.raises(InvalidRequest, match="No user query found"):
        ChatTemplate(TEMPLATES["qwen3_6"]).render([{"role": "system", "content": "only a system message"}])


def test_broken_template_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }")


def test_special_tokens_loop_controls_and_strftime_are_available():
    source = "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}{{ strftime_now('%Y') | length }}"
    text = ChatTemplate(source, special_tokens={"bos_token": "<s>"}).render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    )
    assert text == "<s>a4"


def test_generation_tag_renders_its_body():
    source = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render([{"role": "assistant", "content": "x"}]) == "[x]"


def test_reasoning_is_aliased_like_transformers():
    source = "{{ messages[0].reasoning_content }}|{{ messages[0].thinking }}"
    assert ChatTemplate(source).render([{"role": "assistant", "content": "", "reasoning": "r"}]) == "r|r"


def test_sandbox_blocks_attribute_escapes():
    with pytest.raises(InvalidRequest):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(
            [{"role": "user", "content": "x"}]
        )


def test_message_keys_set_to_none_count_as_missing_like_transformers(tmp_path):
    # OpenAI clients send `content: null` beside tool calls and `name: null`; transformers drops
    # such keys, so `is defined` and `default` see them as absent
    from kapitsa.testing.tiny import write_tiny_checkpoint

    transformers = pytest.importorskip("transformers")
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content | default('-') }}"
        "{% if m.name is defined %}({{ m.name }}){% endif %}{{ m.pair }};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "hi", "name": None, "pair": (1, 2)},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    reference = transformers.AutoTokenizer.from_pretrained(str(write_tiny_checkpoint(tmp_path, "qwen3_5")))
    expected = reference.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert expected == "user:hi(1, 2);assistant:-;"
    assert ChatTemplate(source).render(messages, add_generation_prompt=False) == expected
