"""Turning sampled tokens into a sequence's stream: detokenize, hold back possible stop strings,
end at EOS / stop ids / stop strings / max_tokens, attach logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from kapitsa.engine.runner.sampler import SampledToken
from kapitsa.engine.runner.sequence import Sequence
from kapitsa.engine.types import Event, FinishReason, TokenEvent, TokenLogprob, Usage


def threadsafe_put(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]) -> Callable[[Event], None]:
    """A sequence's `emit` for the engine thread: the event goes onto `events` on the consumer's loop."""

    def put(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's loop is gone: nobody is listening
            loop.call_soon_threadsafe(events.put_nowait, event)

    return put


def emit_tokens(seq: Sequence, tokens: list[SampledToken]) -> FinishReason | None:
    """Append `tokens` to `seq` (stopping at the first that ends it) and emit one `TokenEvent`.

    Returns the finish reason, or None while the sequence goes on.
    """
    ids: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    reason: FinishReason | None = None
    for token in tokens:
        if not seq.first_token_at:
            seq.first_token_at = time.perf_counter()
        seq.output_ids.append(token.token_id)
        ids.append(token.token_id)
        if seq.request.sampling.logprobs is not None:
            logprobs.append(_logprob(seq, token))
        reason = _consume(seq, token.token_id, text)
        if reason is None and len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            if seq.stop_sequence is None:
                text.append(seq.stop.feed(seq.detokenizer.flush()).text + seq.stop.flush())
            break
    if len(ids) < len(tokens):  # a verify's tokens past the end: its drafts there were not kept
        drafts, predicted = seq.step_drafts
        seq.draft_accepted -= drafts - min(drafts, len(ids))
        seq.prediction_accepted -= predicted - min(predicted, len(ids))
    event_logprobs = tuple(logprobs) if seq.request.sampling.logprobs is not None else None
    seq.emit(TokenEvent(seq.request_id, tuple(ids), "".join(text), event_logprobs, index=seq.choice_index))
    return reason


def _consume(seq: Sequence, token_id: int, text: list[str]) -> FinishReason | None:
    params = seq.request.sampling
    if token_id in params.stop_token_ids or (token_id in seq.eos_ids and not params.ignore_eos):
        return "stop"
    check = seq.stop.feed(seq.detokenizer.add(token_id))
    text.append(check.text)
    if check.stop is not None:
        seq.stop_sequence = check.stop
        return "stop"
    return None


def _logprob(seq: Sequence, token: SampledToken) -> TokenLogprob:
    top = tuple((tid, seq.token_text(tid), lp) for tid, lp in token.top)
    return TokenLogprob(token.token_id, seq.token_text(token.token_id), token.logprob, top)


def usage_of(seq: Sequence) -> Usage:
    """What a finished (or failed) sequence reports: its tokens and prefill/decode times."""
    prefill_end = seq.prefill_done_at or seq.finished_at
    return Usage(
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=len(seq.output_ids),
        cached_tokens=seq.num_cached_tokens,
        cache_write_tokens=max(0, seq.num_checkpointed_tokens - seq.num_cached_tokens),
        prefill_seconds=max(0.0, prefill_end - seq.prefill_started) if seq.prefill_started else 0.0,
        decode_seconds=max(0.0, seq.finished_at - prefill_end) if seq.prefill_done_at else 0.0,
        draft_tokens_proposed=seq.draft_proposed,
        draft_tokens_accepted=seq.draft_accepted,
        prediction_tokens_proposed=seq.prediction_proposed,
        prediction_tokens_accepted=seq.prediction_accepted,
    )
