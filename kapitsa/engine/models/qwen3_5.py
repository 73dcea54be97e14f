"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers + gated attention.

Serves model_type qwen3_5, qwen3_5_moe (vision-language wrappers: the text model lives under
`language_model.`, the vision tower is dropped), qwen3_5_text, qwen3_5_moe_text and qwen3_next
(flat). Parameter paths match mlx-lm's, so MLX checkpoints load as published.

MTP: `mtp.*` tensors are kept. When a checkpoint ships them, `sanitize` attaches `self.mtp`
(an `MTPHead`) and returns its weights under `mtp.`; see `MTPHead` for how to run it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kapitsa.engine import kernels
from kapitsa.engine.cache.hybrid import HybridCache
from kapitsa.engine.cache.layers import KVCache, RecurrentCache, ReplayRecord, StepInfo, full_step
from kapitsa.engine.kernels.gdn import gdn_decode, gdn_step, gdn_step_reference, projection_views
from kapitsa.engine.kernels.gdn import probe as probe_gdn_kernels
from kapitsa.engine.kernels.gdn_prefill import gdn_chain
from kapitsa.engine.kernels.moe import routed_experts
from kapitsa.engine.kernels.router import plain_weight, route
from kapitsa.engine.loading.fuse import fuse_into, normed_projections, projections
from kapitsa.engine.loading.moe_fold import fold_shared_mlp, shared_slots, split_rows
from kapitsa.engine.models.base import (
    Attention,
    HybridLM,
    compiled,
    compiled_attention,
    fast_chain,
    fast_decode,
    known_fields,
    require,
)
from kapitsa.engine.models.qwen_weights import sanitize_qwen
from kapitsa.engine.ops.conv import causal_conv, conv_state_after
from kapitsa.engine.ops.gated_delta import fast_kernel_works, gated_delta, gdn_decay, l2norm_qk
from kapitsa.engine.ops.linear import act_linear_plus, glu_linear, linear_plus, normed_linear
from kapitsa.engine.ops.moe import SwitchGLU, topk_indices
from kapitsa.engine.ops.norm import GatedRMSNorm, silu_mul
from kapitsa.engine.ops.rope import Rope
from kapitsa.engine.ops.tree import gather_time, tree_conv, tree_recurrence
from kapitsa.engine.options import KernelOptions

WRAPPED_TYPES = ("qwen3_5", "qwen3_5_moe")  # published as vision-language checkpoints


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int = 0
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attn_output_gate: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        text = dict(config.get("text_config") or config)
        text["model_type"] = config.get("model_type", text.get("model_type", "qwen3_5"))
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        for key in ("mlp_only_layers",):
            text[key] = text.get(key) or []
        return cls(**known_fields(cls, text))

    def __post_init__(self) -> None:
        rope = self.rope_parameters or {}
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.partial_rotary_factor = float(rope.get("partial_rotary_factor", self.partial_rotary_factor))
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            self.rope_scaling = rope
        if self.layer_types is None:
            every = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        require(
            len(self.layer_types) == self.num_hidden_layers, "layer_types does not match num_hidden_layers"
        )
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        require(not unknown, f"unknown Qwen layer types {sorted(unknown)}")
        require(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            "linear_num_value_heads must be a multiple of linear_num_key_heads",
        )

    @property
    def wrapped(self) -> bool:
        return self.model_type in WRAPPED_TYPES

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )


