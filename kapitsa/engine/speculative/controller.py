"""Adaptive draft length (hybrid-engine.md §5.6): pick k maximising expected tokens per unit of
verify cost, from a measured cost curve c(T) and running per-depth acceptance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# The longest draft by default: a verify forward of 1 + 7 tokens is the widest that CUDA's few-row
# quantized mat-vec kernels always take (8 rows). Wider verifies reach the 9-16-row kernel only once
# its probe passes, else the stock mat-mul at about twice the cost, so longer drafts are opt-in
# (`--draft-tokens 15`).
DEFAULT_MAX_DRAFT = 7


def default_cost_curve(max_tokens: int, *, per_token: float = 0.08) -> list[float]:
    """c(T) relative to one decode step. Verify of T tokens reads the weights once, so on
    bandwidth-bound hardware the extra rows are cheap; refine by measuring `c` at load."""
    return [1.0 + per_token * (t - 1) for t in range(1, max_tokens + 2)]


def gpu_cost_curve(max_tokens: int, *, verify: float = 1.8, per_token: float = 0.02) -> list[float]:
    """c(T) on a GPU, relative to a pipelined decode step (the next step queued on the device
    before the previous token is read). A verify step can't be pipelined: its draft depends on
    what the previous one accepted, so it pays a host round trip and the rollback as well: about
    two decode steps, nearly flat in T, since the rows share one read of the weights (docs/results.md
    has the verify costs). Metal is assumed to behave alike."""
    return [1.0] + [verify + per_token * (t - 1) for t in range(2, max_tokens + 2)]


@dataclass(slots=True)
class DraftLengthController:
    max_draft: int = DEFAULT_MAX_DRAFT
    decay: float = 0.9  # EWMA weight of history
    margin: float = 0.05  # speculate only if it beats plain decode by this much
    cost: list[float] = field(default_factory=list)  # cost[T-1] = c(T)
    # P(accept depth i | accepted depth i-1). Depth counts from where the drafter's current run
    # of correct tokens began (`from_depth` below): a copy that has held for a few tokens tends to
    # hold, and that is what deep entries learn; the last entry stands for every deeper one.
    alphas: list[float] = field(default_factory=list)
    probe_every: int = 16  # when speculation is off, try one short draft every this many tokens
    prior: float = 0.6  # the acceptance assumed at every depth before any draft was scored
    _off_since: int | None = None  # position (output tokens) where speculation last went off
    _calls: int = 0
    # best_length's answers since the estimate last changed, by (from_depth, extra_cost): while
    # speculation rests the engine asks every decode step, and the answer changes only when a
    # guess is scored (update) or the cost curve is set
    _best: dict[tuple[int, float], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.cost:
            self.cost = default_cost_curve(self.max_draft)
        if len(self.cost) < self.max_draft + 1:
            raise ValueError("cost curve must cover T = 1..max_draft+1")
        if not self.alphas:
            self.alphas = [self.prior] * self.max_draft

    def _alpha_index(self, depth: int) -> int:
        return min(depth, len(self.alphas) - 1)

    def expected_tokens(self, k: int, from_depth: int = 0) -> float:
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.alphas[self._alpha_index(from_depth + i)]
            total += reach
        return total

    def best_length(self, from_depth: int = 0, extra_cost: float = 0.0) -> int:
        """The draft length with the best expected tokens per unit of cost, for a draft that
        continues a run of `from_depth` correct tokens and costs `extra_cost` decode steps on top
        of its verify (leaving pipelined decoding); 0 when none beats plain decoding by `margin`.
        No side effects (`choose` also schedules probes); O(max_draft) once per estimate, as the
        engine asks every decode step."""
        key = (from_depth, extra_cost)
        known = self._best.get(key)
        if known is None:
            known = self._best[key] = self._best_length(from_depth, extra_cost)
        return known

    def _best_length(self, from_depth: int, extra_cost: float) -> int:
        best_k, best = 0, (1.0 / self.cost[0]) * (1 + self.margin)
        total, reach, last = 1.0, 1.0, len(self.alphas) - 1
        for k in range(1, self.max_draft + 1):
            reach *= self.alphas[min(from_depth + k - 1, last)]
            total += reach
            rate = total / (self.cost[k] + extra_cost)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def choose(self, position: int | None = None, from_depth: int = 0) -> int:
        """The draft length to use next; 0 means plain decoding is better right now.

        `position` is the sequence's output length (None: count calls instead). While off, one
        1-token probe every `probe_every` positions keeps the acceptance estimate current."""
        self._calls += 1
        position = self._calls if position is None else position
        best_k = self.best_length(from_depth)
        if best_k > 0:
            self._off_since = None
        elif self._off_since is None:
            self._off_since = position
        elif position - self._off_since >= self.probe_every:
            self._off_since = position
            return 1
        return best_k

    def note_off(self, position: int) -> None:
        """Record that speculation is off from `position` when no draft pays (as `choose` does) and
        it is not already off."""
        if self._off_since is None and self.best_length() == 0:
            self._off_since = position

    def resting(self, position: int) -> bool:
        """Whether speculation is off and no probe is due at `position`: plain steps until then
        (which the engine can pipeline)."""
        return self._off_since is not None and position - self._off_since < self.probe_every

    def update(self, proposed: int, accepted: int, from_depth: int = 0) -> None:
        """Fold one verify step in: depths < accepted passed, depth `accepted` failed (if proposed);
        `from_depth`: the run of correct tokens the draft continued."""
        self._best.clear()
        for i in range(min(proposed, self.max_draft)):
            if i > accepted:
                break
            hit = 1.0 if i < accepted else 0.0
            j = self._alpha_index(from_depth + i)
            self.alphas[j] = self.decay * self.alphas[j] + (1 - self.decay) * hit

    def set_cost_curve(self, cost: Sequence[float]) -> None:
        base = cost[0]
        self.cost = [c / base for c in cost]
        self._best.clear()
