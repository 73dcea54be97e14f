"""What a prefill keeps of the prompt's last positions for a drafter that reads the target.

An MTP head drafts from the target's final-normed hidden states, a block drafter (DFlash) from
some layers' outputs. A verify hands those over for the positions it keeps, but the prompt has no
verify: without this, such a drafter starts every answer with no context (MTP has nothing to
draft from at all on the first step). A `PromptTail` collects them while the prefill runs, chunk
by chunk, and keeps only the last `window` positions, so its memory is bounded whatever the
prompt's length. Positions restored from the prefix cache were never computed and are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

# The prompt positions a drafter is given: the recent text a draft continues. An MTP head or a
# block drafter attends over all of them once per answer (a forward of this many rows), and on a
# 27B shape five tapped layers of 512 positions are ~26 MB in bf16, held until the first step.
DEFAULT_TAIL_WINDOW = 512


@dataclass(frozen=True)
class TailRequest:
    """What a drafter reads of the prompt: final-normed hidden states, layer outputs, or both."""

    normed: bool = False
    taps: tuple[int, ...] = ()
    window: int = DEFAULT_TAIL_WINDOW

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")


@dataclass(eq=False)
class PromptTail:
    """Rows for prompt positions `[start, start + length)`: `normed` `[n, H]` and `taps`
    (layer index -> `[n, H]`), of a batch-1 prefill."""

    request: TailRequest
    prompt_end: int | None = None  # the prompt's length: chunks that end a window before it keep nothing
    start: int = 0
    normed: mx.array | None = None
    taps: dict[int, mx.array] = field(default_factory=dict)
    length: int = 0

    def wants(self, end: int) -> bool:
        """Whether a chunk that ends at prompt position `end` has rows the tail will keep."""
        return self.prompt_end is None or end > self.prompt_end - self.request.window

    def keep(self, end: int, normed: mx.array | None, taps: dict[int, mx.array]) -> None:
        """Fold in the rows of a chunk that ends at prompt position `end` (the chunk's last rows,
        already cut to at most `window`); the chunk follows the rows kept so far."""
        rows = next(iter(taps.values())).shape[0] if taps else normed.shape[0]
        if self.length and self.start + self.length != end - rows:
            self.normed, self.taps, self.length = None, {}, 0  # not contiguous: start over
        drop = max(0, self.length + rows - self.request.window)
        self.normed = _joined(self.normed, normed, drop)
        self.taps = {i: _joined(self.taps.get(i), rows_i, drop) for i, rows_i in taps.items()}
        self.length += rows - drop
        self.start = end - self.length

    def arrays(self) -> list[mx.array]:
        return ([] if self.normed is None else [self.normed]) + list(self.taps.values())

    def next_tokens(self, prompt_ids: list[int], first_output: int) -> list[int]:
        """The token after each kept position: the prompt's next one, then the first output."""
        return [*prompt_ids[self.start + 1 : self.start + self.length], first_output]


def tail_for(strategy: object, prompt_end: int) -> PromptTail | None:
    """An empty tail for the prefill of a `prompt_end`-token prompt when `strategy` (a decode
    strategy) has drafters that read the target (its `prompt_tail_request`), else None."""
    request = getattr(strategy, "prompt_tail_request", None)
    return None if request is None else PromptTail(request, prompt_end)


def _joined(kept: mx.array | None, new: mx.array | None, drop: int) -> mx.array | None:
    if new is None:
        return None
    if kept is None or kept.shape[0] == 0:
        return new[drop:]
    if drop >= kept.shape[0]:
        return new[drop - kept.shape[0] :]
    return mx.concatenate([kept[drop:], new], axis=0)
