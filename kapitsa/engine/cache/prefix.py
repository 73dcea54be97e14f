"""Prefix cache for hybrid models: a radix tree over token ids.

Edges own the attention K/V of their token span, stored once. Some nodes carry a `Checkpoint`: the
recurrent (conv + SSM) state after the node's last token. A hybrid can only resume where a checkpoint
is, so every leaf carries one: evicting a leaf's checkpoint also drops the KV edges above it that no
other checkpoint needs. Arrays are immutable, so a sequence restored from a checkpoint keeps working
when that checkpoint is later evicted (it holds its own references).

KV payloads are tuples of arrays whose token axis is `kv_axis` (per attention layer: K, V and, for
quantized caches, scales/biases). The tree never looks inside them beyond slicing and concatenating.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from kapitsa.engine.cache.disk import DiskTier, StoredPrefix
from kapitsa.engine.cache.resident import (
    RESUMED_KINDS,
    Conversation,
    Residency,
    ResidentPolicy,
    conversations,
    is_stale,
)

KVSource = Callable[[int, int], tuple[mx.array, ...]]  # (start, end) -> KV arrays for that span
CHECKPOINT_KINDS = ("system", "turn", "branch", "periodic", "final")
# Written to disk soon after they are made, so a crash keeps them: the system prompt, and the end of
# the last message, where the next request resumes when the template re-renders the reply differently.
WRITE_BEHIND_KINDS = ("system", "turn")
MAX_SPILLED = 16  # spilled conversation heads remembered for an idle engine's preload


def nbytes_of(arrays: Sequence[mx.array]) -> int:
    return sum(a.nbytes for a in arrays)


@dataclass(slots=True, eq=False)
class Checkpoint:
    pos: int  # tokens folded into the state
    recurrent: tuple[mx.array, ...]  # batch-1 recurrent layer state, flattened, shared by reference
    next_logits: mx.array | None = None  # logits after `pos` tokens: an exact hit needs no new token
    kind: str = "turn"
    last_used: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown checkpoint kind {self.kind!r}")
        extra = self.next_logits.nbytes if self.next_logits is not None else 0
        self.nbytes = nbytes_of(self.recurrent) + extra


@dataclass(slots=True, eq=False)
class _Node:
    tokens: tuple[int, ...]  # edge label from the parent
    kv: tuple[mx.array, ...]  # K/V of the edge's span
    start: int  # position of the edge's first token
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    last_used: int = 0
    # a lookup resumed from its own turn, final or periodic checkpoint here, or a returning conversation
    # checkpointed here; kept when the checkpoint goes, so the mark outlives older checkpoints (resident.py)
    resumed: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """What to restore: KV for [0, pos) per array, and the recurrent state at pos."""

    pos: int
    # per KV array, its spans along the path's edges, unjoined: a restore writes them once into a
    # buffer with room for the prompt's remaining tokens (snapshot.fill)
    kv_spans: tuple[tuple[mx.array, ...], ...]
    recurrent: tuple[mx.array, ...]
    next_logits: mx.array | None
    kind: str
    from_disk: bool = False
    kv_axis: int = 2

    @property
    def kv(self) -> tuple[mx.array, ...]:
        """Each KV array over [0, pos), its spans joined."""
        return tuple(mx.concatenate(p, axis=self.kv_axis) if len(p) > 1 else p[0] for p in self.kv_spans)


def _common_prefix(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal `tokens[start:]` (no copy of the long prompt tail)."""
    n = min(len(edge), len(tokens) - start)
    if tuple(tokens[start : start + n]) == edge[:n]:  # the usual case, compared in C
        return n
    for i in range(n):
        if edge[i] != tokens[start + i]:
            return i
    return n


def _detach(x: mx.array) -> mx.array:
    # A copy, not a view: a view would keep the whole source buffer (a live sequence's KV) alive.
    return mx.contiguous(x)


