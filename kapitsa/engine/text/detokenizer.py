"""Streaming detokenization that never emits a partial UTF-8 character.

Byte-level BPE splits multi-byte characters (CJK, emoji) over several tokens; decoding a lone
token then gives U+FFFD. We decode a short window of recent tokens and emit only text that
extends the previous decode and does not end in U+FFFD (the offsets scheme of vLLM and TGI),
which also keeps SentencePiece-style leading spaces right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

_REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Feed generated token ids one at a time (or a few); get the newly completed text back."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window re-decoded each step
        self._read_offset = 0  # tokens before this have had their text emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append token(s); return the text they complete ('' while a character is still partial)."""
        if not isinstance(token_ids, int):
            # one at a time, so complete text before a trailing partial character is not held back
            return "".join(self.add(token_id) for token_id in token_ids)
        self.token_ids.append(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._emitted.append(new_text)
        return new_text

    def flush(self) -> str:
        """At the end of generation: the held-back text, with U+FFFD for bytes that never completed."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        rest = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        if rest:
            self._emitted.append(rest)
        return rest
