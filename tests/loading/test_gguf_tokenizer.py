"""The tokenizer rebuilt from a GGUF file's metadata: pre-tokenizer by `tokenizer.ggml.pre` as
llama.cpp reads it, named chat templates, and the end-of-generation ids."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Regex, pre_tokenizers

from kapitsa.engine.gguf.tokenizer import tokenizer_from_gguf
from kapitsa.errors import UnsupportedModel

_CONTROL, _NORMAL = 3, 1
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eom|>"]


def _meta(pre: str, *, extra_tokens: tuple[str, ...] = (), **fields: Any) -> dict[str, Any]:
    """A byte-level vocabulary (every byte a token, no merges) as convert_hf_to_gguf.py writes one."""
    tokens = [*_SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet()), *extra_tokens]
    types = [_CONTROL if t in _SPECIALS else _NORMAL for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        **fields,
    }


def _pieces(pre_tokenizer: Any, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


# combining marks (\p{M}) inside words: Devanagari, Thai, a decomposed accent NFC cannot compose
TEXTS = ["नमस्ते दुनिया", "ภาษาไทย ง่าย", "q\u0307\u0323 x\u0301y", "I've 12 apples, ok?"]


@pytest.mark.parametrize("text", TEXTS)
def test_qwen35_splits_words_with_their_combining_marks_like_qwen3_5(text: str) -> None:
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.tokenization_qwen3_5")
    reference = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen3_5.PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend = tokenizer_from_gguf(_meta("qwen35"), {}).backend
    normalized = backend.normalizer.normalize_str(text)
    assert _pieces(backend.pre_tokenizer, normalized) == _pieces(reference, normalized)


def test_qwen2_keeps_qwen2_split() -> None:
    backend = tokenizer_from_gguf(_meta("qwen2"), {}).backend
    assert len(_pieces(backend.pre_tokenizer, "नमस्ते")) > 1  # Qwen2's \p{L}+ stops at each mark


@pytest.mark.parametrize("pre", ["pixtral", "tekken", "llama-bpe"])
def test_tiktoken_vocabularies_take_whole_words_from_the_vocabulary(pre: str) -> None:
    # llama.cpp sets ignore_merges for these: a pre-token found in the vocabulary is one token even
    # where the merges would not build it (tiktoken's rule)
    tok = tokenizer_from_gguf(_meta(pre, extra_tokens=("hello",)), {})
    assert tok.encode("hello") == [tok.token_to_id("hello")]


def test_qwen_vocabularies_build_words_from_merges() -> None:
    tok = tokenizer_from_gguf(_meta("qwen35", extra_tokens=("hello",)), {})
    assert len(tok.encode("hello")) == 5


@pytest.mark.parametrize(
    ("architecture", "like"), [("qwen35", "qwen35"), ("qwen3next", "qwen2"), ("nemotron_h", "pixtral")]
)
def test_a_file_that_names_no_pre_tokenizer_splits_as_its_architecture(architecture: str, like: str) -> None:
    unnamed = _meta("", extra_tokens=("hello",), **{"general.architecture": architecture})
    del unnamed["tokenizer.ggml.pre"]
    named = tokenizer_from_gguf(_meta(like, extra_tokens=("hello",)), {})
    guessed = tokenizer_from_gguf(unnamed, {})
    text = "hello नमस्ते world"
    assert guessed.encode(text) == named.encode(text)
    # the split itself: with no merges, every byte-level split encodes Devanagari to the same bytes
    assert _pieces(guessed.backend.pre_tokenizer, text) == _pieces(named.backend.pre_tokenizer, text)


def test_an_unknown_pre_tokenizer_splits_as_its_architecture_or_is_refused() -> None:
    text = "hello नमस्ते world"
    guessed = tokenizer_from_gguf(_meta("gpt-4o", **{"general.architecture": "qwen35"}), {})
    named = tokenizer_from_gguf(_meta("qwen35"), {})
    assert _pieces(guessed.backend.pre_tokenizer, text) == _pieces(named.backend.pre_tokenizer, text)
    with pytest.raises(UnsupportedModel, match="gpt-4o"):  # no architecture to go by
        tokenizer_from_gguf(_meta("gpt-4o"), {})


def test_named_chat_templates_are_read() -> None:
    meta = _meta(
        "qwen35",
        **{
            "tokenizer.chat_template": "plain",
            "tokenizer.chat_templates": ["tool_use"],
            "tokenizer.chat_template.tool_use": "with tools",
        },
    )
    tok = tokenizer_from_gguf(meta, {})
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=[{"type": "function"}]) == "with tools"


def test_a_file_with_only_named_templates_still_chats() -> None:
    meta = _meta("qwen35", **{"tokenizer.chat_template.tool_use": "with tools"})
    tok = tokenizer_from_gguf(meta, {})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "with tools"


def test_eom_and_turn_end_ids_end_generation() -> None:
    meta = _meta("qwen35", **{"tokenizer.ggml.eom_token_id": _SPECIALS.index("<|eom|>")})
    tok = tokenizer_from_gguf(meta, {})
    expected = {tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eom|>")}
    assert set(tok.eos_token_ids) == expected


def test_unknown_token_reaches_the_template() -> None:
    meta = _meta(
        "qwen35",
        **{"tokenizer.ggml.unknown_token_id": 0, "tokenizer.chat_template": "{{ unk_token }}"},
    )
    tok = tokenizer_from_gguf(meta, {})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>"
