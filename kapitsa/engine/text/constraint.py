"""Constrained decoding: a grammar (JSON Schema, Lark, regex) enforced token by token.

llguidance compiles the grammar against the model's vocabulary (`GrammarCompiler`, once per model);
each constrained sequence owns a `TokenConstraint` (an llguidance matcher) that gives the allowed
tokens before each pick and advances with each emitted token. Rows without a constraint never see
one, so a batch mixing both leaves the free rows' logits untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer as BackendTokenizer

from kapitsa.engine.types import Constraint
from kapitsa.errors import InvalidRequest, KapitsaError

_NEG_INF = float("-inf")
# Whitespace between JSON tokens is capped: a pretty-printed answer fits, an endless run of
# blanks (which a weak model's free mask invites) does not. A schema's `x-guidance` overrides it.
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary.

    Args:
        backend: the model's `tokenizers.Tokenizer`.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_ids: the tokens that end a generation; a finished grammar allows only these.
    """

    def __init__(self, backend: BackendTokenizer, *, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.eos_ids = tuple(sorted(set(eos_ids)))
        self.vocab_size = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.ll_tokenizer = _make_ll_tokenizer(backend, self.vocab_size, self.eos_ids)

    def grammar(self, constraint: Constraint) -> str:
        """The llguidance grammar for `constraint`; raises `InvalidRequest` when it does not compile."""
        try:
            if constraint.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.value, defaults=_JSON_OPTIONS
                )
            elif constraint.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(constraint.value)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(constraint.value)
        except (ValueError, RuntimeError, TypeError) as err:
            raise InvalidRequest(f"the output grammar is invalid: {err}") from err
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise InvalidRequest(f"the output grammar is invalid: {'; '.join(messages)}")
        return grammar

    def make(self, constraint: Constraint) -> TokenConstraint:
        """A fresh per-sequence constraint at the grammar's start."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the output grammar is invalid: {matcher.get_error()}")
        return TokenConstraint(matcher, vocab_size=self.vocab_size, eos_ids=self.eos_ids)


class TokenConstraint:
    """One sequence's grammar state: the allowed-token mask for its next pick.

    `prepare` computes the mask on the host; the engine calls it while the step's forward runs, so
    `apply` finds it ready. `advance` feeds each emitted token to the matcher.
    """

    def __init__(self, matcher: llguidance.LLMatcher, *, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._eos_only = np.zeros(vocab_size, dtype=bool)
        self._eos_only[list(eos_ids)] = True
        self._mask: mx.array | None = None  # [V] bool for the current state; None: not computed yet

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    def prepare(self) -> None:
        """Compute the mask for the current state (no-op when it is already there)."""
        if self._mask is not None:
            return
        if self._matcher.is_stopped():  # nothing may follow: only an end-of-sequence token
            allowed = self._eos_only
        else:
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
            allowed = bits[: self._vocab_size].astype(bool)
        self._mask = mx.array(allowed)

    def apply(self, logits: mx.array) -> mx.array:
        """Disallowed tokens of a [V] logits row set to -inf (columns past the mask too)."""
        self.prepare()
        assert self._mask is not None
        width = logits.shape[-1]
        mask = self._mask[:width] if width <= self._vocab_size else _pad(self._mask, width)
        return mx.where(mask, logits, _NEG_INF)

    def advance(self, token_id: int) -> None:
        """Feed an emitted token. Raises `KapitsaError` when it breaks the grammar (a bug upstream)."""
        self._mask = None
        if self._matcher.is_stopped():
            return  # the end-of-sequence token that closes a finished grammar
        if not self._matcher.consume_token(token_id):
            raise KapitsaError(f"the output left its grammar: {self._matcher.get_error()}")


def _make_ll_tokenizer(backend: BackendTokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    if not _is_byte_level(backend):  # llguidance's own loader (its added tokens are all special)
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
    vocabulary = _ByteLevelVocabulary(backend, vocab_size, eos_ids[0] if eos_ids else 0)
    wrapper = llguidance.TokenizerWrapper(vocabulary)
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_ids) or None)


def _pad(mask: mx.array, width: int) -> mx.array:
    return mx.concatenate([mask, mx.zeros((width - mask.shape[0],), dtype=mx.bool_)])


class _ByteLevelVocabulary:
    """The vocabulary as llguidance's `TokenizerWrapper` reads it: each id's bytes, with only the
    special added tokens special. llguidance's own loader marks every added token special, which a
    grammar's literal "<tool_call>" never matches; the model writes these tags as text, and the
    server parses them as text."""

    def __init__(self, backend: BackendTokenizer, vocab_size: int, eos_id: int) -> None:
        decode = _byte_decoder()
        added = backend.get_added_tokens_decoder()
        self.tokens: list[bytes] = []
        for token_id in range(vocab_size):
            piece = backend.id_to_token(token_id)
            if piece is None:
                self.tokens.append(b"")
            elif token_id in added:
                self.tokens.append(piece.encode("utf-8"))
            else:
                self.tokens.append(bytes(decode[c] for c in piece))
        self.special_token_ids = sorted(i for i, t in added.items() if t.special and i < vocab_size)
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


def _is_byte_level(backend: BackendTokenizer) -> bool:
    spec = json.loads(backend.to_str())
    return (spec.get("model") or {}).get("type") == "BPE" and (spec.get("decoder") or {}).get(
        "type"
    ) == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
