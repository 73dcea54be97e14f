"""Engine counters, written by the engine thread and read as an `EngineStats` snapshot."""

from __future__ import annotations

from dataclasses import dataclass

# Throughput is an exponential moving average over steps, so it follows the current load.
_EMA = 0.2


@dataclass
class StatsCounter:
    prompt_cached: int = 0
    prompt_computed: int = 0
    generated: int = 0
    finished: int = 0
    failed: int = 0
    sent_back: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    tokens_per_step: float = 0.0
    last_batch_size: int = 0

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_computed += tokens
        if tokens and seconds > 0:
            self.prefill_tok_s = _ema(self.prefill_tok_s, tokens / seconds)

    def add_decode(self, tokens: int, seconds: float, batch_size: int) -> None:
        self.last_batch_size = batch_size
        if tokens and seconds > 0:
            self.decode_tok_s = _ema(self.decode_tok_s, tokens / seconds)
            self.tokens_per_step = _ema(self.tokens_per_step, tokens / max(batch_size, 1))


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EMA) * old + _EMA * new


def speculation_counts(strategy: object) -> dict[str, int]:
    """A speculating decoder's running counts as `EngineStats` fields (none for plain decoding)."""
    counts = getattr(strategy, "stats", None)
    if counts is None:
        return {}
    return {
        "speculative_verifies": int(getattr(counts, "steps", 0)),
        "draft_tokens_proposed": int(getattr(counts, "proposed", 0)),
        "draft_tokens_accepted": int(getattr(counts, "accepted", 0)),
        "speculative_pipeline_exits": int(getattr(counts, "pipeline_exits", 0)),
    }
