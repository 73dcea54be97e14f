"""Prompt encoding that reuses the work of earlier requests.

An agent's prompt is the previous prompt plus a few messages, and the chat template puts special
tokens (`<|im_start|>`, `<|im_end|>`) around every message. Tokenizers cut the text at special
tokens before anything else, so encoding the pieces between them one by one gives the same ids as
encoding the whole text, and each piece (a message, the system prompt) is encoded once and cached.
This is checked on a rendered sample when the encoder is made; a tokenizer that fails the check (or
whose special tokens strip surrounding spaces) is used whole, uncached.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

_SAMPLE = [
    {"role": "system", "content": "You are a helpful assistant.\n"},
    {"role": "user", "content": " Hello,  world!\n\n"},
    {"role": "assistant", "content": "Hi there. 日本語 🙂"},
    {"role": "user", "content": "def f(x):\n    return x\n"},
]


class PromptEncoder:
    """`encode(text)` equal to `tokenizer.encode(text)`, with per-piece caching when that is exact.

    Args:
        tokenizer: a kapitsa `Tokenizer` (or anything with `encode`; then no caching).
        max_cached_chars: total text kept in the piece cache (least recently used pieces go first).
    """

    def __init__(self, tokenizer: Any, *, max_cached_chars: int = 16_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chars = max_cached_chars
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # prompts are encoded on several worker threads
        self._split = _special_split(tokenizer)
        if self._split is not None and not self._agrees_on_sample():
            self._split = None

    @property
    def is_caching(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(self.tokenizer.encode(text))
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece:
                ids.extend(self._encode_piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            hit = self._pieces.get(piece)
            if hit is not None:
                self._pieces.move_to_end(piece)
                return hit
        ids = tuple(self.tokenizer.encode(piece))
        with self._lock:
            if piece not in self._pieces and len(piece) <= self.max_cached_chars:
                self._pieces[piece] = ids
                self._cached_chars += len(piece)
                while self._cached_chars > self.max_cached_chars:
                    old, _ = self._pieces.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids

    def _agrees_on_sample(self) -> bool:
        try:
            text = self.tokenizer.apply_chat_template(_SAMPLE, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - no template: check on plain text with the special tokens
            text = "".join(_SAMPLE[i]["content"] for i in range(len(_SAMPLE)))
        sample_ids = self.encode(text)
        self._pieces.clear()
        self._cached_chars = 0
        return sample_ids == list(self.tokenizer.encode(text))


def _special_split(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex that cuts text at special tokens (kept as pieces), or None when that would not be exact."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    specials = [t for t in backend.get_added_tokens_decoder().values() if t.special]
    if not specials or any(t.lstrip or t.rstrip or t.single_word for t in specials):
        return None
    # longest first, so a token that contains another one wins
    alternatives = sorted((t.content for t in specials), key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
