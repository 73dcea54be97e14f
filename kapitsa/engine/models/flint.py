"""Flint: a MoE transformer of full and sliding-window attention layers with learned attention sinks.

Every layer is attention (q/k RMS-normed per head, RoPE except on `no_rope_layer_indices`; a
`sliding_attention` layer sees the last `sliding_window` positions, itself included) with a
learned sink logit per head (`softmax_offset`: the softmax's denominator gets exp(sink), nothing
is added to the output), followed by a MoE block (sigmoid routing, `expert_bias` steering the
choice only, top-k weights renormalised; SwiGLU experts plus an ungated shared expert) or, on
`mlp_only_layers`, a dense SwiGLU MLP.

Checkpoint names and the math follow mlx-vlm 0.7.10's flint/ (language.py, config.py): parameters
live under `language_model.`, Hugging Face checkpoints may carry the prefix or not, per-expert
tensors are stacked into `switch_mlp`. Sliding layers keep a `RotatingKVCache` (cache/window.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.layers import KVCache, StepInfo
from kapitsa.engine.cache.quantized_kv import QuantizedKVCache
from kapitsa.engine.cache.window import RotatingKVCache, cacheless_window_mask
from kapitsa.engine.kernels.moe import routed_experts
from kapitsa.engine.kernels.router import plain_weight, route
from kapitsa.engine.loading.moe_fold import fold_shared_mlp, shared_slots
from kapitsa.engine.models.base import Attention, HybridLM, compiled_attention, fast_chain, fast_decode
from kapitsa.engine.models.flint_args import ModelArgs
from kapitsa.engine.models.sparse_moe import MLP, gate_and_up
from kapitsa.engine.ops.moe import SwitchGLU, topk_indices
from kapitsa.engine.ops.rope import Rope
from kapitsa.engine.options import KernelOptions

__all__ = ["Model", "ModelArgs"]

_EXPERT_PARTS = ("weight", "scales", "biases", "bias")


class SinkAttention(Attention):
    """Attention with a learned sink per head, over a `KVCache` or (sliding) a `RotatingKVCache`."""

    def __init__(self, a: ModelArgs, i: int):
        rope = Rope(a.head_dim, a.rope_theta, a.rope_scaling) if a.uses_rope(i) else None
        super().__init__(
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
            bias=a.attention_bias,
            qk_norm_eps=a.rms_norm_eps,
            rope=rope,
        )
        self.softmax_offset = mx.zeros((a.num_attention_heads,))
        self.window = a.window(i)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, info: StepInfo, cache) -> mx.array:
        if self.window is None:
            if cache is not None:
                k, v = cache.update(k, v, info)
            if isinstance(cache, QuantizedKVCache):  # its attention has no sink term: dequantized rows
                k, v = (
                    mx.dequantize(*a, group_size=cache.group_size, bits=cache.bits).astype(q.dtype)
                    for a in (k, v)
                )
            return self._sink_sdpa(q, k, v, info.attention_mask)
        if cache is None:
            return self._sink_sdpa(q, k, v, cacheless_window_mask(info, self.window))
        keys, values, mask = cache.update(k, v, info)
        return self._sink_sdpa(q, keys, values, mask)

    def attend_step(self, q, k, v, info: StepInfo, cache, gate):  # noqa: ANN001
        """The compiled step's attention: the decode kernel has no sink term, so always SDPA."""
        return self.attend(q, k, v, info, cache), ()

    def _sink_sdpa(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:  # noqa: ANN001
        B, _, T, _ = q.shape
        sinks = self.softmax_offset.astype(q.dtype)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=sinks)
        return out.transpose(0, 2, 1, 3).reshape(B, T, -1)


