"""A prefilled answer on the real demo: the Messages API's final assistant message, and chat's
`continue_final_message` (vLLM's extension), continue that text: greedy, each answer equals the raw
completion of the conversation rendered as transformers renders a continued message. What the APIs
refuse with a prefill is a 400 that says why; chat's other template variables reach the template."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from server_harness import LiveServer
from test_demo_answers import DEMO, oai, serve, serve_with_template

from kapitsa.engine.types import ModelInfo, ThinkingPrompt
from kapitsa.errors import InvalidRequest
from kapitsa.server.chat_input import chat_reasoning
from kapitsa.server.openai_models import ChatRequest
from kapitsa.server.prefill import check_unforced

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

ASK = {"role": "user", "content": "Write a Python function that adds two numbers."}
PREFILL = "```python\ndef add("  # the demo model goes on from here (it ends a bare `def add(a, b):`)
TOKENS = 24
GREEDY = {"temperature": 0}  # (this anthropic SDK's typed `create` takes no temperature)
# the demo's template, plus a variable a request may set through chat_template_kwargs
SAYS_STYLE = "{%- if style is defined %}<|im_start|>system\nAnswer {{ style }}.<|im_end|>\n{%- endif %}"


@pytest.fixture(scope="module")
def demo() -> Iterator[LiveServer]:
    yield from serve(DEMO, "demo")


@pytest.fixture(scope="module")
def styled_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    template = SAYS_STYLE + (DEMO / "chat_template.jinja").read_text()
    yield from serve_with_template(tmp_path_factory, "styled-demo", template)


def _continued_prompt(messages: list[dict]) -> str:
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages],
        chat_template=(DEMO / "chat_template.jinja").read_text(),
        continue_final_message=True,
    )
    return rendered[0]


def _completion_of(live: LiveServer, prompt: str) -> str:
    out = oai(live).completions.create(model="demo", prompt=prompt, max_tokens=TOKENS, temperature=0)
    return out.choices[0].text


def _claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_messages_prefill_is_continued(demo: LiveServer, stream: bool) -> None:
    messages = [ASK, {"role": "assistant", "content": PREFILL}]
    expected = _completion_of(demo, _continued_prompt(messages))
    assert expected
    claude = _claude(demo)
    if stream:
        with claude.messages.stream(
            model="demo",
            max_tokens=TOKENS,
            messages=messages,  # type: ignore[arg-type]
            extra_body=GREEDY,
        ) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(
            model="demo", max_tokens=TOKENS, messages=messages, extra_body=GREEDY
        )  # type: ignore[arg-type]
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == expected  # type: ignore[union-attr]


def test_an_adaptive_thinking_prefill_is_continued_without_thinking(demo: LiveServer) -> None:
    blocks = [{"type": "text", "text": PREFILL}]
    messages = [ASK, {"role": "assistant", "content": blocks}]
    message = _claude(demo).messages.create(
        model="demo",
        max_tokens=TOKENS,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"thinking": {"type": "adaptive"}, **GREEDY},
    )
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == _completion_of(
        demo, _continued_prompt([ASK, {"role": "assistant", "content": PREFILL}])
    )  # type: ignore[union-attr]


def test_an_empty_final_assistant_message_is_a_fresh_answer(demo: LiveServer) -> None:
    claude = _claude(demo)
    fresh = claude.messages.create(model="demo", max_tokens=TOKENS, messages=[ASK], extra_body=GREEDY)  # type: ignore[list-item]
    ended = claude.messages.create(
        model="demo",
        max_tokens=TOKENS,
        messages=[ASK, {"role": "assistant", "content": ""}],  # type: ignore[list-item]
        extra_body=GREEDY,
    )
    assert ended.content[0].text == fresh.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("final", "extra", "says"),
    [
        ("def add(a, b): ", {}, "trailing whitespace"),
        (PREFILL, {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "extended thinking"),
        (
            [{"type": "tool_use", "id": "t1", "name": "run", "input": {}}],
            {"tools": [{"name": "run", "input_schema": {"type": "object"}}]},
            "tool_use",
        ),
        (
            PREFILL,
            {
                "tools": [{"name": "run", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any"},
            },
            "required tool call",
        ),
        (
            "{",
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "JSON format",
        ),
    ],
    ids=["trailing-space", "thinking", "tool-use", "forced-tool", "json-format"],
)
def test_what_a_messages_prefill_cannot_do_is_a_400(demo: LiveServer, final, extra: dict, says: str) -> None:
    body = {
        "model": "demo",
        "max_tokens": 8,
        "messages": [ASK, {"role": "assistant", "content": final}],
        **extra,
    }
    reply = httpx.post(demo.url + "/v1/messages", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and says in reply.json()["error"]["message"]


def test_chat_continues_the_final_message(demo: LiveServer) -> None:
    messages = [ASK, {"role": "assistant", "content": PREFILL}]
    out = oai(demo).chat.completions.create(
        model="demo",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert out.choices[0].message.content == _completion_of(demo, _continued_prompt(messages))


@pytest.mark.parametrize(
    ("messages", "extra", "says"),
    [
        ([ASK, {"role": "assistant", "content": PREFILL}], {"add_generation_prompt": True}, "cannot both"),
        ([ASK], {}, "end with an assistant message"),
        (
            [ASK, {"role": "assistant", "content": "{"}],
            {"response_format": {"type": "json_object"}},
            "JSON format",
        ),
    ],
    ids=["both", "user-last", "json"],
)
def test_what_chat_cannot_continue_is_a_400(demo: LiveServer, messages, extra: dict, says: str) -> None:
    body = {"model": "demo", "max_tokens": 8, "messages": messages, "continue_final_message": True, **extra}
    reply = httpx.post(demo.v1 + "/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template(styled_demo: LiveServer) -> None:
    def prompt_tokens(kwargs: dict | None) -> int:
        body = {"model": "styled-demo", "max_tokens": 1, "messages": [ASK]}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        reply = httpx.post(styled_demo.v1 + "/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens(None)
    assert prompt_tokens({"style": "in one short line"}) > plain
    assert prompt_tokens({"enable_thinking": False}) == plain


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "not an identifier"])
def test_chat_template_kwargs_cannot_replace_what_the_renderer_sets(demo: LiveServer, name: str) -> None:
    body = {"model": "demo", "max_tokens": 1, "messages": [ASK], "chat_template_kwargs": {name: 1}}
    reply = httpx.post(demo.v1 + "/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"


def _opening_model() -> ModelInfo:
    """A model whose generation prompt opens `<think>` when thinking is on (Qwen3.6's, Nemotron 3's)."""
    prompt = ThinkingPrompt(by_default=True, when_enabled=True, when_disabled=False)
    return ModelInfo(
        id="m", family="test", context_length=4096, max_output_tokens=512, thinking_prompt=prompt
    )


@pytest.mark.parametrize(
    ("final", "extra", "in_reasoning"),
    [
        (None, {}, True),  # the generation prompt opens reasoning
        (PREFILL, {"continue_final_message": True}, False),  # the prefill is answer text
        ("<think>\nFirst", {"continue_final_message": True}, True),  # the prefill left reasoning open
        ("  ", {"continue_final_message": True}, True),  # blank: answered afresh, after the generation prompt
        ("  ", {"continue_final_message": True, "add_generation_prompt": False}, True),
        (None, {"add_generation_prompt": False}, False),  # no generation prompt: nothing is open
    ],
    ids=["fresh", "prefill", "open-think", "blank", "blank-no-prompt", "no-prompt"],
)
def test_the_output_starts_where_the_prompt_leaves_it(final, extra: dict, in_reasoning: bool) -> None:
    """The parser's (and a grammar's) first channel follows the prompt the engine renders."""
    messages = [ASK] if final is None else [ASK, {"role": "assistant", "content": final}]
    body = ChatRequest.model_validate({"model": "m", "messages": messages, **extra})
    assert chat_reasoning(body, _opening_model()) is in_reasoning


def test_a_blank_prefill_under_a_json_format_is_answered_afresh() -> None:
    check_unforced("  \n", forced=True, field="continue_final_message")  # no 400: nothing to continue
    with pytest.raises(InvalidRequest, match="prefilled"):
        check_unforced("{", forced=True, field="continue_final_message")


def test_a_chat_prediction_changes_no_token(demo: LiveServer) -> None:
    """Predicted Outputs: the prediction reaches the engine (whose drafters copy from it,
    tests/engine/test_prediction.py) and is never forced: the same greedy answer."""
    from kapitsa.server.chat_input import to_generation_request
    from kapitsa.server.openai_models import ChatRequest

    body = {
        "messages": [ASK],
        "prediction": {"type": "content", "content": [{"type": "text", "text": "x = 1"}]},
    }
    assert to_generation_request(ChatRequest(**body), demo.engine.models()[0]).prediction == "x = 1"

    def answer(extra: dict) -> str:
        out = oai(demo).chat.completions.create(
            model="demo", messages=[ASK], max_tokens=TOKENS, temperature=0, **extra
        )  # type: ignore[arg-type]
        return out.choices[0].message.content or ""

    plain = answer({})
    assert answer({"extra_body": {"prediction": {"type": "content", "content": plain}}}) == plain
    parts = [{"type": "text", "text": "def add(a, b):\n    return a + b\n"}]
    assert answer({"extra_body": {"prediction": {"type": "content", "content": parts}}}) == plain
    bad = {
        "model": "demo",
        "max_tokens": 4,
        "messages": [ASK],
        "prediction": {"type": "diff", "content": "x"},
    }
    reply = httpx.post(demo.v1 + "/chat/completions", json=bad, timeout=30)
    assert reply.status_code == 400 and "prediction" in reply.text
