"""Which tokens a chat request will resume from, known before its template renders.

An agent's next request repeats the previous request's messages and adds the reply and new messages.
The client remembers the tokens each conversation's last request became (its prompt and reply) under
a fingerprint of its messages; a request whose leading messages have a remembered fingerprint names
those tokens to the engine (`Engine.prefetch`), so a checkpoint on disk is read while the template
renders and the prompt is tokenized.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any

MAX_CONVERSATIONS = 16  # remembered requests, least recently used dropped first


class TurnHints:
    """Messages fingerprint -> token ids of the request that rendered them (and its reply)."""

    def __init__(self, max_entries: int = MAX_CONVERSATIONS) -> None:
        self.max_entries = max_entries
        self._tokens: collections.OrderedDict[bytes, array.array] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, messages: Sequence[dict[str, Any]], token_ids: Sequence[int]) -> None:
        key = _fingerprints(messages)[-1]
        with self._lock:
            self._tokens[key] = array.array("i", token_ids)  # 4 bytes a token, not a Python int's 28
            self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_entries:
                self._tokens.popitem(last=False)

    def recall(self, messages: Sequence[dict[str, Any]]) -> array.array | None:
        """The tokens of the longest remembered run of leading messages (None: none remembered)."""
        with self._lock:
            for key in reversed(_fingerprints(messages)):
                if key in self._tokens:
                    self._tokens.move_to_end(key)
                    return self._tokens[key]
        return None


def _fingerprints(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """A digest of each leading run of messages: [messages[:1], messages[:2], ...]."""
    digest = hashlib.blake2b(digest_size=16)
    out = []
    for message in messages:
        digest.update(json.dumps(message, sort_keys=True, default=str).encode())
        out.append(digest.copy().digest())
    return out
