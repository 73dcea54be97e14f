"""One request inside the engine: its tokens, where it stands, and how its output is shaped."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, Protocol

from kapitsa.engine.runner.sampler import SequenceSampler
from kapitsa.engine.runner.stop import StopMatcher
from kapitsa.engine.types import Event, FinishReason, GenerationRequest


class Detokenizer(Protocol):
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, not admitted (memory)
    PREFILLING = "prefilling"  # prompt chunks being processed, own batch-1 cache
    DECODING = "decoding"  # in the decode batch
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class Boundary:
    """A prompt position where the prefix cache should take a recurrent checkpoint."""

    pos: int
    kind: str  # "system" | "turn" | "periodic" | "branch"


MESSAGE_KINDS = ("system", "turn")  # message boundaries: agents resume there, always kept


def plan_boundaries(
    message: list[Boundary], extra: list[Boundary], *, resume: int, end: int, min_gap: int
) -> list[Boundary]:
    """The prompt's checkpoint boundaries, sorted: the message boundaries, and the branch and
    periodic ones (`extra`) that lie at least `min_gap` tokens past the resume position or the last
    boundary kept, a periodic one also `min_gap` before the next message boundary or the prompt's
    `end`. Each boundary ends a prefill chunk where the model has fixed-size state, one more forward
    for a checkpoint that would spare a later request at most that many tokens. (A branch stays
    close before a message boundary: the next one lies on this prompt's path, not the branch's.)"""
    known = {b.pos for b in message}
    planned = sorted([*message, *(b for b in extra if b.pos not in known)], key=lambda b: b.pos)
    stops = sorted([*(b.pos for b in message if b.pos > resume), end])
    kept, last = [], resume
    for b in planned:
        if b.kind not in MESSAGE_KINDS:
            if b.pos - last < min_gap:
                continue  # (those at or before the resume position go too: no chunk ends there)
            following = next(pos for pos in stops if pos >= b.pos)
            if b.kind == "periodic" and following - b.pos < min_gap:
                continue
        kept.append(b)
        last = max(last, b.pos)
    return kept


class TokenIds(SequenceABC):
    """A sequence's prompt and output ids as one read-only sequence, without copying either list:
    a decode step reads only its end, and copying a 30k-token agent context costs ~0.1 ms of
    Python per step (a slice that crosses the prompt/output boundary still copies)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._prompt, self._output)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - int or slice, like a list
        n = len(self._prompt)
        if index.__class__ is int and 0 <= index < n:  # the per-step reads first: no other checks
            return self._prompt[index]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1 and start >= n:
                return self._output[start - n : stop - n]
            if step == 1 and stop <= n:
                return self._prompt[start:stop]
            return list(self)[index]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError("token index out of range")
        return self._prompt[position] if position < n else self._output[position - n]


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    prompt_ids: list[int]
    emit: Callable[[Event], None]
    sampler: SequenceSampler | None  # made on the engine thread (it holds MLX arrays)
    detokenizer: Detokenizer
    stop: StopMatcher
    max_tokens: int  # generation limit (request's, or what the context leaves)
    boundaries: list[Boundary] = field(default_factory=list)
    eos_ids: frozenset[int] = frozenset()
    token_text: Callable[[int], str] = str  # one token's text, for logprobs
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    num_checkpointed_tokens: int = 0  # the prompt's longest prefix this request checkpointed
    num_processed: int = 0  # tokens folded into the cache (prompt, then fed output)
    cache: Any = None  # batch-1 model cache while prefilling
    reserved_bytes: int = 0
    last_checkpoint_pos: int = 0  # position of the latest periodic checkpoint taken during output
    reserved_tokens: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    prefill_started: float = 0.0
    prefill_done_at: float = 0.0
    pending_logits: Any = None  # next-token logits of an exact prefix-cache hit
    prompt_tail: Any = None  # a PromptTail while a drafter that reads the target has not taken it
    first_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    choice_index: int = 0  # which of the request's n choices this is
    forks: list[Sequence] = field(default_factory=list)  # the other choices, until the prefill ends
    constraint: Any = None  # a TokenConstraint for a constrained request, built before it is queued
    media: Any = None  # the prompt's images (a vision.media.PromptMedia), None for text
    prompt_key_ids: list[int] | None = None  # prefix-cache keys: images' tokens keyed by their pixels
    prediction_ids: tuple[int, ...] = ()  # the request's predicted output, for drafters to copy from
    draft_proposed: int = 0  # speculative decoding: the drafters' tokens verified for this sequence
    draft_accepted: int = 0  # ...and how many of them it kept
    prediction_proposed: int = 0  # of those drafts, the tokens copied from `prediction_ids`
    prediction_accepted: int = 0  # ...and how many of them it kept
    # the latest verify's kept drafts, and of them the prediction's: the first tokens it returned
    # (a stop among its tokens leaves those after it out of the output, and out of the counts)
    step_drafts: tuple[int, int] = (0, 0)
    # An out-of-memory batch step sent it back to the queue (runner/send_back.py): its next prefill
    # runs over its prompt and output so far (`feed_ids`), then it decodes on where it stopped.
    resuming: bool = False
    times_sent_back: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def continues_conversation(self) -> bool:
        """The request carries an earlier reply: a conversation that came back (cache/resident.py). A
        continued final message is this answer's own start (a prefill), not an earlier reply."""
        messages = self.request.messages or ()
        earlier = messages[:-1] if self.request.continue_final_message else messages
        return any(m.get("role") == "assistant" for m in earlier)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_remaining(self) -> int:
        return len(self.prompt_ids) - self.num_processed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it (`prompt_ids` unless it holds images)."""
        return self.prompt_ids if self.prompt_key_ids is None else self.prompt_key_ids

    @property
    def all_key_ids(self) -> list[int]:
        return self.key_ids + self.output_ids

    @property
    def token_ids(self) -> TokenIds:
        """`all_ids` as a view (no copy): what per-step readers such as drafters take."""
        return TokenIds(self.prompt_ids, self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def feed_ids(self) -> list[int]:
        """What its prefill runs over: the prompt, or prompt and output when it resumes."""
        return self.prompt_ids + self.output_ids if self.resuming else self.prompt_ids

    def next_chunk_end(self, chunk: int) -> int:
        """Where the next prefill chunk ends: `chunk` tokens on, or the next checkpoint boundary."""
        feed = len(self.prompt_ids) + (len(self.output_ids) if self.resuming else 0)  # len(feed_ids)
        end = min(self.num_processed + chunk, feed)
        for boundary in self.boundaries:
            if self.num_processed < boundary.pos < end:
                return boundary.pos
        return end

    def boundary_at(self, pos: int) -> Boundary | None:
        return next((b for b in self.boundaries if b.pos == pos), None)
