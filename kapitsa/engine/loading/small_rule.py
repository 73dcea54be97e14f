"""The small-Mac recipe's widths (`MODEL:small`), as pure arithmetic: no MLX, so doctor uses it too.

The routed experts hold nearly all of a MoE model's parameters but each token reads only a few of
them, so they go to 2 bits (or stay at the 2 bits a checkpoint stores them in). Everything else
(embeddings, attention, shared experts, dense layers, the output head) is read by every token and
gets the most bits the memory budget allows:

    rest bits = the largest of 6, 5, 4, 3 such that
        experts at 2 bits + rest at those bits + what stays float  <=  budget - reserve,
    reserve = max(RESERVE_MIN_BYTES, budget * RESERVE_SHARE)   (KV cache, activations, the process)

and 3 bits when none fits (the model is then too big for the budget; doctor says so). Affine MLX
quantization stores a 16-bit scale and bias per group of 64 weights, +0.5 bit per weight.
"""

from __future__ import annotations

SMALL = "small"  # the `:small` tag
EXPERT_BITS = 2
REST_BITS = (6, 5, 4, 3)  # widest first
DEFAULT_REST_BITS = 4  # when the budget is unknown
RESERVE_SHARE = 0.2
RESERVE_MIN_BYTES = 2 << 30
GROUP_OVERHEAD_BITS = 0.5  # a bf16 scale and bias per 64 weights


def reserve_bytes(budget_bytes: int) -> int:
    """What the recipe leaves beside the weights: a fifth of the budget, at least 2 GiB."""
    return max(RESERVE_MIN_BYTES, int(budget_bytes * RESERVE_SHARE))


def small_weights_bytes(*, expert_params: float, rest_params: float, rest_bits: int) -> int:
    """Bytes of the weights under the recipe: experts at 2 bits, the rest at `rest_bits`."""
    experts = expert_params * (EXPERT_BITS + GROUP_OVERHEAD_BITS) / 8
    rest = rest_params * (rest_bits + GROUP_OVERHEAD_BITS) / 8
    return int(experts + rest)


def choose_rest_bits(
    budget_bytes: int | None, *, expert_params: float, rest_params: float, fixed_bytes: int = 0
) -> int:
    """The width of everything but the routed experts: the most bits (6..3) whose weights, beside
    `fixed_bytes` the recipe leaves as they are (routers, vision towers), leave the reserve free in
    `budget_bytes`; 3 when none does, DEFAULT_REST_BITS when the budget is unknown."""
    if budget_bytes is None or budget_bytes <= 0:
        return DEFAULT_REST_BITS
    room = budget_bytes - reserve_bytes(budget_bytes) - fixed_bytes
    for bits in REST_BITS:
        if small_weights_bytes(expert_params=expert_params, rest_params=rest_params, rest_bits=bits) <= room:
            return bits
    return REST_BITS[-1]
