"""Resident conversations on the tiny engine: four interleaved agent conversations, with one-shot side
requests (titles) between their turns, under a prefix-cache budget that plain LRU thrashes in."""

from __future__ import annotations

from test_prefix_reuse import chat

from kapitsa.server.metrics import prometheus_text

SYSTEM = "You are a careful coding agent.\n" + "".join(
    f"Rule {i}: be short, cite paths.\n" for i in range(14)
)
CONVERSATIONS = 4
ROUNDS = 3


async def _interleaved(client, *, side_requests: bool) -> list[float]:
    """Reuse (cached / prompt tokens) of every conversation turn, in the order they ran."""
    conversations = [[{"role": "system", "content": SYSTEM}] for _ in range(CONVERSATIONS)]
    reuse = []
    for turn in range(ROUNDS):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"C{i} step {turn}."})
            text, _, finish = await chat(client, messages, 8)
            messages.append({"role": "assistant", "content": text})
            reuse.append(finish.usage.cached_tokens / finish.usage.prompt_tokens)
            if side_requests and turn > 0:  # a title request of about a conversation's own size
                await chat(
                    client, [{"role": "user", "content": f"Title {turn}.{i}: " + "lorem ipsum " * 12}], 2
                )
    return reuse


async def test_four_interleaved_conversations_stay_resident_where_lru_thrashes(
    qwen_model, make_client
) -> None:
    probe = make_client(qwen_model)
    await _interleaved(probe, side_requests=False)
    stats = probe.stats()
    assert (stats.conversations_in_memory, stats.resident_conversations) == (CONVERSATIONS, CONVERSATIONS)
    # the four conversations' newest state, and some room: under what the cache holds unbudgeted
    # (~1.49x, each turn checkpointing its system prompt, turn and reply ends)
    budget = int(1.45 * stats.resident_bytes)
    assert budget < stats.checkpoint_bytes_in_memory  # what the cache held without a budget

    kept = make_client(qwen_model, prefix_cache_bytes=budget)  # resident_conversations=4 by default
    reuse = await _interleaved(kept, side_requests=True)
    assert min(reuse[1:]) >= 0.90, reuse  # the very first request has nothing to reuse
    stats = kept.stats()
    assert stats.resident_conversations == CONVERSATIONS and stats.resident_bytes <= budget
    assert f"kapitsa_resident_conversations {CONVERSATIONS}\n" in prometheus_text(stats)  # GET /metrics

    lru = make_client(qwen_model, prefix_cache_bytes=budget, resident_conversations=0)
    lru_reuse = await _interleaved(lru, side_requests=True)
    assert min(lru_reuse[1:]) < 0.90, lru_reuse  # the negative control: the same budget under LRU
    assert sum(lru_reuse) < sum(reuse)
