"""Resident conversations: which prefix-cache checkpoints eviction takes first.

An agent conversation comes back every few seconds with its previous prompt plus one reply and one
message, so what it needs in memory is its newest state: the leaf checkpoint at the end of its last
request (the reply as generated) and the deepest "turn" checkpoint above it (the end of the last
message, where it resumes when the template re-renders the reply differently). Everything older on
its path (earlier turns, periodic checkpoints) only costs memory.

A conversation is a leaf of the tree, unless a newer leaf also passes through the leaf's turn
checkpoint: then the leaf is a reply the next request re-rendered differently (stale), part of
the newer one's conversation. A conversation is resumed once a lookup hit one of its own turn, final
or periodic checkpoints, or a request carrying an earlier reply checkpointed it; resumed conversations
rank above one-shot requests (titles, quota checks) of any recency. The `max_conversations` first
conversations in that order are resident.

Eviction order (first to go first): checkpoints that are no conversation's newest (earlier turns,
periodic ones, branch points, stale replies), least recently used; then one-shot requests' newest,
least recently used; then those of resumed conversations that are not resident, by recency; then
system prompts; then resident conversations' newest, least recent conversation first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_RESIDENT_CONVERSATIONS = 4
# A hit on one of these marks a conversation as resumed; a hit on a system prompt or on a branch
# point (where siblings fork) is some other request's.
RESUMED_KINDS = ("turn", "final", "periodic")

Node = Any  # prefix._Node (the tree's node; prefix.py imports this module)


@dataclass(slots=True, frozen=True)
class Conversation:
    head: Node  # its leaf
    anchor: Node | None  # the deepest turn checkpoint above the head
    last_used: int
    resumed: bool

    @property
    def newest(self) -> tuple[Node, ...]:
        """The nodes whose checkpoints the conversation resumes from."""
        return (self.head,) if self.anchor is None else (self.head, self.anchor)


def path_to(node: Node) -> list[Node]:
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


def _anchor(path: list[Node]) -> Node | None:
    for node in reversed(path[:-1]):
        if node.checkpoint is not None and node.checkpoint.kind == "turn":
            return node
    return None


def _resumed(path: list[Node]) -> bool:
    return any(n.resumed for n in path)


def conversations(nodes: Iterable[Node]) -> list[Conversation]:
    """The tree's conversations, most important first (resumed, then most recently used)."""
    leaves = [n for n in nodes if not n.children and n.checkpoint is not None]
    found = []
    newest_below: dict[int, int] = {}  # id(turn node) -> newest leaf use under it
    for leaf in leaves:
        path = path_to(leaf)
        found.append((leaf, path, _anchor(path)))
        for node in path[:-1]:
            if node.checkpoint is not None and node.checkpoint.kind == "turn":
                newest_below[id(node)] = max(newest_below.get(id(node), 0), leaf.last_used)
    out = [
        Conversation(leaf, anchor, leaf.last_used, _resumed(path))
        for leaf, path, anchor in found
        if anchor is None or newest_below[id(anchor)] <= leaf.last_used  # else stale
    ]
    return sorted(out, key=lambda c: (c.resumed, c.last_used), reverse=True)


def is_stale(leaf: Node) -> bool:
    """Whether a leaf is a reply some newer request re-rendered differently (see the module docstring)."""
    anchor = _anchor(path_to(leaf))
    if anchor is None:
        return False
    stack = list(anchor.children.values())
    while stack:
        node = stack.pop()
        if node is not leaf and not node.children and node.last_used > leaf.last_used:
            return True
        stack.extend(node.children.values())
    return False


@dataclass(slots=True, frozen=True)
class Residency:
    """What the policy keeps now (a snapshot the engine thread replaces; others read it)."""

    conversations: int = 0  # conversations with state in memory
    resident: int = 0  # of those, the ones whose newest checkpoints eviction spares
    resident_bytes: int = 0  # their KV and newest checkpoints


class ResidentPolicy:
    """Eviction order for a `PrefixCache` (see the module docstring).

    Args:
        max_conversations: how many conversations keep their newest checkpoints until memory
            runs out (the prefix cache's budget says how many actually fit).
    """

    def __init__(self, max_conversations: int = DEFAULT_RESIDENT_CONVERSATIONS) -> None:
        if max_conversations < 1:
            raise ValueError("a resident policy keeps at least one conversation")
        self.max_conversations = max_conversations

    def resident(self, nodes: Iterable[Node]) -> list[Conversation]:
        return conversations(nodes)[: self.max_conversations]

    def summary(self, nodes: Iterable[Node]) -> Residency:
        ranked = conversations(nodes)
        kept = ranked[: self.max_conversations]
        return Residency(len(ranked), len(kept), resident_bytes(kept))

    def pick_victim(self, nodes: list[Node]) -> Node | None:
        """The checkpointed node to evict next, or None when there is none."""
        rank: dict[int, tuple[int, int]] = {}  # id(node) -> (tier, recency) of the newest checkpoints
        for i, conv in enumerate(conversations(nodes)):
            tier = _RESIDENT if i < self.max_conversations else _RESUMED if conv.resumed else _ONE_SHOT
            for node in conv.newest:
                rank[id(node)] = max(rank.get(id(node), (_OLDER, 0)), (tier, conv.last_used))

        def order(node: Node) -> tuple[int, int, int]:
            ck = node.checkpoint
            tier, recency = rank.get(id(node), (_SYSTEM if ck.kind == "system" else _OLDER, ck.last_used))
            return tier, recency, -node.end

        return min((n for n in nodes if n.checkpoint is not None), key=order, default=None)


# Eviction tiers, first to go first (the module docstring's order).
_OLDER, _ONE_SHOT, _RESUMED, _SYSTEM, _RESIDENT = range(5)


def resident_bytes(conversations: Iterable[Conversation]) -> int:
    """KV along the conversations' paths (shared prefixes counted once) plus their newest checkpoints."""
    seen: set[int] = set()
    total = 0
    for conv in conversations:
        for node in path_to(conv.head):
            if id(node) not in seen:
                seen.add(id(node))
                total += sum(a.nbytes for a in node.kv)
        total += sum(n.checkpoint.nbytes for n in conv.newest if n.checkpoint is not None)
    return total
