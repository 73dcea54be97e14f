"""Images through the three APIs with the official SDKs, on a tiny Qwen3.5 checkpoint with its vision
tower: `image_url` (data: and file://), Responses `input_image`, Anthropic base64 `image` blocks."""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image
from server_harness import live_server, open_tiny_engine

from kapitsa.server.images import TOOL_IMAGE_OMITTED

IMAGE_TOKENS = (24 // 4) * (40 // 4) // 4  # a 40x24 image: 6x10 patches of 4 px, merged 2x2
QUESTION = "Describe it."
MODEL = "qwen"  # the tiny checkpoint's folder name
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0}  # the Anthropic SDK has no temperature argument any more


def png(fill: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((24, 40, 3), fill, dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


BLACK, WHITE = png(0), png(255)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_content(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = open_tiny_engine(tmp_path_factory.mktemp("vl") / "qwen", vision=True)
    try:
        with live_server(engine) as server:
            yield server
    finally:
        engine.close()


@pytest.fixture
def oai(live):
    return openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)


def ask_chat(oai, content, model: str = MODEL):  # noqa: ANN001, ANN201
    messages = [{"role": "user", "content": content}]
    return oai.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, extra_body=NO_THINKING
    )


def test_chat_reads_data_urls_and_files_and_counts_image_tokens(oai, tmp_path) -> None:
    black = ask_chat(oai, chat_content(data_url(BLACK)))
    white = ask_chat(oai, chat_content(data_url(WHITE)))
    (tmp_path / "black.png").write_bytes(BLACK)
    from_file = ask_chat(oai, chat_content((tmp_path / "black.png").as_uri()))
    text_only = ask_chat(oai, [{"type": "text", "text": QUESTION}])
    assert black.choices[0].message.content != white.choices[0].message.content
    assert from_file.choices[0].message.content == black.choices[0].message.content
    # <|vision_start|> and <|vision_end|> around the image's tokens
    assert black.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS + 2


def test_responses_input_image_answers_as_chat_does(oai) -> None:
    chat = ask_chat(oai, chat_content(data_url(WHITE)))
    response = oai.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(WHITE)},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=12,
        temperature=0,
        reasoning={"effort": "none"},
        store=False,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_anthropic_image_blocks_and_count_tokens(claude, oai) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(WHITE)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}]
    reply = claude.messages.create(
        model=MODEL, messages=messages, max_tokens=12, thinking={"type": "disabled"}, extra_body=GREEDY
    )
    counted = claude.messages.count_tokens(
        model=MODEL, messages=messages, thinking={"type": "disabled"}
    ).input_tokens
    u = reply.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted
    assert reply.content[0].text == ask_chat(oai, chat_content(data_url(WHITE))).choices[0].message.content
    text_only = claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], thinking={"type": "disabled"}
    )
    assert counted == text_only.input_tokens + IMAGE_TOKENS + 2


def test_a_second_turn_that_re_sends_the_screenshot_is_cached(claude) -> None:
    screenshot = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": _b64(png(90))},
    }
    turn1 = [{"role": "user", "content": [screenshot, {"type": "text", "text": "What is on screen?"}]}]
    first = claude.messages.create(model=MODEL, messages=turn1, max_tokens=6, extra_body=GREEDY)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "".join(b.text for b in first.content if b.type == "text")},
        {"role": "user", "content": "And what now?"},
    ]
    second = claude.messages.create(model=MODEL, messages=turn2, max_tokens=6, extra_body=GREEDY)
    # turn 1 left the state at the end of its question cached, past the image (earlier tests' prompts
    # may have left a few leading tokens cached); turn 2 reads at least that far
    cached_after_turn1 = first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens
    assert first.usage.cache_read_input_tokens < IMAGE_TOKENS < cached_after_turn1
    assert second.usage.cache_read_input_tokens >= cached_after_turn1


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://localhost/cat.png"])
def test_an_http_url_is_a_clear_400(oai, url) -> None:
    with pytest.raises(openai.BadRequestError, match="does not fetch images from the network"):
        ask_chat(oai, chat_content(url))


def test_an_unreadable_image_is_a_clear_400(oai, claude, tmp_path) -> None:
    with pytest.raises(openai.BadRequestError, match="could not be decoded"):
        ask_chat(oai, chat_content(data_url(b"not a png")))
    with pytest.raises(openai.BadRequestError, match="cannot read"):
        ask_chat(oai, chat_content((tmp_path / "missing.png").as_uri()))
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}
    with pytest.raises(anthropic.BadRequestError, match="not valid base64"):
        claude.messages.create(model=MODEL, messages=[{"role": "user", "content": [bad]}], max_tokens=4)


def test_a_text_only_model_answers_a_clear_400() -> None:
    with live_server() as server:  # the FakeEngine's model reads text only
        oai = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=10)
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.BadRequestError, match="reads text only"):
            ask_chat(oai, chat_content(data_url(BLACK)), model="fake")
        with pytest.raises(openai.BadRequestError, match="reads text only"):
            oai.responses.create(
                model="fake",
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(BLACK)}]}],
            )
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": _b64(BLACK)},
        }
        with pytest.raises(anthropic.BadRequestError, match="reads text only"):
            claude.messages.create(
                model="fake", messages=[{"role": "user", "content": [image]}], max_tokens=4
            )


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def _view_image_turn(output: str | list[dict]) -> list[dict]:
    """A Responses input where the model called a tool that returned `output` (Codex's view_image)."""
    return [
        {"role": "user", "content": [{"type": "input_text", "text": "Look at shot.png"}]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": '{"path": "shot.png"}'},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


VIEW_IMAGE = [{"type": "function", "name": "view_image", "parameters": {"type": "object", "properties": {}}}]


def test_a_responses_tool_output_image_reaches_the_model(oai) -> None:
    def ask(output):  # noqa: ANN001, ANN202
        return oai.responses.create(
            model=MODEL,
            input=_view_image_turn(output),
            tools=VIEW_IMAGE,
            max_output_tokens=8,
            extra_body=NO_THINKING,
        )

    black = ask([{"type": "input_image", "image_url": data_url(BLACK)}])
    white = ask([{"type": "input_image", "image_url": data_url(WHITE)}])
    text = ask([{"type": "input_text", "text": ""}])
    assert black.usage.input_tokens == white.usage.input_tokens
    assert black.usage.input_tokens >= text.usage.input_tokens + IMAGE_TOKENS


def test_a_text_only_model_reads_a_note_for_a_tool_output_image() -> None:
    """An agent's tool result with an image does not end the session on a text-only model."""
    with live_server() as server:
        oai = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=10)
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=10)
        output = [
            {"type": "input_text", "text": "here:"},
            {"type": "input_image", "image_url": data_url(BLACK)},
        ]
        oai.responses.create(model="fake", input=_view_image_turn(output), tools=VIEW_IMAGE)
        tool = next(m for m in server.engine.requests[-1].messages if m["role"] == "tool")
        assert tool["content"] == "here:\n" + TOOL_IMAGE_OMITTED
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": _b64(BLACK)},
        }
        messages = [
            {"role": "user", "content": "Take a screenshot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
        ]
        claude.messages.create(model="fake", messages=messages, max_tokens=4)
        tool = next(m for m in server.engine.requests[-1].messages if m["role"] == "tool")
        assert tool["content"] == TOOL_IMAGE_OMITTED
