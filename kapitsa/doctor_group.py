"""`kapitsa doctor --hostfile`: what fits on a group of machines, from every rank's memory budget.

Each rank measures its own budget (probe_hardware) and the ranks gather them; a model fits the
group when every rank's share fits that rank. Pipeline: a rank holds 1/n of the layers and rank 0
also the embedding and head; tensor: every rank 1/n of every layer and the embedding and head
whole. A rank's KV and recurrent state are those of its share of the layers (or heads).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kapitsa import memory_estimate
from kapitsa.catalog import Architecture, Catalog

GiB = 1 << 30
_ORDER = {"fits": 0, "tight": 1, "too_big": 2}


@dataclass(frozen=True, slots=True)
class GroupFit:
    ref: str
    weights_bytes: int
    rank_weights_bytes: tuple[int, ...]  # what each rank holds
    rank_verdicts: tuple[str, ...]
    verdict: str  # the worst rank's
    max_context: int | None  # the smallest over the ranks


def rank_shares(weights: int, embed: int, ranks: int, parallel: str) -> tuple[int, ...]:
    """The weight bytes each rank holds: the layers split, the embedding and head where they live."""
    layers = max(weights - embed, 0) / ranks
    if parallel == "tensor":
        return tuple(int(layers + embed) for _ in range(ranks))
    return tuple(int(layers + (embed if r == 0 else 0)) for r in range(ranks))


def _rank_arch(arch: Architecture, ranks: int) -> Architecture:
    """The cache a rank keeps: that of 1/n of the cached layers (pipeline), or of 1/n of their heads
    (tensor), the same bytes."""
    return dataclasses.replace(
        arch,
        attention_layers=math.ceil(arch.attention_layers / ranks),
        linear_layers=math.ceil(arch.linear_layers / ranks),
        mamba_layers=math.ceil(arch.mamba_layers / ranks),
    )


def group_fits(
    catalog: Catalog, usable: list[int], *, parallel: str, num_checkpoints: int = 4
) -> list[GroupFit]:
    fits = []
    for entry in catalog:
        if entry.arch is None or entry.package_path is not None:
            continue
        for quant in entry.quants:
            weights = memory_estimate.weights_bytes(entry.arch, quant.bits_per_weight)
            embed = int(2 * entry.arch.vocab_size * entry.arch.hidden_size * quant.bits_per_weight / 8)
            shares = rank_shares(weights, embed, len(usable), parallel)
            arch = _rank_arch(entry.arch, len(usable))
            estimates = [
                memory_estimate.estimate(
                    arch, usable_bytes=u, weight_bytes=s, num_checkpoints=num_checkpoints
                )
                for u, s in zip(usable, shares, strict=True)
            ]
            verdicts = tuple(e.verdict for e in estimates)
            worst = max(verdicts, key=lambda v: _ORDER.get(v, 3))
            contexts = [e.max_context for e in estimates]
            ref = entry.alias if quant.name == entry.default_quant else f"{entry.alias}:{quant.name}"
            context = None if worst == "too_big" or None in contexts else min(contexts)
            fits.append(GroupFit(ref, weights, shares, verdicts, worst, context))
    return fits


def render_group(usable: list[int], totals: list[int], fits: list[GroupFit], *, parallel: str) -> str:
    lines = [f"group: {len(usable)} ranks, --parallel {parallel}"]
    for rank, (u, t) in enumerate(zip(usable, totals, strict=True)):
        lines.append(f"  rank {rank}: {u / GiB:.1f} GiB usable of {t / GiB:.1f} GiB")
    lines.append(f"  summed: {sum(usable) / GiB:.1f} GiB usable")
    lines.append("")
    lines.append(f"{'model':<22} {'weights':>9}  {'per rank (GiB)':<28} {'context':>9}  verdict")
    for fit in fits:
        per_rank = " ".join(
            f"{b / GiB:.1f}{'' if v == 'fits' else '!'}"
            for b, v in zip(fit.rank_weights_bytes, fit.rank_verdicts, strict=True)
        )
        context = f"{fit.max_context:,}" if fit.max_context else "-"
        lines.append(
            f"{fit.ref:<22} {fit.weights_bytes / GiB:>7.1f}G  {per_rank:<28} {context:>9}  {fit.verdict}"
        )
    lines.append("")
    lines.append("'!' marks a rank its share does not fit comfortably; the context is the smallest rank's.")
    return "\n".join(lines)
