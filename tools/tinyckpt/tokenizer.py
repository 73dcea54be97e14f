"""A byte-level BPE tokenizer in Qwen's layout (same pre-tokenizer regex, special tokens at the end of the vocab)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .template import template_source

VOCAB_SIZE = 8192
# Qwen's split pattern: contractions, letters, single digits, punctuation runs, newlines, other whitespace.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (content, special): as in Qwen3's tokenizer, the think/tool markers are added tokens but not "special",
# so decoding keeps them in the text.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
]
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"


def _plain_text(texts: Iterable[str]) -> Iterable[str]:
    # The markers are matched whole at encode time; BPE should not spend merges learning their spelling.
    for text in texts:
        for token, _ in ADDED_TOKENS:
            text = text.replace(token, "\n")
        yield text


def train_tokenizer(texts: Iterable[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_plain_text(texts), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for t, s in ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template_source(),
    }


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {t: tokenizer.token_to_id(t) for t, _ in ADDED_TOKENS}


def write_tokenizer_files(tokenizer: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(template_source())
