from __future__ import annotations

import pytest

from kapitsa.engine.runner.memory import MemoryBudget, StateSizes, check_context
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.text.prepare import prepare_prompt
from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.engine.types import GenerationRequest
from kapitsa.errors import ContextOverflow


def test_context_checks_only_the_prompt() -> None:
    check_context(10, 11)
    with pytest.raises(ContextOverflow, match="prompt is too long: 16 tokens"):
        check_context(16, 16)


@pytest.mark.parametrize(
    ("kv", "recurrent", "scratch", "limit"),
    [
        (100, 1000, 10, 10_000),
        (100, 1000, 10, 2_500),
        (0, 1000, 10, 2_500),
        (100, 0, 0, 7_000),
        (7, 5, 0, 100),
    ],
)
def test_tokens_that_fit_is_the_longest_sequence_that_fits(
    kv: int, recurrent: int, scratch: int, limit: int
) -> None:
    sizes = StateSizes(kv_bytes_per_token=kv, recurrent_bytes=recurrent, activation_bytes_per_token=scratch)
    budget = MemoryBudget(sizes, limit_bytes=limit, weights_bytes=0, prefill_chunk=8)
    longest = budget.tokens_that_fit()
    assert budget.fits_ever(budget.sequence_bytes(longest))
    assert longest > 10**9 or not budget.fits_ever(budget.sequence_bytes(longest + 1))


def test_budget_accounting() -> None:
    sizes = StateSizes(kv_bytes_per_token=100, recurrent_bytes=1000, activation_bytes_per_token=10)
    budget = MemoryBudget(sizes, limit_bytes=10_000, weights_bytes=2_000, prefill_chunk=8)
    assert budget.available_bytes == 8_000
    assert budget.sequence_bytes(20) == 20 * 100 + 1000 + 8 * 10
    assert budget.reserve_tokens(20, None, 100) == 100  # whole remaining context (< default reserve)
    assert budget.reserve_tokens(20, 5, 100) == 25
    assert budget.fits_now(5_000)
    budget.reserve(5_000)
    assert not budget.fits_now(3_001) and budget.fits_now(3_000)
    assert not budget.fits_now(2_000, other_bytes=1_500)
    budget.release(5_000)
    assert budget.free_bytes == 8_000 and not budget.fits_ever(8_001)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def tokenizer(request, tmp_path_factory):
    from kapitsa.testing.tiny import write_tiny_checkpoint

    return Tokenizer.from_folder(write_tiny_checkpoint(tmp_path_factory.mktemp("t") / "c", request.param))


def test_message_boundaries_are_prefixes_of_the_prompt(tokenizer) -> None:
    messages = (
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "list files"},
    )
    prepared = prepare_prompt(tokenizer, GenerationRequest(messages=messages))
    kinds = [b.kind for b in prepared.boundaries]
    assert kinds == ["system", "turn"]
    system, turn = (b.pos for b in prepared.boundaries)
    without_gen = tokenizer.encode(tokenizer.apply_chat_template(list(messages), add_generation_prompt=False))
    assert prepared.ids[:turn] == without_gen and turn < len(prepared.ids)
    # another conversation with the same system prompt shares everything up to the system boundary
    other = prepare_prompt(
        tokenizer, GenerationRequest(messages=(messages[0], {"role": "user", "content": "bye"}))
    )
    assert other.ids[:system] == prepared.ids[:system]
    assert "You are terse." in tokenizer.decode(prepared.ids[:system])


def test_raw_prompts_have_no_boundaries(tokenizer) -> None:
    prepared = prepare_prompt(tokenizer, GenerationRequest(prompt="just text"))
    assert prepared.ids == tokenizer.encode("just text") and prepared.boundaries == []


def test_a_continued_message_ends_the_prompt_and_its_turn_is_the_checkpoint(tokenizer) -> None:
    messages = (
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "The files are"},
    )
    prepared = prepare_prompt(tokenizer, GenerationRequest(messages=messages, continue_final_message=True))
    assert tokenizer.decode(prepared.ids).endswith("The files are")
    closed = tokenizer.encode(tokenizer.apply_chat_template(list(messages[:2]), add_generation_prompt=False))
    assert [b.kind for b in prepared.boundaries] == ["system", "turn"]
    assert prepared.boundaries[1].pos == len(closed) and prepared.ids[: len(closed)] == closed


@pytest.mark.parametrize(
    ("final", "continued", "returning"),
    [
        ({"role": "assistant", "content": "{"}, True, False),  # a one-shot prefill: no earlier reply
        ({"role": "assistant", "content": "It is"}, False, True),  # a closed reply the answer follows
        ({"role": "user", "content": "and then?"}, False, True),  # the earlier reply is in the middle
    ],
    ids=["prefill", "closed-reply", "earlier-reply"],
)
def test_a_prefill_is_not_an_earlier_reply(final: dict, continued: bool, returning: bool) -> None:
    """A conversation that came back ranks above one-shot requests in the prefix cache: a prefilled
    one-shot request (Anthropic's `{` before a JSON answer) is not one."""
    messages = [{"role": "user", "content": "Rate this."}]
    if final["role"] == "user":
        messages.append({"role": "assistant", "content": "Fine."})
    request = GenerationRequest(messages=(*messages, final), continue_final_message=continued)
    seq = Sequence(request, [1, 2], lambda _e: None, None, None, StopMatcher(()), max_tokens=4)  # type: ignore[arg-type]
    assert seq.continues_conversation is returning
