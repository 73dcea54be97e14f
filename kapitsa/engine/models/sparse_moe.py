"""Qwen's feed-forward blocks: the SwiGLU MLP (dense layers and the shared expert) and the sparse
MoE block (softmax top-k routed SwiGLU experts plus a sigmoid-gated shared expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.kernels.moe import routed_experts
from kapitsa.engine.kernels.router import plain_weight, route
from kapitsa.engine.loading.fuse import fuse_into, normed_projections, projections
from kapitsa.engine.loading.moe_fold import fold_shared_mlp, shared_slots, split_rows
from kapitsa.engine.ops.linear import act_linear_plus, glu_linear, linear_plus, normed_linear
from kapitsa.engine.ops.moe import SwitchGLU, topk_indices
from kapitsa.engine.ops.norm import silu_mul
from kapitsa.engine.options import KernelOptions

if TYPE_CHECKING:
    from kapitsa.engine.models.qwen3_5_args import ModelArgs


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    PROJECTIONS = ("gate_proj", "up_proj")

    def fuse(self) -> bool:
        return fuse_into(self, self.PROJECTIONS, "gate_up_proj")

    def __call__(self, x: mx.array) -> mx.array:
        act = glu_linear(self.gate_up_proj, x) if "gate_up_proj" in self else None
        if act is None:
            act = silu_mul(*projections(self, x, self.PROJECTIONS, "gate_up_proj"))
        return self.down_proj(act)

    def residual(self, h: mx.array, norm: nn.Module) -> mx.array:
        """`h + self(norm(h))`, with the norm, the SwiGLU and the add inside the one-row mat-vecs
        at decode."""
        if "gate_up_proj" in self:  # [gate | up]: its own epilogue or down's prologue makes the SwiGLU
            act = glu_linear(self.gate_up_proj, h, norm)
            if act is not None:
                return linear_plus(self.down_proj, act, h)
            gate_up = normed_linear(norm, self.gate_up_proj, h)
            return act_linear_plus(self.down_proj, gate_up, h, "silu_glu", _swiglu)
        gate, up = normed_projections(self, norm, h, self.PROJECTIONS, "gate_up_proj")
        return linear_plus(self.down_proj, silu_mul(gate, up), h)


def _swiglu(gate_up: mx.array) -> mx.array:
    return silu_mul(*mx.split(gate_up, 2, axis=-1))


class SparseMoe(nn.Module):
    """Softmax top-k routed SwiGLU experts plus a shared expert scaled by sigmoid(shared_expert_gate)."""

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk_prob = a.num_experts_per_tok, a.norm_topk_prob
        self.num_experts = a.num_experts
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)
        self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    ROUTER = ("gate", "shared_expert_gate")

    def fuse(self) -> bool:
        """For inference (fuse_model): the router and the shared expert's gate as one mat-vec,
        and the shared expert appended to the routed experts' stacks (kapitsa.engine.loading.moe_fold)."""
        fused = fuse_into(self, self.ROUTER, "router_proj")
        return self._fold_shared_expert() or fused

    def _fold_shared_expert(self) -> bool:
        if not self.kernel_options.fold_shared_experts:
            return False
        if "shared_expert" not in self or "shared_fold" in self.__dict__:
            return False
        mlp = self.shared_expert
        gate_up = gate_and_up(mlp)
        folded = gate_up and fold_shared_mlp(
            self.switch_mlp, {"gate_proj": gate_up[0], "up_proj": gate_up[1]}, {"down_proj": mlp.down_proj}
        )
        if not folded:
            return False
        delattr(self, "shared_expert")
        object.__setattr__(self, "shared_fold", folded)  # (first expert, count): not a parameter
        return True

    def route(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(expert indices, their weights in x's dtype, the shared expert's gate logit): through
        the fused router kernel (kernels/router.py, family "route") where it applies. A folded
        shared expert rides along as expert(s) after the routed ones at its gate's score."""
        folded = self.__dict__.get("shared_fold")
        weight = plain_weight(self.router_proj) if "router_proj" in self else None
        if weight is not None and kernels.enabled("route", self.kernel_options):
            kw = dict(
                experts=self.num_experts, top_k=self.top_k, mode="softmax", normalize=self.norm_topk_prob
            )  # the weights in x's dtype from the kernel itself: no cast after it (a primitive a layer)
            return route(x, weight, **kw, weights_dtype=x.dtype, shared=folded, shared_gate=True)
        logits, shared_logit = projections(self, x, self.ROUTER, "router_proj")
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        inds = topk_indices(probs, self.top_k)
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        scores = scores.astype(x.dtype)
        if folded is not None:
            inds, scores = shared_slots(inds, scores, *folded, mx.sigmoid(shared_logit))
        return inds, scores, shared_logit

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores, shared_logit = self.route(x)
        folded = self.__dict__.get("shared_fold")
        if kernels.enabled(
            "moe", self.kernel_options
        ):  # routed experts' weights read once per step (kernels/moe.py)
            routed = routed_experts(self.switch_mlp, x, inds, scores, self.kernel_options.moe_pairs)
        else:
            routed = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        if folded is not None:
            return routed
        return routed + mx.sigmoid(shared_logit) * self.shared_expert(x)


def gate_and_up(mlp: MLP) -> tuple[nn.Module, nn.Module] | None:
    """The MLP's gate and up projections (views of the fused one's row halves); None if fused unquantized."""
    if "gate_up_proj" not in mlp:
        return mlp.gate_proj, mlp.up_proj
    halves = split_rows(mlp.gate_up_proj, 2) if isinstance(mlp.gate_up_proj, nn.QuantizedLinear) else None
    return None if halves is None else (halves[0], halves[1])
