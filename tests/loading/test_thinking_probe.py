"""`probe_thinking`: whether the generation prompt leaves the output inside `<think>`, read from the render."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest

from kapitsa.engine.loading.loader import load_model
from kapitsa.engine.text.thinking_probe import probe_thinking
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import ThinkingPrompt

DEMO = Path(str(resources.files("kapitsa").joinpath("demo")))

TURNS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
ALWAYS_OPEN = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
SYSTEM_MENTIONS_TAGS = (
    "<|im_start|>system\nBegin every answer with <think>.<|im_end|>\n"
    + TURNS
    + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REJECTS = "{{ raise_exception('needs a system message') }}"


def with_template(source: str) -> Tokenizer:
    demo = Tokenizer.from_folder(DEMO)
    return Tokenizer(demo.backend, special_tokens=demo.special_tokens, chat_templates={"default": source})


CLOSE = Tokenizer.from_folder(DEMO).token_to_id("</think>")  # one token in the demo's vocabulary


def test_demo_template_thinks_only_when_asked() -> None:
    assert load_model(DEMO).info.thinking_prompt == ThinkingPrompt(
        by_default=False, when_enabled=True, when_disabled=False, close_token=CLOSE
    )


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("qwen3_5", ThinkingPrompt(by_default=True, when_enabled=True, when_disabled=False)),
        ("nemotron_h", ThinkingPrompt(by_default=True, when_enabled=True, when_disabled=False)),
        ("qwen3_next", ThinkingPrompt()),  # closes the block only when disabled: the model opens it itself
    ],
)
def test_tiny_templates(tiny, kind: str, expected: ThinkingPrompt) -> None:
    loaded = load_model(tiny(kind))
    close = loaded.tokenizer.token_to_id("</think>")
    assert close is not None and loaded.info.thinking_prompt == dataclasses.replace(
        expected, close_token=close
    )


def test_a_template_that_always_opens_thinks_even_when_disabled() -> None:
    assert probe_thinking(with_template(ALWAYS_OPEN)) == ThinkingPrompt(True, True, True, CLOSE)


def test_tags_named_outside_the_generation_prompt_do_not_count() -> None:
    assert probe_thinking(with_template(SYSTEM_MENTIONS_TAGS)) == ThinkingPrompt(close_token=CLOSE)


def test_a_template_that_rejects_the_probe_counts_as_not_thinking() -> None:
    assert probe_thinking(with_template(REJECTS)) == ThinkingPrompt(close_token=CLOSE)


def test_starts_in_reasoning_follows_the_request() -> None:
    prompt = ThinkingPrompt(by_default=False, when_enabled=True, when_disabled=False)
    assert [prompt.starts_in_reasoning(v) for v in (None, True, False)] == [False, True, False]


def test_a_close_tag_of_several_tokens_has_no_close_token() -> None:
    backend = Tokenizer.from_folder(DEMO)
    split = Tokenizer(
        backend.backend, special_tokens=backend.special_tokens, chat_templates={"default": TURNS}
    )
    split.encode = lambda text, **_: [ord(c) for c in text]  # type: ignore[method-assign]
    assert probe_thinking(split).close_token is None