class PrefixCache:
    """The in-memory radix tree, with LRU eviction under `budget_bytes` and an optional disk tier.

    Args:
        budget_bytes: edge KV plus checkpoint bytes kept in memory.
        kv_axis: the token axis of KV arrays ([B, H, T, D] -> 2).
        disk: where evicted leaf checkpoints go (and come back from); None = memory only.
        resident: which checkpoints eviction spares longest (resident.py); None = least recently used.
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        kv_axis: int = 2,
        disk: DiskTier | None = None,
        resident: ResidentPolicy | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.kv_axis = kv_axis
        self.disk = disk
        self.resident = resident
        self._root = _Node((), (), 0)
        self._clock = itertools.count(1)
        self.kv_bytes = 0
        self.checkpoint_bytes = 0
        self.num_checkpoints = 0
        self.residency = Residency()  # refreshed by `enforce_budget`, read by other threads' stats
        # leaf checkpoints eviction wrote to disk, the most important last: (tokens, resumed)
        self._spilled: list[tuple[tuple[int, ...], bool]] = []
        self.num_preloaded = 0  # checkpoints an idle engine loaded back from disk

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.checkpoint_bytes

    # lookup

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """The deepest usable checkpoint for a prompt (memory first, then a deeper one on disk)."""
        found = self._deepest_checkpoint(tokens)
        best_pos = found[-1].end if found else 0
        if self._spilled:
            self._forget_spills_under(tokens)
        if self.disk is not None:
            stored = self.disk.lookup(tokens, min_pos=best_pos + 1)
            if stored is not None:
                self._insert_stored(stored)
                found = self._deepest_checkpoint(tokens)
                return self._match(found, from_disk=True)
        return self._match(found) if found else None

    def read_ahead(self, tokens: Sequence[int]) -> bool:
        """Start reading the disk checkpoint `lookup(tokens)` would load, unless memory holds one as
        deep (disk.py's read-ahead); True when a read started."""
        if self.disk is None:
            return False
        found = self._deepest_checkpoint(tokens)
        return self.disk.read_ahead_for(tokens, min_pos=(found[-1].end if found else 0) + 1)

    def match_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the tree holds KV for (checkpointed or not)."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_prefix(child.tokens, tokens, depth)
            depth += common
            if common < len(child.tokens):
                break
            node = child
        return depth

    def _deepest_checkpoint(self, tokens: Sequence[int]) -> list[_Node]:
        """The path from the root to the deepest node whose checkpoint the prompt can resume from."""
        path: list[_Node] = []
        best = 0
        node, depth, n = self._root, 0, len(tokens)
        while depth < n:
            child = node.children.get(tokens[depth])
            if child is None or _common_prefix(child.tokens, tokens, depth) < len(child.tokens):
                break
            node, depth = child, child.end
            path.append(node)
            ck = node.checkpoint
            if ck is not None and (depth < n or ck.next_logits is not None):
                best = len(path)
        return path[:best]

    def _match(self, path: list[_Node], *, from_disk: bool = False) -> PrefixMatch | None:
        if not path:
            return None
        tick = next(self._clock)
        for node in path:
            node.last_used = tick
        ck = path[-1].checkpoint
        assert ck is not None
        ck.last_used = tick
        path[-1].resumed = path[-1].resumed or ck.kind in RESUMED_KINDS
        spans = tuple(zip(*(node.kv for node in path), strict=True))
        return PrefixMatch(ck.pos, spans, ck.recurrent, ck.next_logits, ck.kind, from_disk, self.kv_axis)

    # insert

    def insert(
        self,
        tokens: Sequence[int],
        *,
        recurrent: tuple[mx.array, ...],
        kv_source: KVSource,
        kind: str = "turn",
        next_logits: mx.array | None = None,
        conversation: bool = False,
    ) -> bool:
        """Checkpoint the state after `tokens`; KV not yet in the tree is copied from `kv_source`.
        `conversation`: the request continues a conversation (it carries an earlier reply), which
        marks the node as resumed (resident.py) even when the lookup found none of its state.

        Returns:
            True when this made a new checkpoint; False when `tokens` already had one (or were empty).
        """
        if not tokens:
            return False
        node, depth = self._walk_splitting(tokens)
        if depth < len(tokens):
            kv = tuple(_detach(a) for a in kv_source(depth, len(tokens)))
            child = _Node(tuple(tokens[depth:]), kv, depth, parent=node)
            node.children[child.tokens[0]] = child
            self.kv_bytes += nbytes_of(kv)
            node = child
        # evaluate now: a lazy copy would keep the whole source (a batch's KV buffer) alive
        mx.eval(*node.kv, *recurrent, *(() if next_logits is None else (next_logits,)))
        tick = next(self._clock)
        is_new = node.checkpoint is None
        if node.checkpoint is None:
            node.checkpoint = Checkpoint(len(tokens), recurrent, next_logits, kind, tick)
            self.checkpoint_bytes += node.checkpoint.nbytes
            self.num_checkpoints += 1
            if self.disk is not None and kind in WRITE_BEHIND_KINDS:
                self.disk.save_later(self._stored(node, node.checkpoint))
        else:
            node.checkpoint.last_used = tick
        node.resumed = node.resumed or conversation
        for n in self._path_to(node):
            n.last_used = tick
        self.enforce_budget()
        return is_new

    def _walk_splitting(self, tokens: Sequence[int]) -> tuple[_Node, int]:
        """Follow `tokens` down the tree, splitting an edge where they end or diverge inside it."""
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_prefix(child.tokens, tokens, depth)
            if common < len(child.tokens):
                child = self._split(child, common)
            node, depth = child, child.end
        return node, depth

    def _split(self, node: _Node, offset: int) -> _Node:
        """Cut `node`'s edge after `offset` tokens; return the new upper node."""
        parent = node.parent
        assert parent is not None
        upper_kv = tuple(_detach(_slice(a, 0, offset, self.kv_axis)) for a in node.kv)
        lower_kv = tuple(_detach(_slice(a, offset, None, self.kv_axis)) for a in node.kv)
        upper = _Node(node.tokens[:offset], upper_kv, node.start, parent=parent, last_used=node.last_used)
        parent.children[upper.tokens[0]] = upper
        node.tokens, node.kv, node.start, node.parent = (
            node.tokens[offset:],
            lower_kv,
            node.start + offset,
            upper,
        )
        upper.children[node.tokens[0]] = node
        return upper

    def _insert_stored(self, stored: StoredPrefix, *, conversation: bool = False) -> None:
        kv = tuple(
            mx.concatenate(parts, axis=self.kv_axis) if len(parts) > 1 else parts[0]
            for parts in zip(*stored.kv_parts, strict=True)
        )

        def kv_source(start: int, end: int) -> tuple[mx.array, ...]:
            return tuple(_slice(a, start, end, self.kv_axis) for a in kv)

        self.insert(
            stored.tokens,
            recurrent=stored.recurrent,
            kv_source=kv_source,
            kind=stored.kind,
            next_logits=stored.next_logits,
            conversation=conversation,
        )

    def preload(self, room_bytes: int) -> bool:
        """Load the most important spilled leaf checkpoint back from disk if its file fits in
        `room_bytes` (eviction spills the least important first, so that is the last one spilled).

        Returns:
            True when one was loaded; False when none is left or the next one does not fit.
        """
        while self._spilled and self.disk is not None:
            tokens, resumed = self._spilled[-1]
            size = self.disk.entry_bytes(tokens)
            if size is None or self._holds_checkpoint(tokens):
                self._spilled.pop()  # gone from disk, or back in memory
                continue
            if size > room_bytes:
                return False
            self._spilled.pop()
            stored = self.disk.load_exact(tokens)
            if stored is None:
                continue
            self._insert_stored(stored, conversation=resumed)
            self.num_preloaded += 1
            return True
        return False

    # eviction

    def enforce_budget(self, budget_bytes: int | None = None) -> None:
        """Evict least-recently-used checkpoints (system prompts last) until under budget."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        while self.nbytes > budget:
            victim = self._pick_victim()
            if victim is None:
                break
            self._evict(victim)
        if self.resident is not None:
            self.residency = self.resident.summary(self._iter_nodes())

    def _pick_victim(self) -> _Node | None:
        nodes = [n for n in self._iter_nodes() if n.checkpoint is not None]
        if not nodes:
            return None
        if self.resident is not None:
            return self.resident.pick_victim(nodes)
        return min(nodes, key=lambda n: (n.checkpoint.kind == "system", n.checkpoint.last_used, -n.end))  # type: ignore[union-attr]

    def _evict(self, node: _Node) -> None:
        ck = node.checkpoint
        assert ck is not None
        if self.disk is not None and not node.children:
            self._spill(node, ck)
            self._remember_spill(node)
        node.checkpoint = None
        self.checkpoint_bytes -= ck.nbytes
        self.num_checkpoints -= 1
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Drop KV edges that no checkpoint at or below them can use any more."""
        while node is not self._root and node.checkpoint is None and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            self.kv_bytes -= nbytes_of(node.kv)
            node = parent

    def _holds_checkpoint(self, tokens: Sequence[int]) -> bool:
        path = self._deepest_checkpoint([*tokens, -1])  # -1: no token; a final has no next logits
        return bool(path) and path[-1].end == len(tokens)

    def _forget_spills_under(self, tokens: Sequence[int]) -> None:
        """A prompt that came back supersedes its conversation's spilled checkpoints (the lookup
        loaded what it needed; the rest is older state)."""
        self._spilled = [s for s in self._spilled if tuple(tokens[: len(s[0])]) != s[0]]

    def _remember_spill(self, node: _Node) -> None:
        if is_stale(node):
            return  # a reply as generated that the next request re-rendered: nobody resumes there
        path = self._path_to(node)
        tokens = tuple(t for n in path for t in n.tokens)
        spill = (tokens, any(n.resumed for n in path))
        if self._spilled and self._spilled[-1][0][: len(tokens)] == tokens:
            self._spilled.insert(len(self._spilled) - 1, spill)  # an anchor after its head: a fallback
        else:
            self._spilled.append(spill)
        del self._spilled[:-MAX_SPILLED]

    def _spill(self, node: _Node, ck: Checkpoint) -> None:
        assert self.disk is not None
        self.disk.save(self._stored(node, ck))

    def _stored(self, node: _Node, ck: Checkpoint) -> StoredPrefix:
        """The checkpoint with the KV of its whole path, one span per edge (no copy)."""
        path = self._path_to(node)
        tokens = tuple(t for n in path for t in n.tokens)
        return StoredPrefix(tokens, tuple(n.kv for n in path), ck.recurrent, ck.next_logits, ck.kind)

    def flush_to_disk(self) -> None:
        """Write every leaf, system and turn checkpoint to the disk tier, wait for its writer and
        let it end (the engine is stopping)."""
        if self.disk is None:
            return
        for node in list(self._iter_nodes()):
            ck = node.checkpoint
            if ck is not None and (not node.children or ck.kind in WRITE_BEHIND_KINDS):
                self._spill(node, ck)
        self.disk.close()

    def conversations(self) -> list[Conversation]:
        """The tree's conversations, most important first (resident.py)."""
        return conversations(self._iter_nodes())

    def clear(self) -> None:
        self._root = _Node((), (), 0)
        self.kv_bytes = self.checkpoint_bytes = self.num_checkpoints = 0

    # helpers

    def _iter_nodes(self):  # noqa: ANN202
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _path_to(self, node: _Node) -> list[_Node]:
        path = []
        while node is not self._root:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        return path[::-1]


def _slice(a: mx.array, start: int, end: int | None, axis: int) -> mx.array:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, end)
    return a[tuple(index)]