class FlintMoe(nn.Module):
    """Sigmoid-routed SwiGLU experts (top-k on score + expert_bias, weights the scores renormalised)
    plus an ungated shared expert."""

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.num_experts = a.num_experts_per_tok, a.num_experts
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.expert_bias = mx.zeros((a.num_experts,))
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)
        if a.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size)

    def fuse(self) -> bool:
        """For inference (fuse_model): the shared expert appended to the routed experts' stacks at
        score 1 (kapitsa.engine.loading.moe_fold), when the formats allow."""
        if not self.kernel_options.fold_shared_experts:
            return False
        if "shared_expert" not in self or "shared_fold" in self.__dict__:
            return False
        mlp = self.shared_expert
        halves = gate_and_up(mlp)
        folded = halves and fold_shared_mlp(
            self.switch_mlp, {"gate_proj": halves[0], "up_proj": halves[1]}, {"down_proj": mlp.down_proj}
        )
        if not folded:
            return False
        delattr(self, "shared_expert")
        object.__setattr__(self, "shared_fold", folded)  # (first expert, count): not a parameter
        return True

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert indices, float32 weights): the router kernel's sigmoid mode (kernels/router.py)
        where the router is a plain linear; a quantized router (MLX checkpoints store it at 8
        bits) projects through its own module, then the same selection."""
        weight = plain_weight(self.gate)
        if weight is not None:
            inds, weights, _ = route(
                x, weight, experts=self.num_experts, top_k=self.top_k, mode="sigmoid", bias=self.expert_bias
            )
            return inds, weights
        scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        inds = topk_indices(scores + self.expert_bias.astype(mx.float32), self.top_k)
        picked = mx.take_along_axis(scores, inds, axis=-1)
        return inds, picked / (picked.sum(axis=-1, keepdims=True) + 1e-20)

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.route(x)
        folded = self.__dict__.get("shared_fold")
        if folded is not None:  # the shared expert rides along as expert(s) at score 1
            inds, weights = shared_slots(inds, weights, *folded, 1.0)
        if kernels.enabled("moe", self.kernel_options):  # routed experts' weights read once per step
            out = routed_experts(self.switch_mlp, x, inds, weights, self.kernel_options.moe_pairs)
        else:
            out = (self.switch_mlp(x, inds) * weights[..., None]).sum(axis=-2).astype(x.dtype)
        if "shared_expert" in self:
            out = out + self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.self_attn = SinkAttention(a, i)
        self.mlp = FlintMoe(a) if a.is_moe_layer(i) else MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x: mx.array, info: StepInfo, cache) -> mx.array:  # noqa: ANN001
        options = self.kernel_options
        if cache is not None and (fast_decode(info, cache, options) or fast_chain(info, cache, options)):
            return compiled_attention(self, self.self_attn, x, info, cache, self._attn_pre, self._attn_post)
        h = x + self.self_attn(self.input_layernorm(x), info, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    # compiled decode and short-chain steps (see models/base.py)
    def _attn_pre(self, x: mx.array, offsets: mx.array):
        q, k, v, _ = self.self_attn.project_rotated(x, offsets, norm=self.input_layernorm)
        return q, k, v

    def _attn_post(self, x: mx.array, out: mx.array):
        h = self.self_attn.finish(out, None, residual=x)
        if isinstance(self.mlp, MLP):  # norm and add fused into its projections at decode
            return self.mlp.residual(h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [DecoderLayer(a, i) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.model = Backbone(a)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)


class Model(HybridLM):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args, self.model_type = args, args.model_type
        self.language_model = LanguageModel(args)

    def backbone_parts(self):
        m = self.language_model.model
        return m.embed_tokens, m.layers, m.norm

    def head(self):
        text = self.language_model
        return text.model.embed_tokens.as_linear if self.args.tie_word_embeddings else text.lm_head

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.language_model.model.layers

    def make_layer_cache(self, layer: DecoderLayer):
        a, window = self.args, layer.self_attn.window
        if window is not None:
            return RotatingKVCache(a.num_key_value_heads, a.head_dim, window)
        return KVCache(a.num_key_value_heads, a.head_dim)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`language_model.` prefix optional; per-expert tensors stacked into `switch_mlp`; the
        router bias under any of its names as `mlp.expert_bias` (zeros when the checkpoint has none)."""
        w = {k.removeprefix("language_model."): v for k, v in weights.items()}
        if self.args.tie_word_embeddings:
            w.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, FlintMoe):
                _sanitize_moe(w, f"model.layers.{i}.mlp.", self.args.num_experts)
        return {f"language_model.{k}": v for k, v in w.items()}

    def state_bytes(self, dtype: mx.Dtype = mx.bfloat16) -> tuple[int, int]:
        """(fixed bytes per sequence: the sliding windows, KV bytes per token: full attention)."""
        _, kv = super().state_bytes(dtype)
        windows = sum(
            c.state_nbytes(dtype) for c in self.make_cache(1).layers if isinstance(c, RotatingKVCache)
        )
        return windows, kv

    def quant_predicate(self, path: str, module: nn.Module) -> bool | dict:
        """The router stays in full precision (tiny; the router kernel reads it as it is)."""
        return not path.endswith("mlp.gate")

    def cast_predicate(self, path: str) -> bool:
        return not path.endswith("expert_bias")


def _sanitize_moe(w: dict[str, mx.array], prefix: str, num_experts: int) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        for part in _EXPERT_PARTS:
            first = f"{prefix}experts.0.{name}.{part}"
            if first in w:
                keys = [f"{prefix}experts.{e}.{name}.{part}" for e in range(num_experts)]
                w[f"{prefix}switch_mlp.{name}.{part}"] = mx.stack([w.pop(k) for k in keys])
    for alias in ("gate.e_score_correction_bias", "gate.expert_bias"):
        if f"{prefix}{alias}" in w:
            w[f"{prefix}expert_bias"] = w.pop(f"{prefix}{alias}")
    if f"{prefix}gate.weight" in w:
        w.setdefault(f"{prefix}expert_bias", mx.zeros((num_experts,)))
