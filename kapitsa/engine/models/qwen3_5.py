"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers + gated attention.

Serves model_type qwen3_5, qwen3_5_moe (vision-language wrappers: the text model lives under
`language_model.`, the vision tower is dropped), qwen3_5_text, qwen3_5_moe_text and qwen3_next
(flat). Parameter paths match mlx-lm's, so MLX checkpoints load as published.

MTP: `mtp.*` tensors are kept. When a checkpoint ships them, `sanitize` attaches `self.mtp`
(an `MTPHead`) and returns its weights under `mtp.`; see `MTPHead` for how to run it.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, RecurrentCache, StepInfo, full_step
from kapitsa.engine.kernels.gdn import probe as probe_gdn_kernels
from kapitsa.engine.models.base import (
    Attention,
    HybridLM,
    compiled,
    compiled_attention,
    fast_chain,
    fast_decode,
)
from kapitsa.engine.models.gated_deltanet import GatedDeltaNet
from kapitsa.engine.models.qwen3_5_args import ModelArgs
from kapitsa.engine.models.qwen_weights import sanitize_qwen
from kapitsa.engine.models.sparse_moe import MLP, SparseMoe
from kapitsa.engine.ops.gated_delta import fast_kernel_works
from kapitsa.engine.ops.rope import MRope, Rope
from kapitsa.engine.options import KernelOptions


