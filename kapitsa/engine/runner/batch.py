"""The decode batch: one `HybridCache` with a row per decoding sequence, and the tokens in flight.

Pipelined decoding (as mlx-lm's generate loop does): step n+1 is queued on the device with the
sampled tokens of step n still lazy, and only then are step n's tokens read back and streamed, so
the host's work (detokenizing, stop strings, events) overlaps the device's. That needs sampling that
the host need not read back first (`SequenceSampler.is_stateless`: no logprobs, no grammar;
penalties and the EOS decay count queued picks on the device); a batch with any other sequence
runs synchronously (`flush`, then the `DecodeStrategy`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.sampler import SampledToken, SequenceSampler


class DecodeBatch:
    def __init__(self) -> None:
        self.cache: HybridCache | None = None
        self._inflight: mx.array | None = None  # [B] sampled, not yet fed nor read back
        self._streamed: list[bool] = []  # per row: its in-flight token was already streamed

    @property
    def size(self) -> int:
        return 0 if self.cache is None else self.cache.batch_size

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def join(self, cache: HybridCache, last_token: int) -> None:
        """Add a prefilled sequence whose `last_token` was sampled (and streamed) but not fed."""
        self.cache = cache if self.cache is None else HybridCache.merge([self.cache, cache])
        if self._inflight is not None:
            token = mx.array([last_token], dtype=self._inflight.dtype)
            self._inflight = mx.concatenate([self._inflight, token])
            self._streamed.append(True)
        mx.eval(*self.cache.state_arrays())

    def leave(self, rows: Seq[int]) -> None:
        """Drop rows (finished or aborted sequences); the others keep their order."""
        gone = set(rows)
        keep = [i for i in range(self.size) if i not in gone]
        if not keep:
            if self._inflight is not None:
                mx.eval(self._inflight)  # let the last queued step finish: nothing may run unowned
            self.cache, self._inflight, self._streamed = None, None, []
            mx.clear_cache()  # idle: hand freed buffers back rather than keep them cached
            return
        assert self.cache is not None
        self.cache.filter(keep)
        if self._inflight is not None:
            self._inflight = self._inflight[mx.array(keep, dtype=mx.int32)]
            self._streamed = [self._streamed[i] for i in keep]
        mx.eval(*self.cache.state_arrays())

    def extract(self, row: int) -> HybridCache:
        assert self.cache is not None
        return self.cache.extract(row)

    def pipelined_step(
        self, runner: ModelRunner, samplers: Seq[SequenceSampler], last_tokens: Seq[int]
    ) -> list[SampledToken | None]:
        """Queue the next step; return the previous step's tokens (None: nothing new for that row)."""
        assert self.cache is not None
        inputs = self._inflight if self._inflight is not None else mx.array(list(last_tokens), dtype=mx.int32)
        logits = runner.decode_lazy(self.cache, inputs)
        sampled = _sample_lazy(samplers, logits)
        mx.async_eval(sampled)
        ready = self._read_back(samplers)
        self._inflight, self._streamed = sampled, [False] * len(samplers)
        return ready

    def flush(self, samplers: Seq[SequenceSampler]) -> list[SampledToken | None]:
        """Read back the tokens in flight without queueing another step."""
        ready = self._read_back(samplers)
        self._inflight, self._streamed = None, []
        return ready

    def _read_back(self, samplers: Seq[SequenceSampler]) -> list[SampledToken | None]:
        if self._inflight is None:
            return [None] * len(samplers)
        out: list[SampledToken | None] = []
        for sampler, token_id, streamed in zip(
            samplers, self._inflight.tolist(), self._streamed, strict=True
        ):
            if streamed:
                out.append(None)
                continue
            sampler.observe(token_id)
            out.append(SampledToken(token_id, 0.0))
        return out


def can_pipeline(samplers: Seq[SequenceSampler | None]) -> bool:
    return all(s is not None and s.is_stateless for s in samplers)


def _sample_lazy(samplers: Seq[SequenceSampler], logits: mx.array) -> mx.array:
    """[B] token ids, still lazy: plain greedy rows share one argmax, others sample per row."""
    if all(s.is_greedy_plain for s in samplers):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    rows = [s.lazy_pick(logits[i].astype(mx.float32)) for i, s in enumerate(samplers)]
    return mx.stack(rows).astype(mx.int32)
