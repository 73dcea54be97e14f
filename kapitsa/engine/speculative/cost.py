"""The verify cost curve c(T) measured on the served model, once per engine.

On a GPU a dense model's verify forward of up to 16 tokens reads the weights once and costs about
two pipelined decode steps whatever T is (controller.gpu_cost_curve, measured on the H200). A MoE
model's does not: each of the T tokens routes to its own experts, so a verify of 8 tokens on
Nemotron-30B-A3B reads up to 8x the expert weights and cost 4.5x a one-token forward there
(docs/results.md); priced as a dense verify, drafts that are half accepted would run at a third of
plain speed. So a GPU's curve is the built-in one raised by the verify widths' measured cost
relative to one token (`gpu_width_timings`, `gpu_cost_curve_from_timings`). On the CPU a small model is compute-bound: a
verify of T tokens costs about 0.75 T decode steps on the demo (its [T] forward against a
one-token step), so drafts pay only when short and nearly always accepted (`measured_cost_curve`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from kapitsa.engine.kernels import cuda_disk_cache
from kapitsa.engine.speculative.controller import DEFAULT_MAX_DRAFT, gpu_cost_curve

CONTEXT_TOKENS = 32  # a short context, so the timing reads the forward and not the attention
REPEATS = 5
# On a GPU with no --draft-tokens, drafts may reach LONG_DRAFT tokens when the model's measured
# verify of LONG_DRAFT + 1 tokens costs at most LONG_DRAFT_COST_RATIO times an 8-token one (the
# H200's 27B: 25.2 against 20.7 ms, 1.22); the controller still picks each draft's length.
LONG_DRAFT = 15
LONG_DRAFT_COST_RATIO = 1.3


def _median_forward_s(model, cache, width: int) -> float:  # noqa: ANN001 - a kapitsa HybridLM
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = model.forward(mx.array([[1] * width], dtype=mx.int32), cache, lengths=[width], record=True)
        mx.eval(model.logits(out.hidden))
        cache.rollback([width])
        mx.eval(*cache.state_arrays())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measured_cost_curve(model, max_draft: int) -> list[float]:  # noqa: ANN001 - a kapitsa HybridLM
    """c(T) for T = 1..max_draft+1 relative to a one-token forward: the ends timed (each forward with
    its replay record and rollback, as a verify runs), the rest interpolated linearly."""
    cache = model.make_cache(1)
    mx.eval(model(mx.array([[1] * CONTEXT_TOKENS], dtype=mx.int32), cache))
    _median_forward_s(model, cache, 1)  # warm-up: the first calls build and compile
    one = _median_forward_s(model, cache, 1)
    top = _median_forward_s(model, cache, max_draft + 1)
    ratio = max(top / max(one, 1e-9), 1.0)
    return [1.0 + (ratio - 1.0) * t / max_draft for t in range(max_draft + 1)]


def gpu_cost_curve_from_timings(
    forward_s: Callable[[int], float], max_draft: int, widths: Sequence[int]
) -> list[float]:
    """c(T) on a GPU: `gpu_cost_curve`, each verify raised to the built-in verify price times its
    padded width's measured cost relative to one token (`forward_s(width)`: seconds of a forward
    of that width), never below the built-in curve. A dense model's widths cost about what one
    token does, so its curve stays the built-in one; a MoE model's rise with the experts they read."""
    built_in = gpu_cost_curve(max_draft)
    verify_price = built_in[1]  # the narrowest verify: the host round trip a dense verify costs
    one = max(forward_s(1), 1e-9)
    measured = sorted({w for w in widths if w > 1})
    ratio_at = {w: forward_s(w) / one for w in measured}
    curve = [built_in[0]]
    for T in range(2, max_draft + 2):
        width = next((w for w in measured if w >= T), measured[-1] if measured else None)
        ratio = ratio_at.get(width, 1.0)
        curve.append(max(built_in[T - 1], verify_price * ratio))
    return curve


def gpu_width_timings(model, widths: Sequence[int]) -> dict[int, float]:  # noqa: ANN001
    """Seconds of the model's forward (with its replay record and rollback, as a verify runs) at 1
    and each of `widths`, after one warm-up forward per width (the first call compiles)."""
    sizes = sorted({1, *(w for w in widths if w > 1)})
    for width in sizes:
        _build_forward(model, width)
    cuda_disk_cache.drain(
        cuda_disk_cache.WAIT_LIMIT_S
    )  # every width's kernels on disk before the first runs (none on a CPU)
    cache = model.make_cache(1)
    mx.eval(model(mx.array([[1] * CONTEXT_TOKENS], dtype=mx.int32), cache))
    for width in sizes:
        _median_forward_s(model, cache, width)
    return {width: _median_forward_s(model, cache, width) for width in sizes}


def _build_forward(model, width: int) -> None:  # noqa: ANN001 - a kapitsa HybridLM
    """A timed forward of `width` tokens and its rollback, built on a throwaway cache and never run:
    building them hands each custom kernel they launch to the compile workers
    (kernels/cuda_disk_cache.py), so every width's kernels (the rollback's masked replay is a
    recurrent kernel of its own) compile side by side, and are on disk, before the timings run them."""
    cache = model.make_cache(1)
    model(mx.array([[1] * CONTEXT_TOKENS], dtype=mx.int32), cache)
    out = model.forward(mx.array([[1] * width], dtype=mx.int32), cache, lengths=[width], record=True)
    model.logits(out.hidden)
    cache.rollback([width])


def takes_long_drafts(timed: dict[int, float]) -> bool:
    """Whether a GPU's longest verify (LONG_DRAFT + 1 tokens) costs little more than an 8-token
    one on this model (`timed`: seconds per width): a dense model's 16 rows share one read of the
    weights when the 9-16-row mat-vec kernel took them, so a copy that holds gains twice the
    tokens for ~20% more time; where that kernel is missing or the rows route to more experts
    (MoE), the 16-token verify costs far more and drafts stay at most DEFAULT_MAX_DRAFT long."""
    wide, narrow = timed.get(LONG_DRAFT + 1), timed.get(DEFAULT_MAX_DRAFT + 1)
    return wide is not None and narrow is not None and wide <= LONG_DRAFT_COST_RATIO * narrow
