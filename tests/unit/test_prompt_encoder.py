from __future__ import annotations

import pytest

from kapitsa.engine.text.prompt_encoder import PromptEncoder
from kapitsa.engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def tokenizer(request, tmp_path_factory):
    from kapitsa.testing.tiny import write_tiny_checkpoint

    return Tokenizer.from_folder(write_tiny_checkpoint(tmp_path_factory.mktemp("t") / "c", request.param))


def _conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse. 日本語\n"}]
    for i in range(turns):
        messages += [
            {"role": "user", "content": f" read  file_{i}.py\n\n<tool_call>x</tool_call> 🙂"},
            {"role": "assistant", "content": f"Done {i}.\n  def f():\n\treturn {i}"},
        ]
    return messages


def test_same_ids_as_a_full_encode_and_reuses_pieces(tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    assert encoder.is_caching
    for turns in (1, 3, 6):
        text = tokenizer.apply_chat_template(_conversation(turns), add_generation_prompt=True)
        assert encoder.encode(text) == tokenizer.encode(text)
    calls = []
    original = tokenizer.encode
    tokenizer.encode = lambda text, **kw: calls.append(text) or original(text, **kw)
    try:
        text = tokenizer.apply_chat_template(_conversation(7), add_generation_prompt=True)
        assert encoder.encode(text) == original(text)
    finally:
        del tokenizer.encode
    assert sum(len(c) for c in calls) < len(text) // 4  # only the new turn's pieces were encoded


def test_plain_text_and_text_without_specials(tokenizer) -> None:
    encoder = PromptEncoder(tokenizer)
    for text in ("", "no specials here", "<|im_start|>", "a<|im_end|><|im_end|>b", "<|im_start|>user\n"):
        assert encoder.encode(text) == tokenizer.encode(text)


def test_tokenizer_without_backend_is_used_whole() -> None:
    class Plain:
        def encode(self, text: str) -> list[int]:
            return [len(text)]

    encoder = PromptEncoder(Plain())
    assert not encoder.is_caching and encoder.encode("abc") == [3]
