"""How one decode step turns the batch's last tokens into new tokens.

`PlainDecode` feeds one token per sequence and samples one. A speculative decoder implements the
same `DecodeStrategy.step` (propose, verify with `cache.begin(..., record=True)`, roll back the
rejected tokens with `cache.rollback`) and may return several accepted tokens per sequence; the
engine streams them in order and stops a sequence at its first stop condition. A strategy
with `pipelined = True` lets the engine run plain steps pipelined instead of calling `step`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import mlx.core as mx

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.runner.model_runner import ModelRunner
from kapitsa.engine.runner.sampler import SampledToken, sample_batch
from kapitsa.engine.runner.sequence import Sequence


class DecodeStrategy(Protocol):
    def step(
        self, runner: ModelRunner, cache: HybridCache, sequences: Seq[Sequence]
    ) -> list[list[SampledToken]]:
        """Advance every sequence of the batch.

        Args:
            runner: the model runner.
            cache: the decode batch; row b is `sequences[b]`; each cache holds every token of its
                sequence except the last sampled one (`sequences[b].output_ids[-1]`).
            sequences: the batch, in row order (read-only: samplers, ids, params).
        Returns:
            Per sequence, the new tokens (at least one), sampled with that sequence's sampler. The cache
            must afterwards hold every returned token except the last.
        """
        ...


class PlainDecode:
    name = "none"
    # The engine may run this strategy's steps itself, pipelined (batch.py), when sampling allows.
    pipelined = True

    def step(
        self, runner: ModelRunner, cache: HybridCache, sequences: Seq[Sequence]
    ) -> list[list[SampledToken]]:
        logits = runner.decode_lazy(
            cache, mx.array([seq.output_ids[-1] for seq in sequences], dtype=mx.int32)
        )
        mx.async_eval(logits)
        samplers = [seq.sampler for seq in sequences]
        for sampler in samplers:
            sampler.prepare()  # grammar masks on the host while the device runs the forward
        return [[pick] for pick in sample_batch(samplers, logits)]