class GatedDeltaNet(nn.Module):
    """Linear attention layer. Qwen3-Next packs the projections per key head (`in_proj_qkvz`,
    `in_proj_ba`); Qwen3.5 keeps them apart (`in_proj_qkv`, `_z`, `_b`, `_a`)."""

    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nk, self.nv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.kernel = a.linear_conv_kernel_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.packed = a.model_type == "qwen3_next"
        if self.packed:
            self.in_proj_qkvz = nn.Linear(a.hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(a.hidden_size, 2 * self.nv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(a.hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(a.hidden_size, value_dim, bias=False)
            self.in_proj_b = nn.Linear(a.hidden_size, self.nv, bias=False)
            self.in_proj_a = nn.Linear(a.hidden_size, self.nv, bias=False)
        self.dt_bias = mx.ones((self.nv,))
        self.A_log = mx.zeros((self.nv,))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, a.hidden_size, bias=False)

    @property
    def _in_projections(self) -> tuple[str, ...]:
        if self.packed:
            return ("in_proj_qkvz", "in_proj_ba")
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def fuse(self) -> bool:
        """One in-projection for the layer (see kapitsa.engine.loading.fuse)."""
        return fuse_into(self, self._in_projections, "in_proj")

    def _project(self, x: mx.array):
        B, T, _ = x.shape
        outputs = projections(self, x, self._in_projections, "in_proj")
        if not self.packed:
            qkv, z, b, a = outputs
            return qkv, z.reshape(B, T, self.nv, self.dv), b, a
        per = self.nv // self.nk
        qkvz, ba = outputs
        q, k, v, z = mx.split(
            qkvz.reshape(B, T, self.nk, -1), [self.dk, 2 * self.dk, 2 * self.dk + per * self.dv], axis=-1
        )
        b, a = mx.split(ba.reshape(B, T, self.nk, 2 * per), [per], axis=-1)
        qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        return qkv, z.reshape(B, T, self.nv, self.dv), b.reshape(B, T, self.nv), a.reshape(B, T, self.nv)

    def __call__(self, x: mx.array, info: StepInfo, cache: RecurrentCache | None) -> mx.array:
        B, T, _ = x.shape
        qkv, z, b, a = self._project(x)
        conv_state, s0 = (cache.conv, cache.state) if cache is not None else (None, None)
        if conv_state is None:
            conv_state, s0 = mx.zeros((B, self.kernel - 1, self.conv_dim), qkv.dtype), None
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        if info.parents is None and kernels.enabled("gdn", self.kernel_options):
            return self._chain_fused(conv_in, z, b, a, s0, info, cache)
        if info.parents is None:
            conv_out = causal_conv(conv_in, self.conv1d.weight)
        else:
            conv_out = tree_conv(conv_in, info.conv_windows(self.kernel), self.conv1d.weight)
        q, k, v = mx.split(nn.silu(conv_out), [self.nk * self.dk, 2 * self.nk * self.dk], axis=-1)
        q, k = l2norm_qk(q.reshape(B, T, self.nk, self.dk), k.reshape(B, T, self.nk, self.dk))
        v = v.reshape(B, T, self.nv, self.dv)
        g, beta = gdn_decay(self.A_log, a, self.dt_bias), mx.sigmoid(b)
        if s0 is None:
            s0 = mx.zeros((B, self.nv, self.dv, self.dk), mx.float32)
        inputs = (q, k, v, g, beta)
        if info.parents is None:
            y, state = gated_delta(*inputs, s0, info.recurrent_mask)
        else:  # each node steps from its parent's state; the cache keeps s0 until commit_path
            y = tree_recurrence(
                lambda t, st: gated_delta(*(x[:, t : t + 1] for x in inputs), st), s0, info.parents
            )
        if cache is not None:
            if info.parents is None:
                cache.conv, cache.state = conv_state_after(conv_in, info.kept, self.kernel), state
            if info.record:

                def replay(mask, order=None):
                    xs = inputs if order is None else tuple(gather_time(x, order) for x in inputs)
                    return gated_delta(*xs, s0, mask)[1]

                cache.record = ReplayRecord(conv_in, self.kernel, replay)
        return self.out_proj(self.norm(y, z).reshape(B, T, -1))

    def _chain_fused(self, conv_in, z, b, a, s0, info: StepInfo, cache: RecurrentCache | None) -> mx.array:
        """A chain of tokens (prefill chunk, verification) through the fused kernel, any length
        (kernels/gdn_prefill.py); the rollback replay runs it again from s0 under its mask."""
        B, T = a.shape[:2]

        def run(mask):
            return gdn_chain(
                conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
                **self._heads, norm_eps=self.norm.eps, mask=mask,
            )  # fmt: skip

        out, state = run(info.recurrent_mask)
        if cache is not None:
            cache.conv, cache.state = conv_state_after(conv_in, info.kept, self.kernel), state
            if info.record:

                def replay(mask, order=None):
                    assert order is None, "a chain's replay takes its tokens in order"
                    return run(mask)[1]

                cache.record = ReplayRecord(conv_in, self.kernel, replay)
        return self.out_proj(out)

    def decode(
        self,
        x: mx.array,
        conv_state: mx.array,
        s0: mx.array,
        *,
        norm: nn.Module | None = None,
        residual: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Plain decode step as a pure function: (x, conv rows, state) -> (out, conv rows, state);
        of norm(x) when `norm` is given, and residual + out when `residual` is.

        One fused kernel (conv, q/k norms, gated delta rule, gated output norm; kernels/gdn.py)
        where the backend has it, the same math in MLX ops elsewhere. With the fused
        in-projection, z/b/a are read in place from its output, and the input norm and the
        residual add can run inside the projections' one-row mat-vecs (qlinear.py)."""
        if "in_proj" in self and not self.packed:  # conv rows: the projection's first C columns
            rows = self.in_proj(x) if norm is None else normed_linear(norm, self.in_proj, x)
            z, b, a = projection_views(rows, packed=False, **self._heads)
        else:
            rows, z, b, a = self._project(x if norm is None else norm(x))
        out, conv_state, state = gdn_decode(
            conv_state, rows, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps, fused=kernels.enabled("gdn", self.kernel_options),
        )  # fmt: skip
        y = self.out_proj(out) if residual is None else linear_plus(self.out_proj, out, residual)
        return y, conv_state, state

    def _step(self):
        """The fused kernel where the `gdn` family is on (it falls back itself off-GPU), else the
        model's op-by-op math: one choice for decode, chains and their replays."""
        return gdn_step if kernels.enabled("gdn", self.kernel_options) else gdn_step_reference

    def chain(self, x: mx.array, conv_state: mx.array, s0: mx.array) -> tuple[mx.array, ...]:
        """T tokens of a chain (no padding) through the fused kernel, as a pure function:
        (out, conv_in, state, *replay inputs) — the fused projection, or z, b, a (`chain_record`)."""
        if "in_proj" in self and not self.packed:
            proj = self.in_proj(x)
            qkv, extra = proj[..., : self.conv_dim], (proj,)
            z, b, a = projection_views(proj, packed=False, **self._heads)
        else:
            qkv, z, b, a = self._project(x)
            extra = (z, b, a)
        conv_in = mx.concatenate([conv_state, qkv], axis=1)
        out, state = self._step()(
            conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps,
        )  # fmt: skip
        return (self.out_proj(out), conv_in, state, *extra)  # out: [B, T, Hv*Dv]

    def chain_record(self, conv_in: mx.array, s0: mx.array, extra: list[mx.array]) -> ReplayRecord:
        """The rollback record of a `chain` call: the kernel again from s0 under the kept mask."""
        args = (conv_in, s0, *extra)

        def replay(mask, order=None):
            assert order is None, "a chain's replay takes its tokens in order"
            return self.chain_replay(mask, *args)

        return ReplayRecord(conv_in, self.kernel, replay, fn=self.chain_replay, args=args)

    def chain_replay(self, mask: mx.array, conv_in: mx.array, s0: mx.array, *extra: mx.array) -> mx.array:
        """The state after the masked tokens of a `chain` call (its conv rows, s0 and projection)."""
        z, b, a = projection_views(extra[0], packed=False, **self._heads) if len(extra) == 1 else extra
        return self._step()(
            conv_in, self.conv1d.weight, a, b, self.A_log, self.dt_bias, z, self.norm.weight, s0,
            **self._heads, norm_eps=self.norm.eps, mask=mask,
        )[1]  # fmt: skip

    @property
    def _heads(self) -> dict[str, int]:
        return dict(num_k_heads=self.nk, num_v_heads=self.nv, head_k_dim=self.dk, head_v_dim=self.dv)


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
        gate_up = _gate_and_up(mlp)
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
        the fused router kernel (kernels/router.py, family "route") where it applies."""
        weight = plain_weight(self.router_proj) if "router_proj" in self else None
        if weight is not None and kernels.enabled("route", self.kernel_options):
            kw = dict(
                experts=self.num_experts, top_k=self.top_k, mode="softmax", normalize=self.norm_topk_prob
            )
            inds, scores, shared_logit = route(x, weight, **kw)
            return inds, scores.astype(x.dtype), shared_logit
        logits, shared_logit = projections(self, x, self.ROUTER, "router_proj")
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        inds = topk_indices(probs, self.top_k)
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores.astype(x.dtype), shared_logit

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores, shared_logit = self.route(x)
        folded = self.__dict__.get("shared_fold")
        if folded is not None:  # the shared expert rides along as expert(s) at its gate's score
            inds, scores = shared_slots(inds, scores, *folded, mx.sigmoid(shared_logit))
        if kernels.enabled(
            "moe", self.kernel_options
        ):  # routed experts' weights read once per step (kernels/moe.py)
            routed = routed_experts(self.switch_mlp, x, inds, scores)
        else:
            routed = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        if folded is not None:
            return routed
        return routed + mx.sigmoid(shared_logit) * self.shared_expert(x)


def _gate_and_up(mlp: MLP) -> tuple[nn.Module, nn.Module] | None:
    """The MLP's gate and up projections (views of the fused one's row halves); None if fused unquantized."""
    if "gate_up_proj" not in mlp:
        return mlp.gate_proj, mlp.up_proj
    halves = split_rows(mlp.gate_up_proj, 2) if isinstance(mlp.gate_up_proj, nn.QuantizedLinear) else None
    return None if halves is None else (halves[0], halves[1])


class DecoderLayer(nn.Module):
    kernel_options = KernelOptions()  # the engine's, given by use_kernel_options

    def __init__(self, a: ModelArgs, kind: str, moe: bool):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(a)
        else:
            rope = Rope(int(a.head_dim * a.partial_rotary_factor), a.rope_theta, a.rope_scaling)
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
        y, conv_in, state, *extra = self.linear_attn.chain(self.input_layernorm(x), conv, state)
        return (self._mlp_residual(x + y), conv_in, state, *extra)

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
