"""What the bench sends: its sizes (`BenchConfig`) and deterministic prompts and conversations.

Prompts carry a fresh nonce at the very start so no run is served from an earlier run's prefix
cache; everything after the nonce is fixed, so every engine sees the same text.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass
from typing import Any

Message = dict[str, str]

_WORDS = (
    "cache",
    "token",
    "layer",
    "state",
    "batch",
    "model",
    "prompt",
    "kernel",
    "tensor",
    "stream",
    "server",
    "client",
    "engine",
    "memory",
    "thread",
    "queue",
    "python",
    "metal",
    "decode",
    "prefill",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "with",
    "on",
    "as",
    "it",
    "by",
    "this",
)


@dataclass(slots=True, frozen=True)
class BenchConfig:
    """Workload sizes. The defaults suit a laptop with a real model; tests shrink them."""

    short_prompt_words: int = 40
    long_prompt_words: int = 3000
    decode_tokens: int = 128
    replay_turns: int = 6
    replay_context_words: int = 1500
    concurrent_streams: int = 4
    concurrent_tokens: int = 64
    # one untimed request of this many tokens before the workloads (0: none), so no workload times a
    # target's first-use work (traces, kernel compiles, lazy loading)
    warmup_tokens: int = 8

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            least = 0 if name == "warmup_tokens" else 1
            if value < least:
                raise ValueError(f"{name} must be >= {least}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def filler_text(num_words: int, *, seed: int) -> str:
    """Deterministic prose-like text of `num_words` words (roughly one token each)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def nonce() -> str:
    return f"[run {uuid.uuid4().hex[:12]}]"


def single_turn(num_words: int, *, seed: int, run_nonce: str) -> list[Message]:
    """One user message asking to continue a text of `num_words` filler words."""
    text = filler_text(num_words, seed=seed)
    return [{"role": "user", "content": f"{run_nonce} Continue this text without stopping:\n{text}"}]


_REPLAY_TURNS = (
    (
        "The test in tests/test_cache.py fails with a KeyError. Find out why.",
        "I will read the test and the cache module first.\n<tool>read tests/test_cache.py</tool>",
    ),
    (
        "<tool_result>def test_evict():\n    cache = LRU(2)\n    cache.put('a', 1)\n    cache.put('b', 2)\n"
        "    cache.put('c', 3)\n    assert cache.get('a') is None</tool_result>",
        "The test expects 'a' to be evicted. Let me look at LRU.put.\n<tool>read kapitsa/cache.py</tool>",
    ),
    (
        "<tool_result>def put(self, key, value):\n    self.data[key] = value\n    if len(self.data) > self.size:\n"
        "        del self.data[self.order.pop()]</tool_result>",
        "`order.pop()` removes the newest key, not the oldest. It should be `pop(0)`.\n<tool>edit kapitsa/cache.py</tool>",
    ),
    (
        "<tool_result>edited 1 line</tool_result>",
        "Now I run the test again.\n<tool>run pytest tests/test_cache.py</tool>",
    ),
    (
        "<tool_result>1 passed in 0.02s</tool_result>",
        "The test passes. The bug was that eviction dropped the most recent key instead of the oldest.",
    ),
    ("Thanks. Also add a test for updating an existing key.", "<tool>edit tests/test_cache.py</tool>"),
    ("<tool_result>edited 6 lines</tool_result>", "<tool>run pytest tests/test_cache.py</tool>"),
    ("<tool_result>2 passed in 0.02s</tool_result>", "Both tests pass."),
)


def agent_replay_prefixes(turns: int, *, context_words: int, run_nonce: str) -> list[list[Message]]:
    """The request history at each turn of a recorded coding-agent session.

    Turn k's request is turn k-1's request plus the recorded assistant reply and the next user
    message, so an engine with a prefix cache recomputes only the new tail. The recorded replies
    (not the engine's own) are replayed, so every engine sees identical prompts.
    """
    system = (
        f"{run_nonce} You are a coding agent working in a Python repository. Use tools to read, edit "
        f"and run code. Project notes follow.\n{filler_text(context_words, seed=7)}"
    )
    history: list[Message] = [{"role": "system", "content": system}]
    requests: list[list[Message]] = []
    for index in range(turns):
        user, assistant = _REPLAY_TURNS[index % len(_REPLAY_TURNS)]
        history.append({"role": "user", "content": user})
        requests.append(list(history))
        history.append({"role": "assistant", "content": assistant})
    return requests
