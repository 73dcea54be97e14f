"""Nemotron-H's multi-token-prediction head (`mtp.layers.*`, as NVIDIA's checkpoints and vLLM's
NemotronH-MTP read it).

One MTP step is a short stack of ordinary Nemotron-H blocks whose kinds come from
`mtp_hybrid_override_pattern` ("*E": attention, then MoE) or `mtp_layers_block_type`. Its first
block fuses the embedding of token t+1 with the target's final-normed hidden state at t:
`eh_proj(concat(enorm(embed), hnorm(hidden)))`; its last block ends in `final_layernorm`, and the
target's LM head reads the result. The engine drives it through the same interface as Qwen's head
(`mtp_forward`, `mtp_logits`, `make_mtp_cache`; speculative/mtp.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.models.base import require

_MTP_BLOCK_CHARS = {"attention": "*", "full_attention": "*", "moe": "E", "mlp": "-"}


def mtp_pattern(config: dict[str, Any]) -> str:
    """The block kinds of one MTP step; "" when the config names none (no head is built)."""
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None:
        blocks = config.get("mtp_layers_block_type") or ()
        require(all(b in _MTP_BLOCK_CHARS for b in blocks), f"unknown MTP block types in {list(blocks)!r}")
        pattern = "".join(_MTP_BLOCK_CHARS[b] for b in blocks)
    require(set(pattern) <= set("*E-"), f"bad mtp_hybrid_override_pattern {pattern!r}")
    return pattern


def pattern_from_weights(mtp: dict[str, mx.array]) -> str:
    """The MTP step's block kinds read from its tensors, for a config that names none (transformers
    then assumes attention, then MoE): attention has `q_proj`, MoE a router `gate`, a dense MLP a bare
    `up_proj`. "" when a layer is none of these (no head is built; the tensors stay aside)."""
    layers = sorted(
        {int(k.split(".")[2]) for k in mtp if k.startswith("mtp.layers.") and k.split(".")[2].isdigit()}
    )
    kinds = []
    for i in layers:
        mixer = f"mtp.layers.{i}.mixer."
        if f"{mixer}q_proj.weight" in mtp:
            kinds.append("*")
        elif f"{mixer}gate.weight" in mtp:
            kinds.append("E")
        elif f"{mixer}up_proj.weight" in mtp:
            kinds.append("-")
        else:
            return ""
    return "".join(kinds) if layers == list(range(len(layers))) else ""


class MTPBlock(nn.Module):
    """A Nemotron-H block, with the step's fusion in front (first block) or its norm behind (last)."""

    def __init__(self, block: nn.Module, hidden: int, eps: float, *, first: bool, last: bool) -> None:
        super().__init__()
        self.block = block
        if first:
            self.enorm = nn.RMSNorm(hidden, eps=eps)
            self.hnorm = nn.RMSNorm(hidden, eps=eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        if last:
            self.final_layernorm = nn.RMSNorm(hidden, eps=eps)


class NemotronMTPHead(nn.Module):
    def __init__(self, args, pattern: str, make_block) -> None:  # noqa: ANN001 - ModelArgs, Block factory
        super().__init__()
        last = len(pattern) - 1
        self.layers = [
            MTPBlock(make_block(ch), args.hidden_size, args.layer_norm_epsilon, first=i == 0, last=i == last)
            for i, ch in enumerate(pattern)
        ]

    def combine(self, embed: mx.array, hidden: mx.array) -> mx.array:
        first = self.layers[0]
        return first.eh_proj(mx.concatenate([first.enorm(embed), first.hnorm(hidden)], axis=-1))


def mtp_weight_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint names -> this head's: `mtp.layers.{i}.{norm,mixer}.*` live in the inner block."""
    out = {}
    for key, value in weights.items():
        parts = key.split(".")  # mtp, layers, i, rest...
        if len(parts) > 3 and parts[3] in ("norm", "mixer"):
            key = ".".join([*parts[:3], "block", *parts[3:]])
        out[key] = value
    return out
