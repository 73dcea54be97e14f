"""Whether a batch's drafts pay for verifying the whole batch.

A verify runs every row of the batch at the verify's width, drafting or not (a row without a draft
is padded), so one row's draft makes all B rows pay for a verify. Each row's controller prices its
draft as if the row decoded alone; for a batch, the rows' expected tokens together must beat the
width's price for all of them: the mean expected tokens per row (1 for a row without a draft)
above c(W) plus the cost of leaving pipelined steps, by the controller's margin. At batch 1 this is
the controller's own rule.

The price of width W at batch 1 stands for its price at batch B, relative to a plain step of the
same rows: where the forward is compute-bound (the CPU) B x W tokens cost about W times B tokens,
as W tokens cost against one; where it is bound by reading the weights (a dense model on a GPU) both
read them once. A MoE batch's rows share some experts, so its verify costs less than W times its
plain step's expert reads, and the batch-1 price errs towards plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class RowPlan:
    """A row's verify as the decoder prices it before leaving pipelined steps."""

    length: int  # draft tokens
    expected: float  # tokens the verify is expected to give (the target's own included)
    probe: bool = False  # a resting device drafter's periodic probe
    draft: tuple[int, ...] = ()  # a host drafter's draft


def batch_verify_pays(
    expected: Sequence[float],
    cost: Sequence[float],
    width: int,
    *,
    extra_cost: float = 0.0,
    margin: float = 0.05,
) -> bool:
    """Whether a verify of `width` tokens a row beats a plain step for the batch.

    Args:
        expected: each row's expected tokens from the verify (its accepted draft plus the target's
            own token; 1.0 for a row without a draft).
        cost: the controller's c(T) for T = 1.., relative to a plain step (c(1) = 1); a width past
            its end is priced at its last entry.
        width: the verify's tokens a row, padding included.
        extra_cost: plain steps a verify costs beyond c(W) (leaving pipelined decoding).
        margin: how much better than plain decoding a verify must be.
    """
    if not expected or width <= 1:
        return False
    price = cost[min(width, len(cost)) - 1] + extra_cost
    return sum(expected) / len(expected) > price * (1 + margin)
