"""Cache token counts mean what Anthropic's mean: `cache_read_input_tokens` were served from the prefix
cache, `cache_creation_input_tokens` are the prompt tokens this request made cached (they were not
before), `input_tokens` the rest; OpenAI's `cached_tokens` agrees (and its prediction tokens are only
the drafts copied from a `prediction`). Unit tests, then a tiny real engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

import anthropic
import openai
from server_harness import live_server, open_tiny_engine

from kapitsa.engine.types import Usage
from kapitsa.server.anthropic import anthropic_usage
from kapitsa.server.common import choice_usage
from kapitsa.server.openai_chat import openai_usage

SYSTEM = "You are a careful assistant who answers every question in one short sentence. " * 3


def test_anthropic_input_tokens_exclude_cache_reads_and_writes() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=5, cached_tokens=60, cache_write_tokens=30)
    assert anthropic_usage(usage) == {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 30,
    }
    assert openai_usage(usage)["prompt_tokens_details"] == {"cached_tokens": 60, "cache_write_tokens": 30}
    assert openai_usage(usage)["prompt_tokens"] == 100  # OpenAI counts cached tokens inside the prompt


def test_counts_are_clamped_to_the_prompt() -> None:
    usage = Usage(prompt_tokens=10, cached_tokens=12, cache_write_tokens=5)
    out = anthropic_usage(usage)
    assert (out["input_tokens"], out["cache_read_input_tokens"], out["cache_creation_input_tokens"]) == (
        0,
        10,
        0,
    )


def test_a_repeated_prompt_reads_what_the_first_wrote(tmp_path) -> None:  # noqa: ANN001
    engine = open_tiny_engine(tmp_path / "qwen")
    messages = [{"role": "user", "content": "Name a prime number below fifty."}]
    try:
        with live_server(engine) as live:
            claude = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)
            ask = dict(model="claude-x", system=SYSTEM, messages=messages, max_tokens=3)
            first = claude.messages.create(**ask).usage
            second = claude.messages.create(**ask).usage
            oai = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
            chat = oai.chat.completions.create(
                model=engine.info.id,
                messages=[{"role": "system", "content": SYSTEM}, *messages],
                max_tokens=3,
                # the Messages requests leave out `thinking`, which is no thinking: the same prompt
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            ).usage
    finally:
        engine.close()
    prompt = first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert first.input_tokens < 0.1 * prompt  # only the generation prompt after the last message
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0  # nothing new: every checkpoint already existed
    assert second.input_tokens == first.input_tokens
    assert chat.prompt_tokens == prompt
    assert chat.prompt_tokens_details.cached_tokens == second.cache_read_input_tokens


def test_prediction_tokens_are_the_drafts_copied_from_the_prediction() -> None:
    """Drafts copied from the context are speculative decoding's own: a request without a
    `prediction` reports no accepted or rejected prediction tokens; every choice's are summed."""
    drafts = Usage(prompt_tokens=10, completion_tokens=20, draft_tokens_proposed=12, draft_tokens_accepted=7)
    details = openai_usage(drafts)["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] == details["rejected_prediction_tokens"] == 0
    predicted = replace(drafts, prediction_tokens_proposed=9, prediction_tokens_accepted=5)
    details = openai_usage(choice_usage([_Finish(predicted), _Finish(predicted)]))[
        "completion_tokens_details"
    ]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (10, 8)


@dataclass
class _Finish:
    usage: Usage
