"""The three architectures, as transformers configs, and the Qwen3.5/Qwen3-Next MTP head.

Sizes are chosen for a few minutes of training on one GPU and a small footprint on disk: the demo
ships in the wheel (quantized), the others are test fixtures.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import NemotronHConfig, NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

# The demo's window holds a coding agent's first request (9k-30k tokens) with room to answer; its
# rotary base is raised so that the rotated quarter of each head stays smooth over that range.
MAX_POSITIONS = {"main": 131072, "draft": 8192}
ROPE_THETA = {"main": 1_000_000.0, "draft": 10000.0}


def qwen_config(size: str, vocab_size: int, eos_id: int, pad_id: int) -> Qwen3_5TextConfig:
    """`main` is the demo model (GDN x3 + gated attention, repeated); `draft` is its small speculative drafter."""
    dims = {
        "main": dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=2,  # narrow attention: a long prompt's cost on a CPU is mostly here
            num_key_value_heads=1,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        ),
        "draft": dict(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        ),
    }[size]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS[size],
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_THETA[size],
            "partial_rotary_factor": 0.25,
        },
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        attn_implementation="sdpa",
        **dims,
    )


# Nemotron-3-Nano's layer rhythm (Mamba-2 / MoE alternating, one attention layer), shortened.
NEMOTRON_PATTERN = "MEMEM*EME"


def nemotron_config(vocab_size: int, eos_id: int, pad_id: int) -> NemotronHConfig:
    pattern = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        layers_block_type=[pattern[c] for c in NEMOTRON_PATTERN],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        intermediate_size=384,
        mamba_num_heads=12,
        mamba_head_dim=32,
        n_groups=2,
        ssm_state_size=32,
        conv_kernel=4,
        chunk_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        moe_shared_expert_intermediate_size=384,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS["draft"],
        tie_word_embeddings=False,
        use_mamba_kernels=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        attn_implementation="sdpa",
    )


def build_model(name: str, vocab_size: int, eos_id: int, pad_id: int) -> nn.Module:
    if name == "nemotron":
        return NemotronHForCausalLM(nemotron_config(vocab_size, eos_id, pad_id))
    return Qwen3_5ForCausalLM(qwen_config(name, vocab_size, eos_id, pad_id))


class MTPHead(nn.Module):
    """Qwen3-Next / Qwen3.5 multi-token prediction head, named as the published checkpoints name it (`mtp.*`).

    Given the target's final (post-norm) hidden state h_t and the embedding of token t+1, it predicts
    token t+2: fc(concat(norm_e(embed(t+1)), norm_h(h_t))) -> one full-attention decoder layer -> norm
    -> the target's own lm_head. The embedding and lm_head are the target's (shared, frozen).
    """

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(config=layer_config)
        self._init(config.initializer_range)

    def _init(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, Qwen3_5RMSNorm):
                nn.init.zeros_(module.weight)  # these norms scale by (1 + weight)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_embeds, hidden: [batch, seq, hidden] (embed(t+1), h_t); returns the head's hidden state."""
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        )
        batch, length, _ = x.shape
        positions = torch.arange(length, device=x.device).view(1, 1, length).expand(3, batch, length)
        x = self.layers[0](x, position_embeddings=self.rotary_emb(x, positions), attention_mask=None)
        return self.norm(x)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v for k, v in self.state_dict().items() if "rotary_emb" not in k}


def parameter_count(module: nn.Module) -> int:
    seen = {id(p): p.numel() for p in module.parameters()}
    return sum(seen.values())
