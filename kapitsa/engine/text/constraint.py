"""Constrained decoding: a grammar (JSON Schema, Lark, regex) enforced token by token.

llguidance compiles the grammar against the model's vocabulary (`GrammarCompiler`, once per model);
each constrained sequence owns a `TokenConstraint` (an llguidance matcher) that gives the allowed
tokens before each pick and advances with each emitted token. Rows without a constraint never see
one, so a batch mixing both leaves the free rows' logits untouched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

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
        self.ll_tokenizer = llguidance.LLTokenizer(
            _text_tags_as_text(backend.to_str()), n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
        )

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


def _pad(mask: mx.array, width: int) -> mx.array:
    return mx.concatenate([mask, mx.zeros((width - mask.shape[0],), dtype=mx.bool_)])


def _text_tags_as_text(tokenizer_json: str) -> str:
    """The tokenizer with its non-special added tokens (`<tool_call>`, `<think>`) as plain vocabulary.

    llguidance treats every added token as a special token, which a grammar's literal "<tool_call>"
    never matches; the model writes these tags as text, and the server parses them as text.
    """
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return tokenizer_json
    kept = []
    for token in spec.get("added_tokens") or []:
        content = token.get("content", "")
        if token.get("special") or not content.isascii() or not content.isprintable() or " " in content:
            kept.append(token)
        else:
            vocab[content] = token["id"]
    spec["added_tokens"] = kept
    return json.dumps(spec)
