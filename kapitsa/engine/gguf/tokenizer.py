"""A `Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` fields (byte-level BPE, as
llama.cpp stores Qwen and Nemotron-H vocabularies: tokens, merges, token types)."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kapitsa.engine.text.tokenizer import Tokenizer
from kapitsa.errors import CheckpointError, UnsupportedModel

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# pre-tokenizer split patterns by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp uses them
_QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Mistral NeMo's "tekken" split (also the 131k-token vocabulary of Nemotron-H)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_PRE = ("qwen2", "qwen35", "qwen3")
_TURN_ENDS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def _field_list(meta: dict[str, Any], key: str) -> list[Any]:
    field = meta.get(key)
    if field is None:
        return []
    return list(field.contents()) if hasattr(field, "contents") else list(field)


def _backend(tokens: list[str], merges: list[str], pre: str) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        tok = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    except Exception as e:  # the Rust side reports a bad vocabulary as a plain Exception
        raise CheckpointError(f"the GGUF vocabulary is inconsistent: {e}") from e
    split = _QWEN_SPLIT if pre in _QWEN_PRE else _TEKKEN_SPLIT if pre == "tekken" else _LLAMA3_SPLIT
    if pre in _QWEN_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


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
    backend = _backend(tokens, merges, str(meta.get("tokenizer.ggml.pre", "default")))
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
               "pad_token": token_at("tokenizer.ggml.padding_token_id")}  # fmt: skip
    eos_ids = [
        meta[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if isinstance(meta.get(k), int)
    ]
    # like llama.cpp's end-of-generation heuristics: chat turn ends count even when not the eos id
    eos_ids += [
        i
        for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == _CONTROL and t in _TURN_ENDS
    ]
    template = meta.get("tokenizer.chat_template")
    templates = {"default": template} if isinstance(template, str) else {}
    return Tokenizer(backend, special_tokens=special, eos_token_ids=eos_ids, chat_templates=templates)
