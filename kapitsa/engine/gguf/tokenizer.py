"""A `Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` fields (byte-level BPE, as
llama.cpp stores Qwen and Nemotron-H vocabularies: tokens, merges, token types)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.errors import CheckpointError, UnsupportedModel

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
log = logging.getLogger("kapitsa.gguf")

# pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp uses them
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen3.5's split keeps combining marks (\p{M}) inside words, where Qwen2's cuts a word at each mark
_QWEN35_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Mistral NeMo's "tekken" split
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class _Pre:
    split: str
    ignore_merges: bool  # tiktoken's rule: a pre-token found whole in the vocabulary is one token
    nfc: bool  # Qwen's tokenizer.json normalizes to NFC first


_QWEN2, _QWEN35 = _Pre(_QWEN2_SPLIT, False, True), _Pre(_QWEN35_SPLIT, False, True)
_LLAMA3, _TEKKEN = _Pre(_LLAMA3_SPLIT, True, False), _Pre(_TEKKEN_SPLIT, True, False)
# the names llama.cpp maps to these pre-tokenizers; Nemotron-H / Nemotron 3 files say "pixtral"
_PRE_TOKENIZERS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3),
    "tekken": _TEKKEN,
}
_TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def _field_list(meta: dict[str, Any], key: str) -> list[Any]:
    field = meta.get(key)
    if field is None:
        return []
    return list(field.contents()) if hasattr(field, "contents") else list(field)


# what a file of these architectures splits with when it names no pre-tokenizer kapitsa knows (older
# or other converters): its family's published files' split, with a warning, rather than no model
_ARCHITECTURE_PRE = {"qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3next": "qwen2", "nemotron_h": "pixtral",
                     "nemotron_h_moe": "pixtral"}  # fmt: skip


def _pre_name(meta: dict[str, Any]) -> str:
    named = str(meta.get("tokenizer.ggml.pre") or "")
    if named in _PRE_TOKENIZERS:
        return named
    architecture = str(meta.get("general.architecture", ""))
    fallback = _ARCHITECTURE_PRE.get(architecture)
    if fallback is None:
        return named or "default"  # refused by _backend, naming what it reads
    log.warning(
        "the GGUF file's pre-tokenizer %r is not one kapitsa knows; splitting as %s files do (%s)",
        named or None,
        architecture,
        fallback,
    )
    return fallback


def _backend(tokens: list[str], merges: list[str], pre_name: str) -> BackendTokenizer:
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        known = ", ".join(sorted(_PRE_TOKENIZERS))
        raise UnsupportedModel(
            f"the GGUF file's pre-tokenizer {pre_name!r} is not supported (kapitsa reads {known}); "
            "load the Hugging Face checkpoint instead"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    except Exception as e:  # the Rust side reports a bad vocabulary as a plain Exception
        raise CheckpointError(f"the GGUF vocabulary is inconsistent: {e}") from e
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _templates(meta: dict[str, Any]) -> dict[str, str]:
    """`tokenizer.chat_template` plus the named ones (`tokenizer.chat_template.<name>`), which
    convert_hf_to_gguf.py writes from a tokenizer_config's list of templates (e.g. `tool_use`)."""
    prefix = "tokenizer.chat_template."
    named = {
        k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)
    }
    default = meta.get("tokenizer.chat_template")
    return {**named, "default": default} if isinstance(default, str) else named


def tokenizer_from_gguf(meta: dict[str, Any], config: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModel(
            f"GGUF tokenizer model {model!r} is not supported (kapitsa reads byte-level BPE, 'gpt2')"
        )
    tokens = [str(t) for t in _field_list(meta, "tokenizer.ggml.tokens")]
    merges = [str(m) for m in _field_list(meta, "tokenizer.ggml.merges")]
    types = [int(t) for t in _field_list(meta, "tokenizer.ggml.token_type")] or [1] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise CheckpointError("the GGUF file has no usable token list")
    backend = _backend(tokens, merges, _pre_name(meta))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
    )

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    special = {"bos_token": token_at("tokenizer.ggml.bos_token_id"), "eos_token": token_at("tokenizer.ggml.eos_token_id"),
               "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
               "pad_token": token_at("tokenizer.ggml.padding_token_id")}  # fmt: skip
    # llama.cpp ends a generation on the eos, end-of-turn and end-of-message ids
    ends = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = [i for k in ends if isinstance(i := meta.get(k), int) and 0 <= i < len(tokens)]
    # like llama.cpp's end-of-generation heuristics: chat turn ends count even when not the eos id
    eos_ids += [
        i
        for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == _CONTROL and t in _TURN_ENDS
    ]
    return Tokenizer(backend, special_tokens=special, eos_token_ids=eos_ids, chat_templates=_templates(meta))