class DecoderLayer(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs, kind: str, moe: bool):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(a)
        else:
            dims = int(a.head_dim * a.partial_rotary_factor)
            rope = (
                Rope(dims, a.rope_theta, a.rope_scaling)
                if a.mrope_section is None
                else MRope(dims, a.rope_theta, a.rope_scaling, a.mrope_section)
            )
            self.self_attn = Attention(
                a.hidden_size,
                a.num_attention_heads,
                a.num_key_value_heads,
                a.head_dim,
                bias=a.attention_bias,
                gated=a.attn_output_gate,
                qk_norm_eps=a.rms_norm_eps,
                rope=rope,
            )
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.mlp = SparseMoe(a) if moe else MLP(a.hidden_size, a.intermediate_size)

    @property
    def is_linear(self) -> bool:
        return self.kind == "linear_attention"

    def __call__(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        if cache is not None and fast_decode(info, cache, self.kernel_options):
            return self._decode(x, info, cache)
        if cache is not None and fast_chain(info, cache, self.kernel_options):
            return self._chain(x, info, cache)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), info, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    # compiled decode step (see models/base.py)
    def _decode(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        if self.is_linear:
            fast_kernel_works()  # probe before tracing: it evaluates
            probe_gdn_kernels()
            out, cache.conv, cache.state = compiled(self, "linear", self._linear_step)(
                x, cache.conv, cache.state
            )
            return out
        return compiled_attention(self, self.self_attn, x, info, cache, self._attn_pre, self._attn_post)

    def _chain(self, x: mx.array, info: StepInfo, cache) -> mx.array:
        """A short chain (verification) through compiled functions, one trace per T; attention
        layers reuse their decode functions, which take any T."""
        if not self.is_linear:
            return self._decode(x, info, cache)
        s0 = cache.state
        out, conv_in, state, *extra = compiled(self, "linear_chain", self._linear_chain)(x, cache.conv, s0)
        cache.conv, cache.state = conv_in[:, info.T :], state
        if info.record:
            cache.record = self.linear_attn.chain_record(conv_in, s0, extra)
        return out

    def _linear_chain(self, x: mx.array, conv: mx.array, state: mx.array):
        # the decode step's calls (input norm and residual add in the projections), for T tokens
        h, conv_in, state, *extra = self.linear_attn.chain(
            x, conv, state, norm=self.input_layernorm, residual=x
        )
        return (self._mlp_residual(h), conv_in, state, *extra)

    def _linear_step(self, x: mx.array, conv: mx.array, state: mx.array):
        # the input norm and the residual add go into the projections (one kernel each at decode)
        h, conv, state = self.linear_attn.decode(x, conv, state, norm=self.input_layernorm, residual=x)
        return self._mlp_residual(h), conv, state

    def _attn_pre(self, x: mx.array, offsets: mx.array):
        q, k, v, gate = self.self_attn.project_rotated(x, offsets, norm=self.input_layernorm)
        return (q, k, v) if gate is None else (q, k, v, gate)

    def _attn_post(self, x: mx.array, out: mx.array, gate: mx.array | None = None):
        return self._mlp_residual(self.self_attn.finish(out, gate, residual=x))

    def _mlp_residual(self, h: mx.array) -> mx.array:
        if isinstance(self.mlp, MLP):  # norm and add fused into its projections at decode
            return self.mlp.residual(h, self.post_attention_layernorm)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [DecoderLayer(a, kind, a.is_moe_layer(i)) for i, kind in enumerate(a.layer_types)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.model = Backbone(a)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)


class MTPHead(nn.Module):
    """Qwen multi-token-prediction head (one full-attention layer).

    To predict token t+2 from position t: `h = model.mtp_forward(next_ids, hidden, cache)` with
    `next_ids[:, j]` = token t+1+j and `hidden[:, j]` = the target's hidden at t+j after the final
    norm (`model.final_norm(out.hidden)`); then `model.mtp_logits(h)`. Its cache is
    `model.make_mtp_cache(batch)` (attention only: rollback by `rollback(n)` needs no record).
    """

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.layers = [
            DecoderLayer(a, "full_attention", a.num_experts > 0) for _ in range(a.mtp_num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class Model(HybridLM):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args, self.model_type = args, args.model_type
        if args.wrapped:
            self.language_model = LanguageModel(args)
        else:
            self.model = Backbone(args)
            if not args.tie_word_embeddings:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = None

    @property
    def _text(self) -> nn.Module:
        return self.language_model if self.args.wrapped else self

    def backbone_parts(self):
        m = self._text.model
        return m.embed_tokens, m.layers, m.norm

    def head(self):
        text = self._text
        return text.model.embed_tokens.as_linear if self.args.tie_word_embeddings else text.lm_head

    @property
    def layers(self) -> list[DecoderLayer]:
        return self._text.model.layers

    def make_layer_cache(self, layer: DecoderLayer):
        a = self.args
        if layer.is_linear:
            gdn = layer.linear_attn
            return RecurrentCache((gdn.kernel - 1, gdn.conv_dim), (gdn.nv, gdn.dv, gdn.dk))
        return KVCache(a.num_key_value_heads, a.head_dim)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = sanitize_qwen(weights, self.args)
        if self.mtp is None and any(k.startswith("mtp.") for k in out):
            layers = {int(m.group(1)) for k in out if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
            self.args.mtp_num_hidden_layers = max(layers, default=-1) + 1
            self.mtp = MTPHead(self.args)
            if "mtp.embed_tokens.weight" in out:  # `mtp_use_dedicated_embeddings`
                self.mtp.embed_tokens = nn.Embedding(self.args.vocab_size, self.args.hidden_size)
        return out

    # -- MTP -------------------------------------------------------------------------------
    def make_mtp_cache(self, batch_size: int = 1) -> HybridCache:
        a = self.args
        return HybridCache([KVCache(a.num_key_value_heads, a.head_dim) for _ in self.mtp.layers], batch_size)

    def mtp_forward(
        self,
        next_ids: mx.array,
        hidden: mx.array,
        cache: HybridCache | None = None,
        *,
        lengths: list[int] | None = None,
    ) -> mx.array:
        if self.mtp is None:
            raise ValueError("this checkpoint ships no MTP weights")
        embed_tokens = self.mtp.get("embed_tokens") or self.backbone_parts()[0]
        embed = embed_tokens(next_ids)
        h = self.mtp.fc(
            mx.concatenate(
                [self.mtp.pre_fc_norm_embedding(embed), self.mtp.pre_fc_norm_hidden(hidden)], axis=-1
            )
        )
        B, T = next_ids.shape
        info = cache.begin(T, lengths) if cache is not None else full_step(B, T, lengths)
        for i, layer in enumerate(self.mtp.layers):
            h = layer(h, info, None if cache is None else cache[i])
        if cache is not None:
            cache.end(info)
        return h

    def mtp_logits(self, hidden: mx.array) -> mx.array:
        return self.head()(self.mtp.norm(hidden))

    # -- loader hooks ----------------------------------------------------------------------
    def quant_predicate(self, path: str, module: nn.Module) -> bool | dict:
        """Router and shared-expert gates stay in full precision (tiny, and routing is sensitive)."""
        return not (path.endswith("mlp.gate") or path.endswith("shared_expert_gate"))
