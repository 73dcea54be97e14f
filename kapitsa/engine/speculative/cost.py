"""The verify cost curve c(T) measured on the served model, for backends where no measured curve
is built in (the CPU).

On a GPU a verify forward of up to 16 tokens reads the weights once and costs about two pipelined
decode steps whatever T is (controller.gpu_cost_curve, measured on the H200). On the CPU a small
model is compute-bound: a verify of T tokens costs about 0.75 T decode steps on the demo (its
[T] forward against a one-token step), so drafts pay only when short and nearly always accepted.
That depends on the model's size and the machine, so the opener times it once per engine.
"""

from __future__ import annotations

import time

import mlx.core as mx

CONTEXT_TOKENS = 32  # a short context, so the timing reads the forward and not the attention
REPEATS = 5


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
