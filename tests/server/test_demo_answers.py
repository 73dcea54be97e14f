"""The real demo, through the real loader and engine: a plain request is answered in `content` / a `text` block,
and a template whose generation prompt opens `<think>` still routes the output to reasoning."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import anthropic
import openai
import pytest
from server_harness import LiveServer, live_server

from kapitsa.engine.inprocess import InProcessEngine
from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.options import EngineConfig

DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))
ASK = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
OPENS_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def serve(folder: Path, model_id: str, **settings: object) -> Iterator[LiveServer]:
    """The checkpoint in `folder` behind a live server (`settings`: ServerSettings fields)."""
    loaded = load_model(folder, model_id=model_id)
    client = InProcessEngine.from_loaded(loaded, config=EngineConfig(prefix_cache_bytes=0))
    try:
        with live_server(client, **settings) as live:  # type: ignore[arg-type]
            yield live
    finally:
        client.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[LiveServer]:
    yield from serve(DEMO, "demo")


def serve_with_template(
    tmp_path_factory: pytest.TempPathFactory, model_id: str, template: str
) -> Iterator[LiveServer]:
    """The demo with `template` as its chat template, behind a live server."""
    folder = tmp_path_factory.mktemp(model_id)
    for path in DEMO.iterdir():
        shutil.copy(path, folder / path.name)
    (folder / "chat_template.jinja").write_text(template)
    yield from serve(folder, model_id)


@pytest.fixture(scope="module")
def thinking_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from serve_with_template(tmp_path_factory, "thinking-demo", OPENS_THINK)


def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)


def test_chat_completion_answers_in_content(demo: LiveServer) -> None:
    out = oai(demo).chat.completions.create(model="demo", messages=ASK, max_tokens=16)  # type: ignore[arg-type]
    message = out.choices[0].message
    assert message.content
    assert not getattr(message, "reasoning_content", None)


def test_chat_stream_answers_in_content(demo: LiveServer) -> None:
    chunks = oai(demo).chat.completions.create(model="demo", messages=ASK, max_tokens=16, stream=True)  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas)
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)


def test_responses_answer_in_output_text(demo: LiveServer) -> None:
    out = oai(demo).responses.create(model="demo", input=ASK[0]["content"], max_output_tokens=16)
    assert out.output_text
    assert [item.type for item in out.output] == ["message"]


@pytest.mark.parametrize("thinking", [None, {"type": "adaptive"}], ids=["unset", "adaptive"])
def test_anthropic_message_has_a_text_block(demo: LiveServer, thinking: dict | None) -> None:
    claude = anthropic.Anthropic(base_url=demo.url, api_key="x", max_retries=0, timeout=60)
    extra = {"extra_body": {"thinking": thinking}} if thinking else {}
    out = claude.messages.create(model="demo", max_tokens=16, messages=ASK, **extra)  # type: ignore[arg-type]
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text  # type: ignore[union-attr]


def test_anthropic_thinking_enabled_starts_a_thinking_block(demo: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=demo.url, api_key="x", max_retries=0, timeout=60)
    out = claude.messages.create(
        model="demo",
        max_tokens=16,
        messages=ASK,  # type: ignore[arg-type]
        extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}},
    )
    assert out.content[0].type == "thinking"


def test_asking_for_thinking_routes_to_reasoning(demo: LiveServer) -> None:
    out = oai(demo).chat.completions.create(
        model="demo",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert getattr(out.choices[0].message, "reasoning_content", None)


def test_a_template_that_opens_think_by_default_routes_to_reasoning(thinking_demo: LiveServer) -> None:
    out = oai(thinking_demo).chat.completions.create(model="thinking-demo", messages=ASK, max_tokens=16)  # type: ignore[arg-type]
    assert getattr(out.choices[0].message, "reasoning_content", None)
