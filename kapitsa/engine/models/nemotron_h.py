"""Nemotron-H: Mamba-2 mixers, attention (no positions), relu^2 MLPs, routed MoE with shared
experts, and the latent MoE of the larger Nemotron-3 models (routed experts run in a smaller
`moe_latent_size` space between `fc1_latent_proj` and `fc2_latent_proj`; the shared expert and
the router see the full hidden state). Dory-class dense models are patterns without `E`.

The layer stack comes from `hybrid_override_pattern` (`M` Mamba-2, `*` attention, `-` MLP,
`E` MoE) or `layers_block_type` / `layer_types`. Parameter paths match mlx-lm's.

MTP: when the checkpoint ships `mtp.*` tensors, `sanitize` attaches `self.mtp` (nemotron_mtp.py),
its blocks as the config names them or as the tensors show (attention, MoE, MLP), and returns its
weights; tensors of blocks it cannot tell are kept aside in `model.mtp_weights` (a dict of arrays,
not parameters).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, RecurrentCache, StepInfo, full_step
from kapitsa.engine.kernels.mamba import probe as probe_mamba_kernels
from kapitsa.engine.kernels.moe import routed_experts
from kapitsa.engine.kernels.router import route
from kapitsa.engine.loading.moe_fold import fold_shared_mlp, shared_slots
from kapitsa.engine.models.base import (
    Attention,
    HybridLM,
    compiled,
    compiled_attention,
    fast_chain,
    fast_decode,
)
from kapitsa.engine.models.mamba2 import Mamba2Mixer
from kapitsa.engine.models.nemotron_h_args import ModelArgs
from kapitsa.engine.models.nemotron_mtp import NemotronMTPHead, mtp_weight_names, pattern_from_weights
from kapitsa.engine.models.nemotron_weights import sanitize_nemotron
from kapitsa.engine.ops.linear import act_linear_plus, normed_linear
from kapitsa.engine.ops.moe import SwitchReluSquared, topk_indices
from kapitsa.engine.ops.norm import relu_squared
from kapitsa.engine.options import KernelOptions


class ReluSquaredMLP(nn.Module):
    def __init__(self, dims: int, hidden: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(dims, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dims, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu_squared(self.up_proj(x)))

    def residual(self, h: mx.array, norm: nn.Module) -> mx.array:
        """`h + self(norm(h))`, with the norm and the add inside the one-row mat-vecs at decode."""
        up = normed_linear(norm, self.up_proj, h)
        return act_linear_plus(self.down_proj, up, h, "relu2", relu_squared)


class Router(nn.Module):
    """Sigmoid scores; experts chosen on score + e_score_correction_bias within the best
    `topk_group` of `n_group` groups; weights are the plain scores (normalised, scaled)."""

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        # random until a checkpoint fills it, like nn.Linear: a zero router ties every expert, and
        # a model built without a checkpoint (tests, benchmarks) would route every token alike
        scale = a.hidden_size**-0.5
        self.weight = mx.random.uniform(-scale, scale, (a.n_routed_experts, a.hidden_size))
        self.e_score_correction_bias = mx.zeros((a.n_routed_experts,))

    def __call__(self, x: mx.array, shared: tuple[int, int] | None = None) -> tuple[mx.array, mx.array]:
        """(indices, weights); `shared`: folded shared experts (first, count) appended to every row
        at weight 1."""
        a = self.a
        if (a.n_group <= 1 or a.topk_group >= a.n_group) and kernels.enabled("route", self.kernel_options):
            inds, weights, _ = route(
                x, self.weight, experts=a.n_routed_experts, top_k=a.num_experts_per_tok, mode="sigmoid",
                bias=self.e_score_correction_bias, normalize=a.norm_topk_prob, scale=a.routed_scaling_factor,
                shared=shared,
            )  # fmt: skip
            return inds, weights
        inds, weights = self._route_ops(x)
        return (inds, weights) if shared is None else shared_slots(inds, weights, *shared, 1.0)

    def _route_ops(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.a
        scores = mx.sigmoid(x.astype(mx.float32) @ self.weight.astype(mx.float32).T)
        choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if a.n_group > 1:
            grouped = mx.unflatten(choice, -1, (a.n_group, -1))
            group_score = mx.topk(grouped, 2, axis=-1).sum(axis=-1)  # [..., n_group]
            dropped = mx.argpartition(group_score, kth=a.n_group - a.topk_group - 1, axis=-1)
            dropped = dropped[..., : a.n_group - a.topk_group]
            grouped = mx.put_along_axis(grouped, dropped[..., None], mx.array(-mx.inf), axis=-2)
            choice = grouped.flatten(-2)
        # the choice carries no gradient (tools/train_mtp_head.py trains through this router)
        inds = mx.stop_gradient(topk_indices(choice, a.num_experts_per_tok))
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, weights * a.routed_scaling_factor


class MoE(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        expert_dims = a.moe_latent_size or a.hidden_size
        self.gate = Router(a)
        self.switch_mlp = SwitchReluSquared(
            expert_dims, a.moe_intermediate_size, a.n_routed_experts, a.mlp_bias
        )
        if a.n_shared_experts:
            self.shared_experts = ReluSquaredMLP(
                a.hidden_size, a.moe_shared_expert_intermediate_size, a.mlp_bias
            )
        if a.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(a.hidden_size, a.moe_latent_size, bias=a.mlp_bias)
            self.fc2_latent_proj = nn.Linear(a.moe_latent_size, a.hidden_size, bias=a.mlp_bias)

    def fuse(self) -> bool:
        """For inference (fuse_model): the shared experts appended to the routed experts' stacks
        at score 1 (kapitsa.engine.loading.moe_fold); not with a latent MoE, whose experts work in
        another width than the shared ones."""
        if not self.kernel_options.fold_shared_experts:
            return False
        if "shared_experts" not in self or "fc1_latent_proj" in self or "shared_fold" in self.__dict__:
            return False
        mlp = self.shared_experts
        folded = fold_shared_mlp(self.switch_mlp, {"fc1": mlp.up_proj}, {"fc2": mlp.down_proj})
        if folded is None:
            return False
        delattr(self, "shared_experts")
        object.__setattr__(self, "shared_fold", folded)  # (first expert, count): not a parameter
        return True

    def __call__(self, x: mx.array) -> mx.array:
        folded = self.__dict__.get("shared_fold")  # the shared experts ride along as experts at score 1
        inds, weights = self.gate(x, folded)
        routed_in = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        if kernels.enabled(
            "moe", self.kernel_options
        ):  # routed experts' weights read once per step (kernels/moe.py)
            y = routed_experts(self.switch_mlp, routed_in, inds, weights, self.kernel_options.moe_pairs)
        else:
            y = self.switch_mlp(routed_in, inds)
            y = (y * weights[..., None]).sum(axis=-2).astype(y.dtype)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class Block(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs, block_type: str):
        super().__init__()
        self.block_type = block_type
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.layer_norm_epsilon)
        if block_type == "M":
            self.mixer = Mamba2Mixer(a)
        elif block_type == "*":
            self.mixer = Attention(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, bias=a.attention_bias
            )
        elif block_type == "-":
            self.mixer = ReluSquaredMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)
        else:
            self.mixer = MoE(a)

    def __call__(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        if fast_decode(info, cache, self.kernel_options) and (cache is not None or self.block_type in "-E"):
            return self._decode(x, info, cache)
        if fast_chain(info, cache, self.kernel_options) and (cache is not None or self.block_type in "-E"):
            return self._chain(x, info, cache)
        h = self.norm(x)
        if self.block_type in "M*":
            return x + self.mixer(h, info, cache)
        return x + self.mixer(h)

    # compiled decode step (see models/base.py)
    def _decode(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        if self.block_type == "M":
            if kernels.enabled("mamba", self.kernel_options):
                probe_mamba_kernels()  # before tracing: it evaluates (once per process)
            out, cache.conv, cache.state = compiled(self, "mamba", self._mamba_step)(
                x, cache.conv, cache.state
            )
            return out
        if self.block_type == "*":
            return compiled_attention(self, self.mixer, x, info, cache, self._attn_pre, self._attn_post)
        return compiled(self, "ffn", self._ffn_step)(x)

    def _chain(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        """A short chain (verification) through compiled functions, one trace per T; attention and
        FFN blocks reuse their decode functions, which take any T."""
        if self.block_type != "M":
            return self._decode(x, info, cache)
        if kernels.enabled("mamba", self.kernel_options):
            probe_mamba_kernels()
        s0 = cache.state
        out, conv_in, state, dt = compiled(self, "mamba_chain", self._mamba_chain)(x, cache.conv, s0)
        cache.conv, cache.state = conv_in[:, info.T :], state
        if info.record:
            cache.record = self.mixer.chain_record(conv_in, s0, dt)
        return out

    # The block's norm and residual add go into the mixers' projections (one kernel each at decode).
    def _mamba_chain(self, x: mx.array, conv: mx.array, state: mx.array):
        return self.mixer.chain(x, conv, state, norm=self.norm, residual=x)

    def _mamba_step(self, x: mx.array, conv: mx.array, state: mx.array):
        return self.mixer.decode(x, conv, state, norm=self.norm, residual=x)

    def _attn_pre(self, x: mx.array, offsets: mx.array):
        # no rope: offsets are unused; project_rotated lays q, k, v out in one kernel on CUDA
        q, k, v, _ = self.mixer.project_rotated(x, offsets, norm=self.norm)
        return q, k, v

    def _attn_post(self, x: mx.array, out: mx.array):
        return self.mixer.finish(out, None, residual=x)

    def _ffn_step(self, x: mx.array) -> mx.array:
        if isinstance(self.mixer, ReluSquaredMLP):
            return self.mixer.residual(x, self.norm)
        return x + self.mixer(self.norm(x))


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [Block(a, ch) for ch in a.pattern]
        self.norm_f = nn.RMSNorm(a.hidden_size, eps=a.layer_norm_epsilon)


class Model(HybridLM):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args, self.model_type = args, args.model_type
        self.backbone = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        object.__setattr__(self, "_mtp_weights", {})  # a plain attribute, not module parameters
        self.mtp = None

    @property
    def mtp_weights(self) -> dict[str, mx.array]:
        """`mtp.*` tensors of the checkpoint (after `sanitize`), kept for a Nemotron MTP drafter."""
        return self._mtp_weights

    def backbone_parts(self):
        return self.backbone.embeddings, self.backbone.layers, self.backbone.norm_f

    def head(self):
        return self.backbone.embeddings.as_linear if self.args.tie_word_embeddings else self.lm_head

    @property
    def layers(self) -> list[Block]:
        return self.backbone.layers

    def make_layer_cache(self, layer: Block):
        if layer.block_type == "M":
            m = layer.mixer
            return RecurrentCache((m.kernel - 1, m.conv_dim), (m.heads, m.head_dim, m.state_size))
        if layer.block_type == "*":
            return KVCache(self.args.num_key_value_heads, self.args.head_dim)
        return None

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        main, mtp = sanitize_nemotron(weights, self.args)
        pattern = self.args.mtp_pattern or pattern_from_weights(mtp)
        if mtp and pattern and "mtp.layers.0.eh_proj.weight" in mtp:
            self.mtp = NemotronMTPHead(self.args, pattern, lambda ch: Block(self.args, ch))
            return main | mtp_weight_names(mtp)
        if mtp:
            object.__setattr__(self, "_mtp_weights", mtp)  # not a parameter: kept beside the model
        return main

    # -- MTP -------------------------------------------------------------------------------
    def make_mtp_cache(self, batch_size: int = 1) -> HybridCache:
        caches = [self.make_layer_cache(layer.block) for layer in self.mtp.layers]
        return HybridCache(caches, batch_size)

    def mtp_forward(
        self, next_ids: mx.array, hidden: mx.array, cache: HybridCache | None = None, *, lengths=None
    ) -> mx.array:
        """Token t+2's hidden state from token t+1's ids and the target's final-normed hidden at t
        (both [B, T]); already through the step's `final_layernorm`."""
        if self.mtp is None:
            raise ValueError("this checkpoint ships no MTP weights")
        h = self.mtp.combine(self.backbone.embeddings(next_ids), hidden)
        B, T = next_ids.shape
        info = cache.begin(T, lengths) if cache is not None else full_step(B, T, lengths)
        for i, layer in enumerate(self.mtp.layers):
            h = layer.block(h, info, None if cache is None else cache[i])
        if cache is not None:
            cache.end(info)
        return self.mtp.layers[-1].final_layernorm(h)

    def mtp_logits(self, hidden: mx.array) -> mx.array:
        return self.head()(hidden)

    def quant_predicate(self, path: str, module: nn.Module) -> bool | dict:
        """The router (`mixer.gate`) is not an nn.Linear and stays float; everything else may quantize."""
        return not path.endswith("mixer.gate")

    def cast_predicate(self, path: str) -> bool:
        return not (
            path.endswith("mixer.gate.weight") or "A_log" in path or "e_score_correction_bias" in path
        )
