"""The resident-conversation policy on a prefix tree with fake payloads (KV [1, 1, T, 1] holds token ids)."""

from __future__ import annotations

import mlx.core as mx

from kapitsa.engine.cache.prefix import PrefixCache
from kapitsa.engine.cache.resident import ResidentPolicy


def _insert(cache: PrefixCache, tokens, kind: str = "turn", **kw) -> None:
    def source(start: int, end: int):
        return (mx.array(list(tokens[start:end]), dtype=mx.float32).reshape(1, 1, -1, 1),)

    cache.insert(tokens, recurrent=(mx.zeros((1, 4)),), kv_source=source, kind=kind, **kw)


def _turn(cache: PrefixCache, prompt: list[int], reply: list[int]) -> None:
    """One request: a lookup, the turn checkpoint at the prompt's end, the final one after the reply."""
    cache.lookup(prompt)
    _insert(cache, prompt, "turn")
    _insert(cache, prompt + reply, "final")


def test_a_re_rendered_reply_is_stale_not_a_conversation() -> None:
    cache = PrefixCache(budget_bytes=1 << 20, resident=ResidentPolicy(4))
    prompt = list(range(100, 120))
    _turn(cache, prompt, [1, 2, 3])
    _turn(cache, prompt + [9, 9, 9, 50, 51], [4, 5])  # the template rendered the reply as 9 9 9
    _turn(cache, list(range(200, 210)), [6])  # another conversation
    # the leaf at 23 (the reply as generated) is stale; the resumed conversation ranks first
    ranked = cache.conversations()
    assert [(c.head.end, c.anchor.end, c.resumed) for c in ranked] == [(27, 25, True), (11, 10, False)]


def test_one_shot_requests_go_before_resumed_conversations() -> None:
    kv_token = 4  # one float32 per token
    cache = PrefixCache(budget_bytes=1 << 20, resident=ResidentPolicy(2))
    a, b = list(range(100, 140)), list(range(200, 240))
    for conv in (a, b):
        _turn(cache, conv, [1, 2])
    for conv in (a, b):  # both come back: resumed
        _turn(cache, conv + [1, 2, 7], [3])
    for i in range(3):  # newer one-shots, each as large as a conversation
        _turn(cache, [300 + i] * 40, [4])
    cache.enforce_budget(cache.nbytes - 40 * kv_token)
    assert [c.head.end for c in cache.conversations() if c.resumed] == [44, 44]
    match = cache.lookup(a + [1, 2, 7, 3, 8])
    assert match is not None and match.pos == 44


def test_without_the_policy_lru_evicts_the_older_conversation() -> None:
    kv_token = 4
    cache = PrefixCache(budget_bytes=1 << 20)
    a, b = list(range(100, 140)), list(range(200, 240))
    for conv in (a, b):
        _turn(cache, conv, [1, 2])
    for conv in (a, b):
        _turn(cache, conv + [1, 2, 7], [3])
    for i in range(3):
        _turn(cache, [300 + i] * 40, [4])
    cache.enforce_budget(cache.nbytes - 40 * kv_token)
    match = cache.lookup(a + [1, 2, 7, 3, 8])
    assert match is None or match.pos < 44  # the negative control of the test above


def test_conversation_flag_marks_a_returning_conversation_resumed() -> None:
    cache = PrefixCache(budget_bytes=1 << 20, resident=ResidentPolicy(1))
    _insert(cache, [1, 2, 3], "final", conversation=True)
    _insert(cache, [5, 6, 7], "final")
    assert [(c.head.end, c.resumed) for c in cache.conversations()] == [(3, True), (3, False)]
    assert cache.residency.resident == 1 and cache.residency.conversations == 2
