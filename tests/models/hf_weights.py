"""Tiny configs and random weights under the tensor names Hugging Face checkpoints use.

Written out by hand from the published checkpoints' layouts (not derived from our sanitize), so
the parity tests exercise each implementation's own renaming.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

VOCAB = 256


def qwen_config(kind: str) -> dict:
    """kind: dense (qwen3_5 VL wrapper), moe (qwen3_5_moe), next (qwen3_next, flat)."""
    text = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
    }
    if kind in ("moe", "next"):
        text.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    if kind == "next":
        text.update(
            model_type="qwen3_next",
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            mlp_only_layers=[],
            full_attention_interval=2,
        )
        text.pop("rope_parameters")
        text["layer_types"] = ["linear_attention", "full_attention"] * 2
        return text
    model_type = "qwen3_5_moe" if kind == "moe" else "qwen3_5"
    text["model_type"] = model_type + "_text"
    text["layer_types"] = ["linear_attention", "full_attention"] * 2
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
        "unknown_key": 1,
    }


class _Rand:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, out_dim: int, in_dim: int) -> mx.array:
        return mx.array(self.rng.normal(0, 1 / math.sqrt(in_dim), (out_dim, in_dim)).astype(np.float32))

    def normal(self, shape, scale=1.0) -> mx.array:
        return mx.array(self.rng.normal(0, scale, shape).astype(np.float32))

    def uniform(self, shape, lo, hi) -> mx.array:
        return mx.array(self.rng.uniform(lo, hi, shape).astype(np.float32))


def qwen_weights(config: dict, seed: int = 0, mtp: bool = False, fused_experts: bool = True) -> dict:
    t = config.get("text_config", config)
    wrapped = "text_config" in config
    r = _Rand(seed)
    H, V = t["hidden_size"], t["vocab_size"]
    pre = "model.language_model." if wrapped else "model."
    w = {
        f"{pre}embed_tokens.weight": r.normal((V, H)),
        f"{pre}norm.weight": r.normal((H,), 0.1),
        "lm_head.weight": r.linear(V, H),
    }
    if wrapped:
        w["model.visual.patch_embed.proj.weight"] = r.normal((8, 3))  # must be dropped
    for i, kind in enumerate(t["layer_types"]):
        packed = t.get("model_type") == "qwen3_next"
        _qwen_layer(w, r, t, f"{pre}layers.{i}.", kind, packed=packed, fused_experts=fused_experts)
    if mtp:
        w["mtp.fc.weight"] = r.linear(H, 2 * H)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = r.normal((H,), 0.1)
        _qwen_layer(w, r, t, "mtp.layers.0.", "full_attention", packed=False, fused_experts=fused_experts)
    return w


def _qwen_layer(w, r, t, p, kind, packed, fused_experts):
    H = t["hidden_size"]
    w[p + "input_layernorm.weight"] = r.normal((H,), 0.1)
    w[p + "post_attention_layernorm.weight"] = r.normal((H,), 0.1)
    if kind == "linear_attention":
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv, K = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
        conv = 2 * nk * dk + nv * dv
        a = p + "linear_attn."
        if packed:
            w[a + "in_proj_qkvz.weight"] = r.linear(2 * nk * dk + 2 * nv * dv, H)
            w[a + "in_proj_ba.weight"] = r.linear(2 * nv, H)
        else:
            w[a + "in_proj_qkv.weight"] = r.linear(conv, H)
            w[a + "in_proj_z.weight"] = r.linear(nv * dv, H)
            w[a + "in_proj_b.weight"] = r.linear(nv, H)
            w[a + "in_proj_a.weight"] = r.linear(nv, H)
        w[a + "conv1d.weight"] = r.normal((conv, 1, K), 0.5)
        w[a + "dt_bias"] = r.uniform((nv,), 0.0, 1.0)
        w[a + "A_log"] = mx.log(r.uniform((nv,), 1.0, 16.0))
        w[a + "norm.weight"] = 1.0 + r.normal((dv,), 0.1)
        w[a + "out_proj.weight"] = r.linear(H, nv * dv)
    else:
        nh, nkv, D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        a = p + "self_attn."
        w[a + "q_proj.weight"] = r.linear(2 * nh * D, H)
        w[a + "k_proj.weight"] = r.linear(nkv * D, H)
        w[a + "v_proj.weight"] = r.linear(nkv * D, H)
        w[a + "o_proj.weight"] = r.linear(H, nh * D)
        w[a + "q_norm.weight"] = r.normal((D,), 0.1)
        w[a + "k_norm.weight"] = r.normal((D,), 0.1)
    m = p + "mlp."
    if t.get("num_experts", 0) > 0:
        E, inner, S = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
        w[m + "gate.weight"] = r.linear(E, H)
        if fused_experts:
            w[m + "experts.gate_up_proj"] = mx.stack(
                [mx.concatenate([r.linear(inner, H), r.linear(inner, H)]) for _ in range(E)]
            )
            w[m + "experts.down_proj"] = mx.stack([r.linear(H, inner) for _ in range(E)])
        else:
            for e in range(E):
                for n, shape in (
                    ("gate_proj", (inner, H)),
                    ("up_proj", (inner, H)),
                    ("down_proj", (H, inner)),
                ):
                    w[f"{m}experts.{e}.{n}.weight"] = r.linear(*shape)
        for n, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            w[f"{m}shared_expert.{n}.weight"] = r.linear(*shape)
        w[m + "shared_expert_gate.weight"] = r.linear(1, H)
    else:
        inner = t["intermediate_size"]
        for n, shape in (("gate_proj", (inner, H)), ("up_proj", (inner, H)), ("down_proj", (H, inner))):
            w[f"{m}{n}.weight"] = r.linear(*shape)


def nemotron_config(kind: str) -> dict:
    """kind: moe (Nemotron-3 Nano class), latent (latent MoE, larger Nemotron-3), dense (Dory class)."""
    c = {
        "model_type": "nemotron_h",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "use_bias": False,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "time_step_limit": [0.0, float("inf")],
        "time_step_min": 0.001,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }
    if kind == "dense":
        c["hybrid_override_pattern"] = "M-M*-M"
        return c
    c.update(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    c["layers_block_type"] = ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"]
    if kind == "latent":
        c["moe_latent_size"] = 32
    return c


def nemotron_weights(config: dict, seed: int = 0, mtp: bool = False) -> dict:
    r = _Rand(seed)
    H, V = config["hidden_size"], config["vocab_size"]
    w = {
        "backbone.embeddings.weight": r.normal((V, H)),
        "backbone.norm_f.weight": 1.0 + r.normal((H,), 0.1),
        "lm_head.weight": r.linear(V, H),
    }
    pattern = config.get("hybrid_override_pattern") or "".join(
        {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}[b]
        for b in config["layers_block_type"]
    )
    for i, ch in enumerate(pattern):
        _nemotron_block(w, r, config, f"backbone.layers.{i}.", ch)
    if mtp:  # vLLM's NemotronH-MTP names: blocks as in the backbone, the fusion on the first
        steps = config.get("mtp_hybrid_override_pattern") or "*E"
        for i, ch in enumerate(steps):
            _nemotron_block(w, r, config, f"mtp.layers.{i}.", ch)
        w["mtp.layers.0.eh_proj.weight"] = r.linear(H, 2 * H)
        w["mtp.layers.0.enorm.weight"] = 1.0 + r.normal((H,), 0.1)
        w["mtp.layers.0.hnorm.weight"] = 1.0 + r.normal((H,), 0.1)
        w[f"mtp.layers.{len(steps) - 1}.final_layernorm.weight"] = 1.0 + r.normal((H,), 0.1)
    return w


def _nemotron_block(w, r, c, p, ch):
    H = c["hidden_size"]
    w[p + "norm.weight"] = 1.0 + r.normal((H,), 0.1)
    m = p + "mixer."
    if ch == "M":
        nh, hd, N, G, K = (
            c["mamba_num_heads"],
            c["mamba_head_dim"],
            c["ssm_state_size"],
            c["n_groups"],
            c["conv_kernel"],
        )
        inner, conv = nh * hd, nh * hd + 2 * G * N
        w[m + "in_proj.weight"] = r.linear(inner + conv + nh, H)
        w[m + "conv1d.weight"] = r.normal((conv, 1, K), 0.5)
        w[m + "conv1d.bias"] = r.normal((conv,), 0.1)
        w[m + "dt_bias"] = r.uniform((nh,), -2.0, 0.0)
        w[m + "A_log"] = mx.log(r.uniform((nh,), 1.0, 8.0))
        w[m + "D"] = r.uniform((nh,), 0.5, 1.5)
        w[m + "norm.weight"] = 1.0 + r.normal((inner,), 0.1)
        w[m + "out_proj.weight"] = r.linear(H, inner)
    elif ch == "*":
        nh, nkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        w[m + "q_proj.weight"] = r.linear(nh * D, H)
        w[m + "k_proj.weight"] = r.linear(nkv * D, H)
        w[m + "v_proj.weight"] = r.linear(nkv * D, H)
        w[m + "o_proj.weight"] = r.linear(H, nh * D)
    elif ch == "-":
        w[m + "up_proj.weight"] = r.linear(c["intermediate_size"], H)
        w[m + "down_proj.weight"] = r.linear(H, c["intermediate_size"])
    else:
        E, inner, S = (
            c["n_routed_experts"],
            c["moe_intermediate_size"],
            c["moe_shared_expert_intermediate_size"],
        )
        L = c.get("moe_latent_size") or H
        w[m + "gate.weight"] = r.linear(E, H)
        w[m + "gate.e_score_correction_bias"] = r.normal((E,), 0.1)
        for e in range(E):
            w[f"{m}experts.{e}.up_proj.weight"] = r.linear(inner, L)
            w[f"{m}experts.{e}.down_proj.weight"] = r.linear(L, inner)
        w[m + "shared_experts.up_proj.weight"] = r.linear(S, H)
        w[m + "shared_experts.down_proj.weight"] = r.linear(H, S)
        if c.get("moe_latent_size"):
            w[m + "fc1_latent_proj.weight"] = r.linear(L, H)
            w[m + "fc2_latent_proj.weight"] = r.linear(H, L)
